"""Normalisation over packed token tensors: batch whitening of advantages (optionally over the data-parallel
ranks) and running statistics of critic targets (:class:`ValueNormalizer`)."""
from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist

from realhf.impl.model.utils.masked import check_mask as _check_mask


def _masked_moments(x: torch.Tensor, mask: torch.Tensor, group=None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sum, sum of squares, count) over the mask in float64, summed across ``group``'s ranks if given."""
    xd = torch.where(mask, x.detach().double(), torch.zeros((), dtype=torch.float64, device=x.device))
    buf = torch.stack([xd.sum(), (xd * xd).sum(), mask.sum().double()])
    if group is not None:
        dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group)
    return buf[0], buf[1], buf[2]


def masked_normalization(
    x: torch.Tensor,
    mask: torch.Tensor,
    eps: float = 1e-5,
    unbiased: bool = False,
    all_reduce_group=None,
) -> torch.Tensor:
    """Whiten ``x`` with the mean and variance of its masked entries::

        mu = sum(x m) / sum(m);  var = sum(x^2 m) / sum(m) - mu^2   (times N/(N-1) if unbiased)
        out = (x - mu) / sqrt(var + eps)  on masked entries, 0 elsewhere

    With ``all_reduce_group`` (a ``torch.distributed`` group, e.g. the data-parallel group), the sums and
    count are all-reduced so every rank normalises with the global statistics. Moments are accumulated
    in float64; the result has ``x``'s dtype.
    """
    _check_mask(x, mask)
    s, sq, cnt = _masked_moments(x, mask, all_reduce_group)
    c = cnt.clamp(min=1.0)
    mean = s / c
    var = (sq / c - mean * mean).clamp(min=0.0)
    if unbiased:
        var = var * c / (c - 1.0).clamp(min=1.0)
    out = (x.double() - mean) * torch.rsqrt(var + eps)
    return torch.where(mask, out, torch.zeros_like(out)).to(x.dtype)


class ValueNormalizer:
    """Running mean/std of critic targets, for value normalisation (PopArt-style without the output
    layer rescaling): train the critic on ``normalize(returns)``, read values with ``denormalize``.

    ``beta=None``: exact statistics of everything seen (parallel Welford merge).
    ``beta in (0, 1)``: exponential moving averages of E[x] and E[x^2], debiased by ``1 - beta^k``.
    Before the first update ``mean = 0, var = 1``. ``std = sqrt(var + eps)``.
    With ``all_reduce_group``, every ``update`` uses statistics summed over the group's ranks, so all
    ranks keep identical state.
    """

    def __init__(self, beta: Optional[float] = None, eps: float = 1e-5, all_reduce_group=None):
        if beta is not None:
            assert 0.0 < beta < 1.0, f"beta must be in (0, 1) or None, got {beta}"
        self.beta = beta
        self.eps = float(eps)
        self.group = all_reduce_group
        self.mean = 0.0
        self.var = 1.0
        self.count = 0.0  # tokens seen (beta=None) or updates (EMA)
        self._ema_mean = 0.0
        self._ema_sq = 0.0
        self._debias = 0.0

    @torch.no_grad()
    def update(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> None:
        if mask is None:
            mask = torch.ones_like(x, dtype=torch.bool)
        _check_mask(x, mask)
        s, sq, cnt = (float(t) for t in _masked_moments(x, mask, self.group))
        if cnt == 0:
            return
        bmean = s / cnt
        bvar = max(sq / cnt - bmean * bmean, 0.0)
        if self.beta is None:
            total = self.count + cnt
            delta = bmean - self.mean
            m2 = self.var * self.count + bvar * cnt + delta * delta * self.count * cnt / total
            self.mean += delta * cnt / total
            self.var = m2 / total
            self.count = total
        else:
            b = self.beta
            self._ema_mean = b * self._ema_mean + (1 - b) * bmean
            self._ema_sq = b * self._ema_sq + (1 - b) * (sq / cnt)
            self._debias = b * self._debias + (1 - b)
            self.mean = self._ema_mean / self._debias
            self.var = max(self._ema_sq / self._debias - self.mean * self.mean, 0.0)
            self.count += 1

    @property
    def std(self) -> float:
        return math.sqrt(self.var + self.eps)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std

    def denormalize(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.std + self.mean

    def state_dict(self) -> Dict[str, float]:
        return {
            "mean": self.mean,
            "var": self.var,
            "count": self.count,
            "ema_mean": self._ema_mean,
            "ema_sq": self._ema_sq,
            "debias": self._debias,
        }

    def load_state_dict(self, state: Dict[str, float]) -> None:
        missing = {"mean", "var", "count", "ema_mean", "ema_sq", "debias"} - set(state)
        assert not missing, f"ValueNormalizer state is missing {sorted(missing)}"
        self.mean = float(state["mean"])
        self.var = float(state["var"])
        self.count = float(state["count"])
        self._ema_mean = float(state["ema_mean"])
        self._ema_sq = float(state["ema_sq"])
        self._debias = float(state["debias"])


RunningMeanStd = ValueNormalizer
