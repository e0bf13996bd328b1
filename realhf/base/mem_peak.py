"""The peak of memory a piece of work allocates above what was allocated when it started.

On CUDA: ``torch.cuda.max_memory_allocated`` after a reset (the caching allocator's count of live tensor bytes). On
the CPU, where torch keeps no such count, the allocator's own events as ``torch.profiler`` records them with
``profile_memory=True``: every allocation and free of a tensor's memory in order, summed into the live bytes of the
work and their maximum. Both count what tensors hold, not what the process's allocator keeps aside, so the two
devices measure the same quantity (what a memory model estimates).

The CPU count slows the work while it runs (a profiler event per allocation): for tests and checks, not for every
training step.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Iterator, Optional, Tuple, TypeVar

T = TypeVar("T")


@dataclasses.dataclass
class PeakBytes:
    peak: int = 0  # the most bytes allocated at once above the start, at any moment of the work
    end: int = 0  # the bytes still allocated at the end, above the start (what the work kept)


@contextlib.contextmanager
def measure(device=None) -> Iterator[PeakBytes]:
    """``with measure(device) as m: work()`` then ``m.peak`` / ``m.end`` (bytes). ``device``: a torch device (or its
    name); None or a CPU device counts host tensor memory."""
    import torch

    dev = torch.device(device) if device is not None else torch.device("cpu")
    res = PeakBytes()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        start = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        yield res
        torch.cuda.synchronize(dev)
        res.peak = max(0, torch.cuda.max_memory_allocated(dev) - start)
        res.end = torch.cuda.memory_allocated(dev) - start
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield res
    res.peak, res.end = _cpu_peak(prof)


def _cpu_peak(prof) -> Tuple[int, int]:
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type() == _cpu_device_type())
    live = peak = 0
    for _, n in events:
        live += n
        peak = max(peak, live)
    return peak, live


def _cpu_device_type():
    import torch

    return torch._C._autograd.DeviceType.CPU


def peak_bytes(fn: Callable[[], T], device=None) -> Tuple[T, PeakBytes]:
    """``fn()``'s result and the :class:`PeakBytes` of its work (see :func:`measure`)."""
    with measure(device) as m:
        out = fn()
    return out, m


def gib(n: Optional[int]) -> float:
    return 0.0 if not n else n / (1 << 30)
