"""A run's curve and summary from its ``stats.jsonl``: ``python -m realhf.apps.plot <log_dir> [--out PNG]``.

Works on a finished run and on one still going (it reads the rows written so far). The picture has two panels:
the task reward of every step with its moving average (the loss for runs without a reward, e.g. ``sft``), and
the time each MFC took per step. The launcher draws ``<log_dir>/reward_curve.png`` and prints the summary at the
end of every run; this command draws the same for any run.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Dict, List, Optional

FIGSIZE, DPI = (8.0, 6.0), 100  # an 800 x 600 picture


def step_rows(log_dir: str) -> List[dict]:
    """The per-step rows of ``<log_dir>/stats.jsonl`` (rows logged for an earlier step by the checkpoint evaluator,
    which have no ``step_time``, are left out; a partly written last line is ignored)."""
    rows = []
    with open(os.path.join(log_dir, "stats.jsonl")) as f:
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and "step_time" in row:
                rows.append(row)
    return rows


def curve_key(rows: List[dict]) -> Optional[str]:
    """What the curve shows: the mean reward of every answer generated in a step under dynamic sampling (whose
    trained batch, ``task_reward``'s, keeps only prompts with mixed rewards), else the task reward when the run has
    one, else the training loss."""
    for key in ("dynamic_sampling/all_mean", "task_reward", "loss"):
        if any(isinstance(r.get(key), float) for r in rows):
            return key
    return None


def moving_average(values: List[float], window: int) -> List[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def _quarter_means(values: List[float]) -> Dict[str, float]:
    q = max(1, len(values) // 4)
    return {"first_quarter": sum(values[:q]) / q, "last_quarter": sum(values[-q:]) / q}


def summarize(log_dir: str) -> dict:
    """Steps, wall time of the steps, first-quarter vs last-quarter mean of the curve's value, where things are."""
    rows = step_rows(log_dir)
    run_dir = os.path.dirname(os.path.abspath(log_dir))
    out = {"steps": len(rows), "last_global_step": rows[-1]["global_step"] if rows else 0,
           "step_seconds": round(sum(r["step_time"] for r in rows), 1), "logs": log_dir,
           "checkpoints": os.path.join(run_dir, "checkpoints")}
    key = curve_key(rows)
    if key is not None:
        out[key] = {k: round(v, 4) for k, v in _quarter_means([r[key] for r in rows if isinstance(r.get(key), float)]).items()}
    return out


def plot_run(log_dir: str, out: Optional[str] = None) -> Optional[str]:
    """Draw the run's curve to ``out`` (default ``<log_dir>/reward_curve.png``); returns the path, or None when the
    run has no step yet."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = step_rows(log_dir)
    key = curve_key(rows)
    if not rows or key is None:
        return None
    out = out or os.path.join(log_dir, "reward_curve.png")
    pts = [(r["global_step"], r[key]) for r in rows if isinstance(r.get(key), float)]
    steps, vals = [p[0] for p in pts], [p[1] for p in pts]
    window = max(1, min(8, len(vals) // 4))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=FIGSIZE, dpi=DPI, sharex=True, height_ratios=[3, 2])
    top.plot(steps, vals, marker="o", ms=3, lw=1, alpha=0.6, label=key)
    if window > 1:
        top.plot(steps, moving_average(vals, window), lw=2, label=f"moving average ({window} steps)")
    top.set_ylabel(key)
    top.set_title(os.path.relpath(os.path.dirname(os.path.abspath(log_dir)), os.path.dirname(os.path.dirname(
        os.path.dirname(os.path.abspath(log_dir))))))
    top.grid(alpha=0.3)
    top.legend(loc="best", fontsize="small")
    for tkey in sorted({k for r in rows for k in r if k.endswith("/time")}):
        bottom.plot([r["global_step"] for r in rows if tkey in r], [r[tkey] for r in rows if tkey in r], lw=1,
                    label=tkey[: -len("/time")])
    bottom.set_ylabel("seconds per step")
    bottom.set_xlabel("global step")
    bottom.grid(alpha=0.3)
    if bottom.lines:
        bottom.legend(loc="best", fontsize="small")
    fig.tight_layout()
    tmp = out + ".tmp.png"
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, out)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("log_dir", help="a run's log folder (<fileroot>/<experiment>/<trial>/logs)")
    ap.add_argument("--out", default=None, help="the picture to write (default <log_dir>/reward_curve.png)")
    a = ap.parse_args(argv)
    if not os.path.isfile(os.path.join(a.log_dir, "stats.jsonl")):
        sys.stderr.write(f"error: {a.log_dir} has no stats.jsonl; give a run's log folder\n")
        return 2
    path = plot_run(a.log_dir, a.out)
    sys.stdout.write(json.dumps({**summarize(a.log_dir), "plot": path}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
