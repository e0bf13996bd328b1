"""One step of a plan's dataflow graph, simulated on the cost model: when each model function call (MFC) runs, on
which devices, for how long, and the step's time.

A plan is plain data (:class:`StepPlan`: models with their meshes, calls with their parents and workloads); the
launcher's spec becomes one with :func:`plan_of`, and a search builds them directly. The rules:

* An MFC occupies its model's devices (a served replica: the generation servers' devices and the worker holding
  the client). MFCs on disjoint devices run at the same time; MFCs sharing a device run one after the other, in the
  DFG's topological order (the master dispatches them in that order).
* An MFC starts when its parents have ended and its devices are free. Its time is then: the reallocation of its
  model's parameters from the trained replica (a mirror replica whose layout differs from its source's; the source's
  devices are busy too), or their publication to the generation servers (a served replica); the move of its inputs
  from each parent's mesh to its own (bytes per token by key); its computation (:class:`realhf.plan.cost.CostModel`
  over its workload, :class:`realhf.plan.fit.Workload`); and the master's fixed cost of a call.
  A training call pays its host-side work (``Hardware.train_call_overhead_s``); under data parallelism also its
  small all-reduces beside the gradients' (token counts, statistics, advantage moments: ``TRAIN_DP_REDUCTIONS``)
  and what a real data-parallel call takes beyond all that (``Hardware.dp_train_call_overhead_s``; a pipelined one,
  ``Hardware.pp_train_call_overhead_s``).
* The step adds the master's fixed cost of a step (fetching the batch, clearing it, logging). The fixed costs are the
  hardware's (``Hardware.call_overhead_s``, ``step_overhead_s``): measured on a profiled machine, tabled for a GPU.

Pure arithmetic, no torch: a search may call :func:`simulate_step` thousands of times.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Optional, Sequence, Tuple

from realhf.api.core.model_api import ReaLModelConfig
from realhf.plan import comm_cost
from realhf.plan.comm_cost import Mesh
from realhf.plan.cost import CostModel
from realhf.plan.fit import UNBOUNDED, Workload, gen_micro_batches
from realhf.plan.hardware import Hardware
from realhf.plan.memory import Shard, dtype_bytes, params

# the small all-reduces over the data-parallel group of a training call beside the gradients': the train engine's
# token count and statistics (realhf.impl.model.backend.engine.train_batch), the PPO interface's minibatch count,
# advantage moments and statistics (realhf.impl.model.interface.ppo_interface.train_step)
TRAIN_DP_REDUCTIONS = 5
SMALL_REDUCTION_BYTES = 64.0
# bytes per token of a buffer key moved between MFCs (by its name's ending); per-sequence keys move ~nothing
KEY_BYTES = (("input_ids", 8.0), ("prompts", 8.0), ("mask", 1.0), ("logprobs", 4.0), ("values", 4.0),
             ("advantages", 4.0), ("returns", 4.0), ("versions", 4.0), ("rewards", 0.0), ("seq_no_eos_mask", 0.0))
DEFAULT_KEY_BYTES = 4.0


def key_bytes(key: str) -> float:
    """Bytes per token of buffer key ``key`` (token ids int64, masks bool, per-token floats fp32)."""
    for suffix, b in sorted(KEY_BYTES, key=lambda kb: -len(kb[0])):
        if key.endswith(suffix):
            return b
    return DEFAULT_KEY_BYTES


@dataclasses.dataclass(frozen=True)
class ServerFleet:
    """Generation servers serving a replica: ``n`` servers of ``tp`` devices each from device ``first``, at most
    ``max_rows`` answers in flight per server; trained weights reach them over ``weight_sync`` (disk | memory)."""

    n: int
    tp: int = 1
    first: int = 0
    max_rows: int = UNBOUNDED
    weight_sync: str = "disk"

    def __post_init__(self):
        if self.n < 1 or self.tp < 1:
            raise ValueError(f"ServerFleet: n and tp must be >= 1, got n={self.n}, tp={self.tp}")
        if self.weight_sync not in ("disk", "memory"):
            raise ValueError(f"ServerFleet.weight_sync={self.weight_sync!r}; allowed: 'disk', 'memory'")

    @property
    def devices(self) -> Tuple[int, ...]:
        return tuple(range(self.first, self.first + self.n * self.tp))


@dataclasses.dataclass(frozen=True)
class PlanModel:
    """A model replica: its shape, its mesh (ranks ``mesh.first`` ... in grid order), its dtype, whether it trains,
    the trained replica it mirrors (``realloc_from``) and the servers that serve it (then ``mesh`` is the client's
    worker)."""

    name: str
    cfg: ReaLModelConfig
    mesh: Mesh
    dtype: str = "float32"
    trains: bool = False
    realloc_from: Optional[str] = None
    servers: Optional[ServerFleet] = None

    @property
    def devices(self) -> Tuple[int, ...]:
        own = tuple(range(self.mesh.first, self.mesh.first + self.mesh.world))
        return own + (self.servers.devices if self.servers is not None else ())


@dataclasses.dataclass(frozen=True)
class PlanCall:
    """An MFC: its model, the parents it reads from with the bytes per token each edge moves, its workload (None:
    no model computation, e.g. a rule-based reward, which grades ``answers`` answers on the host) and its
    micro-batches."""

    name: str
    model: str
    parents: Tuple[Tuple[str, float], ...] = ()
    work: Optional[Workload] = None
    n_mbs: int = 1
    max_tokens: int = UNBOUNDED
    answers: int = 0
    messages: Tuple[int, ...] = ()  # per parent: the messages its outputs take (samples x keys), when known


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """Models and calls; ``calls`` in the DFG's topological order."""

    models: Tuple[PlanModel, ...]
    calls: Tuple[PlanCall, ...]

    def __post_init__(self):
        names = {m.name for m in self.models}
        seen = set()
        for c in self.calls:
            if c.model not in names:
                raise ValueError(f"call {c.name!r} runs model {c.model!r}, not one of {sorted(names)}")
            for p, _ in c.parents:
                if p not in seen:
                    raise ValueError(f"call {c.name!r} reads from {p!r}, which is not an earlier call; calls must be "
                                     f"in topological order: {[x.name for x in self.calls]}")
            seen.add(c.name)
        for m in self.models:
            if m.realloc_from is not None and m.realloc_from not in names:
                raise ValueError(f"model {m.name!r} mirrors {m.realloc_from!r}, not one of {sorted(names)}")

    def model(self, name: str) -> PlanModel:
        return next(m for m in self.models if m.name == name)


@dataclasses.dataclass
class CallEstimate:
    name: str
    model: str
    devices: Tuple[int, ...]
    start: float
    realloc_s: float  # reallocation from the trained replica, or publication to the servers
    transfer_s: float  # the inputs moved from the parents' meshes
    compute_s: float
    overhead_s: float
    realloc_kind: str = ""  # "realloc" | "publish" | ""

    @property
    def time_s(self) -> float:
        return self.realloc_s + self.transfer_s + self.compute_s + self.overhead_s

    @property
    def end(self) -> float:
        return self.start + self.time_s


@dataclasses.dataclass
class StepEstimate:
    calls: List[CallEstimate]
    step_s: float
    hardware: str

    def call(self, name: str) -> CallEstimate:
        return next(c for c in self.calls if c.name == name)

    def table(self) -> str:
        lines = [f"# step estimate on {self.hardware}",
                 f"# {'mfc':<14} {'devices':<12} {'start s':>9} {'realloc s':>10} {'transfer s':>10} "
                 f"{'compute s':>10} {'end s':>9}"]
        for c in self.calls:
            devs = f"{c.devices[0]}-{c.devices[-1]}" if len(c.devices) > 1 else str(c.devices[0])
            lines.append(f"# {c.name:<14} {devs:<12} {c.start:>9.4g} {c.realloc_s:>10.4g} {c.transfer_s:>10.4g} "
                         f"{c.compute_s:>10.4g} {c.end:>9.4g}" + (f"  ({c.realloc_kind})" if c.realloc_kind else ""))
        lines.append(f"# step: {self.step_s:.4g} s")
        return "\n".join(lines)

    def as_dict(self) -> Dict:
        return dict(step_s=self.step_s, hardware=self.hardware,
                    calls={c.name: dict(model=c.model, devices=list(c.devices), start=c.start, end=c.end,
                                        realloc_s=c.realloc_s, transfer_s=c.transfer_s, compute_s=c.compute_s,
                                        realloc_kind=c.realloc_kind) for c in self.calls})


# ---------------------------------------------------------------------------------------------------- compute


def _micro_batches(tokens: float, seq_len: int, n_mbs: int, max_tokens: int, pp: int, train: bool) -> int:
    """The engine's split of ``tokens`` (as :func:`realhf.plan.fit.call_estimate` counts it)."""
    n_min = max(n_mbs, pp if train else 1)
    mb_tokens = min(tokens, max(seq_len, min(max_tokens, math.ceil(tokens / n_min))))
    return max(n_min, math.ceil(tokens / max(1, mb_tokens)))


def generate_time(cm: CostModel, w: Workload, prompts: float, tp: int, pp: int, n_mbs: int = 1,
                  max_rows: int = UNBOUNDED) -> float:
    """``prompts`` prompts' generation on one data-parallel rank (or server): in ``n_mbs`` micro-batches, and in
    waves of at most ``max_rows`` answers in flight."""
    if prompts <= 0:
        return 0.0
    per_wave = max(1, min(math.ceil(prompts / max(1, n_mbs)), max(1, max_rows // max(1, w.n))))
    waves = math.ceil(prompts / per_wave)
    full, rest = divmod(prompts, per_wave) if waves > 1 else (0, prompts)
    t = full * cm.generate(per_wave, w.seq_len, w.n, w.max_new, tp, pp) if full else 0.0
    return t + (cm.generate(rest, w.seq_len, w.n, w.max_new, tp, pp) if rest else 0.0)


def compute_time(hw: Hardware, m: PlanModel, call: PlanCall, cm: Optional[CostModel] = None) -> float:
    """The computation of ``call`` on ``m``'s mesh (its slowest data-parallel rank), or on its servers."""
    w = call.work
    if w is None:  # a rule-based reward: its data-parallel ranks grade their share of the answers
        return math.ceil(call.answers / m.mesh.dp) * hw.reward_s_per_answer
    if w.kind == "generate" and m.servers is not None:
        if hw.server_generate_overhead_s is not None:  # the server's own cost in place of the interface's
            hw, cm = dataclasses.replace(hw, generate_overhead_s=hw.server_generate_overhead_s), None
        cm = cm or CostModel(m.cfg, hw, m.dtype)
        return generate_time(cm, w, math.ceil(w.seqs / m.servers.n), m.servers.tp, 1, 1, m.servers.max_rows)
    cm = cm or CostModel(m.cfg, hw, m.dtype)
    if w.kind == "generate":
        prompts = math.ceil(w.seqs / m.mesh.dp)
        return generate_time(cm, w, prompts, m.mesh.tp, m.mesh.pp,
                             gen_micro_batches(w, prompts, call.n_mbs, call.max_tokens))
    tp, pp = m.mesh.tp, m.mesh.pp
    seqs = math.ceil(w.seqs / m.mesh.dp)
    if w.kind == "inference":
        tokens = seqs * w.seq_len
        mbs = _micro_batches(tokens, w.seq_len, call.n_mbs, call.max_tokens, pp, False)
        return cm.forward(tokens * w.body_share, mbs, w.seq_len, tokens * w.head_share, tp, pp)
    if w.kind != "train":
        raise ValueError(f"call {call.name!r}: workload kind {w.kind!r}; allowed: 'train', 'inference', 'generate'")
    k = max(1, w.minibatches)
    tokens = math.ceil(seqs / k) * w.seq_len
    mbs = _micro_batches(tokens, w.seq_len, call.n_mbs, call.max_tokens, pp, True)
    per_rank = params(Shard(m.cfg, tp, pp, 0, dtype_bytes(m.dtype)))
    one = (cm.train(tokens * w.body_share, mbs, w.seq_len, tokens * w.head_share, tp, pp, w.checkpointing)
           + comm_cost.grad_allreduce(hw, per_rank, 4, m.mesh) + cm.optimizer_step(per_rank)
           + train_reductions(hw, m.mesh))
    return (k * one + hw.train_call_overhead_s + (hw.dp_train_call_overhead_s if m.mesh.dp > 1 else 0.0)
            + (hw.pp_train_call_overhead_s if m.mesh.pp > 1 else 0.0))


def train_reductions(hw: Hardware, mesh) -> float:
    """A training call's small all-reduces over the data-parallel group beside the gradients'
    (``TRAIN_DP_REDUCTIONS``): each pays the collective's latency."""
    return TRAIN_DP_REDUCTIONS * comm_cost.allreduce(hw, SMALL_REDUCTION_BYTES, mesh.dp,
                                                     mesh.intra(mesh.dp * mesh.tp, hw))


# ---------------------------------------------------------------------------------------------------- the step


def realloc_time(hw: Hardware, plan: StepPlan, m: PlanModel) -> Tuple[float, str, Tuple[int, ...]]:
    """(seconds, "realloc" | "publish" | "", devices it occupies) of bringing mirror ``m`` its source's trained
    parameters before its call: nothing for a replica that mirrors none, or one on the same mesh as its source."""
    if m.realloc_from is None:
        return 0.0, "", ()
    src = plan.model(m.realloc_from)
    b = dtype_bytes(m.dtype)
    src_devs = tuple(range(src.mesh.first, src.mesh.first + src.mesh.world))
    if m.servers is not None:
        n = params(Shard(src.cfg, 1, 1, 0, b))
        method = "disk" if m.servers.weight_sync == "disk" else "broadcast"
        return (comm_cost.publish_weights(hw, n, b, m.servers.n, method, tensors=comm_cost.hf_tensor_count(src.cfg)),
                "publish", src_devs)
    if m.mesh == src.mesh:
        return 0.0, "", ()
    return comm_cost.realloc(hw, m.cfg, src.mesh, m.mesh, b), "realloc", src_devs


def _tokens(w: Optional[Workload]) -> float:
    if w is None:
        return 0.0
    if w.kind == "generate":
        return w.seqs * w.n * (w.seq_len + w.max_new)
    return w.seqs * w.seq_len


class _Free:
    """When each device is next free: a step function over device ids, kept as intervals (a plan's meshes are
    ranges, so a step has a handful of them however many devices it spans)."""

    def __init__(self):
        self.bounds: List[int] = [0]  # interval i is [bounds[i], bounds[i + 1]) (the last one open)
        self.vals: List[float] = [0.0]

    def _split(self, x: int) -> int:
        import bisect

        i = bisect.bisect_right(self.bounds, x) - 1
        if self.bounds[i] != x:
            self.bounds.insert(i + 1, x)
            self.vals.insert(i + 1, self.vals[i])
            i += 1
        return i

    def max_over(self, ranges: Sequence[Tuple[int, int]]) -> float:
        import bisect

        out = 0.0
        for lo, hi in ranges:
            i = bisect.bisect_right(self.bounds, lo) - 1
            while i < len(self.bounds) and self.bounds[i] < hi:
                out = max(out, self.vals[i])
                i += 1
        return out

    def raise_to(self, ranges: Sequence[Tuple[int, int]], t: float) -> None:
        for lo, hi in ranges:
            a, b = self._split(lo), self._split(hi)
            for i in range(a, b):
                self.vals[i] = max(self.vals[i], t)


def _ranges(m: PlanModel) -> Tuple[Tuple[int, int], ...]:
    own = ((m.mesh.first, m.mesh.first + m.mesh.world),)
    if m.servers is None:
        return own
    return own + ((m.servers.first, m.servers.first + m.servers.n * m.servers.tp),)


def simulate_step(plan: StepPlan, hw: Hardware, memo: Optional[dict] = None) -> StepEstimate:
    """One step of ``plan`` on devices of ``hw`` (see the module docstring for the rules; the fixed costs of a call
    and of a step are ``hw``'s). ``memo``: a dict kept between calls on the same hardware (a search's), where compute
    and reallocation times are remembered."""
    free = _Free()
    done: Dict[str, CallEstimate] = {}
    models = {m.name: m for m in plan.models}
    calls = {c.name: c for c in plan.calls}
    memo = {} if memo is None else memo
    for c in plan.calls:
        m = models[c.model]
        cm = memo.get(("cm", id(m.cfg), m.dtype))
        if cm is None:
            cm = memo[("cm", id(m.cfg), m.dtype)] = CostModel(m.cfg, hw, m.dtype)
            memo[("cfg", id(m.cfg))] = m.cfg  # keeps the id valid while the memo lives
        src = models.get(m.realloc_from) if m.realloc_from else None
        rkey = ("r", id(m.cfg), m.dtype, m.mesh, m.servers, src and src.mesh)
        if rkey not in memo:
            memo[rkey] = realloc_time(hw, plan, m)
        rs, kind, src_devs = memo[rkey]
        own, src_ranges = _ranges(m), (_ranges(src)[:1] if src_devs else ())
        ready = max((done[p].end for p, _ in c.parents), default=0.0)
        start = max(ready, free.max_over(own + src_ranges))
        xfer = 0.0
        for i, (p, bpt) in enumerate(c.parents):  # each parent's outputs, moved at once from its mesh to this one
            tokens = _tokens(c.work) or _tokens(calls[p].work)
            msgs = c.messages[i] if i < len(c.messages) else 0
            xfer = max(xfer, comm_cost.data_transfer(hw, tokens, bpt, models[calls[p].model].mesh, m.mesh, msgs))
        ckey = ("c", id(m.cfg), m.dtype, m.mesh, m.servers, c.work and dataclasses.astuple(c.work), c.n_mbs,
                c.max_tokens, c.answers)
        if ckey not in memo:
            memo[ckey] = compute_time(hw, m, c, cm)
        dkey = ("d", m.mesh, m.servers)
        if dkey not in memo:
            memo[dkey] = m.devices
        est = CallEstimate(c.name, m.name, memo[dkey], start, rs, xfer, memo[ckey], hw.call_overhead_s, kind)
        done[c.name] = est
        free.raise_to(src_ranges, start + rs)
        free.raise_to(own, est.end)
    end = max((e.end for e in done.values()), default=0.0)
    return StepEstimate(list(done.values()), end + hw.step_overhead_s, hw.name)


# ---------------------------------------------------------------------------------------------------- from a spec


def _mesh(m) -> Mesh:
    d = m.layout
    return Mesh(d.dp, d.tp, d.pp, min(m.ranks))


def plan_of(spec, cfgs: Dict[str, ReaLModelConfig], workloads: Dict[str, Workload], device: str = "cpu",
            budgets: Optional[Dict[str, Tuple[int, int]]] = None) -> StepPlan:
    """The :class:`StepPlan` of an experiment's spec (``realhf.api.core.system_api.ExperimentSpec``): ``cfgs``, each
    computing model's shape (a model without one, e.g. a rule-based reward, grades the generated answers);
    ``workloads``, each MFC's work per step; ``budgets``: (n_mbs, max_tokens_per_mb) per MFC overriding the spec's."""
    from realhf.api.core.dfg import build_graph
    from realhf.plan.fit import model_dtype

    produced = {k for f in spec.mfcs for k in f.buffer_output_keys}
    dataset_keys = {k for f in spec.mfcs for k in f.buffer_input_keys if k not in produced}
    g = build_graph(list(spec.mfcs), dataset_keys)
    served_cfg = {m.name: cfgs.get(m.realloc_from) for m in spec.models if m.gen_servers is not None}
    models = []
    for m in spec.models:
        cfg = cfgs.get(m.name) or served_cfg.get(m.name)
        if cfg is None:  # no weights (rule-based reward): a shape that computes nothing
            cfg = next(iter(cfgs.values()))
        fleet = None
        if m.gen_servers is not None:
            s = m.gen_servers
            fleet = ServerFleet(s.n_servers, s.tp, s.first_slot, s.max_num_seqs,
                                "disk" if s.param_realloc == "disk" else "memory")
        models.append(PlanModel(m.name, cfg, _mesh(m), model_dtype(m, device), m.optimizer is not None,
                                m.realloc_from, fleet))
    has_shape = set(cfgs) | {k for k, v in served_cfg.items() if v is not None}
    answers = sum(w.seqs * w.n for w in workloads.values() if w.kind == "generate")  # what a rule-based reward grades
    # the batch's samples (a prompt with its answers is one): the generation's prompts, else the largest call's rows
    samples = max((w.seqs for w in workloads.values() if w.kind == "generate"),
                  default=max((w.seqs for w in workloads.values()), default=0))
    calls = []
    for name in g.topological_order():
        f = g[name]
        parents = tuple((p, sum(key_bytes(k) for k in g.edge_keys(p, name))) for p in g.parents(name))
        messages = tuple(samples * len(g.edge_keys(p, name)) for p in g.parents(name))
        n_mbs, max_tokens = (budgets or {}).get(name, (f.mb_spec.n_mbs, f.mb_spec.max_tokens_per_mb))
        work = workloads.get(name) if str(f.model_name) in has_shape else None
        graded = answers if work is None and f.is_inference else 0
        calls.append(PlanCall(name, str(f.model_name), parents, work, n_mbs, max_tokens, graded, messages))
    return StepPlan(tuple(models), tuple(calls))
