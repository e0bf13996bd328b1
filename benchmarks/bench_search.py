"""The execution-plan search on the GPU example configs for simulated clusters of tabled GPUs: per case the search's
step estimate beside the best single global layout's, the ``heuristic`` allocation's and the config's own allocation,
the predicted speed-ups, and the search's own time. Asynchronous configs: the chosen split's throughput beside the
config's own split. Every figure is the simulator's prediction (``realhf.plan``), not a measurement.

    python benchmarks/bench_search.py                 # the table of docs/planning.md
    python benchmarks/bench_search.py --cases 7b-512 --json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
GPU = os.path.join(ROOT, "examples", "configs", "gpu")
# name -> (experiment, config, cluster, options...)
CASES = {
    "1.5b-8": ("ppo-math", "grpo-qwen1.5b-1node.yaml", "h800x8x1"),
    "1.5b-32": ("ppo-math", "grpo-qwen1.5b-4nodes.yaml", "h800x8x4"),
    "7b-32": ("ppo-math", "grpo-qwen7b-4nodes.yaml", "h800x8x4"),
    "7b-64": ("ppo-math", "grpo-qwen7b-4nodes.yaml", "h800x8x8"),
    "7b-ppo-64": ("ppo-math", "grpo-qwen7b-4nodes.yaml", "h800x8x8", "use_critic=true", "ppo.kl_ctl=0.05",
                  "ppo.adv_norm=true", "ppo.group_adv_norm=false", "critic.gradient_checkpointing=true"),
    "7b-128": ("ppo-math", "grpo-qwen7b-16nodes.yaml", "h800x8x16"),
    "32b-128": ("ppo-math", "grpo-qwen32b-16nodes.yaml", "h800x8x16"),
    "7b-512": ("ppo-math", "grpo-qwen7b-16nodes.yaml", "h800x8x64"),
    "async-1.5b-8": ("async-ppo-math", "async-grpo-qwen1.5b-1node.yaml", "h800x8x1"),
    "async-1.5b-64": ("async-ppo-math", "async-grpo-qwen1.5b-1node.yaml", "h800x8x8"),
}


def run_case(name: str, time_limit: float) -> dict:
    exp, config, cluster, *options = CASES[name]
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "realhf.apps.plan", exp, "--config", os.path.join(GPU, config),
                        *options, "--cluster", cluster, "--search", "--json", "--time-limit", str(time_limit)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        return dict(case=name, error=p.stderr.strip()[-500:])
    s = json.loads(p.stdout)["search"]
    out = dict(case=name, config=config + "".join(f" {o}" for o in options), cluster=cluster,
               wall_s=round(time.monotonic() - t0, 1))
    if exp == "async-ppo-math":
        out.update(kind="async", eta=s["eta"], chosen=s["chosen"]["allocation"], tokens_per_s=s["chosen"]["tokens_per_s"],
                   config_allocation=s["config"]["allocation"] if s["config"] else None,
                   config_tokens_per_s=s["config"]["tokens_per_s"] if s["config"] else None)
        return out

    def step(e):
        return None if e is None else e["step_s"]

    out.update(kind="sync", n_evals=s["n_evals"], search_s=round(s["seconds"], 1), chosen=s["chosen"]["placements"],
               step_s=step(s["chosen"]), global_s=step(s["best_global"]), heuristic_s=step(s["heuristic"]),
               config_allocation=s["config"]["allocation_mode"] if s["config"] else None,
               config_s=step(s["config"]))
    return out


def _x(a, b):
    return f"{a / b:.2f}x" if a and b else "no fit"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, from {list(CASES)}")
    ap.add_argument("--time-limit", type=float, default=30.0, help="the search's time limit per case (s)")
    ap.add_argument("--json", action="store_true", help="one JSON object per case")
    a = ap.parse_args(argv)
    rows = [run_case(c.strip(), a.time_limit) for c in a.cases.split(",") if c.strip()]
    if a.json:
        for r in rows:
            print(json.dumps(r))
        return 0
    print("| case | config | cluster | search step s | global s | heuristic s | config's allocation s | search / global "
          "| search / heuristic | search / config | search time s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        if "error" in r:
            print(f"| {r['case']} | error: {r['error']} |")
        elif r["kind"] == "sync":
            heur = round(r["heuristic_s"]) if r["heuristic_s"] else "no fit"
            if r["config_allocation"] is None:
                own, vs_own = "— (for another device count)", "—"
            else:
                own = f"{round(r['config_s']) if r['config_s'] else 'no fit'} ({r['config_allocation']})"
                vs_own = _x(r["config_s"], r["step_s"])
            print(f"| {r['case']} | {r['config']} | {r['cluster']} | {r['step_s']:.0f} | {r['global_s']:.0f} | {heur} | "
                  f"{own} | {_x(r['global_s'], r['step_s'])} | {_x(r['heuristic_s'], r['step_s'])} | {vs_own} | "
                  f"{r['search_s']} |")
    for r in rows:
        if r.get("kind") == "async":
            own = (f"; the config's {r['config_allocation']} {r['config_tokens_per_s'] or 0:.0f} tokens/s "
                   f"({_x(r['tokens_per_s'], r['config_tokens_per_s'])})" if r["config_allocation"] else "")
            print(f"\n{r['case']} ({r['cluster']}, eta {r['eta']}): {r['chosen']} {r['tokens_per_s']:.0f} "
                  f"tokens/s{own}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
