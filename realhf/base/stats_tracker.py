"""Statistics of a training step, recorded where they are computed and reduced once.

A loss function records what it measured on its micro-batch in a :class:`StatsTracker`:

* ``mean(key, value, weight)``: ``value`` is a mean over ``weight`` items (e.g. the loss over a micro-batch's loss
  tokens, ``weight`` their number); the step reports ``sum(value * weight) / sum(weight)`` over everything it
  combined, so a micro-batch, a minibatch or a data-parallel rank counts by its weight, not once.
* ``sum(key, value)``: a count or total (e.g. the number of answer tokens); the step reports the total.
* ``max(key, value)``: the step reports the largest value.

Trackers combine by summing weighted sums, weights and totals and taking the largest maxima: :meth:`merge` in one
process (micro-batches, minibatches), :meth:`all_reduce_` over a process group (data-parallel ranks: one SUM
all-reduce that can carry the caller's own sums alongside, plus one MAX all-reduce only when maxima were recorded)
and :meth:`broadcast_` from the rank that recorded them (the last pipeline stage). Every rank of a group must
record the same keys. :meth:`export` gives the step's numbers; a mean whose weights sum to 0 reads 0.0.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

MEAN, SUM, MAX = "mean", "sum", "max"
_WIDTH = {MEAN: 2, SUM: 1, MAX: 1}  # floats per statistic: a mean holds (weighted sum, weight)


class StatsTracker:
    """Weighted means, sums and maxima of one step (see the module docstring)."""

    def __init__(self):
        self._kind: Dict[str, str] = {}
        self._acc: Dict[str, List[float]] = {}

    def __len__(self) -> int:
        return len(self._kind)

    def __contains__(self, key: str) -> bool:
        return key in self._kind

    def _record(self, key: str, kind: str, vals: List[float]) -> None:
        old = self._kind.get(key)
        if old is None:
            self._kind[key], self._acc[key] = kind, list(vals)
            return
        if old != kind:
            raise ValueError(f"statistic {key!r} was recorded as a {old} and now as a {kind}: record each key one way")
        acc = self._acc[key]
        if kind == MAX:
            acc[0] = max(acc[0], vals[0])
        else:
            for i, v in enumerate(vals):
                acc[i] += v

    def mean(self, key: str, value, weight=1.0) -> None:
        """Record ``value``, a mean over ``weight`` items (a number >= 0; items of weight 0 add nothing)."""
        w = float(weight)
        if not (math.isfinite(w) and w >= 0):
            raise ValueError(f"statistic {key!r}: weight={weight!r}; a weight must be a finite number >= 0")
        self._record(key, MEAN, [float(value) * w if w else 0.0, w])

    def sum(self, key: str, value) -> None:
        """Record ``value`` to be added up."""
        self._record(key, SUM, [float(value)])

    def max(self, key: str, value) -> None:
        """Record ``value``; the step reports the largest."""
        self._record(key, MAX, [float(value)])

    def merge(self, other: "StatsTracker") -> "StatsTracker":
        """Add ``other``'s records to this tracker (same key, same kind); returns self."""
        for key, kind in other._kind.items():
            self._record(key, kind, other._acc[key])
        return self

    def export(self) -> Dict[str, float]:
        """The step's numbers, by key in sorted order: means (0.0 where no weight was recorded), sums, maxima."""
        out = {}
        for key in sorted(self._kind):
            acc = self._acc[key]
            out[key] = (acc[0] / acc[1] if acc[1] > 0 else 0.0) if self._kind[key] == MEAN else acc[0]
        return out

    # ---- the wire form: a layout (keys and kinds, sorted) and a flat float64 tensor ----

    def layout(self) -> List[Tuple[str, str]]:
        return [(k, self._kind[k]) for k in sorted(self._kind)]

    def _pack(self, layout: List[Tuple[str, str]], kind_filter, device) -> torch.Tensor:
        vals = [v for k, kind in layout if kind_filter(kind) for v in self._acc[k]]
        return torch.tensor(vals, dtype=torch.float64, device=device)

    def _unpack(self, layout: List[Tuple[str, str]], kind_filter, t: torch.Tensor) -> None:
        vals, i = t.tolist(), 0
        for k, kind in layout:
            if kind_filter(kind):
                self._kind[k], self._acc[k] = kind, vals[i : i + _WIDTH[kind]]
                i += _WIDTH[kind]

    def all_reduce_(self, group, head: Optional[torch.Tensor] = None, device=None) -> Optional[torch.Tensor]:
        """Make this tracker the combination of those of every rank of ``group``, in place. ``head``: a float64
        vector of the caller's own to be summed over the group in the same all-reduce; returned summed (None
        without one). ``device``: where the collective's tensors live (default ``head``'s device, else the CPU)."""
        device = head.device if head is not None else device
        layout = self.layout()
        n_head = 0 if head is None else head.numel()
        is_sum = lambda kind: kind != MAX  # noqa: E731
        vals = _with_head(head, self._pack(layout, is_sum, device))
        dist.all_reduce(vals, group=group)
        self._unpack(layout, is_sum, vals[n_head:])
        if any(kind == MAX for _, kind in layout):
            is_max = lambda kind: kind == MAX  # noqa: E731
            mx = self._pack(layout, is_max, device)
            dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=group)
            self._unpack(layout, is_max, mx)
        return vals[:n_head] if head is not None else None

    def broadcast_(self, src: int, group, head: Optional[torch.Tensor] = None, device=None) -> Optional[torch.Tensor]:
        """Make every rank of ``group`` hold the tracker of global rank ``src``, in place (what the other ranks
        recorded is replaced). ``head``: a float64 vector of ``src``'s sent along; returned (None without one)."""
        device = head.device if head is not None else device
        obj = [(self.layout(), 0 if head is None else head.numel())]
        dist.broadcast_object_list(obj, src=src, group=group)
        layout, n_head = obj[0]
        every = lambda kind: True  # noqa: E731
        if dist.get_rank() == src:
            vals = _with_head(head, self._pack(layout, every, device))
        else:
            vals = torch.zeros(n_head + sum(_WIDTH[kind] for _, kind in layout), dtype=torch.float64, device=device)
        dist.broadcast(vals, src=src, group=group)
        self._kind, self._acc = {}, {}
        self._unpack(layout, every, vals[n_head:])
        return vals[:n_head] if head is not None else None


def _with_head(head: Optional[torch.Tensor], vals: torch.Tensor) -> torch.Tensor:
    return vals if head is None else torch.cat([head.to(torch.float64).reshape(-1), vals])
