"""The checkpoint evaluator during training (``auto_eval``): a real short run logs ``<dataset>/<metric>``
for every save step to stats.jsonl and TensorBoard; a failing evaluation is reported and training goes on."""
import glob
import json
import os
import sys

import pytest

from realhf.api.quickstart.eval_config import EvaluatorConfig
from realhf.base.stats import StatsLogger
from realhf.testing import run_quickstart
from realhf.impl.model.tiny import ensure_tiny_model
from realhf.system.trainer.evaluator import AutoEvaluator, flatten_metrics, policy_model

@pytest.fixture(scope="module")
def model():
    return ensure_tiny_model("qwen2", tie_word_embeddings=True)


def _write_sft(path, n):
    with open(path, "w") as f:
        for i in range(n):
            a, b = i % 10, (3 * i) % 10
            f.write(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n")


def _quickstart(args, timeout=240):
    p = run_quickstart(args, timeout=timeout)
    assert p.returncode == 0, f"quickstart failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    return p


def _stats(run_dir):
    with open(os.path.join(run_dir, "logs", "stats.jsonl")) as f:
        return [json.loads(l) for l in f if l.strip()]


def _tb_scalars(run_dir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = {}
    for ev in glob.glob(os.path.join(run_dir, "logs", "tensorboard", "events.out.tfevents.*")):
        acc = EventAccumulator(ev, size_guidance={"scalars": 0})
        acc.Reload()
        if tag in acc.Tags()["scalars"]:
            out.update({e.step: e.value for e in acc.Scalars(tag)})
    return out


def _sft(model, train, root, exp, *extra):
    return ["sft", f"model.path={model}", "dataset.max_seqlen=512", f"dataset.train_path={train}", "dataset.train_bs_n_seqs=8",
            "model.optimizer.lr=1e-3", f"fileroot={root}", f"experiment_name={exp}", "allocation_mode=d1m1p1",
            "n_devices_per_node=1", "exp_ctrl.benchmark_steps=4", "exp_ctrl.save_freq_steps=2",
            "auto_eval.enabled=true", "auto_eval.max_problems=3", "auto_eval.n_sampling=2",
            "auto_eval.max_gen_tokens=4", "auto_eval.prompt_type=plain", "auto_eval.batch_size=4", *extra]


def test_auto_eval_logs_metrics_of_each_save(model, tmp_path):
    train = tmp_path / "train.jsonl"
    _write_sft(train, 40)
    root = str(tmp_path / "runs")
    _quickstart(_sft(model, train, root, "ae", "auto_eval.data_names=[gsm8k,aime24]"))
    run_dir = os.path.join(root, "ae", "trial0")
    rows = _stats(run_dir)
    assert [r["global_step"] for r in rows if "loss" in r] == [1, 2, 3, 4]
    ev = {r["global_step"]: r for r in rows if "gsm8k/greedy_acc" in r}
    assert sorted(ev) == [2, 4], rows  # one evaluation per save, logged at the save's step
    for step, r in ev.items():
        for ds in ("gsm8k", "aime24"):
            assert r[f"{ds}/num_questions"] == 3.0
            for k in ("greedy_acc", "sample_pass@1", "pass@2", "maj@2"):
                assert 0.0 <= r[f"{ds}/{k}"] <= 1.0, (k, r)
            assert 1.0 <= r[f"{ds}/greedy_length"] <= 4.0
        assert r["auto_eval/seconds"] > 0
        tag = f"epoch1epochstep{step}globalstep{step}"
        out = os.path.join(run_dir, "eval", tag)
        assert os.path.isfile(os.path.join(out, "gsm8k", "greedy.jsonl")) and os.path.isfile(os.path.join(out, "aggregate.json"))
        with open(os.path.join(out, "job.json")) as f:
            assert f"checkpoints/default/{tag}" in json.load(f)["model_path"]
    assert not any("auto_eval/failed" in r for r in rows)
    for tag in ("gsm8k/greedy_acc", "gsm8k/sample_pass@1", "aime24/greedy_acc"):
        assert sorted(_tb_scalars(run_dir, tag)) == [2, 4], tag


def test_failing_evaluation_is_reported_and_training_goes_on(model, tmp_path):
    """A dataset that passes the config check but cannot be read makes every evaluation fail: the run
    still trains every step and exits 0, and each failure is in stats.jsonl and in the master's log."""
    bad = tmp_path / "evaldata" / "broken"
    bad.mkdir(parents=True)
    (bad / "test.jsonl").write_text('{"question": "1+1?", "answer": "#### 2"}\nnot json\n')
    train = tmp_path / "train.jsonl"
    _write_sft(train, 40)
    root = str(tmp_path / "runs")
    _quickstart(_sft(model, train, root, "bad", "auto_eval.data_names=[broken]", f"auto_eval.data_dir={tmp_path / 'evaldata'}"))
    run_dir = os.path.join(root, "bad", "trial0")
    rows = _stats(run_dir)
    assert [r["global_step"] for r in rows if "loss" in r] == [1, 2, 3, 4]
    failed = {r["global_step"]: r for r in rows if r.get("auto_eval/failed") == 1.0}
    assert sorted(failed) == [2, 4]
    assert all("exit code 2" in r["auto_eval/error"] for r in failed.values())
    with open(os.path.join(run_dir, "logs", "master.log")) as f:
        log = f.read()
    assert "auto_eval: evaluation of global step 2" in log and "not valid JSON" in log and "training continues" in log


def _cfg(**kw):
    return EvaluatorConfig(**{"data_names": ["gsm8k"], "max_problems": 2, "n_sampling": 0, "max_gen_tokens": 2,
                              "prompt_type": "plain", **kw})


def test_evaluator_crash_and_timeout_are_reported(tmp_path):
    """A crashing or hanging evaluation process is reported as failed; the queue goes on after it."""
    stats = StatsLogger(str(tmp_path / "logs"))
    crash = AutoEvaluator(_cfg(), stats, str(tmp_path / "eval"),
                          cmd=[sys.executable, "-c", "import os, sys; print('boom'); sys.stdout.flush(); os.abort()"])
    crash.submit(str(tmp_path / "ckpt1"), 1)
    crash.submit(str(tmp_path / "ckpt2"), 2)  # queued behind the first
    assert crash.wait(timeout=60)
    assert "signal 6" in crash.results[1]["error"] and "signal 6" in crash.results[2]["error"]
    hang = AutoEvaluator(_cfg(timeout=0.5), stats, str(tmp_path / "eval2"),
                         cmd=[sys.executable, "-c", "import time; time.sleep(60)"])
    hang.submit(str(tmp_path / "ckpt3"), 3)
    assert hang.wait(timeout=60)  # a hang detector: the 0.5 s evaluation timeout ends it long before
    assert "timed out" in hang.results[3]["error"]
    # what is still queued when the master stops waiting is stopped and reported
    slow = AutoEvaluator(_cfg(), stats, str(tmp_path / "eval3"), cmd=[sys.executable, "-c", "import time; time.sleep(60)"])
    slow.submit(str(tmp_path / "ckpt4"), 4)
    slow.submit(str(tmp_path / "ckpt5"), 5)
    assert not slow.wait(timeout=0.5)
    assert slow.pending() == 0 and "stopped" in slow.results[4]["error"] and "not run" in slow.results[5]["error"]
    stats.close()
    with open(tmp_path / "logs" / "stats.jsonl") as f:
        rows = [json.loads(l) for l in f]
    assert sorted(r["global_step"] for r in rows if r.get("auto_eval/failed") == 1.0) == [1, 2, 3, 4, 5]


def test_policy_model_and_flatten():
    from types import SimpleNamespace as NS

    spec = NS(models=[NS(name="critic", optimizer=object(), is_critic=True), NS(name="ref", optimizer=None, is_critic=False),
                      NS(name="actor", optimizer=object(), is_critic=False)])
    assert policy_model(spec).name == "actor"
    assert flatten_metrics({"gsm8k": {"greedy_acc": 0.5, "num_questions": 3}}) == {"gsm8k/greedy_acc": 0.5,
                                                                                    "gsm8k/num_questions": 3.0}


def test_config_checks():
    with pytest.raises(ValueError, match="available: .*gsm8k"):
        EvaluatorConfig(enabled=True, data_names=["gsm8kk"])
    with pytest.raises(ValueError, match="prompt_type"):
        EvaluatorConfig(prompt_type="nope")
    assert EvaluatorConfig(data_names="gsm8k, aime24").data_names == ["gsm8k", "aime24"]
    assert EvaluatorConfig(enabled=True).eval_kwargs()["n_workers"] == 0
