"""The step simulator against measured steps, and the asynchronous model against the AReaL paper.

``python benchmarks/bench_plan.py measured [--steps 6]``: tiny ``ppo-math`` runs on this machine (2 model workers)
under d2m1p1, d1m2p1, d1m1p2, a per-MFC plan and a ``gen.`` plan; per plan the measured step time (the median of
the steps after the first) beside the simulator's (:mod:`realhf.plan.simulate`, on this machine's profile) and
their ratio. ``--model`` picks another model folder (e.g. SmolLM2-135M); ``--answer``/``--prompts``/``--group``
size the work; ``--repeat R`` measures the plans in turn R times and tabulates the medians (a tiny model's step moves
by up to 1.8x between runs minutes apart on a 2-core host); ``--fresh-profile`` profiles the machine again in every
round, so that each round's simulation sees the host as its launches did.

``python benchmarks/bench_plan.py scale --bench-log LOG``: the synchronous launches of a ``benchmarks/bench_scale.py``
run (its JSON lines in ``LOG``: the step at users' scale, e.g. a Qwen2.5-1.5B shape on a GPU) beside the simulator's
step on this machine's profile, measured first where not cached (the GPU check script runs it with ``PLAN=1``).

``python benchmarks/bench_plan.py areal``: the asynchronous model (:mod:`realhf.plan.async_sim`) in AReaL's small
setting beside the throughput the AReaL paper reports.

Each result is one JSON line; a table follows on stderr.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

PLANS = (("d2m1p1", 2), ("d1m2p1", 2), ("d1m1p2", 2), ("actor_gen:d2m1p1,*:d1m2p1", 2), ("gen.d1m1p1+d1m1p1", 2))


def run_args(model: str, data: str, root: str, layout: str, n_dev: int, steps: int, prompts: int = 8,
             group: int = 4, answer: int = 16, extra=()) -> list:
    """The quickstart options of one tiny ppo-math (GRPO) launch (:func:`realhf.apps.control_probe.run_args`),
    named after its layout: answers of exactly ``answer`` tokens."""
    from realhf.apps.control_probe import run_args as tiny_grpo_args

    name = "plan-" + "".join(ch if ch.isalnum() else "-" for ch in "_".join((layout, *extra)))
    return tiny_grpo_args(model, data, root, name, layout, n_dev, steps, prompts, group, answer, extra)


def measure_and_simulate(model: str, data: str, root: str, layout: str, n_dev: int, steps: int = 6,
                         refresh_profile: bool = False, **kw) -> dict:
    """Launch the plan for ``steps`` steps and simulate its step (:func:`simulate_run`; ``refresh_profile``: on this
    machine's profile measured again right after the launch)."""
    from realhf.testing import read_stats, run_quickstart

    args = run_args(model, data, root, layout, n_dev, steps, **kw)
    p = run_quickstart(args + ["-q"], timeout=900)
    if p.returncode != 0:
        raise RuntimeError(f"{layout}: the run failed (exit {p.returncode}): {p.stderr[-3000:]}")
    name = next(a.split("=", 1)[1] for a in args if a.startswith("experiment_name="))
    return dict(simulate_run(args, read_stats(root, name), refresh_profile), extra=list(kw.get("extra", ())))


def simulate_run(args: list, rows: list, refresh_profile: bool = False) -> dict:
    """A finished launch (its quickstart options ``args``, experiment first, and its stats' rows) beside the
    simulator's step: the measured step time is the median of the steps after the first (which loads and warms up);
    the simulation takes the prompts' mean length from the run (and, with ``refresh_profile``, this machine's
    profile measured again first)."""
    from realhf.api.quickstart.entry import parse_cli
    from realhf.apps.planning import estimate
    from realhf.experiments import registered

    later = rows[1:] or rows
    registered()
    _, cfg = parse_cli(args)
    est, _ = estimate(args[0], cfg, prompt_len=statistics.mean(r["avg_prompt_len"] for r in later),
                      refresh_profile=refresh_profile)
    measured = statistics.median(r["step_time"] for r in later)

    def med(key: str) -> float:
        return round(statistics.median(r.get(key, 0.0) for r in later), 4)

    # per MFC: the master's time of the call (request to last reply), the slowest worker's own compute time in it,
    # and the simulator's call (its computation, its inputs' move, the fixed cost)
    mfcs = {c.name: dict(measured_s=med(f"{c.name}/time"), measured_compute_s=med(f"{c.name}/compute_time"),
                         simulated_s=round(c.time_s, 4), simulated_compute_s=round(c.compute_s, 4))
            for c in est.calls}
    layout = next(a.split("=", 1)[1] for a in args if a.startswith("allocation_mode="))
    return dict(plan=layout, steps=len(later), measured_s=round(measured, 4), simulated_s=round(est.step_s, 4),
                ratio=round(est.step_s / measured, 3), mfcs=mfcs)


def scale(a) -> int:
    """The synchronous launches of a ``bench_scale.py`` run (its JSON lines in ``--bench-log``), each beside the
    simulator's step on this machine's profile (measured here first if not cached)."""
    from realhf.testing import read_stats

    out = []
    with open(a.bench_log) as f:
        modes = [r for r in (json.loads(line) for line in f if line.startswith("{")) if r.get("part") == "mode"]
    for m in modes:
        if m.get("experiment") != "ppo-math" or m.get("rc") != 0 or not m.get("args") or m.get("steps_done", 0) < 2:
            continue  # the asynchronous run has its own model (bench_async_plan.py); a failed or short run has no step
        name = next(o.split("=", 1)[1] for o in m["args"] if o.startswith("experiment_name="))
        rows = [r for r in read_stats(os.path.dirname(m["log"]), name) if "step_time" in r]
        r = dict(simulate_run(["ppo-math"] + m["args"], rows), mode=m["mode"], answer_tokens=m.get("answer_tokens"))
        print(json.dumps(r), flush=True)
        out.append(r)
    if not out:
        print(f"no finished synchronous launch of two steps or more in {a.bench_log}", file=sys.stderr)
        return 1
    sys.stderr.write(f"{'mode':<10} {'plan':<20} {'measured s':>10} {'simulated s':>11} {'sim/meas':>8}\n")
    for r in out:
        sys.stderr.write(f"{r['mode']:<10} {r['plan']:<20} {r['measured_s']:>10.4f} {r['simulated_s']:>11.4f} "
                         f"{r['ratio']:>8.3f}\n")
    return 0


def measured(a) -> int:
    from realhf.impl.dataset import make_arithmetic_problems, write_math_jsonl
    from realhf.impl.model.tiny import ensure_tiny_model

    root = a.root or tempfile.mkdtemp(prefix="bench_plan_")
    data = os.path.join(root, "math.jsonl")
    write_math_jsonl(make_arithmetic_problems(64, seed=3, kind="easy"), data)
    model = a.model or ensure_tiny_model("qwen2", tie_word_embeddings=True)
    plans = [(layout, n) for layout, n in PLANS if not a.plans or layout in a.plans]
    runs = {layout: [] for layout, _ in plans}
    for r in range(a.repeat):  # the plans in turn, round after round: a slow spell of the host falls on all
        for i, (layout, n) in enumerate(plans):
            res = measure_and_simulate(model, data, os.path.join(root, f"r{r}"), layout, n, a.steps,
                                       refresh_profile=a.fresh_profile and i == 0, prompts=a.prompts, group=a.group,
                                       answer=a.answer)
            print(json.dumps(dict(res, round=r)), flush=True)
            runs[layout].append(res)
    sys.stderr.write(f"{'plan':<28} {'measured s':>10} {'simulated s':>11} {'sim/meas':>8}"
                     + (f"  (medians of {a.repeat} rounds; each round's sim/meas)" if a.repeat > 1 else "") + "\n")
    for layout, rs in runs.items():
        m = statistics.median(x["measured_s"] for x in rs)
        sim = statistics.median(x["simulated_s"] for x in rs)
        each = " ".join(f"{x['ratio']:.3f}" for x in rs) if a.repeat > 1 else ""
        sys.stderr.write(f"{layout:<28} {m:>10.4f} {sim:>11.4f} {sim / m:>8.3f}  {each}\n")
    return 0


def areal(a) -> int:
    from realhf.plan.async_sim import areal_small_setting

    rows = areal_small_setting()
    for r in rows:
        print(json.dumps(r), flush=True)
    sys.stderr.write(f"{'eta':>4} {'simulated tok/s':>15} {'paper tok/s':>12} {'sim/paper':>9} {'trainer idle':>12} "
                     f"{'gen idle':>8} {'staleness':>9}\n")
    for r in rows:
        sys.stderr.write(f"{r['eta']:>4} {r['tokens_per_s']:>15.0f} {r['paper_tokens_per_s']:>12.0f} "
                         f"{r['ratio']:>9.3f} {r['trainer_idle']:>12.2f} {r['generation_idle']:>8.2f} "
                         f"{r['mean_staleness']:>9.2f}\n")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    m = sub.add_parser("measured", help="tiny ppo-math plans here: measured vs simulated step time")
    m.add_argument("--steps", type=int, default=6)
    m.add_argument("--model", default=None, help="a model folder (default: the tiny Qwen2)")
    m.add_argument("--prompts", type=int, default=8)
    m.add_argument("--group", type=int, default=4)
    m.add_argument("--answer", type=int, default=16, help="tokens of every answer")
    m.add_argument("--plans", nargs="*", default=None, help=f"a subset of {[p for p, _ in PLANS]}")
    m.add_argument("--repeat", type=int, default=1, help="rounds over the plans (the table gives the medians)")
    m.add_argument("--root", default=None, help="where the runs write (default: a temporary folder)")
    m.add_argument("--fresh-profile", action="store_true",
                   help="profile this machine again in every round, after its first launch (the cached profile is "
                        "replaced): each round's plans are simulated on the host as it was during their launches")
    sub.add_parser("areal", help="the asynchronous model in AReaL's small setting beside the paper's figures")
    sc = sub.add_parser("scale", help="bench_scale.py's synchronous launches beside the simulator's step")
    sc.add_argument("--bench-log", required=True, help="the JSON lines bench_scale.py printed")
    a = ap.parse_args(argv)
    if a.what == "measured" and a.repeat < 1:
        ap.error(f"--repeat={a.repeat}: expected a positive number")
    return {"measured": measured, "areal": areal, "scale": scale}[a.what](a)


if __name__ == "__main__":
    sys.exit(main())
