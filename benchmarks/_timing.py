"""Timing helpers shared by the benchmark scripts (imported as ``_timing`` when a script runs)."""
from __future__ import annotations

import statistics
import time

import torch


def inprocess_copy_seconds(numel: int, repeats: int) -> float:
    """Median time of one in-process ``copy_`` of ``numel`` fp32 elements (after a warm-up copy): the
    plain-copy reference that transfer figures are compared with."""
    src = torch.empty(numel)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])
