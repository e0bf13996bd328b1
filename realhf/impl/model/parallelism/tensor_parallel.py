"""Tensor parallelism: column/row-parallel linear layers, a vocab-parallel embedding, and vocab-parallel
log-probs and entropy computed without gathering full-vocabulary logits.

All layers take the tensor-parallel group explicitly (``None`` means tp = 1 and no communication).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from realhf.impl.model.nn import cpu_gemm, decode_ops


def _world(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


class _CopyToTP(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient in backward (input of a column-parallel layer)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce forward; identity backward (output of a row-parallel layer)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


class _GatherFromTP(torch.autograd.Function):
    """All-gather along the last dim forward; keep this rank's slice in backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        world = dist.get_world_size(group)
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, g):
        world = dist.get_world_size(ctx.group)
        rank = dist.get_rank(ctx.group)
        return g.chunk(world, dim=-1)[rank].contiguous(), None


def copy_to_tp(x, group):
    return x if _world(group) == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x, group):
    return x if _world(group) == 1 else _ReduceFromTP.apply(x, group)


def gather_from_tp(x, group):
    return x if _world(group) == 1 else _GatherFromTP.apply(x, group)


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W split by output rows across the tp group; output stays split."""

    def __init__(self, in_features, out_features, bias, group=None, dtype=None, device=None, local_out: int = None):
        super().__init__()
        tp = _world(group)
        if local_out is None:
            assert out_features % tp == 0, f"output size {out_features} not divisible by tp size {tp}"
            local_out = out_features // tp
        self.group = group
        self.weight = nn.Parameter(torch.empty(local_out, in_features, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.empty(local_out, dtype=dtype, device=device)) if bias else None

    # Inference with a very wide output (an LM head over a large vocabulary) runs in row chunks with the aten
    # kernel: a skinny GEMM against a 4096-row slice of the weight stays cache friendly (measured 1.5x faster
    # with MKL on an AVX2 CPU). oneDNN gains nothing from it (measured equal) and packs whole parameters. Code
    # being compiled leaves the choice to the compiler (choosing the kernel there would probe inside the trace).
    CHUNK_ROWS = 4096

    def forward(self, x):
        x = copy_to_tp(x, self.group)
        n = self.weight.shape[0]
        if (not torch.is_grad_enabled() and n > 4 * self.CHUNK_ROWS and x.dim() == 2 and x.shape[0] <= 256
                and not x.is_cuda and not torch.compiler.is_compiling() and cpu_gemm.kernel() == "aten"
                and decode_ops.linear_kernel(x, self.weight, self.bias) is None):  # the tile kernel streams it whole
            out = x.new_empty(x.shape[0], n)
            for i in range(0, n, self.CHUNK_ROWS):
                j = min(n, i + self.CHUNK_ROWS)
                b = None if self.bias is None else self.bias[i:j]
                out[:, i:j] = cpu_gemm.linear(x, self.weight[i:j], b)
            return out
        return cpu_gemm.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W split by input columns; the input is already split, the output is summed."""

    def __init__(self, in_features, out_features, bias, group=None, dtype=None, device=None, local_in: int = None):
        super().__init__()
        tp = _world(group)
        if local_in is None:
            assert in_features % tp == 0, f"input size {in_features} not divisible by tp size {tp}"
            local_in = in_features // tp
        self.group = group
        self.weight = nn.Parameter(torch.empty(out_features, local_in, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None

    def forward(self, x):
        y = reduce_from_tp(cpu_gemm.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows across the tp group."""

    def __init__(self, vocab_size, dim, group=None, dtype=None, device=None, tp: int = None, tp_rank: int = None):
        super().__init__()
        tp = _world(group) if tp is None else tp
        assert vocab_size % tp == 0, f"vocab size {vocab_size} not divisible by tp size {tp}"
        self.group = group
        self.vocab_size = vocab_size
        self.shard = vocab_size // tp
        if tp_rank is None:
            tp_rank = dist.get_rank(group) if group is not None else 0
        self.start = tp_rank * self.shard
        self.weight = nn.Parameter(torch.empty(self.shard, dim, dtype=dtype, device=device))

    def forward(self, ids):
        if _world(self.group) == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.shard)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.group)


# ---------------------------------------------------------------------------------------------------
# Vocab-parallel log-probs and entropy
# ---------------------------------------------------------------------------------------------------


class _VocabParallelLogProbs(torch.autograd.Function):
    """log softmax(logits)[label] where ``logits`` holds this rank's vocab slice [N, V/tp]."""

    @staticmethod
    def forward(ctx, logits, labels, group, start):
        logits = logits.float()
        lmax = logits.max(dim=-1).values
        if group is not None:
            dist.all_reduce(lmax, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - lmax.unsqueeze(-1)
        local = labels - start
        inside = (local >= 0) & (local < logits.shape[-1])
        safe = local.clamp(0, logits.shape[-1] - 1)
        picked = shifted.gather(-1, safe.unsqueeze(-1)).squeeze(-1) * inside
        exp = shifted.exp_()  # in place: the shifted logits are not needed again (two [rows, V/tp] buffers at most)
        sumexp = exp.sum(-1)
        if group is not None:
            both = torch.stack([sumexp, picked])
            dist.all_reduce(both, group=group)
            sumexp, picked = both[0], both[1]
        logprobs = picked - sumexp.log()
        ctx.save_for_backward(exp, sumexp, safe, inside)
        return logprobs

    @staticmethod
    def backward(ctx, g):
        exp, sumexp, safe, inside = ctx.saved_tensors
        grad = exp.div_(sumexp.unsqueeze(-1)).neg_()  # -softmax, in place: exp is not needed again
        grad.scatter_add_(-1, safe.unsqueeze(-1), inside.to(grad.dtype).unsqueeze(-1))
        return grad.mul_(g.unsqueeze(-1)), None, None, None


class _VocabParallelEntropy(torch.autograd.Function):
    """Entropy of softmax(logits) where ``logits`` holds this rank's vocab slice."""

    @staticmethod
    def forward(ctx, logits, group):
        logits = logits.float()
        lmax = logits.max(dim=-1).values
        if group is not None:
            dist.all_reduce(lmax, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - lmax.unsqueeze(-1)
        exp = shifted.exp()
        both = torch.stack([exp.sum(-1), (exp * shifted).sum(-1)])
        if group is not None:
            dist.all_reduce(both, group=group)
        sumexp, sum_pz = both[0], both[1]
        ent = sumexp.log() - sum_pz / sumexp
        ctx.save_for_backward(shifted, exp, sumexp, ent)
        ctx.group = group
        return ent

    @staticmethod
    def backward(ctx, g):
        shifted, exp, sumexp, ent = ctx.saved_tensors
        p = exp / sumexp.unsqueeze(-1)
        # dH/dz_i = -p_i (z_i - logZ + H) with z shifted, logZ = log sumexp
        grad = -p * (shifted - sumexp.log().unsqueeze(-1) + ent.unsqueeze(-1))
        return grad * g.unsqueeze(-1), None


def vocab_parallel_logprobs(logits: torch.Tensor, labels: torch.Tensor, group=None) -> torch.Tensor:
    """Per-row log-probability of ``labels`` under softmax of (possibly vocab-sharded) ``logits``, fp32."""
    if _world(group) == 1:  # the whole vocabulary is here: torch's fused log-softmax
        return torch.log_softmax(logits.float(), -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    start = (dist.get_rank(group) * logits.shape[-1]) if group is not None and _world(group) > 1 else 0
    return _VocabParallelLogProbs.apply(logits, labels, group if _world(group) > 1 else None, start)


def vocab_parallel_entropy(logits: torch.Tensor, group=None) -> torch.Tensor:
    return _VocabParallelEntropy.apply(logits, group if _world(group) > 1 else None)
