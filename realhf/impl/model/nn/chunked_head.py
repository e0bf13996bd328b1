"""The output head fused with log-softmax, chunk by chunk: log-probs (and entropy) of the next tokens without ever
holding [tokens x vocabulary] logits beyond a bounded chunk of tokens.

A training or inference pass over a batch of T tokens with a vocabulary of V would otherwise hold the head's
logits [T, V] in the model's dtype, their fp32 copy and the log-softmax (for Qwen2.5's 151,936-token vocabulary,
0.6 MB a token in fp32 alone: 74 GiB for a batch of 128 answers of 1,024 tokens). Here the last stage hands its
normalised hidden states to :func:`head_logprobs` instead (``PackedInput.defer_head``; the model returns a
:class:`HeadOutput`), which projects :func:`chunk_rows` tokens at a time, reduces each chunk's logits to per-token
numbers (log-prob of the label, log-sum-exp, entropy) and drops them. The backward pass projects each chunk again
and multiplies its gradient straight into the gradients of the hidden states and of the head's weight, so neither
pass holds more than one chunk of logits. Rows that fit in one chunk take the whole-logits path instead (the same
computation, to the bit, as a head that is not deferred; no recomputation).

Tensor parallelism: the head's weight holds this rank's vocabulary slice; each chunk's maximum and sums are
all-reduced over the tensor group (as ``tensor_parallel.vocab_parallel_logprobs`` does for whole logits) and the
hidden states' gradient is summed over the group by the head's ``copy_to_tp``.

Results equal log_softmax(logits / temperature)[label] and the entropy of softmax(logits / temperature) computed
on whole logits, within fp32 rounding; gradients likewise.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Tuple, Union

import torch
import torch.distributed as dist

from realhf.base.logits_chunk import chunk_rows  # noqa: F401 (re-exported)
from realhf.impl.model.nn import cpu_gemm
from realhf.impl.model.parallelism.tensor_parallel import (
    ColumnParallelLinear,
    copy_to_tp,
    vocab_parallel_entropy,
    vocab_parallel_logprobs,
)

# The fp32 logits of one chunk stay within ``realhf.base.logits_chunk.chunk_bytes()`` (1 GiB: 1,766 tokens of
# Qwen2.5's vocabulary, 5,461 of SmolLM2's; ``REALHF_LOGITS_CHUNK_MB`` overrides it). A chunk's pass holds at most three such fp32 buffers
# at once, plus the chunk's logits in the model's dtype where that is not fp32.


@dataclasses.dataclass
class HeadOutput:
    """What the last stage returns when its head is deferred: the final norm's output at the head rows and the
    output projection (this rank's vocabulary slice). :func:`head_logprobs` turns it into log-probs chunk by chunk;
    :meth:`logits` computes the whole logits (for callers that really need them)."""

    hidden: torch.Tensor  # [N, H], after the final norm
    head: ColumnParallelLinear

    @property
    def device(self) -> torch.device:
        return self.hidden.device

    @property
    def n_rows(self) -> int:
        return self.hidden.shape[0]

    @property
    def vocab_start(self) -> int:
        g = self.head.group
        if g is None or dist.get_world_size(g) == 1:
            return 0
        return dist.get_rank(g) * self.head.weight.shape[0]

    def logits(self) -> torch.Tensor:
        return self.head(self.hidden)


def _allreduce(t: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(t, op=op, group=group)
    return t


def _matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` with this process's CPU GEMM kernel (``cpu_gemm``; plain matmul on other devices)."""
    return cpu_gemm.linear(a, b.t())


def _weight_grad(grad: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """``grad^T @ h`` (the head weight's gradient from one chunk), with oneDNN where it is this process's CPU GEMM
    kernel, as the head's own backward pass computes it (``cpu_gemm._OneDNNLinear``: it takes a contiguous copy)."""
    if grad.is_cpu and cpu_gemm.kernel() == "onednn":
        return _matmul(grad.t().contiguous(), h)
    return grad.t() @ h


def _chunk_logits(head: ColumnParallelLinear, h: torch.Tensor, temperature: float) -> torch.Tensor:
    """One chunk's logits / temperature, fp32 (called with grad off: the head's own no-grad path, e.g. its
    skinny-GEMM chunking on CPU)."""
    z = head(h).float()
    return z.div_(temperature) if temperature != 1.0 else z


def _chunk_logp(head: ColumnParallelLinear, h: torch.Tensor, temperature: float, group):
    """log_softmax of one chunk's logits / temperature over the whole (possibly sharded) vocabulary, fp32, in place
    in the logits' buffer; and the rows' log-sum-exp (of logits / temperature)."""
    z = _chunk_logits(head, h, temperature)
    lmax = z.max(-1).values
    if group is not None:
        _allreduce(lmax, group, dist.ReduceOp.MAX)
    z.sub_(lmax.unsqueeze(-1))
    lse_shifted = torch.logsumexp(z, -1)  # of this rank's slice; at most one [rows, V/tp] temporary
    if group is not None:  # every slice was shifted by the global maximum: their sums add up
        lse_shifted = _allreduce(lse_shifted.exp(), group).log()
    z.sub_(lse_shifted.unsqueeze(-1))  # now log p
    return z, lmax + lse_shifted


def _label_logp(logp: torch.Tensor, labels: torch.Tensor, start: int, group) -> torch.Tensor:
    local = labels - start
    inside = (local >= 0) & (local < logp.shape[-1])
    picked = logp.gather(-1, local.clamp(0, logp.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    picked = torch.where(inside, picked, torch.zeros_like(picked))
    return _allreduce(picked, group)


def _entropy(logp: torch.Tensor, group) -> torch.Tensor:
    """-sum p log p of each row, with p = exp(logp), without a [rows, V] temporary (a batched dot product)."""
    p = logp.exp()
    ent = -torch.bmm(p.unsqueeze(1), logp.unsqueeze(2)).view(-1)
    return _allreduce(ent, group)


class _ChunkedHeadLogProbs(torch.autograd.Function):
    """(log-probs [N], entropy [N] or an empty tensor) of ``labels`` under softmax(head(h) / temperature)."""

    @staticmethod
    def forward(ctx, h, weight, labels, head, temperature, group, start, chunk, want_entropy):
        del weight  # an input only so that autograd sends its gradient
        n = h.shape[0]
        lp = torch.empty(n, dtype=torch.float32, device=h.device)
        lse = torch.empty(n, dtype=torch.float32, device=h.device)
        ent = torch.empty(n if want_entropy else 0, dtype=torch.float32, device=h.device)
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            logp, lse[s:e] = _chunk_logp(head, h[s:e], temperature, group)
            lp[s:e] = _label_logp(logp, labels[s:e], start, group)
            if want_entropy:
                ent[s:e] = _entropy(logp, group)
            del logp
        ctx.head, ctx.temperature, ctx.start, ctx.chunk = head, temperature, start, chunk
        ctx.want_entropy = want_entropy
        ctx.save_for_backward(h, labels, lse, ent)
        ctx.set_materialize_grads(False)
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        h, labels, lse, ent = ctx.saved_tensors
        head = ctx.head
        w = head.weight
        n = h.shape[0]
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        gh = torch.empty_like(h) if need_h else None
        gw = None
        for s in range(0, n, ctx.chunk):
            e = min(n, s + ctx.chunk)
            logp = _chunk_logits(head, h[s:e], ctx.temperature).sub_(lse[s:e].unsqueeze(-1))
            # d lp / d z = onehot - p;  d H / d z = -p (log p + H); in place, at most two [rows, V/tp] buffers
            g = g_lp[s:e].unsqueeze(-1) if g_lp is not None else None
            if ctx.want_entropy and g_ent is not None:
                p = logp.exp()
                coef = logp.add_(ent[s:e].unsqueeze(-1)).mul_(g_ent[s:e].unsqueeze(-1))
                if g is not None:
                    coef.add_(g)
                grad = p.mul_(coef).neg_()
                del coef
            elif g is not None:
                grad = logp.exp_().mul_(g).neg_()
            else:
                grad = logp.zero_()
            del logp  # with entropy its buffer is free now (grad is p's): at most two chunk buffers from here on
            if g is not None:
                local = labels[s:e] - ctx.start
                inside = (local >= 0) & (local < grad.shape[-1])
                idx = local.clamp(0, grad.shape[-1] - 1).unsqueeze(-1)
                grad.scatter_add_(-1, idx, torch.where(inside, g_lp[s:e], torch.zeros_like(g_lp[s:e])).unsqueeze(-1))
            if ctx.temperature != 1.0:
                grad.div_(ctx.temperature)
            grad = grad.to(w.dtype)
            if need_h:
                gh[s:e] = _matmul(grad, w)
            if need_w:
                part = _weight_grad(grad, h[s:e])
                gw = part if gw is None else gw.add_(part)
            del grad
        return gh, gw, None, None, None, None, None, None, None


def logits_logprobs(logits: torch.Tensor, labels: torch.Tensor, group=None, temperature: float = 1.0,
                    entropy: bool = False):
    """:func:`head_logprobs` from whole logits [N, V/tp] (vocab-parallel): log-probs and, with ``entropy``, the
    entropies, each from its own fp32 copy of logits / temperature."""
    def scaled():
        return logits.float() / temperature if temperature != 1.0 else logits

    lp = vocab_parallel_logprobs(scaled(), labels.to(logits.device), group)
    return (lp, vocab_parallel_entropy(scaled(), group)) if entropy else lp


def head_logprobs(out: HeadOutput, labels: torch.Tensor, temperature: float = 1.0, entropy: bool = False,
                  chunk: Optional[int] = None) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """log p(labels[i] | row i) under softmax(head(hidden) / temperature), fp32 [N], differentiable with respect to
    the hidden states and the head's weight; with ``entropy``, also each row's entropy (fp32 [N]). ``chunk`` rows
    at a time (default :func:`chunk_rows` of this rank's vocabulary slice). Rows that fit one chunk take the
    whole-logits path (the same computation as a head that is not deferred)."""
    head = out.head
    group = head.group if head.group is not None and dist.get_world_size(head.group) > 1 else None
    if chunk is None:
        chunk = chunk_rows(head.weight.shape[0])
    labels = labels.to(out.device)
    if out.n_rows <= chunk:
        return logits_logprobs(out.logits(), labels, head.group, temperature, entropy)
    h = copy_to_tp(out.hidden, group)  # the hidden states' gradient is summed over the tensor group
    lp, ent = _ChunkedHeadLogProbs.apply(h, head.weight, labels, head, float(temperature), group,
                                         out.vocab_start, int(chunk), bool(entropy))
    return (lp, ent) if entropy else lp
