"""Batched generation with a KV cache, under any tensor/pipeline layout.

All ranks of one model replica (one data-parallel rank: its tp x pp ranks) call ``generate`` with the
same prompts. Prompts are prefilled packed (no padding); each decode step feeds one token per
unfinished sequence; finished sequences are dropped from the batch and the cache so they stop costing
work. The last stage samples (vocab-parallel logits are gathered only for sampling) and broadcasts the
tokens to the other stages.

Returned log-probs are those of the sampled tokens under ``log_softmax(logits / temperature)``
(temperature 1 for greedy), i.e. before top-k/top-p truncation — the same quantity a training forward
pass with that temperature computes.
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from realhf.api.core.model_api import GenerationHyperparameters
from realhf.impl.model.nn.kv_cache import KVCache
from realhf.impl.model.nn.real_model import PackedInput, ReaLModel, make_packed_input
from realhf.impl.model.parallelism.tensor_parallel import gather_from_tp


@dataclasses.dataclass
class GenerationOutput:
    tokens: List[List[int]]  # generated ids per sequence (prompt excluded; stop token included)
    logprobs: List[List[float]]  # log-prob of each generated token
    no_eos: List[bool]  # True where the sequence hit max_new_tokens without a stop token


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


def sample_tokens(
    logits: torch.Tensor, g: GenerationHyperparameters, gen: Optional[torch.Generator], banned: Optional[torch.Tensor] = None,
    row_gens: Optional[List[torch.Generator]] = None,
):
    """logits [B, V] (fp32, full vocab) -> (tokens [B], logprobs [B]).

    ``banned`` token ids (stop tokens before min_new_tokens) are never sampled, but the returned
    log-probs are those of the unmodified distribution. With ``row_gens`` (one generator per row),
    each row is sampled by inverse CDF from its own random stream, so a sequence's sample does not
    depend on which other sequences share its batch (layout-independent sampling).
    """
    scaled = logits if g.greedy else logits / g.temperature
    logp = torch.log_softmax(scaled, -1)
    if banned is not None and banned.numel():
        scaled = scaled.clone()
        scaled[:, banned] = float("-inf")
    if g.greedy:
        tok = scaled.argmax(-1)
    else:
        probs = filter_logits(scaled, g.top_k, g.top_p).softmax(-1)
        if row_gens is not None:
            u = torch.cat([torch.rand(1, generator=rg, dtype=torch.float64) for rg in row_gens]).to(probs.device)
            cdf = probs.double().cumsum(-1)
            u = u * cdf[:, -1]
            tok = torch.searchsorted(cdf, u.unsqueeze(-1)).squeeze(-1).clamp(max=probs.shape[-1] - 1)
            # never land on a zero-probability token through rounding at a CDF plateau
            bad = probs.gather(-1, tok.unsqueeze(-1)).squeeze(-1) <= 0
            if bool(bad.any()):
                tok[bad] = probs[bad].argmax(-1)
        else:
            tok = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
    return tok, logp.gather(-1, tok.unsqueeze(-1)).squeeze(-1)


@torch.no_grad()
def generate(
    model: ReaLModel,
    prompts: Sequence[Sequence[int]],
    gconfig: GenerationHyperparameters,
    eos_token_id: Optional[int] = None,
    generator: Optional[torch.Generator] = None,
    seeds: Optional[Sequence[int]] = None,
) -> GenerationOutput:
    """Generate ``gconfig.n`` continuations for every prompt (the n samples of a prompt are adjacent).

    ``seeds`` (one per prompt) make sampling independent of batch composition and layout: sample j of
    prompt i draws from its own generator seeded by ``(seeds[i], j)``.
    """
    grid = model.grid
    prompts = [list(p) for p in prompts for _ in range(gconfig.n)]
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate needs at least one prompt and every prompt must be non-empty")
    device = model.flat.device
    cfg = model.config
    stop = set(gconfig.stop_token_ids)
    if eos_token_id is not None:
        stop.add(int(eos_token_id))
    stop_t = torch.tensor(sorted(stop), dtype=torch.long, device=device)
    if generator is None and gconfig.seed is not None:
        generator = torch.Generator(device=device).manual_seed(gconfig.seed)
    B = len(prompts)
    row_gens_all = None
    if seeds is not None and not gconfig.greedy:
        if len(seeds) * gconfig.n != B:
            raise ValueError(f"seeds has {len(seeds)} entries for {B // gconfig.n} prompts")
        row_gens_all = [torch.Generator().manual_seed((int(s) * 1000003 + j) % (2**63)) for s in seeds for j in range(gconfig.n)]
    seqlens = [len(p) for p in prompts]
    max_len = max(seqlens) + gconfig.max_new_tokens + 1
    pp = model.pp
    comm = None
    if pp > 1:
        from realhf.impl.model.parallelism.pipeline import StageComm

        comm = StageComm(grid, cfg.hidden_dim, model.dtype, device)
        last_stage_rank = grid.global_rank_of(pp - 1, grid.dp_rank, grid.tp_rank)
    cache = KVCache(
        model.n_local_layers, B, max_len, model.n_local_kv_heads, cfg.head_dim, model.dtype, device
    )
    tp_group = model.tp_group
    tp_src = grid.global_rank_of(grid.pp_rank, grid.dp_rank, 0) if model.tp > 1 else None

    def run_stage(x_in, inp: PackedInput, n_tokens: int):
        if pp > 1 and not model.is_first:
            x_in = comm.recv_forward(n_tokens)
        y = model(x_in, inp)
        if pp > 1 and not model.is_last:
            comm.send_forward(y, blocking=True)
        return y

    def pick(out, n_generated: int):
        """On the last stage: sample from the head output; then share tokens with every rank."""
        packed = torch.empty(out_rows, 2, dtype=torch.float64, device=device)
        if model.is_last:
            logits = gather_from_tp(out.float(), tp_group)
            banned = stop_t if n_generated < gconfig.min_new_tokens else None
            rg = [row_gens_all[i] for i in alive.tolist()] if row_gens_all is not None else None
            tok, lp = sample_tokens(logits, gconfig, generator, banned, rg)
            packed[:, 0] = tok.double()
            packed[:, 1] = lp.double()
            if tp_src is not None:
                dist.broadcast(packed, src=tp_src, group=tp_group)
        if pp > 1:
            dist.broadcast(packed, src=last_stage_rank, group=grid.pp_group)
        return packed[:, 0].long(), packed[:, 1]

    # ---- prefill
    inp = make_packed_input(seqlens, device=device)
    inp.cache = cache
    inp.head_rows = (inp.cu_seqlens[1:] - 1).long()
    cache.begin_prefill(torch.tensor(seqlens, device=device))
    ids = torch.tensor([t for p in prompts for t in p], dtype=torch.long, device=device)
    out_rows = B
    alive = torch.arange(B, device=device)  # original index of each cache row
    out = run_stage(ids if model.is_first else None, inp, sum(seqlens))
    cache.end_prefill()
    tok, lp = pick(out, 0)

    tokens: List[List[int]] = [[] for _ in range(B)]
    logps: List[List[float]] = [[] for _ in range(B)]
    no_eos = [True] * B
    for step in range(gconfig.max_new_tokens):
        tl, ll = tok.tolist(), lp.tolist()
        rows = alive.tolist()
        keep = []
        for j, orig in enumerate(rows):
            tokens[orig].append(tl[j])
            logps[orig].append(ll[j])
            if tl[j] in stop:
                no_eos[orig] = False
            else:
                keep.append(j)
        if step == gconfig.max_new_tokens - 1 or not keep:
            break
        if len(keep) < len(rows):
            kt = torch.tensor(keep, dtype=torch.long, device=device)
            cache.keep(kt)
            alive, tok = alive[kt], tok[kt]
        out_rows = alive.numel()
        dinp = PackedInput(
            cu_seqlens=torch.arange(out_rows + 1, dtype=torch.int32, device=device),
            max_seqlen=1,
            position_ids=cache.positions().clone(),
            cache=cache,
        )
        out = run_stage(tok if model.is_first else None, dinp, out_rows)
        cache.advance()
        tok, lp = pick(out, step + 1)
    if comm is not None:
        comm.flush()
    return GenerationOutput(tokens=tokens, logprobs=logps, no_eos=no_eos)
