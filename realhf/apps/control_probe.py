"""The control plane's fixed costs, measured for the planner on a real run (:mod:`realhf.plan.profile` takes them as
its ``control_probe``): a few steps of ``ppo-math`` (GRPO: generation, the rule-based reward, training) on the tiny
Qwen2 model, one model worker (``d1m1p1``), launched here as a user launches it. What a model function call (MFC)
takes beside its worker's computation — the master's request and its encoding, the worker's bookkeeping around the
call (its inputs from its store, the peak-memory window, the outputs' header), the reply, the master's buffer — is
the run's own ``<mfc>/time - <mfc>/compute_time``; what a step takes beside its MFCs — fetching the batch, planning
each call, clearing the batch — is ``step_time`` less its MFCs' times. Both are the medians over the steps after
the first (which loads and warms up), the call's also over the MFCs: costs of the runtime, not of the model, which
a small model's step is largely made of and a large model's hardly notices.

Used by ``python -m realhf.apps.profile`` and the planner (:mod:`realhf.apps.planning`); about 5 s.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import uuid
from typing import Dict, List, Sequence

PROBE_STEPS = 8
PROBE_PROMPTS, PROBE_GROUP, PROBE_ANSWER = 8, 4, 16  # a small batch: prompts x answers of exactly this many tokens
MFCS = ("actor_gen", "rew_inf", "actor_train")


def costs(rows: Sequence[Dict], mfcs: Sequence[str] = MFCS) -> Dict:
    """The control plane's costs from a run's stats rows (``stats.jsonl``, the first step's row first):
    ``call_s`` (median over the later steps and ``mfcs`` of an MFC's time beyond its computation), ``step_s``
    (median over the later steps of a step's time beyond its MFCs'), and each MFC's median beside them."""
    later = list(rows[1:]) or list(rows)
    missing = sorted({f"{m}/{k}" for r in later for m in mfcs for k in ("time", "compute_time")} - set().union(*later))
    if not later or missing:
        raise ValueError(f"control probe: the run's stats lack {missing or 'every step'}; "
                         f"expected each step's step_time and, for MFCs {list(mfcs)}, time and compute_time")
    per_call = [max(0.0, r[f"{m}/time"] - r[f"{m}/compute_time"]) for r in later for m in mfcs]
    per_step = [max(0.0, r["step_time"] - sum(r[f"{m}/time"] for m in mfcs)) for r in later]
    return dict(call_s=statistics.median(per_call), step_s=statistics.median(per_step), steps=len(later),
                mfcs={m: round(statistics.median(r[f"{m}/time"] - r[f"{m}/compute_time"] for r in later), 6)
                      for m in mfcs})


def run_args(model: str, data: str, root: str, name: str, layout: str, n_dev: int, steps: int,
             prompts: int = PROBE_PROMPTS, group: int = PROBE_GROUP, answer: int = PROBE_ANSWER, extra=()) -> List[str]:
    """The quickstart options of a tiny ``ppo-math`` (GRPO) launch of ``steps`` steps on ``layout`` over ``n_dev``
    devices: ``prompts`` prompts a step, ``group`` answers each of exactly ``answer`` tokens, no KL, the rule-based
    reward (this probe's run, and ``benchmarks/bench_plan.py``'s)."""
    return ["ppo-math", f"actor.path={model}", f"dataset.path={data}", f"dataset.train_bs_n_seqs={prompts}",
            f"group_size={group}", f"ppo.gen.max_new_tokens={answer}", f"ppo.gen.min_new_tokens={answer}",
            "ppo.ppo_n_minibatches=1", "use_chat_template=false", "prompt_template={prompt}",
            "reward.allow_last_number=true", "use_critic=false", "ppo.kl_ctl=0", f"fileroot={root}",
            f"experiment_name={name}", f"allocation_mode={layout}", f"n_devices_per_node={n_dev}",
            f"exp_ctrl.benchmark_steps={steps}", "seed=1", *extra]


def control_plane_costs(steps: int = PROBE_STEPS, timeout: float = 300.0) -> Dict:
    """Launch the probe's run (module docstring) in a temporary folder and return :func:`costs` of it. Raises
    RuntimeError with the launch's output when the run fails."""
    from realhf.base.process import env_with_source_path, source_root
    from realhf.impl.dataset import make_arithmetic_problems, write_math_jsonl
    from realhf.impl.model.tiny import ensure_tiny_model

    if steps < 2:
        raise ValueError(f"control probe: steps={steps}; at least 2 (the first step warms up)")
    model = ensure_tiny_model("qwen2", tie_word_embeddings=True)
    with tempfile.TemporaryDirectory(prefix="realhf_control_probe_") as root:
        data, trial = os.path.join(root, "math.jsonl"), f"probe-{uuid.uuid4().hex[:8]}"  # its own names
        write_math_jsonl(make_arithmetic_problems(64, seed=3, kind="easy"), data)
        args = run_args(model, data, root, "control-probe", "d1m1p1", 1, steps, extra=(f"trial_name={trial}", "-q"))
        p = subprocess.run([sys.executable, "-m", "realhf.apps.quickstart", *args],
                           cwd=source_root(), capture_output=True, text=True, timeout=timeout,
                           env=env_with_source_path())
        stats = os.path.join(root, "control-probe", trial, "logs", "stats.jsonl")
        if p.returncode != 0 or not os.path.exists(stats):
            raise RuntimeError(f"control probe: the run failed (exit {p.returncode}):\n{(p.stdout + p.stderr)[-3000:]}")
        with open(stats) as f:
            rows = [json.loads(line) for line in f]
    return costs([r for r in rows if "step_time" in r])
