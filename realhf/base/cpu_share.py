"""A CPU worker's compute threads that follow the host's idle cores.

Where a trainer shares a host's cores with other busy processes (on one machine: the generation server of an
asynchronous run, which decodes a batch and then waits for the next weights), a fixed thread count is wrong half of
the time: one thread leaves a core idle while the server waits, two threads collide with the server while it decodes
(each parallel region waits for the thread that lost its core). :class:`ThreadGovernor` measures, every
``interval`` seconds, how many of the cores this process may run on (its affinity) other processes keep busy
(``/proc/stat`` minus this process's own CPU time) and sets the torch threads to the idle ones, between ``lo`` and
``hi``. ``torch.set_num_threads`` acts on the calling thread's parallel regions only (OpenMP), so the compute thread
calls :func:`tick` itself: before every block of a forward pass and, through a gradient hook, between blocks of the
backward pass. A tick between measurements costs one clock read.

One process-wide governor, installed by :func:`install` (the model worker, option ``cpus_per_worker_max``); without
one :func:`tick` does nothing. Linux only (``/proc``); elsewhere :func:`install` leaves the threads fixed.
"""
from __future__ import annotations

import os
import time
from typing import Callable, Optional, Sequence, Tuple

# /proc/stat cpuN fields after the name: user nice system idle iowait irq softirq steal guest guest_nice
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # guest time is already inside user


def read_busy_seconds(cpus: Sequence[int], path: str = "/proc/stat") -> float:
    """CPU seconds the host has spent busy on ``cpus`` since boot (all processes)."""
    want = {f"cpu{c}" for c in cpus}
    hz = os.sysconf("SC_CLK_TCK")
    total = 0
    with open(path) as f:
        for line in f:
            parts = line.split()
            if parts and parts[0] in want:
                vals = parts[1:]
                total += sum(int(vals[i]) for i in _BUSY_FIELDS if i < len(vals))
    return total / hz


def own_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def threads_for(others: float, n_cpus: int, lo: int, hi: int, margin: float = 0.25) -> int:
    """Threads to run with when other processes keep ``others`` of our ``n_cpus`` cores busy: the cores they leave
    idle, counting a core idle while they use at most ``margin`` of it, within [lo, hi]."""
    idle = int(n_cpus - others + margin)
    return max(lo, min(hi, idle))


class ThreadGovernor:
    def __init__(self, lo: int, hi: int, interval: float = 0.25, cpus: Optional[Sequence[int]] = None,
                 set_threads: Optional[Callable[[int], None]] = None,
                 clock: Callable[[], float] = time.monotonic,
                 sample: Optional[Callable[[], Tuple[float, float]]] = None):
        if lo < 1 or hi < lo:
            raise ValueError(f"ThreadGovernor: need 1 <= lo <= hi, got lo={lo}, hi={hi}")
        self.lo, self.hi, self.interval = lo, hi, interval
        self.cpus = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
        if set_threads is None:
            import torch

            set_threads = torch.set_num_threads
        self._set, self._clock = set_threads, clock
        self._sample = sample or (lambda: (read_busy_seconds(self.cpus), own_cpu_seconds()))
        self.threads = lo
        self._set(lo)
        self.changes = 0
        self.others = 0.0  # cores the other processes used in the last window
        self._t = clock()
        self._busy, self._own = self._sample()
        self._thread_s = self._window_s = 0.0

    def mean_threads(self) -> float:
        """The threads in effect on average (by time, over the measured windows) since the last call."""
        mean = self._thread_s / self._window_s if self._window_s > 0 else float(self.threads)
        self._thread_s = self._window_s = 0.0
        return mean

    def tick(self) -> int:
        now = self._clock()
        dt = now - self._t
        if dt < self.interval:
            return self.threads
        busy, own = self._sample()
        self.others = max(0.0, (busy - self._busy) - (own - self._own)) / dt
        self._thread_s += self.threads * dt
        self._window_s += dt
        self._t, self._busy, self._own = now, busy, own
        n = threads_for(self.others, len(self.cpus), self.lo, self.hi)
        if n != self.threads:
            self._set(n)
            self.threads = n
            self.changes += 1
        return n


_governor: Optional[ThreadGovernor] = None


def install(lo: int, hi: int, interval: float = 0.25) -> Optional[ThreadGovernor]:
    """Let this process's compute threads range over [lo, hi] with the host's idle cores (from the calling thread's
    :func:`tick` calls). ``hi <= lo``: fixed at ``lo``, no governor. Returns the governor (None when fixed or where
    ``/proc/stat`` cannot be read)."""
    global _governor
    if hi <= lo or not os.path.exists("/proc/stat"):
        _governor = None
        return None
    _governor = ThreadGovernor(lo, hi, interval)
    return _governor


def mean_threads() -> Optional[float]:
    """The installed governor's :meth:`ThreadGovernor.mean_threads` (None without one)."""
    return _governor.mean_threads() if _governor is not None else None


def uninstall() -> None:
    global _governor
    _governor = None


def active() -> bool:
    return _governor is not None


def tick() -> None:
    if _governor is not None:
        _governor.tick()


def _tick_hook(grad):
    tick()
    return None


def tick_in_backward(x) -> None:
    """Tick again when the backward pass reaches ``x`` (a block's output): between blocks of the backward pass."""
    if _governor is not None and x.requires_grad:
        x.register_hook(_tick_hook)
