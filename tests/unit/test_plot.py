"""What a run's curve and summary show (realhf/apps/plot.py), from a stats file written like a run's."""
import json

from realhf.apps.plot import curve_key, summarize


def _write(tmp_path, rows):
    with open(tmp_path / "stats.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
        f.write('{"global_step": 9, "step_ti')  # a partly written last line is skipped
    return str(tmp_path)


def test_dynamic_sampling_runs_show_every_generated_answer_not_the_filtered_batch(tmp_path):
    # under dynamic sampling the trained batch holds mixed groups only, so its task_reward stays near the middle
    rows = [{"global_step": i + 1, "step_time": 1.0, "task_reward": 0.0, "dynamic_sampling/all_mean": -4.0 + i}
            for i in range(8)]
    assert curve_key(rows) == "dynamic_sampling/all_mean"
    got = summarize(_write(tmp_path, rows))
    assert got["steps"] == 8 and got["dynamic_sampling/all_mean"] == {"first_quarter": -3.5, "last_quarter": 2.5}
    plain = [{k: v for k, v in r.items() if not k.startswith("dynamic")} for r in rows]
    assert curve_key(plain) == "task_reward"
    assert curve_key([{"global_step": 1, "step_time": 1.0, "loss": 0.5}]) == "loss"
    assert curve_key([{"global_step": 1, "step_time": 1.0}]) is None
