"""Whether a plan fits its devices, and the token budgets that make it fit (``max_tokens_per_mb=auto``).

For every model worker rank: what it holds between calls (every replica it is part of: :func:`memory.replica_state`)
and, for every MFC it runs, what the call adds on top (:mod:`realhf.plan.memory`), against the rank's capacity (a
GPU's memory, or on CPU its share of the host's). The launcher refuses a plan whose estimate does not fit before any
worker starts, naming the MFC, the estimate by part, the capacity and what would make it fit; ``--dry-run`` prints
every MFC's estimate.

Torch-free: the launcher runs it from the experiment's spec, each model's ``config.json`` and the workload the
experiment's options describe (:class:`Workload`).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Optional, Tuple

from realhf.api.core.model_api import ReaLModelConfig
from realhf.plan import memory
from realhf.plan.memory import Estimate, GiB, Shard, gib

UNBOUNDED = 2**31 - 1  # MicroBatchSpec's "no budget"
# of a GPU's memory, what tensors may take: the rest is the CUDA context, communication buffers and fragmentation
GPU_USABLE = 0.92
GPU_RESERVED = 1.0 * GiB
# of a host's memory on CPU runs: what the workers' tensors may take, after each process's own ~0.5 GiB (Python,
# torch, tokenizers)
HOST_USABLE = 0.85
PROCESS_BASE = 0.5 * GiB


@dataclasses.dataclass
class Workload:
    """What one MFC computes per step, as the experiment's options bound it."""

    kind: str  # "train" | "inference" | "generate"
    seqs: int  # sequences per step over all data-parallel ranks (generate: prompts)
    seq_len: int  # tokens of the longest sequence (generate: of the longest prompt)
    head_share: float = 1.0  # share of a sequence's tokens that go through the output head (loss / answer rows)
    # share of the tokens the blocks compute: the engine computes a prompt shared by its group's answers once
    # (``nn.shared_prefix``); see :func:`shared_body_share`
    body_share: float = 1.0
    n: int = 1  # generate: answers per prompt
    max_new: int = 0  # generate: new tokens per answer
    minibatches: int = 1  # train: optimizer steps per call, each over its share of the sequences
    entropy: bool = False  # train: the entropy bonus (the head keeps more buffers)
    temperature: float = 1.0
    checkpointing: bool = False  # train: activation checkpointing


def shared_body_share(prompt_len: float, answer_len: float, n: int) -> float:
    """The blocks' tokens over the sequences' tokens for groups of ``n`` answers of ``answer_len`` tokens after one
    prompt of ``prompt_len``: the prompt computed once (1 where ``n`` is 1)."""
    n = max(1, int(n))
    whole = n * (prompt_len + answer_len)
    return 1.0 if whole <= 0 else min(1.0, (prompt_len + n * answer_len) / whole)


@dataclasses.dataclass
class Capacity:
    """Bytes a model worker's tensors may take, where known: ``device`` is "cuda" or "cpu"; ``source`` says where
    the figure came from (for messages)."""

    device: str
    per_rank: Optional[float]
    source: str


@dataclasses.dataclass
class RankCall:
    """One MFC on one rank: what the rank holds, what the call adds, the rank's capacity."""

    mfc: str
    rank: int
    model: str
    layout: str
    dtype: str
    held: Estimate
    call: Estimate
    capacity: Optional[float]

    @property
    def total(self) -> float:
        return self.held.total + self.call.total

    @property
    def fits(self) -> bool:
        return self.capacity is None or self.total <= self.capacity


def shard_of(m, cfg: ReaLModelConfig, rank: int, dtype: str) -> Shard:
    """Rank ``rank``'s shard of model spec ``m`` (its ranks are in grid order: pp, dp, tp)."""
    layout = m.layout
    stage = m.ranks.index(rank) // (layout.dp * layout.tp)
    return Shard(cfg, layout.tp, layout.pp, stage, memory.dtype_bytes(dtype))


def model_dtype(m, device: str) -> str:
    """A model spec's dtype, ``auto`` resolved as the workers do (bf16 on GPU, fp32 on CPU)."""
    if m.dtype not in (None, "auto"):
        return m.dtype
    return "bfloat16" if device == "cuda" else "float32"


def held(spec, cfgs: Dict[str, ReaLModelConfig], device: str) -> Dict[int, Estimate]:
    """What each model worker rank holds between calls: the parameters, gradients and optimizer state of every
    replica it is part of (offloaded inference replicas none; replicas served by generation servers none)."""
    out: Dict[int, Estimate] = {r: Estimate() for r in range(spec.n_workers)}
    for m in spec.models:
        if m.gen_servers is not None or not m.path:
            continue
        for r in m.ranks:
            s = shard_of(m, cfgs[m.name], r, model_dtype(m, device))
            out[r] = out[r] + memory.replica_state(s, m.optimizer is not None, m.offload)
    return out


def _per_rank(w: Workload, dp: int) -> Tuple[int, int]:
    """(sequences, tokens) one data-parallel rank computes at once at most (a training call's minibatch)."""
    seqs = max(1, math.ceil(w.seqs / dp / max(1, w.minibatches)))
    return seqs, seqs * w.seq_len


def gen_micro_batches(w: Workload, prompts: int, n_mbs: int, max_tokens: int) -> int:
    """Micro-batches of a generation call over ``prompts`` prompts on one rank: at least ``n_mbs``, each of at most
    ``max_tokens`` prompt tokens (the prompts at their bound, ``w.seq_len``; a longer prompt goes alone)."""
    n = max(1, n_mbs)
    if max_tokens < UNBOUNDED:
        n = max(n, math.ceil(prompts / max(1, max_tokens // max(1, w.seq_len))))
    return min(n, max(1, prompts))


def call_estimate(m, s: Shard, w: Workload, n_mbs: int, max_tokens: int, src: Optional[Shard] = None) -> Estimate:
    """What MFC work ``w`` adds on a rank holding shard ``s`` of model spec ``m``, with micro-batches of at most
    ``max_tokens`` tokens (at least ``n_mbs`` of them), plus the parameters of an offloaded replica brought back and
    the reallocation into it (from the trained replica's shard ``src`` on this rank, if any)."""
    seqs, tokens = _per_rank(w, m.layout.dp)
    if w.kind == "generate":
        per_mb = max(1, math.ceil(seqs / gen_micro_batches(w, seqs, n_mbs, max_tokens)))
        est = memory.generate_call(s, per_mb, w.n, w.seq_len, w.max_new)
    else:
        # the engine's split: at least n_mbs micro-batches (and one per pipeline stage in training), each within
        # max_tokens, a longer sequence alone; the largest then holds about this many tokens
        n_min = max(n_mbs, m.layout.pp if w.kind == "train" else 1)
        mb_tokens = min(tokens, max(w.seq_len, min(max_tokens, math.ceil(tokens / n_min))))
        mbs = max(n_min, math.ceil(tokens / mb_tokens))
        rows = int(math.ceil(mb_tokens * w.head_share))
        body = int(math.ceil(mb_tokens * w.body_share))
        if w.kind == "train":
            est = memory.train_call(s, body, rows, mbs, w.entropy, w.temperature, w.checkpointing)
        else:
            est = memory.forward_call(s, body, rows, w.temperature)
    if m.realloc_from is not None:  # the parameters arrive before the call: the larger of the two peaks
        realloc = memory.realloc_call(src, s)
        est = realloc if realloc.total > est.total else est
    if m.offload:  # brought back to the device for the call
        est = est + Estimate({"params": memory.params(s) * s.bytes})
    return est


@dataclasses.dataclass
class MemoryPlan:
    capacity: Capacity
    calls: List[RankCall]

    def worst(self) -> Dict[str, RankCall]:
        """Per MFC, the rank closest to (or furthest over) its capacity; the largest estimate where capacity is
        unknown."""
        out: Dict[str, RankCall] = {}
        for c in self.calls:
            key = (c.total / c.capacity) if c.capacity else c.total
            o = out.get(c.mfc)
            if o is None or key > ((o.total / o.capacity) if o.capacity else o.total):
                out[c.mfc] = c
        return out

    def unfit(self) -> List[RankCall]:
        """The MFCs that do not fit (on their fullest rank), the largest estimate first."""
        return sorted((c for c in self.worst().values() if not c.fits), key=lambda c: -c.total)

    def table(self) -> str:
        cap = self.capacity
        head = (f"# memory plan ({cap.device}; capacity per model worker: "
                + (f"{gib(cap.per_rank):.2f} GiB, {cap.source})" if cap.per_rank else f"unknown: {cap.source})"))
        lines = [head, f"# {'mfc':<14} {'rank':>4} {'model':<10} {'layout':<8} {'dtype':<8} {'estimate GiB':>12}  "
                       "parts (held | call)"]
        for name, c in self.worst().items():
            lines.append(f"# {name:<14} {c.rank:>4} {c.model:<10} {c.layout:<8} {c.dtype:<8} {gib(c.total):>12.2f}  "
                         f"{c.held.describe()} | {c.call.describe()}" + ("" if c.fits else "  DOES NOT FIT"))
        return "\n".join(lines)


def plan(spec, cfgs: Dict[str, ReaLModelConfig], workloads: Dict[str, Workload], cap: Capacity,
         budgets: Optional[Dict[str, Tuple[int, int]]] = None) -> MemoryPlan:
    """Every (MFC, rank) estimate of ``spec``. ``budgets``: (n_mbs, max_tokens_per_mb) per MFC overriding the
    spec's (for trying budgets before they are written into the config)."""
    hold = held(spec, cfgs, cap.device)
    models = {m.name: m for m in spec.models}
    calls = []
    for mfc in spec.mfcs:
        m = models[str(mfc.model_name)]
        w = workloads.get(mfc.name)
        if w is None or m.gen_servers is not None or not m.path:
            continue
        n_mbs, max_tokens = (budgets or {}).get(mfc.name, (mfc.mb_spec.n_mbs, mfc.mb_spec.max_tokens_per_mb))
        src = models.get(m.realloc_from) if m.realloc_from else None
        for r in m.ranks:
            dt = model_dtype(m, cap.device)
            s = shard_of(m, cfgs[m.name], r, dt)
            src_shard = (shard_of(src, cfgs[src.name], r, model_dtype(src, cap.device)) if src and r in src.ranks
                         else None)
            calls.append(RankCall(mfc.name, r, m.name, str(m.layout), dt, hold[r],
                                  call_estimate(m, s, w, n_mbs, max_tokens, src_shard), cap.per_rank))
    return MemoryPlan(cap, calls)


def auto_budget(spec, cfgs, workloads, cap: Capacity, mfc_name: str) -> Tuple[int, int]:
    """(n_mbs, max_tokens_per_mb) for MFC ``mfc_name`` under ``max_tokens_per_mb=auto`` (:func:`budget_search` over
    this spec's memory plan)."""
    mfc = next(x for x in spec.mfcs if x.name == mfc_name)
    if cap.per_rank is None:
        return mfc.mb_spec.n_mbs, UNBOUNDED
    m = next(x for x in spec.models if x.name == str(mfc.model_name))

    def fits(budget: Tuple[int, int]) -> bool:
        p = plan(spec, cfgs, workloads, cap, {mfc_name: budget})
        return all(c.fits for c in p.calls if c.mfc == mfc_name)

    return budget_search(workloads[mfc_name], m.layout.dp, mfc.mb_spec.n_mbs, fits)


def budget_search(w: Workload, dp: int, n_mbs: int, fits) -> Tuple[int, int]:
    """The budget ``auto`` gives a call of work ``w`` on ``dp`` data-parallel ranks, at least ``n_mbs``
    micro-batches: the whole per-rank batch in one micro-batch when it fits (no budget), else the largest token
    budget that fits (generation: the fewest micro-batches of prompts). ``fits((n_mbs, max_tokens))`` says whether a
    budget fits every rank. A plan that does not fit even with one sequence per micro-batch keeps the smallest
    budget (the memory plan then refuses it)."""
    if fits((n_mbs, UNBOUNDED)):
        return n_mbs, UNBOUNDED
    seqs, tokens = _per_rank(w, dp)
    if w.kind == "generate":  # fewer prompts per micro-batch never take more memory: the fewest micro-batches
        lo, hi = n_mbs, max(n_mbs, seqs)
        if not fits((hi, UNBOUNDED)):
            return hi, UNBOUNDED
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if fits((mid, UNBOUNDED)) else (mid, hi)
        return hi, UNBOUNDED
    lo, hi = w.seq_len, tokens  # a budget below one sequence is never used: a longer sequence goes alone
    if not fits((n_mbs, lo)):
        return n_mbs, lo
    while hi - lo > max(1, lo // 64):
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits((n_mbs, mid)) else (lo, mid)
    return n_mbs, lo


def refusal(c: RankCall, cap: Capacity, mb_key: str) -> str:
    """The message of a plan that does not fit: the MFC, the estimate by part, the capacity, what would fit.
    ``mb_key``: the config section of the MFC's micro-batches (``actor_train.mb_spec``)."""
    fixes = [f"more tensor or pipeline parallelism for {c.model} (its layout is {c.layout})"]
    if c.held.total <= (cap.per_rank or 0):
        fixes.append(f"a smaller {mb_key}.max_tokens_per_mb (or auto)")
    if "optimizer" in c.held.parts:
        fixes.append("activation checkpointing (actor.gradient_checkpointing=true) for long sequences")
    if c.held.parts.get("params") and "optimizer" not in c.held.parts:
        fixes.append("offload of inference replicas between their calls (<model>.offload=true)")
    if "kv_cache" in c.call.parts:
        fixes.append(f"fewer prompts per generation micro-batch ({mb_key}.n_mbs)")
    alone = (" (what it holds between calls alone is more than that)" if c.held.total > (cap.per_rank or 0) else "")
    return (f"{c.mfc} does not fit on model worker {c.rank}: estimated {gib(c.total):.2f} GiB ({c.model}, layout "
            f"{c.layout}, {c.dtype}; held {c.held.describe()}; the call {c.call.describe()}) against "
            f"{gib(cap.per_rank):.2f} GiB{alone} ({cap.source}). To fit: " + "; ".join(fixes))


def refusal_of(bad: List[RankCall], cap: Capacity, mb_key_of) -> str:
    """The message of a plan whose calls ``bad`` (:meth:`MemoryPlan.unfit`, the largest first) do not fit: the
    largest in full (:func:`refusal`), then every other one with its estimate, so that a user fixing the first learns
    at once what else must change. ``mb_key_of(mfc)``: the config section of an MFC's micro-batches."""
    msg = refusal(bad[0], cap, mb_key_of(bad[0].mfc))
    if len(bad) > 1:
        msg += (f". Also over {gib(cap.per_rank):.2f} GiB: "
                + "; ".join(f"{c.mfc} on model worker {c.rank}, estimated {gib(c.total):.2f} GiB ({c.model}, layout "
                            f"{c.layout})" for c in bad[1:]))
    return msg


def server_estimate(s: Shard, rows: int, max_len: int) -> Estimate:
    """A realhf generation server (``gen.``) with ``rows`` samples in flight of up to ``max_len`` tokens each: its
    parameters, the KV cache of every row at full length, and the larger of a prefill of ``max_len`` tokens and a
    decode step's logits and sampling buffers."""
    decode = rows * s.vocab * (s.bytes + 12)
    prefill = max_len * memory.block_forward_peak_per_token(s)
    return Estimate({"params": memory.params(s) * s.bytes, "kv_cache": memory.kv_cache(s, rows, max_len),
                     "activations": max(decode, prefill)})


def server_rows(s: Shard, max_len: int, capacity: float, demand: int) -> int:
    """The most samples (up to ``demand``) a server can keep in flight within ``capacity`` bytes; 0 if not one."""
    if server_estimate(s, demand, max_len).total <= capacity:
        return demand
    lo, hi = 0, demand
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if server_estimate(s, mid, max_len).total <= capacity else (lo, mid)
    return lo
