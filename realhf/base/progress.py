"""A run's progress as the master reports it: ``<log_dir>/progress.json``, replaced atomically after every step.

Fields: ``total_steps`` (the steps this run really does, given epochs, data size and ``benchmark_steps``),
``global_step`` (done so far, counting the steps before a resume), ``first_step`` (where this launch started:
the recover checkpoint's step, else 0), ``epoch``/``epochs``, ``elapsed`` and ``eta`` (seconds), ``last`` (the last
step's time and key stats) and ``notices`` (warnings a user can act on, each once). The launcher's console
shows it; anything else may read it too.
"""
from __future__ import annotations

import json
import os
from typing import Optional

from realhf.base.plain_json import write_json_atomic

PROGRESS_FILE = "progress.json"

# the stats shown with the progress, when a run has them (reward and losses, then the MFC times)
KEY_STATS = ("task_reward", "loss", "eval_loss", "actor_loss", "critic_loss", "no_eos_ratio")


def key_stats(stats: dict) -> dict:
    """The step time, the key stats and every MFC's time of a step's stats."""
    out = {k: stats[k] for k in ("step_time",) + KEY_STATS if isinstance(stats.get(k), (int, float))}
    out.update({k: v for k, v in stats.items() if k.endswith("/time") and isinstance(v, (int, float))})
    return out


def write_progress(log_dir: str, progress: dict) -> None:
    write_json_atomic(os.path.join(log_dir, PROGRESS_FILE), progress, durable=False)


def clear_progress(log_dir: str) -> None:
    """Remove the progress of an earlier launch (before a new one starts)."""
    try:
        os.remove(os.path.join(log_dir, PROGRESS_FILE))
    except FileNotFoundError:
        pass


def read_progress(log_dir: str) -> Optional[dict]:
    """The last progress written, or None when there is none (yet)."""
    try:
        with open(os.path.join(log_dir, PROGRESS_FILE)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
