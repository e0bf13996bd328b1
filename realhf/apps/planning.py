"""Planning a run without launching it: the experiment's spec built as the quickstart builds it (for this machine,
profiled, or for a cluster of a tabled device), its memory plan (a plan that does not fit is refused as a launch
would refuse it) and its step simulated on the cost model (:mod:`realhf.plan.simulate`). Used by
``python -m realhf.apps.plan`` and by the plan search (:mod:`realhf.apps.plan_search`)."""
from __future__ import annotations

import dataclasses
import math
from typing import Optional, Tuple


def _hardware_and_capacity(cluster, cfg, spec, cfgs, refresh: bool = False):
    """(Hardware, memory-plan Capacity) of a tabled cluster, or of this machine profiled at the actor's shape
    (``refresh``: measured again, not read from the cache)."""
    from realhf.plan import hardware
    from realhf.plan.cost import capacity
    from realhf.plan.fit import Capacity

    if cluster is not None:
        dev, gpus, _ = cluster
        hw = dataclasses.replace(hardware.get(dev), devices_per_node=gpus)
        return hw, Capacity("cuda", capacity(hw), f"{hw.name}: {hw.memory_bytes / 2**30:.1f} GiB per GPU")
    from realhf.experiments.memory_plan import capacity as run_capacity
    from realhf.plan.profile import hardware as hw_of, profile

    import torch

    trained = next((m for m in spec.models if m.optimizer is not None and m.name in cfgs), None)
    shape = cfgs[trained.name] if trained is not None else next(iter(cfgs.values()))
    dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    torch.set_num_threads(max(1, spec.cpus_per_worker))  # a worker's share of the host, as the run has it
    from realhf.gen_server.probe import served_generate_overhead
    from realhf.system.rollout.probe import rollout_episode_overhead
    from realhf.apps.control_probe import control_plane_costs

    served = served_generate_overhead if any(m.gen_servers is not None for m in spec.models) else None
    rollout = rollout_episode_overhead if spec.rollout is not None else None
    return (hw_of(profile(shape, dtype, comm=spec.n_workers > 1, refresh=refresh,
                          control_probe=control_plane_costs,
                          server_probe=served, rollout_probe=rollout)),
            run_capacity(cfg, spec))


def with_prompt_len(work, bound: int, prompt_len: float):
    """``work`` (the MFCs' workloads, sized for prompts of ``bound`` tokens) for prompts of ``prompt_len`` tokens:
    the sequences' length, and the shares of their tokens that the head (the answer rows) and the blocks (a group's
    prompt once: its answers are the generation's ``n``) compute, taken again at that length."""
    from realhf.plan.fit import shared_body_share

    n = next((w.n for w in work.values() if w.kind == "generate"), 1)
    out = {}
    for k, w in work.items():
        if w.kind == "generate":
            out[k] = dataclasses.replace(w, seq_len=max(1, int(math.ceil(prompt_len))))
            continue
        answer = max(0, w.seq_len - bound)
        seq = max(1, int(math.ceil(answer + prompt_len)))
        # a share below 1 was taken at the bound (the head's rows: the answers; the blocks': a shared prompt)
        head = w.head_share if w.head_share >= 1.0 else min(1.0, answer / seq)
        body = w.body_share if w.body_share >= 1.0 else shared_body_share(prompt_len, answer, n)
        out[k] = dataclasses.replace(w, seq_len=seq, head_share=head, body_share=body)
    return out


@dataclasses.dataclass
class Context:
    """What planning a run needs: its (resolved) config and spec, each model's shape, the hardware, the capacity,
    each MFC's workload, the memory plan (None when not checked)."""

    cfg: object
    spec: object
    cfgs: dict
    hw: object
    cap: object
    work: dict
    mem: object


def context(name: str, cfg, cluster: Optional[Tuple[str, int, int]] = None, check_fit: bool = True,
            refresh_profile: bool = False) -> Context:
    """The :class:`Context` of experiment ``name`` under ``cfg``: on a tabled ``cluster`` or on this machine (its
    profile measured again with ``refresh_profile``). With ``check_fit``, the launcher's memory plan
    (:func:`realhf.experiments.memory_plan.plan_run`: ``auto`` budgets resolved into the config and spec; ValueError,
    its refusal, when the plan does not fit), against the tabled GPU's memory for a cluster."""
    from realhf.experiments import build_spec
    from realhf.experiments.memory_plan import model_configs, plan_run, workloads

    if cluster is not None:
        cfg.n_devices_per_node, cfg.n_nodes = cluster[1], cluster[2]
    if check_fit:
        cap_of = None if cluster is None else (lambda c, s: _hardware_and_capacity(cluster, c, s, None)[1])
        cfg, spec, mem = plan_run(name, cfg, lambda c: build_spec(name, c), cap_of)
    else:
        spec, mem = build_spec(name, cfg), None
    cfgs = model_configs(spec)
    hw, cap = _hardware_and_capacity(cluster, cfg, spec, cfgs, refresh_profile)
    work = {k: v for k, v in workloads(cfg).items() if k in {f.name for f in spec.mfcs}}
    return Context(cfg, spec, cfgs, hw, cap, work, mem)


def estimate(name: str, cfg, cluster: Optional[Tuple[str, int, int]] = None, prompt_len: Optional[float] = None,
             refresh_profile: bool = False):
    """(StepEstimate, memory plan) of experiment ``name`` under ``cfg``; raises ValueError (the memory plan's
    refusal) when the plan does not fit. ``prompt_len``: the prompts' mean length in tokens (default: the bound the
    config sets, ``dataset.max_prompt_len``, as the memory plan takes it); ``refresh_profile``: this machine's
    profile measured again first."""
    from realhf.plan.simulate import plan_of, simulate_step

    ctx = context(name, cfg, cluster, refresh_profile=refresh_profile)
    work = ctx.work
    if prompt_len is not None and hasattr(ctx.cfg.dataset, "max_prompt_len"):
        work = with_prompt_len(work, ctx.cfg.dataset.max_prompt_len, prompt_len)
    return simulate_step(plan_of(ctx.spec, ctx.cfgs, work, ctx.hw.device), ctx.hw), ctx.mem

