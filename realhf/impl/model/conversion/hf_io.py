"""Load a Hugging Face folder into any layout of ReaLModel, and save a layout back to a HF folder.

Loading: every rank opens the safetensors files lazily and reads only the tensors of the layers its
pipeline stage holds; tensor-parallel slices are cut from them. Every mismatch (missing tensor,
unexpected shape) raises with the tensor's name, file and the expected shape.

Saving: tensor-parallel slices are gathered within each stage, and data-parallel rank 0 / tensor rank 0
of every stage writes one safetensors shard; stage 0 writes the index and config.json. The folder
loads with ``transformers.AutoModelForCausalLM.from_pretrained`` unchanged. It is written under a
staging name beside the final one and renamed when complete, so a crash mid-save never leaves an
incomplete folder under the final name; a model with non-finite parameters is not saved at all.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from realhf.api.core.model_api import ReaLModelConfig, get_hf_family
from realhf.base import failpoint, logging
from realhf.impl.model.conversion.hf_files import (  # noqa: F401  (the folder checks, kept importable from here)
    _TOKENIZER_FILES, _weight_files, check_tokenizer, check_weight_files, config_from_hf_path, max_positions,
    read_hf_config)
from realhf.impl.model.nn.real_model import ReaLModel, tied_source_name, tp_shard_dim

logger = logging.getLogger(__name__)


def load_hf_into(model: ReaLModel, path: str):
    """Fill ``model``'s local shard from the HF folder ``path``."""
    from safetensors import safe_open

    cfg = model.config
    fam = get_hf_family(cfg.family)
    files = _weight_files(path)
    local = list(model.param_spec)
    # Each local parameter is read from the tensor whose values it holds: a last stage of a tied model
    # that is not also the first keeps its own copy of the embedding as its LM head.
    source = {n: tied_source_name(cfg, n) for n in local}
    want = list(dict.fromkeys(source.values()))
    optional = set()
    if cfg.is_critic:
        optional.add("head.value.weight")  # a fresh critic starts from its random value head
    hf_names = fam.hf_names_for_real(want, cfg)
    optional_hf = set(fam.hf_names_for_real(sorted(optional), cfg)) if optional else set()
    by_file: Dict[str, List[str]] = {}
    for n in hf_names:
        if n not in files:
            if n in optional_hf:
                continue
            raise KeyError(
                f"tensor {n!r} needed by this {cfg.family} model is missing from the checkpoint at {path!r} "
                f"(is this the right model family? config.json says {cfg.family})"
            )
        by_file.setdefault(files[n], []).append(n)
    hf_sd: Dict[str, torch.Tensor] = {}
    for fname, names in by_file.items():
        with safe_open(fname, "pt") as f:
            for n in names:
                hf_sd[n] = f.get_tensor(n)
    real_sd = fam.hf_to_real(hf_sd, cfg)
    for k in list(real_sd):
        if k.startswith("<unknown>"):
            raise KeyError(f"checkpoint tensor {k[9:]!r} in {path!r} is not part of a {cfg.family} model")
    missing = [n for n in local if source[n] not in real_sd and n not in optional]
    if missing:
        raise KeyError(f"checkpoint at {path!r} lacks tensors for {missing[:5]}{'...' if len(missing) > 5 else ''}")
    for name in local:
        if source[name] not in real_sd:
            continue
        t = real_sd[source[name]]
        full = model.full_shape(name)
        if tuple(t.shape) != tuple(full):
            hf = fam.hf_names_for_real([source[name]], cfg)
            raise ValueError(
                f"checkpoint tensor {hf} (for {name}) in {path!r} has shape {tuple(t.shape)}, expected "
                f"{tuple(full)} from config.json — the weights do not match the config"
            )
        model.local_param(name).copy_(model.local_shard(name, t))


def build_from_hf(path: str, grid=None, dtype: Optional[torch.dtype] = None, is_critic: bool = False, device=None,
                  env=None) -> ReaLModel:
    """A ReaLModel shard of the HF folder ``path`` for this rank of ``grid``, built on the device of ``env``
    (a ``RuntimeEnv``) in ``dtype`` (default: the env's); without ``env``, see ``ReaLModel``."""
    cfg = config_from_hf_path(path, is_critic=is_critic)
    model = ReaLModel(cfg, grid=grid, dtype=dtype, device=device, env=env)
    if is_critic:
        model.init_random(seed=0)
    load_hf_into(model, path)
    return model


def gather_full_state(model: ReaLModel) -> Dict[str, torch.Tensor]:
    """This stage's parameters with tensor-parallel slices concatenated (collective over the tp group)."""
    out = {}
    for name in model.param_spec:
        t = model.local_param(name).detach()
        d = tp_shard_dim(name)
        if d is not None and model.tp > 1:
            # slices may differ in size (uneven head partitions): pad to the largest, gather, trim
            sizes = [e - s for s, e in (model.shard_bounds(name, r) for r in range(model.tp))]
            m = max(sizes)
            pad = list(t.shape)
            pad[d] = m
            buf = t.new_zeros(pad)
            buf.narrow(d, 0, t.shape[d]).copy_(t)
            parts = [torch.empty_like(buf) for _ in range(model.tp)]
            dist.all_gather(parts, buf, group=model.tp_group)
            t = torch.cat([p.narrow(d, 0, n) for p, n in zip(parts, sizes)], dim=d)
        out[name] = t.clone()
    return out


def stage_hf_state(model: ReaLModel, dtype: Optional[torch.dtype] = None) -> Dict[str, torch.Tensor]:
    """This pipeline stage's parameters as HF-named full tensors (collective over the tp group): what the stage
    writes in a HF checkpoint, or publishes to generation servers. A tied LM head is left to the embedding."""
    sd = gather_full_state(model)
    cfg = model.config
    if cfg.tied_embedding and not model.shares_tied_weight and not model.is_first:
        sd.pop("head.lm_head.weight", None)  # the first stage writes the embedding
    if model.shares_tied_weight:
        sd.pop("head.lm_head.weight", None)
    hf_sd = get_hf_family(cfg.family).real_to_hf(sd, cfg)
    if dtype is not None:
        hf_sd = {k: v.to(dtype) for k, v in hf_sd.items()}
    return hf_sd


def staging_paths(path: str) -> Tuple[str, str]:
    """(folder a save of ``path`` is written into, name an existing ``path`` is moved to while replaced):
    hidden siblings of ``path``, the same on every rank."""
    parent, name = os.path.split(os.path.normpath(path))
    return os.path.join(parent, f".{name}.saving"), os.path.join(parent, f".{name}.replaced")


def _barrier(group) -> None:
    if group is not None:
        dist.barrier(group=group)


def _publish(tmp: str, path: str, old: str) -> None:
    """Rename the complete folder ``tmp`` to ``path``, replacing a previous ``path``: ``path`` is at every
    moment either the previous complete folder, absent (between the two renames), or the new one."""
    shutil.rmtree(old, ignore_errors=True)
    if os.path.lexists(path):
        os.rename(path, old)
    os.rename(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def save_hf(model: ReaLModel, path: str, tokenizer_src: Optional[str] = None, dtype: Optional[torch.dtype] = None):
    """Write the whole model (collective over its grid) as a HF folder at ``path``.

    Every writer writes into the staging folder of :func:`staging_paths`; when all are done, the first
    stage's writer renames it to ``path`` (replacing an existing one) and every rank returns after that.
    Raises ValueError on every rank, writing nothing, when a parameter to be saved is NaN or infinite.
    """
    grid = model.grid
    writer = grid is None or (grid.dp_rank == 0 and grid.tp_rank == 0)
    _write_hf(stage_hf_state(model, dtype), model.config, path, tokenizer_src, dtype, pp=model.pp, stage=model.stage,
              writer=writer, grid=grid, device=model.device)


def write_hf_state(hf_sd: Dict[str, torch.Tensor], cfg: ReaLModelConfig, path: str,
                   tokenizer_src: Optional[str] = None, dtype: Optional[torch.dtype] = None) -> None:
    """:func:`save_hf` of a whole model's HF state (:func:`stage_hf_state` of a single-process model, or a copy
    of it), without the model: what a single-rank trainer runs on a background thread to publish a snapshot."""
    _write_hf(hf_sd, cfg, path, tokenizer_src, dtype, pp=1, stage=0, writer=True, grid=None, device=None)


def n_nonfinite(tensors) -> int:
    """How many values of ``tensors`` are NaN or infinite. One summing pass when there are none (a sum is finite
    only if every term is), a counting pass otherwise."""
    fl = [v for v in tensors if v.is_floating_point()]
    if all(torch.isfinite(v.sum(dtype=torch.float32)) for v in fl):
        return 0
    return sum(int((~torch.isfinite(v)).sum()) for v in fl)


def _write_hf(hf_sd, cfg, path, tokenizer_src, dtype, *, pp, stage, writer, grid, device):
    from safetensors.torch import save_file

    group = grid.all_group if grid is not None else None
    fam = get_hf_family(cfg.family)
    bad = n_nonfinite(hf_sd.values()) if writer else 0
    if group is not None:
        t = torch.tensor([bad], device=device)
        dist.all_reduce(t, group=group)
        bad = int(t)
    if bad:
        raise ValueError(f"refusing to save the checkpoint {path!r}: {bad} parameter values are not finite "
                         "(NaN or inf); nothing was written")
    leader = writer and stage == 0
    tmp, old = staging_paths(path)
    if leader:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a save that crashed
        os.makedirs(tmp)
    _barrier(group)
    fname = "model.safetensors" if pp == 1 else f"model-{stage + 1:05d}-of-{pp:05d}.safetensors"
    if writer:
        save_file({k: v.contiguous() for k, v in hf_sd.items()}, os.path.join(tmp, fname), metadata={"format": "pt"})
    names = sorted(hf_sd)
    if pp > 1:
        all_names: List = [None] * pp
        dist.all_gather_object(all_names, (fname, names, sum(v.numel() * v.element_size() for v in hf_sd.values())), group=grid.pp_group)
    else:
        all_names = [(fname, names, 0)]
    if leader:
        if pp > 1:
            wm = {n: f for f, ns, _ in all_names for n in ns}
            with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {"total_size": sum(s for _, _, s in all_names)}, "weight_map": wm}, f, indent=1)
        hf_cfg = fam.config_to_hf(cfg)
        if cfg.is_critic:
            hf_cfg = scalar_head_hf_config(hf_cfg)
        if dtype is not None:
            hf_cfg["torch_dtype"] = str(dtype).replace("torch.", "")
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(hf_cfg, f, indent=1)
        if tokenizer_src:
            copy_tokenizer(tokenizer_src, tmp)
    _barrier(group)  # every shard is in the staging folder
    if leader:
        failpoint.hit("save_hf.before_rename")
        _publish(tmp, path, old)
    _barrier(group)  # the folder is at its final name when save_hf returns on any rank


def scalar_head_hf_config(hf_cfg: dict) -> dict:
    """The config.json of a model with a scalar head (a critic or a reward model, whose head is saved as
    ``score.weight``): transformers' ``*ForSequenceClassification`` of the family with one label, so that
    ``AutoModelForSequenceClassification.from_pretrained`` loads it (it scores a sequence at its last token that is
    not the pad token)."""
    archs = [a.replace("ForCausalLM", "ForSequenceClassification").replace("LMHeadModel", "ForSequenceClassification")
             for a in hf_cfg.get("architectures") or []]
    return {**hf_cfg, "architectures": archs, "id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}}


def copy_tokenizer(src: str, dst: str):
    for f in _TOKENIZER_FILES:
        if os.path.isfile(os.path.join(src, f)):
            shutil.copy(os.path.join(src, f), os.path.join(dst, f))
