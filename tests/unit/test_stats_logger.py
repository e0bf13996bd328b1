"""stats.jsonl holds the steps of this run only: a rerun of the same trial, or a resumed run redoing steps
after its recover checkpoint, moves the other rows aside (nothing lost, no step twice)."""
import glob
import json
import os

from realhf.base.stats import StatsLogger


def _rows(path):
    with open(path) as f:
        return [json.loads(l) for l in f if l.strip()]


def _log_steps(d, steps, resume_step=None, tag=""):
    s = StatsLogger(d, resume_step=resume_step)
    for k in steps:
        s.log(k, {"loss": float(k), "tag": tag})
    s.close()


def test_fresh_run_sets_earlier_rows_aside(tmp_path):
    d = str(tmp_path / "logs")
    _log_steps(d, [1, 2, 3], tag="first")
    _log_steps(d, [1, 2], tag="second")
    assert [(r["global_step"], r["tag"]) for r in _rows(os.path.join(d, "stats.jsonl"))] == [(1, "second"), (2, "second")]
    aside = glob.glob(os.path.join(d, "stats.before-*.jsonl"))
    assert len(aside) == 1
    assert [(r["global_step"], r["tag"]) for r in _rows(aside[0])] == [(1, "first"), (2, "first"), (3, "first")]
    _log_steps(d, [1], tag="third")  # a second set-aside file in the same second does not overwrite the first
    files = sorted(glob.glob(os.path.join(d, "stats.before-*.jsonl")))
    assert len(files) == 2 and sum(len(_rows(f)) for f in files) == 5


def test_resumed_run_keeps_steps_up_to_its_checkpoint(tmp_path):
    d = str(tmp_path / "logs")
    _log_steps(d, [1, 2, 3, 4, 5, 6, 7], tag="crashed")
    _log_steps(d, [6, 7, 8], resume_step=5, tag="resumed")
    rows = _rows(os.path.join(d, "stats.jsonl"))
    assert [r["global_step"] for r in rows] == list(range(1, 9))
    assert [r["tag"] for r in rows] == ["crashed"] * 5 + ["resumed"] * 3
    (aside,) = glob.glob(os.path.join(d, "stats.before-*.jsonl"))
    assert [r["global_step"] for r in _rows(aside)] == [6, 7]
    _log_steps(d, [9], resume_step=8)  # nothing after the checkpoint: nothing moved
    assert len(glob.glob(os.path.join(d, "stats.before-*.jsonl"))) == 1
