"""Masked reductions over packed 1-D token tensors, the ground the RL functions stand on.

Per-token tensors are packed: sequences concatenated into one 1-D tensor; ``cu_seqlens`` (``[n+1]``, int) gives
the boundaries. ``mask`` is a bool tensor of the same shape; True marks the tokens that count. "Mean over the
mask" is ``sum(x * mask) / max(sum(mask), 1)``, so an empty mask gives 0, not NaN.
"""
from __future__ import annotations

from typing import Dict, Tuple

import torch

Stats = Dict[str, torch.Tensor]


def check_mask(x: torch.Tensor, mask: torch.Tensor, name: str = "x") -> torch.Tensor:
    assert mask.dtype == torch.bool, f"loss_mask must be a bool tensor, got {mask.dtype}"
    assert mask.shape == x.shape, f"loss_mask shape {tuple(mask.shape)} differs from {name} shape {tuple(x.shape)}"
    return mask


def masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``sum_i x_i * m_i`` (masked-out entries never contribute, even if they are inf/NaN)."""
    return torch.where(mask, x, torch.zeros_like(x)).sum()


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``sum_i x_i m_i / max(sum_i m_i, 1)``."""
    return masked_sum(x, mask) / mask.sum().clamp(min=1).to(x.dtype)


def stat(x: torch.Tensor) -> torch.Tensor:
    """A detached float copy of ``x``, for the stats dicts (no device sync)."""
    return x.detach().float()


def seq_ids(cu_seqlens: torch.Tensor, total: int, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """(sequence id of every packed token ``[T]``, sequence lengths ``[n]``)."""
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    lens = cu[1:] - cu[:-1]
    assert int(cu[-1]) == total, f"cu_seqlens ends at {int(cu[-1])} but the per-token tensors have {total} entries"
    return torch.repeat_interleave(torch.arange(lens.numel(), device=device), lens), lens


def per_seq_sum(x: torch.Tensor, mask: torch.Tensor, ids: torch.Tensor, n: int) -> torch.Tensor:
    """``[n]``: the sum of ``x`` over the masked tokens of each sequence (``ids``: the sequence of every token)."""
    return torch.zeros(n, dtype=x.dtype, device=x.device).index_add(0, ids, torch.where(mask, x, torch.zeros_like(x)))


def last_masked_index(cu_seqlens: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """``[n]`` packed index of each sequence's last True mask entry, -1 for sequences with none."""
    T = loss_mask.numel()
    sid, lens = seq_ids(cu_seqlens, T, loss_mask.device)
    idx = torch.where(loss_mask, torch.arange(T, device=loss_mask.device), torch.full_like(sid, -1))
    out = torch.full((lens.numel(),), -1, dtype=torch.long, device=loss_mask.device)
    return out.scatter_reduce(0, sid, idx, reduce="amax", include_self=True)
