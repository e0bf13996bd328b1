"""Each MFC call's memory on a model worker: the memory model's estimate for the call as it runs (its real
micro-batches, the worker's replicas) beside what the call measured, so that every run checks the model.

Stats per call (the master keeps each MFC's largest over its workers): ``est_mem_gib`` (what the worker holds plus
what the call adds: comparable with ``peak_mem_gib``, CUDA's allocator peak), ``est_increase_gib`` (what the call
adds) and, where measured, ``mem_increase_gib`` (the peak of live tensor bytes above what the worker held when the
call began: always on CUDA, on the CPU with ``REALHF_MEM_TRACE=1``, as the profiler that counts it slows the call).
"""
from __future__ import annotations

import contextlib
import os
from typing import Dict, Iterator, List, Optional, Tuple

from realhf.base import logging
from realhf.base.mem_peak import PeakBytes, measure
from realhf.plan import memory
from realhf.plan.fit import PROCESS_BASE
from realhf.plan.memory import Estimate, GiB, Shard

logger = logging.getLogger(__name__)

TRACE_ENV = "REALHF_MEM_TRACE"


def _engine_model(model):
    """The ReaLModel behind a ``Model`` (None for served replicas and weightless ones)."""
    from realhf.impl.model.nn.real_model import ReaLModel

    module = getattr(getattr(model, "engine", None), "model", None)
    return module if isinstance(module, ReaLModel) else None


def shard(module, pad: float = memory.PAD) -> Shard:
    import torch

    return Shard(module.config, module.tp, module.pp, module.stage, torch.empty(0, dtype=module.dtype).element_size(),
                 pad=pad)


def held(models: Dict[str, object], device) -> Estimate:
    """What this worker holds now: every replica's parameters (none for one offloaded to host memory), and for a
    trained one its gradients, master weights and the optimizer's moments once they exist; on the CPU also the
    process's own memory (Python, torch), which its peak resident memory (``peak_mem_gib``) includes."""
    out = Estimate({"runtime": PROCESS_BASE}) if getattr(device, "type", str(device)) == "cpu" else Estimate()
    for m in models.values():
        module = _engine_model(m)
        if module is None:
            continue
        eng = m.engine
        trains = hasattr(eng, "optimizer")
        st = memory.replica_state(shard(module), trains, offload=getattr(eng, "offloaded", False))
        if trains and not eng.optimizer.state:  # AdamW makes its moments at the first step
            st.parts.pop("optimizer", None)
        out = out + st
    return out


def _pad(seqlens) -> float:
    """Padded tokens over real tokens of the attention's length buckets for these sequences (1: no padding)."""
    from realhf.impl.model.nn.attention import length_buckets

    real = sum(seqlens)
    if not real or len(set(seqlens)) <= 1:
        return 1.0
    return sum(len(b) * seqlens[b[0]] for b in length_buckets(seqlens)) / real


def _body_lens(engine, ids, lens: List[int]) -> List[int]:
    """The lengths of the sequences (or tree segments) the blocks attend over: the engine's layout of a micro-batch
    (``nn.shared_prefix``)."""
    from realhf.impl.model.nn.shared_prefix import segment_lengths

    return segment_lengths(ids, lens) if getattr(engine, "share_prefixes", False) else lens


def call(mfc, iface, model, inp, mb_spec) -> Tuple[Optional[Estimate], Dict[str, int]]:
    """The memory model's estimate of what the call adds, from its real micro-batches (None where it has none: a
    served or weightless replica), and what it was estimated for: the largest micro-batch's ``tokens`` and
    ``head_rows`` (generation: ``prompts`` and ``rows``), and ``n_mbs``."""
    module = _engine_model(model)
    if module is None:
        return None, {}
    if mfc.is_generate:
        g = getattr(iface, "gconfig", None)
        if g is None or "packed_prompts" not in inp.keys:
            return None, {}
        parts = inp.mb_partition(mb_spec.max_tokens_per_mb, mb_spec.n_mbs, key="packed_prompts")
        lens = inp.flat_seqlens("packed_prompts")
        big = max(parts, key=len)
        est = memory.generate_call(shard(module), len(big), g.n, max(lens[i] for i in big), g.max_new_tokens)
        info = {"prompts": len(big), "rows": len(big) * g.n, "n_mbs": len(parts)}
    else:
        n_min = max(mb_spec.n_mbs, module.pp, getattr(getattr(iface, "cfg", None), "ppo_n_minibatches", 1) or 1)
        mbs = inp.split_mbs(mb_spec.max_tokens_per_mb, min_n_mbs=n_min) if inp.bs > 1 else [inp]
        mb = max(mbs, key=lambda x: sum(x.flat_seqlens("packed_input_ids")))
        lens = mb.flat_seqlens("packed_input_ids")
        rows = int((~mb.data["prompt_mask"].bool()).sum()) if "prompt_mask" in mb.keys else sum(lens)
        # the blocks run on the layout the engine gives them: a prompt shared by adjacent sequences once
        body = _body_lens(model.engine, mb.data["packed_input_ids"], lens)
        tokens = sum(body)
        s = shard(module, _pad(body))
        info = {"tokens": tokens, "head_rows": rows, "n_mbs": len(mbs)}
        temp = float(getattr(iface, "temperature", 1.0) or 1.0)
        if mfc.is_train:
            ent = float(getattr(getattr(iface, "cfg", None), "entropy_coef", 0.0) or 0.0) > 0
            est = memory.train_call(s, tokens, rows, len(mbs), ent, temp, getattr(module, "checkpointing", False))
            eng = model.engine
            if hasattr(eng, "optimizer") and not eng.optimizer.state:
                # AdamW makes its moments in the first step, after the backward pass freed the activations
                opt = Estimate({"optimizer": memory.replica_state(s, True).parts["optimizer"]})
                est = est if est.total >= opt.total else opt
        else:
            est = memory.forward_call(s, tokens, rows, temp)
    return est, info


@contextlib.contextmanager
def measured(device) -> Iterator[Optional[PeakBytes]]:
    """The call's peak of live tensor bytes above the start, where it is counted (CUDA; CPU under
    ``REALHF_MEM_TRACE=1``); else yields None."""
    if getattr(device, "type", str(device)) == "cuda" or os.environ.get(TRACE_ENV, "") == "1":
        with measure(device) as m:
            yield m
    else:
        yield None


def stats(held_est: Estimate, call_est: Optional[Estimate], peak: Optional[PeakBytes]) -> Dict[str, float]:
    out = {}
    if call_est is not None:
        out["est_increase_gib"] = call_est.total / GiB
        out["est_mem_gib"] = (held_est.total + call_est.total) / GiB
    if peak is not None:
        out["mem_increase_gib"] = peak.peak / GiB
    return out


def is_out_of_memory(e: BaseException) -> bool:
    """An allocation that failed: CUDA's OutOfMemoryError, or the CPU allocator's "can't allocate memory"."""
    import torch

    if isinstance(e, (MemoryError, torch.OutOfMemoryError)):
        return True
    return isinstance(e, RuntimeError) and ("can't allocate memory" in str(e) or "out of memory" in str(e).lower())


@contextlib.contextmanager
def reported_out_of_memory(mfc: str, rank: int, info: Dict[str, int], held_est: Estimate,
                           call_est: Optional[Estimate], peak_gib: "callable", mb_key: str) -> Iterator[None]:
    """Re-raise an out-of-memory error of the call as a MemoryError that names the MFC and the worker, the
    micro-batch it was working on, the memory model's estimate beside the peak measured until then, and what to
    change."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - only an allocation failure is re-raised with context; others as they are
        if not is_out_of_memory(e):
            raise
        what = ", ".join(f"{k} {v}" for k, v in info.items()) or "its micro-batches"
        est = (f"the memory model estimated {(held_est.total + call_est.total) / GiB:.2f} GiB (held "
               f"{held_est.describe()}; the call {call_est.describe()})" if call_est is not None
               else "no estimate")
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise MemoryError(
            f"{mfc} ran out of memory on model worker {rank} ({type(e).__name__}: {first}); the largest "
            f"micro-batch: {what}; {est}; peak measured until then {peak_gib():.2f} GiB. Lower "
            f"{mb_key}.max_tokens_per_mb (or set it to auto with device_memory_gib), raise n_mbs, use more "
            "tensor/pipeline parallelism or activation checkpointing") from e
