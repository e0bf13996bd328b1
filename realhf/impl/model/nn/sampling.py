"""Sampling one token per row from a decode step's logits: greedy, plain (temperature), top-k/top-p, with banned
stop tokens and per-sequence random streams (``RowStreams``), so that a seeded sequence gets the same samples
whatever shares its batch. ``generate`` (generation.py) and the ``gen`` server's batches sample through
``sample_step`` (the decode core's sampler, ``decode_core.py``), the compiled and graph decode steps through
``sample_with_mask`` inside their graphs, which ``sample_step`` calls too, so every path draws the same tokens.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch

from realhf.api.core.model_api import GenerationHyperparameters
from realhf.impl.model.nn import decode_ops


def _top_p_remove(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Boolean mask of the tokens outside the smallest set whose probability mass reaches ``top_p`` (the
    token that crosses the threshold is kept). Looks at a growing top-k prefix instead of sorting the
    whole vocabulary: the nucleus is usually a few dozen tokens out of tens of thousands."""
    V = logits.shape[-1]
    probs = logits.softmax(-1)
    k = min(V, 64)
    while True:
        vals, idx = torch.topk(probs, k, dim=-1)  # sorted, descending
        cum = vals.cumsum(-1)
        if k == V or bool((cum[..., -1] >= top_p).all()):
            break
        k = min(V, 4 * k)
    keep = (cum - vals) < top_p
    keep[..., 0] = True
    return ~torch.zeros_like(probs, dtype=torch.bool).scatter(-1, idx, keep)


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) tokens outside the top-k and outside the smallest set with mass >= top_p."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        logits = logits.masked_fill(_top_p_remove(logits, top_p), float("-inf"))
    return logits


class SamplingKey(NamedTuple):
    """The parameters that decide how a row's next token is drawn from its logits (rows with equal keys sample in one
    call). Greedy rows ignore the others."""

    greedy: bool
    temperature: float
    top_k: int
    top_p: float

    @classmethod
    def of(cls, params) -> "SamplingKey":
        """The key of ``params`` (``SamplingParams`` or ``GenerationHyperparameters``)."""
        return cls(bool(params.greedy), float(params.temperature), int(params.top_k), float(params.top_p))


def sample_step(logits: torch.Tensor, key: SamplingKey, gen: Optional[torch.Generator],
                banned: Optional[torch.Tensor] = None, ban: Optional[torch.Tensor] = None,
                row_u: Optional[torch.Tensor] = None):
    """logits [B, V] (fp32, full vocab) -> (tokens [B], logprobs [B]): the sampling step of every decode path.

    Tokens never sampled (stop tokens before min_new_tokens) are given as ids (``banned``, the same for every row) or
    as a boolean mask (``ban``, [V] or [B, V]), not both; the returned log-probs are those of the unmodified
    distribution. With ``row_u`` (one uniform number in [0, 1) per row, float64, from that sequence's own random
    stream: ``RowStreams``), each row is sampled by inverse CDF, so a sequence's sample does not depend on which other
    sequences share its batch (layout-independent sampling); else rows draw from ``gen``.
    """
    if banned is not None and ban is not None:
        raise ValueError("sample_step takes banned tokens as ids (banned) or as a mask (ban), not both")
    if key.greedy and not torch.compiler.is_compiling():
        return greedy_tokens(logits, banned, ban)
    if banned is not None and banned.numel() > 0:
        ban = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
        ban[banned] = True
    return sample_with_mask(logits, key.greedy, key.temperature, key.top_k, key.top_p, gen, ban, row_u)


def sample_tokens(
    logits: torch.Tensor, g: GenerationHyperparameters, gen: Optional[torch.Generator], banned: Optional[torch.Tensor] = None,
    row_u: Optional[torch.Tensor] = None,
):
    """``sample_step`` with the sampling parameters of ``g`` and the banned tokens as ids."""
    return sample_step(logits, SamplingKey.of(g), gen, banned=banned, row_u=row_u)


def greedy_tokens(logits: torch.Tensor, banned: Optional[torch.Tensor] = None, ban: Optional[torch.Tensor] = None):
    """logits [B, V] -> (the most likely token of each row other than the ``banned`` ids, or the True entries of the
    mask ``ban`` ([V] or [B, V]); its log-prob under the unmodified distribution). The first of equal maxima, as an
    argmax. Two passes over the logits instead of a log-softmax, a masked copy and an argmax (SmolLM2 at 32 rows:
    1.4 ms against 3.5-4.9 ms on 2 CPU cores); banned ids are set aside in place and restored. For at most
    ``decode_ops.MAX_ROWS`` fp32 CPU rows outside autograd, the C++ ``greedy_sample`` does the same in three passes
    over each row, rows in parallel."""
    mod = decode_ops.for_rows(logits)
    if mod is not None and logits.stride(1) == 1 and (ban is None or ban.dim() == 1):
        tok, lp = mod.greedy_sample(logits, banned, ban)
        return tok, lp
    if banned is not None and banned.numel() > 0:
        saved = logits[:, banned]
        logits[:, banned] = float("-inf")
        best, tok = logits.max(-1)
        logits[:, banned] = saved
        top = torch.maximum(best, saved.max(-1).values)  # the row's maximum, banned ids included
    elif ban is not None:
        best, tok = logits.masked_fill(ban, float("-inf")).max(-1)
        top = logits.max(-1).values
    else:
        best, tok = logits.max(-1)
        top = best
    lse = top + (logits - top.unsqueeze(-1)).exp_().sum(-1).log_()
    return tok, best - lse


def sample_with_mask(logits: torch.Tensor, greedy: bool, temperature: float, top_k: int, top_p: float,
                     gen: Optional[torch.Generator], ban: Optional[torch.Tensor], row_u: Optional[torch.Tensor]):
    """``sample_step`` with the banned tokens as a boolean mask ``ban`` ([V] or [B, V], or None). Without top-k/top-p
    and with ``row_u`` or ``greedy`` it is a pure tensor function (no data-dependent Python branching), so
    the compiled decode step (``compiled_decode.py``) samples inside its graph with this same code."""
    if greedy and not torch.compiler.is_compiling():  # (compiled graphs keep the log-softmax form below)
        return greedy_tokens(logits, ban=ban)
    scaled = logits if greedy or temperature == 1.0 else logits / temperature
    if not (greedy or top_k or top_p < 1.0):
        return _plain_sample(scaled, gen, ban, row_u)
    # greedy under torch.compile, or top-k/top-p
    logp = torch.log_softmax(scaled, -1)
    if ban is not None:
        scaled = scaled.masked_fill(ban, float("-inf"))
    if greedy:
        tok = scaled.argmax(-1)
        return tok, logp.gather(-1, tok.unsqueeze(-1)).squeeze(-1)
    probs = filter_logits(scaled, top_k, top_p).softmax(-1)
    tok = inverse_cdf(probs, row_u) if row_u is not None else torch.multinomial(probs, 1, generator=gen).squeeze(-1)
    return tok, logp.gather(-1, tok.unsqueeze(-1)).squeeze(-1)


def _plain_sample(scaled: torch.Tensor, gen: Optional[torch.Generator], ban: Optional[torch.Tensor],
                  row_u: Optional[torch.Tensor]):
    """Plain sampling from the logits ``scaled`` (temperature applied): the weights are exp(scaled - max), banned
    tokens' set to 0 (both samplers renormalise), and the log-prob is that of the unmodified distribution, so the
    full-vocabulary log-softmax is never written out (two passes over the logits and the sampler's)."""
    m = scaled.max(-1, keepdim=True).values
    w = (scaled - m).exp_()
    lse = m.squeeze(-1) + w.sum(-1).log_()
    if ban is not None:
        w.masked_fill_(ban, 0.0)
    tok = inverse_cdf(w, row_u) if row_u is not None else torch.multinomial(w, 1, generator=gen).squeeze(-1)
    return tok, scaled.gather(-1, tok.unsqueeze(-1)).squeeze(-1) - lse


CDF_BLOCK = 512  # inverse_cdf's block of the vocabulary


def inverse_cdf(w: torch.Tensor, row_u: torch.Tensor) -> torch.Tensor:
    """For each row of the non-negative weights ``w`` [B, V], the first token whose cumulative weight (summed in
    float64) reaches ``row_u`` (one number in [0, 1) per row) times the row's total; never a zero-weight token.

    The cumulative sum runs in two levels: the float64 sums of blocks of ``CDF_BLOCK`` tokens, then the cumulative
    sum inside the one block the target falls in, instead of a float64 copy and cumulative sum of the whole
    [B, V] (SmolLM2 at 32 rows, 2 CPU cores: about 1 ms instead of 4). No data-dependent shape or host sync, except the
    rare zero-weight repair on a CPU, so it compiles and captures as a graph."""
    B, V = w.shape
    C = CDF_BLOCK
    nb = -(-V // C)
    padded = w if nb * C == V else torch.nn.functional.pad(w, (0, nb * C - V))
    blocks = padded.view(B, nb, C)
    ends = blocks.sum(-1, dtype=torch.float64).cumsum(-1)  # [B, nb]: the cumulative weight at each block's end
    target = row_u.to(device=w.device, dtype=torch.float64) * ends[:, -1]
    bi = torch.searchsorted(ends, target.unsqueeze(-1)).squeeze(-1).clamp(max=nb - 1)
    start = torch.where(bi > 0, ends.gather(-1, (bi - 1).clamp(min=0).unsqueeze(-1)).squeeze(-1), 0.0)
    inside = blocks.gather(1, bi.view(B, 1, 1).expand(B, 1, C)).squeeze(1).double().cumsum(-1) + start.unsqueeze(-1)
    tok = (bi * C + torch.searchsorted(inside, target.unsqueeze(-1)).squeeze(-1).clamp(max=C - 1)).clamp(max=V - 1)
    # never land on a zero-weight token through rounding at a CDF plateau (or in the padding)
    bad = w.gather(-1, tok.unsqueeze(-1)).squeeze(-1) <= 0
    if w.is_cpu and not torch.compiler.is_compiling():
        return torch.where(bad, w.argmax(-1), tok) if bool(bad.any()) else tok
    return torch.where(bad, w.argmax(-1), tok)


class RowStreams:
    """One random stream per sequence: ``uniforms(rows, step)`` is the ``step``-th number of each listed
    sequence's own generator (seeded from ``seeds``, one per sequence, indexed by original sequence index),
    whatever other sequences share the batch. Numbers are drawn ``CHUNK`` at a time per sequence (one call
    per sequence every ``CHUNK`` steps instead of one per sequence and step); steps must not decrease.
    The generators and their numbers live on the host, so a seed gives the same samples on every device;
    ``sample_with_mask`` moves a step's numbers to the logits' device."""

    CHUNK = 64

    def __init__(self, seeds: Sequence[int]):
        self.gens = [torch.Generator().manual_seed(int(s) % (2**63)) for s in seeds]
        self.block = -1
        self.u: Optional[torch.Tensor] = None  # [n sequences, CHUNK]

    def uniforms(self, rows: torch.Tensor, step: int) -> torch.Tensor:
        b = step // self.CHUNK
        if b != self.block:
            if b < self.block:
                raise ValueError(f"RowStreams: step {step} after block {self.block}")
            for _ in range(b - self.block):
                self.u = torch.stack([torch.rand(self.CHUNK, generator=g, dtype=torch.float64) for g in self.gens])
            self.block = b
        return self.u[rows.cpu(), step % self.CHUNK]
