"""When the master evaluates, saves HF checkpoints and writes recover checkpoints, from the spec's frequencies.

Frequencies of one kind (steps, epochs, seconds) trigger on whichever comes first; ``None`` means never. The
last step always saves when any save frequency is set, and never writes a recover checkpoint (the run is done).
"""
from __future__ import annotations

import time
from typing import Callable, Optional

from realhf.api.core.system_api import ExperimentSpec


def _every(n: Optional[int], k: int) -> bool:
    return bool(n) and k % n == 0


class Cadence:
    def __init__(self, spec: ExperimentSpec, clock: Callable[[], float] = time.monotonic):
        self.spec, self.clock = spec, clock
        self.last_save = self.last_ckpt = clock()

    def evaluate(self, step: int, epoch: int, epoch_end: bool) -> bool:
        """After global ``step`` (1-based) of 0-based ``epoch``; ``epoch_end``: the step ended its epoch."""
        s = self.spec
        return (epoch_end and _every(s.eval_freq_epochs, epoch + 1)) or _every(s.eval_freq_steps, step)

    def save_and_ckpt(self, step: int, epoch: int, epoch_end: bool, last: bool):
        """(save a HF checkpoint?, write a recover checkpoint?) after a step; remembers when each was last done."""
        s, now = self.spec, self.clock()
        save = (_every(s.save_freq_steps, step) or (epoch_end and _every(s.save_freq_epochs, epoch + 1))
                or (bool(s.save_freq_secs) and now - self.last_save >= s.save_freq_secs)
                or (last and bool(s.save_freq_steps or s.save_freq_epochs or s.save_freq_secs)))
        ckpt = not last and (_every(s.ckpt_freq_steps, step) or (epoch_end and _every(s.ckpt_freq_epochs, epoch + 1))
                             or (bool(s.ckpt_freq_secs) and now - self.last_ckpt >= s.ckpt_freq_secs))
        if save:
            self.last_save = now
        if ckpt:
            self.last_ckpt = now
        return save, ckpt
