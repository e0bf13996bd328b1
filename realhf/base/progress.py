"""A run's progress as the master reports it: ``<log_dir>/progress.json``, replaced atomically after every step.

Fields: ``total_steps`` (the steps this run really does, given epochs, data size and ``benchmark_steps``),
``global_step`` (done so far, counting the steps before a resume), ``first_step`` (where this launch started:
the recover checkpoint's step, else 0), ``epoch``/``epochs``, ``elapsed`` and ``eta`` (seconds), ``last`` (the last
step's time and key stats) and ``notices`` (warnings a user can act on, each once). The launcher's console
shows it; anything else may read it too.

Processes other than the master (the rollout manager of an asynchronous run, which finds problems while the master
waits for a batch) post their notices to ``<log_dir>/notices.jsonl`` (:func:`post_notice`, one JSON string a line);
the console shows those too.
"""
from __future__ import annotations

import json
import os
from typing import List, Optional

from realhf.base.plain_json import write_json_atomic

PROGRESS_FILE = "progress.json"
NOTICES_FILE = "notices.jsonl"

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
    """Remove the progress and the posted notices of an earlier launch (before a new one starts)."""
    for name in (PROGRESS_FILE, NOTICES_FILE):
        try:
            os.remove(os.path.join(log_dir, name))
        except FileNotFoundError:
            pass


def post_notice(log_dir: str, message: str) -> None:
    """Append ``message`` to the run's posted notices (one line, written at once: lines of several processes do not
    mix)."""
    line = (json.dumps(message) + "\n").encode()
    fd = os.open(os.path.join(log_dir, NOTICES_FILE), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def read_posted_notices(log_dir: str) -> List[str]:
    """The notices posted so far (a line still being written is left for the next call)."""
    try:
        with open(os.path.join(log_dir, NOTICES_FILE), "rb") as f:
            data = f.read()
    except OSError:
        return []
    out = []
    for line in data[:data.rfind(b"\n") + 1].splitlines():
        try:
            msg = json.loads(line)
        except ValueError:
            continue
        if isinstance(msg, str):
            out.append(msg)
    return out


def read_progress(log_dir: str) -> Optional[dict]:
    """The last progress written, or None when there is none (yet)."""
    try:
        with open(os.path.join(log_dir, PROGRESS_FILE)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
