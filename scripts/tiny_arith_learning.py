"""A fast learning test of realhf's RL: a tiny model trained here from scratch on arithmetic, then GRPO
(or PPO with a critic) through the quickstart launcher, with held-out greedy accuracy before and after.

The recipe (every training setting is in the example configs; this script adds paths and names):

1. build a tiny random-weight Qwen2 model (2 layers, hidden 64, the tiny 1000-token BPE tokenizer);
2. write bare sums ``"47+5="`` -> ``"52"`` (``make_arithmetic_problems(kind="bare", max_value=99)``,
   1,000 distinct problems): SFT rows, RL prompts, and 200 held-out problems whose prompts appear in
   neither;
3. SFT from scratch (``examples/configs/sft-tiny-arith-cpu.yaml``) on the answers of a *sloppy teacher*
   (``arithmetic.to_sft_rows(slip=0.85, careful_below=2)``): always right when the digit added is 0 or
   1 (20% of the problems), otherwise one too many 85% of the time. The model learns the arithmetic and
   imitates the teacher: it is right on about 30% of held-out problems and one too many on most others,
   where the right answer is its second choice. Only a reward can tell it which answer is right;
4. measure held-out greedy accuracy of the SFT checkpoint ("before");
5. RL from that checkpoint with the rule-based verifier reward: GRPO
   (``examples/configs/grpo-tiny-arith-cpu.yaml``) and/or PPO with a critic and a KL penalty to the
   SFT model (``examples/configs/ppo-critic-tiny-arith-cpu.yaml``);
6. measure held-out greedy accuracy of the RL checkpoint ("after").

(An SFT model merely stopped early at ~30% on clean answers is a poor start for a *fast* test: it
rarely samples the right answer on the problems it gets wrong, and GRPO took it only from 27% to ~45%
in 120 steps; the sloppy teacher gives the regime RL is good at, sharpening answers the model already
samples.)

Everything is seeded: the same machine gives the same figures run after run.

Usage::

    python scripts/tiny_arith_learning.py [--out outputs/tiny_arith] [--algo grpo|ppo|both]
        [--sft key=value ...] [--grpo key=value ...] [--ppo key=value ...]

It prints one JSON summary (accuracies, wall times per phase) and writes it to ``<out>/summary.json``.
``tests/e2e/test_grpo_learns.py`` uses :func:`prepare` and :func:`learn` (what :func:`run_recipe` runs).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

CONFIGS = os.path.join(ROOT, "examples", "configs")
SFT_CONFIG = os.path.join(CONFIGS, "sft-tiny-arith-cpu.yaml")
GRPO_CONFIG = os.path.join(CONFIGS, "grpo-tiny-arith-cpu.yaml")
PPO_CONFIG = os.path.join(CONFIGS, "ppo-critic-tiny-arith-cpu.yaml")
RL_CONFIGS = {"grpo": GRPO_CONFIG, "ppo": PPO_CONFIG}

# The task and the model (see the module docstring).
KIND, MAX_VALUE = "bare", 99
N_SFT, N_RL, N_TEST = 12288, 2048, 200
DATA_SEED, RL_SEED = 1, 2
# The SFT teacher is sloppy (arithmetic.to_sft_rows): always right when the digit added is 0, 1 or 2
# (30% of the problems), otherwise one too many two times in three. The SFT model imitates it: right
# on about 30% of held-out problems, one too many on most others, where the right answer is its
# second choice — the verifier reward has to teach it which answer is right.
SLIP, CAREFUL_BELOW = 0.85, 2
MODEL = dict(family="qwen2", seed=1, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, intermediate_size=256, tie_word_embeddings=True, max_position_embeddings=64)
# Greedy evaluation: answers are at most 3 digits + EOS; the last number counts as the answer, as in
# the RL reward (reward.allow_last_number: true).
EVAL = dict(max_new_tokens=4, prompt_template="{prompt}", use_chat_template=False, allow_last_number=True,
            batch_size=200)


def log(msg: str) -> None:
    print(f"[tiny_arith] {msg}", flush=True)


def build_model(out: str, model: Optional[dict] = None) -> str:
    """The tiny random-weight model (cached in ``<out>/model-init``; deterministic); ``model`` overrides entries of
    ``MODEL`` (e.g. ``num_attention_heads=2`` for head size 32, which vLLM's CPU attention needs)."""
    from realhf.impl.model.tiny import build_tiny_hf_model

    path = os.path.join(out, "model-init")
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        kw = {**MODEL, **(model or {})}
        build_tiny_hf_model(kw.pop("family"), path, seed=kw.pop("seed"), **kw)
    return path


def make_data(out: str, slip: float = SLIP, careful_below: int = CAREFUL_BELOW) -> Dict[str, object]:
    """SFT rows, RL prompts and held-out rows (prompts disjoint from both)."""
    from realhf.impl.dataset import make_arithmetic_problems, write_math_jsonl
    from realhf.impl.dataset.arithmetic import make_heldout_split, write_sft_jsonl

    sft, test = make_heldout_split(N_SFT, N_TEST, seed=DATA_SEED, kind=KIND, max_value=MAX_VALUE)
    held = {r["prompt"] for r in test}
    rl = [r for r in make_arithmetic_problems(2 * N_RL, seed=RL_SEED, kind=KIND, max_value=MAX_VALUE)
          if r["prompt"] not in held][:N_RL]
    paths = {"sft": os.path.join(out, "data", "sft_train.jsonl"), "rl": os.path.join(out, "data", "rl_train.jsonl"),
             "test": os.path.join(out, "data", "heldout.jsonl")}
    write_sft_jsonl(sft, paths["sft"], slip=slip, careful_below=careful_below, seed=DATA_SEED)
    write_math_jsonl(rl, paths["rl"])
    write_math_jsonl(test, paths["test"])
    return {"paths": paths, "test": test}


def quickstart(exp: str, config: str, overrides: Sequence[str], log_path: str, timeout: float = 900) -> None:
    """``python -m realhf.apps.quickstart <exp> --config <config> overrides...``, output to ``log_path``."""
    cmd = [sys.executable, "-m", "realhf.apps.quickstart", exp, "--config", config, *overrides]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    with open(log_path, "w") as f:
        p = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
    if p.returncode != 0:
        with open(log_path) as f:
            tail = f.read()[-4000:]
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}); log {log_path}:\n{tail}")


def last_checkpoint(run_dir: str, model: str) -> str:
    ckpts = sorted(glob.glob(os.path.join(run_dir, "checkpoints", model, "*")), key=os.path.getmtime)
    if not ckpts:
        raise RuntimeError(f"no {model} checkpoint under {run_dir}/checkpoints")
    return ckpts[-1]


def read_stats(run_dir: str) -> List[dict]:
    with open(os.path.join(run_dir, "logs", "stats.jsonl")) as f:
        return [json.loads(l) for l in f if l.strip()]


def evaluate(ckpt: str, test: List[dict], threads: Optional[int] = 2):
    from realhf.experiments.math_eval import math_accuracy

    return math_accuracy(ckpt, test, threads=threads, **EVAL)


def run_sft(out: str, model: str, data: dict, overrides: Sequence[str] = ()) -> str:
    exp = "sft-tiny-arith"
    quickstart("sft", SFT_CONFIG, [f"model.path={model}", f"dataset.train_path={data['paths']['sft']}",
                                   f"fileroot={out}/runs", f"experiment_name={exp}", "trial_name=run", *overrides],
               os.path.join(out, "logs", f"{exp}.log"))
    return os.path.join(out, "runs", exp, "run")


def run_rl(algo: str, out: str, sft_ckpt: str, data: dict, overrides: Sequence[str] = (),
           exp: Optional[str] = None, experiment: str = "ppo-math") -> str:
    exp = exp or f"{algo}-tiny-arith"
    ov = [f"actor.path={sft_ckpt}", f"dataset.path={data['paths']['rl']}", f"fileroot={out}/runs",
          f"experiment_name={exp}", "trial_name=run"]
    if algo == "ppo":
        ov += [f"critic.path={sft_ckpt}", f"ref.path={sft_ckpt}"]
    quickstart(experiment, RL_CONFIGS[algo], ov + list(overrides), os.path.join(out, "logs", f"{exp}.log"))
    return os.path.join(out, "runs", exp, "run")


def prepare(out: str, sft_overrides: Sequence[str] = (), eval_threads: Optional[int] = 2, reuse_sft: bool = False,
            slip: float = SLIP, careful_below: int = CAREFUL_BELOW, model: Optional[dict] = None) -> dict:
    """Steps 1-4: model, data, SFT, held-out accuracy of the SFT checkpoint. Returns the start of the RL
    runs: ``{sft_ckpt, data, heldout_acc_before, sft_steps, seconds}``.

    ``reuse_sft``: keep an SFT checkpoint already in ``out`` (to try RL settings without redoing SFT).
    ``model``: overrides of ``MODEL`` (see :func:`build_model`).
    """
    os.makedirs(out, exist_ok=True)
    secs: Dict[str, float] = {}
    t = time.time()
    model = build_model(out, model)
    data = make_data(out, slip, careful_below)
    secs["setup"] = round(time.time() - t, 1)
    t = time.time()
    sft_dir = os.path.join(out, "runs", "sft-tiny-arith", "run")
    if not (reuse_sft and glob.glob(os.path.join(sft_dir, "checkpoints", "default", "*"))):
        sft_dir = run_sft(out, model, data, sft_overrides)
    sft_ckpt = last_checkpoint(sft_dir, "default")
    secs["sft"] = round(time.time() - t, 1)
    n_steps = len(read_stats(sft_dir))
    t = time.time()
    before = evaluate(sft_ckpt, data["test"], eval_threads)
    secs["eval_before"] = round(time.time() - t, 1)
    log(f"SFT: {n_steps} steps in {secs['sft']}s; held-out greedy accuracy {before.accuracy:.1%} "
        f"({before.n_correct}/{before.n})")
    return {"sft_ckpt": sft_ckpt, "data": data, "heldout_acc_before": before.accuracy, "sft_steps": n_steps,
            "seconds": secs}


def learn(algo: str, out: str, start: dict, overrides: Sequence[str] = (), eval_threads: Optional[int] = 2,
          exp: Optional[str] = None, experiment: str = "ppo-math") -> dict:
    """Steps 5-6 for ``algo`` ("grpo" or "ppo") from :func:`prepare`'s ``start`` (``exp``: the run's experiment
    name, default ``<algo>-tiny-arith``; ``experiment``: ppo-math or async-ppo-math). Returns
    ``{steps, heldout_acc_after, batch_acc_first_quarter, batch_acc_last_quarter, checkpoint, stats, run_dir,
    seconds: {run, eval}}``."""
    t = time.time()
    rl_dir = run_rl(algo, out, start["sft_ckpt"], start["data"], overrides, exp, experiment)
    ckpt = last_checkpoint(rl_dir, "actor")
    run_secs = round(time.time() - t, 1)
    st = read_stats(rl_dir)
    t = time.time()
    after = evaluate(ckpt, start["data"]["test"], eval_threads)
    eval_secs = round(time.time() - t, 1)
    acc = [(s["task_reward"] + 5) / 10 for s in st]  # +5 / -5 rewards -> fraction of sampled answers right
    k = max(1, len(acc) // 4)
    log(f"{algo}: {len(st)} steps in {run_secs}s; held-out greedy accuracy {start['heldout_acc_before']:.1%} -> "
        f"{after.accuracy:.1%} ({after.n_correct}/{after.n})")
    return {"steps": len(st), "heldout_acc_after": after.accuracy,
            "batch_acc_first_quarter": round(sum(acc[:k]) / k, 3), "batch_acc_last_quarter": round(sum(acc[-k:]) / k, 3),
            "checkpoint": ckpt, "stats": st, "run_dir": rl_dir, "seconds": {"run": run_secs, "eval": eval_secs}}


def run_recipe(out: str, algos: Sequence[str] = ("grpo",), sft_overrides: Sequence[str] = (),
               rl_overrides: Optional[Dict[str, Sequence[str]]] = None, eval_threads: Optional[int] = 2,
               reuse_sft: bool = False, slip: float = SLIP, careful_below: int = CAREFUL_BELOW) -> dict:
    """The whole recipe; returns the summary (also written to ``<out>/summary.json``)."""
    rl_overrides = rl_overrides or {}
    t_all = time.time()
    start = prepare(out, sft_overrides, eval_threads, reuse_sft, slip, careful_below)
    secs = dict(start["seconds"])
    summary: dict = {"task": f"make_arithmetic_problems(kind={KIND!r}, max_value={MAX_VALUE}), SFT teacher slip="
                             f"{slip} when b >= {careful_below}", "model": MODEL, "n_heldout": N_TEST,
                     "sft_steps": start["sft_steps"], "heldout_acc_before": start["heldout_acc_before"], "seconds": secs}
    for algo in algos:
        res = learn(algo, out, start, rl_overrides.get(algo, ()), eval_threads)
        secs[algo], secs[f"eval_{algo}"] = res["seconds"]["run"], res["seconds"]["eval"]
        summary[algo] = {k: v for k, v in res.items() if k not in ("stats", "seconds")}
    secs["total"] = round(time.time() - t_all, 1)
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(ROOT, "outputs", "tiny_arith"))
    ap.add_argument("--algo", choices=["grpo", "ppo", "both"], default="both")
    ap.add_argument("--sft", nargs="*", default=[], metavar="KEY=VALUE", help="extra sft overrides")
    ap.add_argument("--grpo", nargs="*", default=[], metavar="KEY=VALUE", help="extra GRPO (ppo-math) overrides")
    ap.add_argument("--ppo", nargs="*", default=[], metavar="KEY=VALUE", help="extra PPO-critic (ppo-math) overrides")
    ap.add_argument("--eval-threads", type=int, default=2)
    ap.add_argument("--reuse-sft", action="store_true", help="keep an SFT checkpoint already in --out")
    ap.add_argument("--slip", type=float, default=SLIP, help="the SFT teacher's slip probability")
    ap.add_argument("--careful-below", type=int, default=CAREFUL_BELOW, help="the teacher is always right when b < this")
    a = ap.parse_args(argv)
    algos = ("grpo", "ppo") if a.algo == "both" else (a.algo,)
    s = run_recipe(os.path.abspath(a.out), algos, a.sft, {"grpo": a.grpo, "ppo": a.ppo}, a.eval_threads,
                   a.reuse_sft, a.slip, a.careful_below)
    print(json.dumps(s, indent=1))
    for algo in algos:
        print(f"{algo}: held-out greedy accuracy {s['heldout_acc_before']:.1%} -> {s[algo]['heldout_acc_after']:.1%} "
              f"(SFT {s['seconds']['sft']}s, {algo} {s['seconds'][algo]}s, total {s['seconds']['total']}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
