"""Per-step statistics: appended to ``<log_dir>/stats.jsonl`` (one JSON object per step), and to
TensorBoard event files and wandb when those are available/enabled."""
from __future__ import annotations

import json
import math
import os
import threading
from typing import Dict, Optional

from realhf.base import logging

logger = logging.getLogger(__name__)


class StatsLogger:
    def __init__(self, log_dir: str, tensorboard_dir: Optional[str] = None, wandb_config: Optional[dict] = None):
        os.makedirs(log_dir, exist_ok=True)
        self.path = os.path.join(log_dir, "stats.jsonl")
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
