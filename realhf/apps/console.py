"""What the launcher shows while a run goes, read from the master's ``progress.json`` (realhf.base.progress).

* On a terminal: one live progress line (tqdm): steps done / steps this run really does, elapsed, ETA, the last
  step's time and key stats (task reward or loss, each MFC's time).
* Otherwise (CI, nohup, Slurm logs): a plain line when a step finishes, at most one every ``interval`` seconds
  (and always the last step).
* Warnings a user can act on (``notices``, the master's and those other processes post) are printed once each,
  above the progress line.
* At the end: a summary (steps, time, first- vs last-quarter reward or loss, where logs, checkpoints and the
  curve are) and ``<log_dir>/reward_curve.png`` (:mod:`realhf.apps.plot`).

Verbosity: ``quiet`` shows only warnings and errors (no progress, no summary); ``verbose`` prints a plain line for
every step, and debug logs.
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Optional, TextIO

from realhf.base import logging
from realhf.base.progress import key_stats, read_posted_notices, read_progress

logger = logging.getLogger(__name__)

VERBOSITIES = ("quiet", "normal", "verbose")


def fmt_secs(s: Optional[float]) -> str:
    if s is None:
        return "?"
    s = int(round(s))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _short_secs(s: float) -> str:
    return f"{s:.2f}s" if s < 10 else f"{s:.1f}s" if s < 60 else fmt_secs(s)


def _stats_text(last: dict, compact: bool = False) -> str:
    """The step time, the key stats and each MFC's time; ``compact`` (the live line): only the task reward (or the
    loss) besides the times."""
    parts = [f"step {_short_secs(last['step_time'])}" if "step_time" in last else ""]
    headline = next((k for k in ("task_reward", "loss") if k in last), None)
    for k, v in last.items():
        if k.endswith("/time"):
            parts.append(f"{k[:-5]} {_short_secs(v)}")
        elif k != "step_time" and (not compact or k == headline):
            parts.append(f"{k} {v:.4g}")
    return ", ".join(p for p in parts if p)


class _StatsTail:
    """The rows added to a run's ``stats.jsonl`` since the last call (a file rewritten in place, as a resumed run
    does to set rows aside, is read again from its start; rows already returned are skipped by step)."""

    def __init__(self, path: str):
        self.path, self.offset, self.inode, self.last_step = path, 0, None, None

    def new_rows(self) -> list:
        try:
            st = os.stat(self.path)
        except OSError:
            return []
        if st.st_ino != self.inode or st.st_size < self.offset:
            self.inode, self.offset = st.st_ino, 0
        rows = []
        with open(self.path) as f:
            f.seek(self.offset)
            for line in f:
                if not line.endswith("\n"):  # being written
                    break
                self.offset += len(line.encode())
                try:
                    row = json.loads(line)
                except ValueError:
                    continue
                step = row.get("global_step")
                if "step_time" in row and isinstance(step, int) and (self.last_step is None or step > self.last_step):
                    self.last_step = step
                    rows.append(row)
        return rows


class Console:
    def __init__(self, verbosity: str = "normal", stream: Optional[TextIO] = None, interval: float = 15.0):
        if verbosity not in VERBOSITIES:
            raise ValueError(f"verbosity {verbosity!r} is not one of {VERBOSITIES}")
        self.verbosity, self.interval = verbosity, interval
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty() and verbosity == "normal"
        self.log_dir = None
        self._bar = None

    def watch(self, log_dir: str) -> None:
        """Follow the run whose logs are in ``log_dir`` (again at each relaunch; the launcher removes the previous
        launch's progress file first)."""
        self.close()
        self.log_dir, self._step, self._notices, self._printed_at = log_dir, None, 0, float("-inf")
        self._posted = 0  # notices of other processes (realhf.base.progress.post_notice) shown so far
        self._tail = _StatsTail(os.path.join(log_dir, "stats.jsonl"))

    def poll(self) -> None:
        """Show what changed in the run's progress since the last call (cheap when nothing did)."""
        if self.log_dir is None:
            return
        posted = read_posted_notices(self.log_dir)
        for msg in posted[self._posted:]:
            self._write(f"warning: {msg}")
        self._posted = max(self._posted, len(posted))
        p = read_progress(self.log_dir)
        if p is None:
            return
        for msg in p.get("notices", [])[self._notices:]:
            self._write(f"warning: {msg}")
        self._notices = len(p.get("notices", []))
        if self.verbosity == "quiet":
            return
        step, total = p["global_step"], p["total_steps"]
        if self._step is None:
            first = p.get("first_step", 0)
            self._tail.last_step = first  # rows up to the resumed step were shown by the launch that made them
            if not self.tty:
                self._write(f"run started: {total} steps to do" + (f", resuming after step {first}" if first else ""))
        if step == self._step:
            return
        self._step = step
        eta = f"ETA {fmt_secs(p['eta'])}" if p.get("eta") is not None else "ETA ?"
        if self.tty:
            self._tty_update(p, eta, _stats_text(p.get("last", {}), compact=True))
        elif self.verbosity == "verbose":  # every step, from the stats rows (steps may finish between polls)
            for row in self._tail.new_rows():
                self._write(f"step {row['global_step']}/{total} | {_stats_text(key_stats(row))}")
        else:
            now = time.monotonic()
            if step > p.get("first_step", 0) and (step == total or now - self._printed_at >= self.interval):
                self._printed_at = now
                self._write(f"step {step}/{total} ({step / max(total, 1):.0%}) | elapsed {fmt_secs(p.get('elapsed'))} "
                            f"| {eta} | {_stats_text(p.get('last', {}))}")

    def _tty_update(self, p: dict, eta: str, stats: str) -> None:
        from tqdm import tqdm

        if self._bar is None:
            try:  # a terminal that reports no size (e.g. a pseudo-terminal nobody sized) gets 120 x 24
                size = os.get_terminal_size(self.stream.fileno())
                sized = size.columns > 0 and size.lines > 0
            except (OSError, ValueError):
                sized = False
            self._bar = tqdm(total=p["total_steps"], initial=p["global_step"], file=self.stream, desc="step",
                             dynamic_ncols=sized, ncols=None if sized else 120, nrows=None if sized else 24,
                             bar_format="{desc} {n_fmt}/{total_fmt} {percentage:3.0f}%|{bar}| [{elapsed}{postfix}]")
        self._bar.set_postfix_str(", ".join(x for x in (eta, stats) if x), refresh=False)
        self._bar.update(p["global_step"] - self._bar.n)

    def _write(self, line: str) -> None:
        if self._bar is not None:
            self._bar.write(line, file=self.stream)
        else:
            self.stream.write(line + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def finish(self, log_dir: str, name: str) -> None:
        """After a run that succeeded: draw its curve and print its summary."""
        from realhf.apps.plot import plot_run, summarize

        self.poll()
        self.close()
        if self.verbosity == "quiet":
            return
        try:
            png = plot_run(log_dir)
            summary = summarize(log_dir)
        except (OSError, ValueError, ImportError) as e:  # the run itself succeeded; say why there is no plot
            logger.warning(f"no summary or plot for {log_dir}: {type(e).__name__}: {e}")
            return
        lines = [f"{name} finished: {summary['steps']} steps in {fmt_secs(summary['step_seconds'])} of step time "
                 f"(last global step {summary['last_global_step']})"]
        for key, q in summary.items():  # the curve's value (realhf.apps.plot.curve_key), by quarter of the steps
            if isinstance(q, dict) and "first_quarter" in q:
                lines.append(f"  {key}: {q['first_quarter']:.4g} in the first quarter of steps -> "
                             f"{q['last_quarter']:.4g} in the last")
        lines.append(f"  logs: {summary['logs']}")
        lines.append(f"  checkpoints: {summary['checkpoints']}")
        if png:
            lines.append(f"  curve: {png}")
        self.stream.write("\n".join(lines) + "\n")
        self.stream.flush()
