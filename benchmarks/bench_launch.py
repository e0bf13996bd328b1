"""Launch benchmark: a short real run from the command line to the launcher's exit, split into phases read from the
run's own logs. Prints JSON lines: one per round, then the medians.

Work: ``sft`` on the tiny Qwen2 model of ``realhf.impl.model.tiny`` over 16 one-digit additions, 12 steps with a
recover checkpoint every 2, layout d2m1p1 (the launcher, a master and two model workers over gloo), or with
``--exp ppo-math`` a tiny GRPO run (4 prompts x 4 samples x 6 tokens a step, 4 steps). Most end-to-end tests pay
such a launch, and so does every user's run before its first step.

Phases, in seconds from the command's start (the log lines' timestamps):
- ``launcher_s``: until the launcher starts the processes (its imports and the checks of config, model, tokenizer
  and data);
- ``ready_s``: until the last model worker is ready (imports, process group, model and optimizer built, data read);
- ``first_step_s``: until the master logs its first step done;
- ``train_s``: from the first step done to "training finished";
- ``exit_s``: from "training finished" until the launcher has exited (processes ending, the summary, the plot);
- ``wall_s``: the whole command.

Usage: python benchmarks/bench_launch.py [--rounds 3] [--exp sft|ppo-math]
To compare two trees, run it with ``PYTHONPATH=<other tree>``: the launched processes import the realhf this
script imports.
"""
from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

_STAMP = re.compile(r"^(\d{8}-\d{2}:\d{2}:\d{2}\.\d{3}) ")


def _stamps(path: str, pattern: str) -> list:
    """The times (epoch seconds) of the log lines of ``path`` that the regular expression ``pattern`` finds."""
    out, rx = [], re.compile(pattern)
    with open(path, errors="replace") as f:
        for line in f:
            m = _STAMP.match(line)
            if m and rx.search(line):
                out.append(datetime.datetime.strptime(m.group(1), "%Y%m%d-%H:%M:%S.%f").timestamp())
    return out


def _command(exp: str, model: str, data: str, root: str) -> list:
    from realhf.testing import sft_cmd

    if exp == "sft":
        return sft_cmd(model, data, root, "b", "model.optimizer.lr=1e-3", "allocation_mode=d2m1p1",
                       "n_devices_per_node=2", "exp_ctrl.total_train_epochs=3", "exp_ctrl.ckpt_freq_steps=2")
    return ["ppo-math", f"actor.path={model}", f"dataset.path={data}/math.jsonl", "dataset.train_bs_n_seqs=4",
            "group_size=4", "ppo.gen.max_new_tokens=6", "ppo.gen.temperature=1.0", "use_chat_template=false",
            "prompt_template={prompt}", "reward_allow_last_number=true", "actor.optimizer.lr=1e-3",
            f"fileroot={root}", "experiment_name=b", "allocation_mode=d2m1p1", "n_devices_per_node=2",
            "exp_ctrl.total_train_epochs=1"]


def one_round(exp: str, model: str, data: str, work: str) -> dict:
    from realhf.base.process import env_with_source_path, source_root

    root = tempfile.mkdtemp(dir=work)
    cmd = [sys.executable, "-m", "realhf.apps.quickstart", *_command(exp, model, data, root)]
    t0 = time.time()
    p = subprocess.run(cmd, cwd=source_root(), env=env_with_source_path(), capture_output=True, text=True,
                       timeout=600)
    t_end = time.time()
    if p.returncode != 0:
        raise RuntimeError(f"the launch failed ({p.returncode}):\n{p.stderr[-3000:]}")
    logs = os.path.join(root, "b", "trial0", "logs")
    launcher = os.path.join(root, "launcher.log")
    with open(launcher, "w") as f:
        f.write(p.stderr + p.stdout)
    started = _stamps(launcher, "started master")[0]
    ready = max(_stamps(w, " ready: models")[0] for w in glob.glob(os.path.join(logs, "model_worker_*.log")))
    master = os.path.join(logs, "master.log")
    steps = _stamps(master, r"global step \d+/\d+ .* done in ")
    first, done = steps[0], _stamps(master, "training finished")[0]
    return dict(launcher_s=round(started - t0, 2), ready_s=round(ready - t0, 2), first_step_s=round(first - t0, 2),
                train_s=round(done - first, 2), exit_s=round(t_end - done, 2), wall_s=round(t_end - t0, 2),
                steps=len(steps))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--exp", choices=["sft", "ppo-math"], default="sft")
    a = ap.parse_args()
    import realhf
    from realhf.impl.dataset import make_arithmetic_problems, write_math_jsonl
    from realhf.testing import write_sum_rows
    from realhf.impl.model.tiny import ensure_tiny_model

    work = tempfile.mkdtemp(prefix="bench_launch-")
    data = os.path.join(work, "data")
    os.makedirs(data)
    write_sum_rows(os.path.join(data, "train.jsonl"))
    write_math_jsonl(make_arithmetic_problems(16, seed=3, kind="easy"), os.path.join(data, "math.jsonl"))
    model = ensure_tiny_model("qwen2", tie_word_embeddings=True)
    one_round(a.exp, model, data, work)  # warm-up: caches (tokenizer class and check, kernels) as a user's 2nd run
    rounds = []
    for i in range(a.rounds):
        r = one_round(a.exp, model, data, work)
        rounds.append(r)
        print(json.dumps(dict(bench="launch", exp=a.exp, round=i, **r)), flush=True)
    med = {k: round(statistics.median(r[k] for r in rounds), 2) for k in rounds[0]}
    print(json.dumps(dict(bench="launch", exp=a.exp, median_of=a.rounds, realhf=os.path.dirname(realhf.__file__),
                          **med)), flush=True)


if __name__ == "__main__":
    main()
