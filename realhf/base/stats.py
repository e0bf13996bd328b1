"""Per-step statistics: appended to ``<log_dir>/stats.jsonl`` (one JSON object per step), and to
TensorBoard event files and wandb when those are available/enabled.

A run starts its ``stats.jsonl`` with its own steps only. A fresh run finding rows of an earlier run of the
same trial, or a resumed run finding rows of steps after its recover checkpoint (steps it is about to redo),
moves those rows to ``stats.before-<time>.jsonl`` beside it, so nothing is lost and no step appears twice.
"""
from __future__ import annotations

import json
import math
import os
import threading
import time
from typing import Dict, Optional

from realhf.base import logging

logger = logging.getLogger(__name__)


def _set_aside_rows(path: str, resume_step: Optional[int]):
    """Move the rows of ``path`` that do not belong to this run (all of them for a fresh run; those with a
    ``global_step`` after ``resume_step`` for a resumed one) to ``stats.before-<time>.jsonl``."""
    if not os.path.exists(path) or os.path.getsize(path) == 0:
        return
    with open(path) as f:
        lines = [l for l in f if l.strip()]
    keep, move = [], []
    for line in lines:
        try:
            step = json.loads(line).get("global_step")
        except (ValueError, AttributeError):
            step = None
        (keep if resume_step is not None and isinstance(step, int) and step <= resume_step else move).append(line)
    if not move:
        return
    stem = os.path.join(os.path.dirname(path), f"stats.before-{time.strftime('%Y%m%d-%H%M%S')}")
    aside, n = stem + ".jsonl", 1
    while os.path.exists(aside):
        aside, n = f"{stem}-{n}.jsonl", n + 1
    with open(aside, "w") as f:
        f.writelines(move)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(keep)
    os.replace(tmp, path)
    what = "an earlier run" if resume_step is None else f"steps after the recover checkpoint (step {resume_step})"
    logger.info(f"moved {len(move)} rows of {what} from {path} to {aside}")


class StatsLogger:
    """``resume_step``: None for a fresh run, else the global step of the recover checkpoint it resumes from
    (see the module docstring for what happens to rows already in ``stats.jsonl``)."""

    def __init__(self, log_dir: str, tensorboard_dir: Optional[str] = None, wandb_config: Optional[dict] = None,
                 resume_step: Optional[int] = None):
        os.makedirs(log_dir, exist_ok=True)
        self.path = os.path.join(log_dir, "stats.jsonl")
        _set_aside_rows(self.path, resume_step)
        self._f = open(self.path, "a")
        self._lock = threading.Lock()  # rows may come from other threads (e.g. the checkpoint evaluator)
        self._tb = None
        tb_dir = tensorboard_dir or os.path.join(log_dir, "tensorboard")
        try:
            from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

            self._tb = SummaryWriter(tb_dir)
        except ImportError:
            logger.info("tensorboard is not installed: stats go to stats.jsonl only")
        self._wandb = None
        if wandb_config and wandb_config.get("mode", "disabled") != "disabled":
            import wandb  # optional; offline mode needs no network

            self._wandb = wandb.init(**wandb_config)

    def log(self, step: int, stats: Dict[str, float]):
        self._write(step, stats, past=False)

    def log_past(self, step: int, stats: Dict[str, float]):
        """Log stats that belong to an earlier global ``step`` (e.g. the evaluation of the checkpoint saved
        at that step, finished later): one more ``stats.jsonl`` row with that ``global_step`` and TensorBoard
        scalars at that step; wandb, whose steps only move forward, gets them at its current step with
        ``past_global_step`` as a value."""
        self._write(step, stats, past=True)

    def _write(self, step: int, stats: Dict[str, float], past: bool):
        row = {"global_step": step}
        for k, v in stats.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                row[k] = float(v) if math.isfinite(float(v)) else str(v)
            else:
                row[k] = v
        with self._lock:
            if self._f.closed:
                raise ValueError(f"stats logger {self.path} is closed")
            self._f.write(json.dumps(row) + "\n")
            self._f.flush()
            if self._tb is not None:
                for k, v in row.items():
                    if isinstance(v, float):
                        self._tb.add_scalar(k, v, step)
                self._tb.flush()
            if self._wandb is not None:
                floats = {k: v for k, v in row.items() if isinstance(v, float)}
                if past:  # attached to wandb's current step, without moving it
                    self._wandb.log({**floats, "past_global_step": float(step)}, commit=False)
                else:
                    self._wandb.log(floats, step=step)

    def close(self):
        with self._lock:
            if self._f.closed:
                return
            self._f.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
