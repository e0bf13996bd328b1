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
    return ExperimentSpec(**{
        **dict(experiment_name=cfg.experiment_name, trial_name=cfg.trial_name, seed=cfg.seed, log_dir=cfg.log_dir(),
               save_dir=cfg.ckpt_dir(), recover_dir=cfg.recover_dir(), threads_per_worker=cfg.cpus_per_worker,
               worker_timeout_secs=cfg.worker_timeout_secs, wandb=cfg.wandb_init_kwargs(),
               tensorboard_dir=cfg.tensorboard_dir()),
        **ctrl, **fields})


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
    from realhf.impl.model.conversion.hf_io import (check_tokenizer, check_weight_files, config_from_hf_path,
                                                    max_positions)

    try:
        cfg = config_from_hf_path(path)
        check_weight_files(path)
        if tokenizer:
            check_tokenizer(path)
    except (ValueError, FileNotFoundError) as e:
        kind = FileNotFoundError if isinstance(e, FileNotFoundError) else ValueError
        raise kind(f"{key}={path!r}: {e}") from None
    try:
        cfg.check_layout(layout.tp, layout.pp)
    except ValueError as e:
        raise ValueError(f"{key}={path!r} under layout {layout}: {e}") from None
    limit = max_positions(path) if seqlen else None
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
    for name, (dims, ranks) in replicas.items():
        trains = optimizer is not None and name == role
        specs.append(ModelSpec(
            name, path, dims, list(ranks), dtype=model_cfg.dtype if model_cfg is not None else "auto",
            is_critic=is_critic, optimizer=optimizer if trains else None, total_train_steps=total_train_steps,
            tokenizer_path=tokenizer_path, realloc_from=role if optimizer is not None and not trains else None,
            offload=bool(model_cfg is not None and model_cfg.offload and not trains),
            compile=bool(model_cfg is not None and model_cfg.compile)))
    return specs
