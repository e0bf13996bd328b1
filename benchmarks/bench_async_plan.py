"""Asynchronous against colocated RL on this machine: measured, and as the planner predicts it.

``python benchmarks/bench_async_plan.py [--steps 8] [--eta 1] [--repeat 3]`` runs, alternately on this host, a tiny
``ppo-math`` (GRPO) colocated on 2 model workers (``d2m1p1``) and a tiny ``async-ppo-math`` with one generation
server beside one trainer worker (``gen.d1m1p1+d1m1p1``, ``async_rl.max_head_offpolicyness=eta``), every answer
exactly ``--answer`` tokens. Each run's throughput is its generated tokens per second of step over the steps after
the first ``--warmup``; the comparison takes the medians over ``--repeat`` pairs of runs. Beside them: the step
simulator's colocated step (:func:`realhf.apps.planning.estimate`) and the asynchronous steady state
(:func:`realhf.plan.async_sim.steady_state`, the answers' tokens per second) on this machine's profile. The figure
that matters is the ratio of ratios: the predicted async/colocated speed-up over the measured one.

One JSON line per run and one for the comparison; a table on stderr.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)


def _measured(root: str, args: list, warmup: int) -> dict:
    from realhf.testing import read_stats, run_quickstart

    p = run_quickstart(args + ["-q"], timeout=1200)
    if p.returncode != 0:
        raise RuntimeError(f"{args[0]} failed (exit {p.returncode}): {p.stderr[-3000:]}")
    name = next(a.split("=", 1)[1] for a in args if a.startswith("experiment_name="))
    rows = read_stats(root, name)
    later = rows[warmup:] or rows
    return dict(step_s=statistics.median(r["step_time"] for r in later),
                prompt_len=statistics.mean(r["avg_prompt_len"] for r in later), steps=len(later))


def compare(model: str, data: str, root: str, steps: int, eta: int, prompts: int, group: int, answer: int,
            warmup: int, repeat: int = 1) -> dict:
    from bench_plan import run_args

    from realhf.api.quickstart.entry import parse_cli
    from realhf.apps.planning import context, estimate
    from realhf.experiments import registered
    from realhf.plan.async_search import setting_of
    from realhf.plan.async_sim import steady_state

    registered()
    tokens = prompts * group * answer  # generated per step
    runs = {"sync": [], "async": []}
    for r in range(repeat):  # alternated, so that a slow spell of the host falls on both
        for kind, mode, exp, extra in (("sync", "d2m1p1", "ppo-math", ()),
                                       ("async", "gen.d1m1p1+d1m1p1", "async-ppo-math",
                                        ("param_realloc=disk", f"async_rl.max_head_offpolicyness={eta}"))):
            where = os.path.join(root, f"r{r}")
            args = [exp] + run_args(model, data, where, mode, 2, steps, prompts=prompts, group=group, answer=answer,
                                    extra=extra)[1:]
            runs[kind].append((args, _measured(where, args, warmup)))
    sync_args, async_args = runs["sync"][0][0], runs["async"][0][0]
    sync_m = {k: statistics.median(m[k] for _, m in runs["sync"]) for k in ("step_s", "prompt_len")}
    async_m = {k: statistics.median(m[k] for _, m in runs["async"]) for k in ("step_s", "prompt_len")}

    _, sync_cfg = parse_cli(sync_args)
    sync_est, _ = estimate("ppo-math", sync_cfg, prompt_len=sync_m["prompt_len"])
    _, async_cfg = parse_cli(async_args)
    ctx = context("async-ppo-math", async_cfg, check_fit=False)
    shape = ctx.cfgs.get("actor") or next(iter(ctx.cfgs.values()))
    s = setting_of(async_cfg, shape, mean_new=answer, dtype="float32")
    s = dataclasses.replace(s, gen_gpus=1, train_gpus=1, prompt_len=max(1, round(async_m["prompt_len"])))
    state = steady_state(s, ctx.hw, eta)

    meas = dict(sync=tokens / sync_m["step_s"], async_=tokens / async_m["step_s"])
    sim = dict(sync=tokens / sync_est.step_s, async_=state.generated_per_s)
    m_ratio, s_ratio = meas["async_"] / meas["sync"], sim["async_"] / sim["sync"]
    each = [round(sm["step_s"] / am["step_s"], 3) for (_, sm), (_, am) in zip(runs["sync"], runs["async"])]
    return dict(eta=eta, tokens_per_step=tokens, repeat=repeat,
                measured=dict(sync_tok_s=round(meas["sync"], 1), async_tok_s=round(meas["async_"], 1),
                              async_over_sync=round(m_ratio, 3), sync_step_s=round(sync_m["step_s"], 3),
                              async_step_s=round(async_m["step_s"], 3), async_over_sync_each=each),
                simulated=dict(sync_tok_s=round(sim["sync"], 1), async_tok_s=round(sim["async_"], 1),
                               async_over_sync=round(s_ratio, 3), trainer_idle=round(state.trainer_idle, 3),
                               generation_idle=round(state.generation_idle, 3)),
                predicted_over_measured=round(s_ratio / m_ratio, 3))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2, help="steps left out of the throughput (loading, first batches)")
    ap.add_argument("--eta", type=int, default=1, help="async_rl.max_head_offpolicyness of the asynchronous run")
    ap.add_argument("--model", default=None, help="a model folder (default: the tiny Qwen2)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--answer", type=int, default=16, help="tokens of every answer")
    ap.add_argument("--repeat", type=int, default=3,
                    help="pairs of runs, alternated (the medians of their step times are compared)")
    ap.add_argument("--root", default=None, help="where the runs write (default: a temporary folder)")
    a = ap.parse_args(argv)
    from realhf.impl.dataset import make_arithmetic_problems, write_math_jsonl
    from realhf.impl.model.tiny import ensure_tiny_model

    root = a.root or tempfile.mkdtemp(prefix="bench_async_plan_")
    data = os.path.join(root, "math.jsonl")
    write_math_jsonl(make_arithmetic_problems(max(64, a.prompts * a.steps), seed=3, kind="easy"), data)
    model = a.model or ensure_tiny_model("qwen2", tie_word_embeddings=True)
    if a.repeat < 1:
        ap.error(f"--repeat={a.repeat}: expected a positive number")
    r = compare(model, data, root, a.steps, a.eta, a.prompts, a.group, a.answer, a.warmup, a.repeat)
    print(json.dumps(r), flush=True)
    m, s = r["measured"], r["simulated"]
    sys.stderr.write(f"{'':<10} {'colocated tok/s':>15} {'async tok/s':>11} {'async/colocated':>15}\n"
                     f"{'measured':<10} {m['sync_tok_s']:>15.1f} {m['async_tok_s']:>11.1f} {m['async_over_sync']:>15.3f}\n"
                     f"{'simulated':<10} {s['sync_tok_s']:>15.1f} {s['async_tok_s']:>11.1f} {s['async_over_sync']:>15.3f}\n"
                     f"predicted / measured speed-up: {r['predicted_over_measured']:.3f}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
