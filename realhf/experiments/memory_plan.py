"""The memory plan of a launch: each MFC's workload from the experiment's options, each rank's capacity, the token
budgets of ``max_tokens_per_mb=auto`` written into the config the processes read, and a refusal (exit 2 with the
reason) of a plan that cannot fit — all before any process starts (:func:`plan_run`)."""
from __future__ import annotations

import copy
import os
from typing import Dict, Optional, Tuple

from realhf.base import logging
from realhf.plan.fit import (GPU_RESERVED, GPU_USABLE, HOST_USABLE, PROCESS_BASE, UNBOUNDED, Capacity, MemoryPlan,
                              Workload, auto_budget, plan, refusal_of, shared_body_share)
from realhf.plan.memory import GiB
from realhf.plan.shapes import shape_of

logger = logging.getLogger(__name__)

CAPACITY_ENV = "REALHF_DEVICE_MEMORY_GIB"


def mfc_config_key(cfg, mfc_name: str) -> str:
    """The config section that micro-batches MFC ``mfc_name`` (``actor_train.mb_spec``; ``mb_spec`` where an
    experiment has one MFC)."""
    return f"{mfc_name}.mb_spec" if hasattr(cfg, mfc_name) else "mb_spec"


def _mb_config(cfg, mfc_name: str):
    return getattr(cfg, mfc_name).mb_spec if hasattr(cfg, mfc_name) else cfg.mb_spec


def workloads(cfg) -> Dict[str, Workload]:
    """Each MFC's work per step as the experiment's options bound it (longest sequences, whole batches)."""
    if hasattr(cfg, "ppo"):  # ppo-math, async-ppo-math
        P, A, n = cfg.dataset.max_prompt_len, cfg.ppo.gen.max_new_tokens, cfg.group_size
        seqs, T = cfg.dataset.train_bs_n_seqs * n, cfg.ppo.gen.temperature
        share = min(1.0, A / (A + P / 2))  # answer rows of a sequence, with prompts of half max_prompt_len on average
        body = shared_body_share(P, A, n)  # a group's prompt computed once (at their bounds: the most tokens)
        ckpt = bool(getattr(cfg.actor, "gradient_checkpointing", False))
        critic_ckpt = bool(getattr(cfg.critic, "gradient_checkpointing", False))
        out = {} if not getattr(cfg, "reward", None) or not cfg.reward.uses_model() else {
            # a reward model (reward.type=model): a forward pass, its scalar head on each sequence's last token
            "rew_inf": Workload("inference", seqs, P + A, 1.0, body_share=body)}
        return {
            **out,
            "actor_gen": Workload("generate", cfg.dataset.train_bs_n_seqs, P, n=n, max_new=A, temperature=T),
            "ref_inf": Workload("inference", seqs, P + A, share, body, temperature=T),
            "actor_inf": Workload("inference", seqs, P + A, share, body, temperature=T),
            "critic_inf": Workload("inference", seqs, P + A, 1.0, body),
            "actor_train": Workload("train", seqs, P + A, share, body, minibatches=cfg.ppo.ppo_n_minibatches,
                                    entropy=cfg.ppo.entropy_coef > 0, temperature=T, checkpointing=ckpt),
            "critic_train": Workload("train", seqs, P + A, 1.0, body, minibatches=cfg.ppo.ppo_n_minibatches,
                                     checkpointing=critic_ckpt),
        }
    if hasattr(cfg, "gen") and hasattr(cfg.dataset, "max_prompt_len"):  # gen
        return {"gen": Workload("generate", cfg.dataset.train_bs_n_seqs, cfg.dataset.max_prompt_len,
                                n=cfg.gen.n, max_new=cfg.gen.max_new_tokens)}
    pairs = _preference_workloads(cfg)
    if pairs is not None:
        return pairs
    if hasattr(cfg.dataset, "max_seqlen"):  # sft
        return {"trainDefault": Workload("train", cfg.dataset.train_bs_n_seqs, cfg.dataset.max_seqlen, 1.0,
                                         checkpointing=bool(getattr(cfg.model, "gradient_checkpointing", False)))}
    return {}


def _preference_workloads(cfg) -> Optional[Dict[str, Workload]]:
    """rw and dpo: every pair is two sequences of up to ``dataset.max_seqlen`` tokens (None: another experiment)."""
    from realhf.api.quickstart.preference_config import DPOConfig, RWConfig

    if not isinstance(cfg, (RWConfig, DPOConfig)):
        return None
    seqs, L = 2 * cfg.dataset.train_bs_n_seqs, cfg.dataset.max_seqlen
    if isinstance(cfg, RWConfig):  # the scalar head scores each sequence's last token
        return {"trainDefault": Workload("train", seqs, L, 1.0,
                                         checkpointing=bool(cfg.model.gradient_checkpointing))}
    # DPO: log-probs of the answer tokens (at most the whole sequence) through the output head
    return {"ref_inf": Workload("inference", seqs, L, 1.0),
            "actor_train": Workload("train", seqs, L, 1.0, checkpointing=bool(cfg.actor.gradient_checkpointing))}


def _uses_gpus(cfg) -> bool:
    if cfg.mode == "ray":
        return cfg.ray_gpus_per_worker > 0
    if cfg.mode == "slurm":
        return cfg.slurm.gpus_per_slot > 0
    from realhf.base.device_slots import visible_cuda_devices

    return visible_cuda_devices() > 0


def _host_memory() -> Optional[float]:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def capacity(config, spec) -> Capacity:
    """Bytes each model worker's tensors may take: ``$REALHF_DEVICE_MEMORY_GIB``, else ``device_memory_gib``, else
    read here (a local GPU run: GPU 0's memory; a CPU run on this host: its memory shared by the processes of a node);
    unknown for a cluster run without the option. Of a GPU, 92% less 1 GiB; of a host, 85% less 0.5 GiB per process,
    split evenly among the node's model workers."""
    device = "cuda" if _uses_gpus(config) else "cpu"
    given, source = os.environ.get(CAPACITY_ENV), f"${CAPACITY_ENV}"
    if not given and config.device_memory_gib:
        given, source = str(config.device_memory_gib), "device_memory_gib"
    total = None
    if given:
        try:
            total = float(given) * GiB
        except ValueError:
            raise ValueError(f"{source}={given!r}: expected a number of GiB") from None
        if not total > 0:
            raise ValueError(f"{source}={given!r}: expected a positive number of GiB")
    elif device == "cuda" and config.mode == "local":
        import torch

        total, source = float(torch.cuda.get_device_properties(0).total_memory), f"{torch.cuda.get_device_name(0)}"
    elif device == "cpu" and config.mode == "local":
        total, source = _host_memory(), "this host's memory"
    if total is None:
        return Capacity(device, None, "set device_memory_gib to check the plan and size auto budgets")
    if device == "cuda":
        return Capacity(device, total * GPU_USABLE - GPU_RESERVED, f"{source}: {total / GiB:.1f} GiB per GPU")
    workers = min(spec.n_workers, config.n_devices_per_node)
    served = spec.served()
    procs = spec.device_slots() if config.n_nodes == 1 else config.n_devices_per_node
    servers = served.gen_servers.n_servers if served is not None and config.n_nodes == 1 else 0
    buffer = _shared_weights_buffer(served) if servers else 0.0
    share = (total * HOST_USABLE - (procs + 1) * PROCESS_BASE - buffer) / max(1, workers + servers)
    return Capacity(device, share, f"{source}: {total / GiB:.1f} GiB shared by {workers} model worker(s)"
                                    + (f" and {servers} generation server(s)" if servers else "")
                                    + (f", less {buffer / GiB:.2f} GiB of weights shared with them" if buffer else ""))


def _shared_weights_buffer(served) -> float:
    """Bytes of host memory a CPU run's weight publisher keeps for the servers on its host
    (``gen_server.weight_transport`` shared, auto's choice there: the served model's weights, one copy)."""
    from realhf.plan.fit import model_dtype
    from realhf.plan.memory import Shard, dtype_bytes, params

    fleet = served.gen_servers
    if fleet.param_realloc != "memory" or fleet.backend != "gen" or fleet.weight_transport == "group":
        return 0.0
    size = dtype_bytes(model_dtype(fleet, "cpu"))
    return float(params(Shard(shape_of(served.path), 1, 1, 0, size)) * size)


def model_configs(spec) -> Dict[str, object]:
    return {m.name: shape_of(m.path, m.is_critic) for m in spec.models if m.path and m.gen_servers is None}


def _is_auto(v) -> bool:
    return isinstance(v, str) and v == "auto"


def mb_auto(cfg, mfc_name: str) -> bool:
    """Whether the config leaves MFC ``mfc_name``'s micro-batch budget to the memory plan (``max_tokens_per_mb=auto``)."""
    return _mfc_exists(cfg, mfc_name) and _is_auto(_mb_config(cfg, mfc_name).max_tokens_per_mb)


def plan_run(exp_name: str, cfg, build, capacity_of=None) -> Tuple[object, object, Optional[MemoryPlan]]:
    """(the config the processes run with — every ``max_tokens_per_mb=auto`` replaced by its budget —, its spec, the
    memory plan). Raises ValueError naming the MFC when the plan does not fit. ``build(cfg)`` builds a spec;
    ``capacity_of(cfg, spec)`` gives the capacity (default :func:`capacity`: this launch's; planning for a cluster of
    a tabled GPU gives that GPU's)."""
    work = workloads(cfg)
    autos = [m for m in work if mb_auto(cfg, m)]
    spec = build(cfg)  # auto budgets unresolved: whole micro-batches
    names = {m.name for m in spec.mfcs}
    work = {k: v for k, v in work.items() if k in names}
    if not work:
        return cfg, spec, None
    cfgs = model_configs(spec)
    cap = (capacity_of or capacity)(cfg, spec)
    resolved = copy.deepcopy(cfg)
    for name in autos:
        if name not in names:  # an MFC this run does not have (its section keeps auto: nothing reads it)
            continue
        mb = _mb_config(resolved, name)
        mb.n_mbs, mb.max_tokens_per_mb = auto_budget(spec, cfgs, work, cap, name)
        if mb.max_tokens_per_mb < UNBOUNDED or mb.n_mbs > _mb_config(cfg, name).n_mbs:
            logger.info(f"{mfc_config_key(cfg, name)}: max_tokens_per_mb=auto -> {mb.max_tokens_per_mb}, "
                        f"n_mbs={mb.n_mbs} ({cap.source})")
    served = spec.served()
    if served is not None and getattr(cfg, "gen_server", None) is not None and cfg.gen_server.max_num_seqs == "auto":
        resolved.gen_server.max_num_seqs = _server_rows(cfg, spec, served, cap)
    # the spec again only where a budget differs from what the first build took (auto: whole micro-batches, the
    # server rows the run can have in flight): building it reads the data and the model folders again
    before = {m.name: (m.mb_spec.n_mbs, m.mb_spec.max_tokens_per_mb) for m in spec.mfcs}
    after = {n: (_mb_config(resolved, n).n_mbs, _mb_config(resolved, n).max_tokens_per_mb) for n in autos if n in names}
    rows_changed = served is not None and resolved.gen_server.max_num_seqs != served.gen_servers.max_num_seqs
    if rows_changed or any(before[n] != v for n, v in after.items()):
        spec = build(resolved)
    p = plan(spec, cfgs, work, cap)
    bad = p.unfit()
    if bad:
        raise ValueError(refusal_of(bad, cap, lambda mfc: mfc_config_key(cfg, mfc)))
    if cap.per_rank is None:
        logger.info(f"memory plan: capacity unknown ({cap.source}); auto budgets leave micro-batches whole")
    return resolved, spec, p


def _server_rows(cfg, spec, served, cap: Capacity) -> int:
    """``gen_server.max_num_seqs=auto``: the samples a server can have in flight in this run, as many as its memory
    holds (realhf's own server; vLLM and SGLang size their KV cache themselves). A server that cannot hold one
    request's samples is refused."""
    from realhf.plan.fit import model_dtype, server_estimate, server_rows
    from realhf.plan.memory import Shard, dtype_bytes

    fleet = served.gen_servers
    demand = fleet.max_num_seqs  # the spec holds the rows in flight while auto is unresolved
    if fleet.backend != "gen" or cap.per_rank is None:
        return demand
    s = Shard(shape_of(served.path), fleet.tp, 1, 0, dtype_bytes(model_dtype(fleet, cap.device)))
    room = cap.per_rank
    if fleet.shares_gpus and cap.device == "cuda":  # beside a model worker on one GPU: what its fullest call leaves
        room -= max((c.total for c in plan(spec, model_configs(spec), workloads(cfg), cap).calls), default=0.0)
    rows = server_rows(s, fleet.max_model_len, room, demand)
    n = getattr(cfg, "group_size", None) or getattr(getattr(cfg, "gen", None), "n", 1)
    if rows < n:
        est = server_estimate(s, n, fleet.max_model_len)
        raise ValueError(f"a generation server cannot hold one prompt's {n} samples of up to {fleet.max_model_len} "
                         f"tokens: estimated {est.describe()} against {room / GiB:.2f} GiB ({cap.source}); shorten "
                         "the sequences, use tensor parallelism in the generation layout, or give the servers their "
                         "own devices")
    if rows < demand:
        logger.info(f"gen_server.max_num_seqs=auto -> {rows} (of {demand} the run could have in flight; "
                    f"{cap.source})")
    return rows


def _mfc_exists(cfg, name: str) -> bool:
    try:
        _mb_config(cfg, name)
    except AttributeError:
        return False
    return True
