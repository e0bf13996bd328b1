"""Execution-plan search: for each model function call (MFC) a device mesh and a dp/tp/pp layout, chosen on the step
simulator (:mod:`realhf.plan.simulate`) among the plans that fit the devices' memory (:mod:`realhf.plan.fit`).

The problem (:class:`Problem`) is the experiment's dataflow graph with each MFC's workload and each model's shape,
taken from a spec built for any valid allocation (:meth:`Problem.from_spec`). A plan gives every *placeable* MFC (one
with its own ``<mfc>.device_mesh``/``<mfc>.parallel`` options) a :class:`Placement`; an MFC without them runs on the
replica of the placeable MFC it shares a model replica with. As the experiments build them (``model_replicas``),
the MFCs of one model on one placement share a replica; the training MFC's replica holds the optimizer and the others
mirror it, their parameters reallocated before they run.

Search space, on ``n_nodes`` x ``per_node`` devices: meshes of 1, 2, 4 ... devices aligned inside a node, and runs
of whole nodes (1, 2, 4 ... and all nodes, aligned); on a mesh every layout whose tensor degree stays in a node and
divides the model (``check_layout``), whose data-parallel degree the batch can feed. An MFC whose micro-batch budget
is ``auto`` gets the budget :func:`realhf.plan.fit.budget_search` finds for its placement, as the launcher would.

Search: every *global* plan (all MFCs on all devices with one layout) is evaluated, then simulated annealing from the
best of them moves one MFC at a time (a new mesh and layout, another MFC's placement, or a new layout on its mesh),
accepting a slower plan with probability ``exp(-slowdown / T)``, ``T`` cooling geometrically; a plan that does not fit
is never accepted. Evaluations are memoised (the compute time of an MFC on a layout, a reallocation between two meshes,
a call's memory on a stage), so thousands of plans a second are evaluated on 512 devices.
"""
from __future__ import annotations

import dataclasses
import math
import random
import time
from typing import Dict, List, Optional, Sequence, Tuple

from realhf.api.core.model_api import ReaLModelConfig
from realhf.base.topology import ParallelDims
from realhf.plan import memory
from realhf.plan.comm_cost import Mesh
from realhf.plan.fit import UNBOUNDED, Workload, budget_search, call_estimate
from realhf.plan.hardware import Hardware
from realhf.plan.memory import Shard, dtype_bytes
from realhf.plan.simulate import PlanCall, PlanModel, StepEstimate, StepPlan, simulate_step


class SearchError(ValueError):
    """No plan can run: the message says why (exit 2 in the command line tools)."""


@dataclasses.dataclass(frozen=True)
class Placement:
    """An MFC's devices ``first`` ... ``first + dp*tp*pp - 1`` and its layout on them."""

    first: int
    dp: int
    tp: int
    pp: int

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def mesh(self) -> Mesh:
        return Mesh(self.dp, self.tp, self.pp, self.first)

    @property
    def layout(self) -> str:
        return str(ParallelDims(self.dp, self.tp, self.pp))

    def stage(self, device: int) -> int:
        return (device - self.first) // (self.dp * self.tp)

    def device_mesh(self, per_node: int) -> str:
        """The ``<mfc>.device_mesh`` option of this placement (``node01:0-3``, ``node01;node02``)."""
        lo, hi = self.first, self.first + self.world - 1
        if lo // per_node == hi // per_node:
            a, b = lo % per_node, hi % per_node
            return f"node{lo // per_node + 1:02d}:" + (f"{a}" if a == b else f"{a}-{b}")
        return ";".join(f"node{n + 1:02d}" for n in range(lo // per_node, hi // per_node + 1))

    def __str__(self) -> str:
        return f"{self.layout}@{self.first}-{self.first + self.world - 1}"


@dataclasses.dataclass(frozen=True)
class Role:
    """A model of the experiment (``actor``, ``ref``, ``critic``, ``reward``): its shape and how its replicas hold
    it."""

    name: str
    cfg: ReaLModelConfig
    dtype: str
    trains: bool
    offload: bool
    has_weights: bool


@dataclasses.dataclass(frozen=True)
class Call:
    """An MFC: its role, whether it trains, its parents with the bytes per token each edge moves, its workload (None:
    no model computation), its micro-batches (``max_tokens`` None: ``auto``), and the placeable MFC it follows (None:
    it is placeable itself)."""

    name: str
    role: str
    trains: bool
    parents: Tuple[Tuple[str, float], ...]
    work: Optional[Workload]
    n_mbs: int
    max_tokens: Optional[int]
    follows: Optional[str] = None
    answers: int = 0  # a weightless call's answers to grade (simulate.PlanCall)
    messages: Tuple[int, ...] = ()  # per parent: the messages its outputs take


@dataclasses.dataclass
class Problem:
    roles: Dict[str, Role]
    calls: Tuple[Call, ...]  # in the DFG's topological order
    n_nodes: int
    per_node: int
    hw: Hardware
    capacity: Optional[float]  # bytes a device's tensors may take (None: unknown, every plan fits)
    sections: Tuple[str, ...] = ()  # the MFCs with placement options (``<mfc>.device_mesh``, ``<mfc>.parallel``)

    @property
    def n_devices(self) -> int:
        return self.n_nodes * self.per_node

    def call(self, name: str) -> Call:
        return next(c for c in self.calls if c.name == name)

    @property
    def placeable(self) -> List[str]:
        return [c.name for c in self.calls if c.follows is None]

    @classmethod
    def from_spec(cls, spec, cfgs: Dict[str, ReaLModelConfig], workloads: Dict[str, Workload], hw: Hardware,
                  capacity: Optional[float], n_nodes: int, per_node: int, placeable: Sequence[str],
                  auto: Sequence[str] = (), ties: Optional[Dict[str, str]] = None) -> "Problem":
        """The problem of an experiment's spec (built for any allocation): ``placeable``, the MFCs with placement
        options; ``auto``, the MFCs whose budget is ``max_tokens_per_mb=auto``; ``ties``, MFCs the experiment
        requires on another's placement ({MFC: the MFC it must share a replica with})."""
        ties = dict(ties or {})
        from realhf.plan.fit import model_dtype
        from realhf.plan.simulate import plan_of

        if spec.served() is not None:
            raise SearchError("the search plans MFCs on the model workers' devices; a run with generation servers "
                              "(an allocation with '<backend>.') is planned by `python -m realhf.apps.plan "
                              "async-ppo-math ... --cluster` with `--search`, which chooses the servers' share")
        device = "cuda" if hw.device == "cuda" else "cpu"
        sp = plan_of(spec, cfgs, workloads, device)
        models = {m.name: m for m in spec.models}
        roles: Dict[str, Role] = {}
        for m in spec.models:
            role = m.name.split("@")[0]
            r = roles.get(role)
            cfg = cfgs.get(m.name) or (r.cfg if r else None) or next(iter(cfgs.values()))
            trains = m.optimizer is not None or (r is not None and r.trains)
            offload = bool(m.offload) or (r is not None and r.offload)
            roles[role] = Role(role, cfg, model_dtype(m, device), trains, offload, bool(m.path))
        replica_of = {f.name: str(f.model_name) for f in spec.mfcs}
        mfc = {f.name: f for f in spec.mfcs}
        trains = {c.name: (str(mfc[c.name].interface_type).split(".")[-1].lower() == "train_step"
                           and models[c.model].optimizer is not None) for c in sp.calls}
        lead = {}  # replica -> the placeable MFC that places it (its training MFC, if any: the others mirror it)
        for c in sorted(sp.calls, key=lambda c: not trains[c.name]):
            if c.name in placeable:
                lead.setdefault(replica_of[c.name], c.name)
        weighty = [c.name for c in sp.calls if c.name in placeable and roles[c.model.split("@")[0]].has_weights]
        calls = []
        for c in sp.calls:
            follows = ties.get(c.name) if c.name in placeable else lead.get(replica_of[c.name])
            if c.name in placeable and not roles[c.model.split("@")[0]].has_weights:
                # computes nothing on the devices (a rule-based reward): where its first parent runs, moving nothing
                follows = next((p for p, _ in c.parents if p in weighty), weighty[0] if weighty else None)
            if c.name not in placeable and follows is None:
                raise SearchError(f"MFC {c.name!r} has no placement options and shares no model replica with an MFC "
                                  "that has them: this experiment cannot be searched")
            calls.append(Call(c.name, c.model.split("@")[0], trains[c.name], c.parents, c.work, c.n_mbs,
                              None if c.name in auto else c.max_tokens, follows, c.answers, c.messages))
        return cls(roles, tuple(calls), n_nodes, per_node, hw, capacity, tuple(n for n in placeable if n in replica_of))


# ---------------------------------------------------------------------------------------------------- the space


def mesh_choices(n_nodes: int, per_node: int) -> List[Tuple[int, int]]:
    """(first device, size) of every mesh: aligned powers of two inside a node, aligned runs of whole nodes."""
    out = []
    size = 1
    while size < per_node:
        if per_node % size == 0:
            out += [(n * per_node + k, size) for n in range(n_nodes) for k in range(0, per_node, size)]
        size *= 2
    k, counts = 1, set()
    while k <= n_nodes:
        counts.add(k)
        k *= 2
    counts.add(n_nodes)
    for k in sorted(counts):
        out += [(s * per_node, k * per_node) for s in range(0, n_nodes - k + 1, k)]
    return out


def layouts(size: int, cfg: ReaLModelConfig, work: Optional[Workload], per_node: int) -> List[Tuple[int, int, int]]:
    """(dp, tp, pp) of every layout of ``size`` devices: tensor parallelism inside a node, every degree dividing
    ``cfg`` (``check_layout``), data parallelism no larger than ``work``'s batch feeds."""
    out = []
    for tp in range(1, min(size, per_node) + 1):
        if size % tp:
            continue
        for pp in range(1, size // tp + 1):
            if (size // tp) % pp:
                continue
            dp = size // tp // pp
            if not cfg.fits_layout(tp, pp):
                continue
            if work is not None:
                feed = work.seqs // max(1, work.minibatches) if work.kind == "train" else work.seqs
                if dp > max(1, feed):
                    continue
            out.append((dp, tp, pp))
    return out


# ---------------------------------------------------------------------------------------------------- evaluation


@dataclasses.dataclass
class Evaluated:
    """A plan: every MFC's placement (followers included) and budget, its estimate (None: it does not fit, ``why``)."""

    placements: Dict[str, Placement]
    budgets: Dict[str, Tuple[int, int]]
    estimate: Optional[StepEstimate]
    why: str = ""

    @property
    def step_s(self) -> float:
        return self.estimate.step_s if self.estimate is not None else math.inf

    @property
    def fits(self) -> bool:
        return self.estimate is not None

    def overrides(self, sections: Sequence[str], per_node: int, budgets: Sequence[str] = ()) -> Dict[str, object]:
        """The options that run this plan: ``allocation_mode=manual``, each MFC's mesh and layout, and the
        micro-batches of the MFCs in ``budgets``."""
        out: Dict[str, object] = {"allocation_mode": "manual"}
        for k in sections:
            out[f"{k}.device_mesh"] = self.placements[k].device_mesh(per_node)
            out[f"{k}.parallel"] = self.placements[k].layout
        for k in budgets:
            out[f"{k}.mb_spec.n_mbs"], out[f"{k}.mb_spec.max_tokens_per_mb"] = self.budgets[k]
        return out

    def key(self) -> Tuple:
        return tuple(sorted((k, str(v)) for k, v in self.placements.items()))

    def describe(self) -> str:
        return ", ".join(f"{k}:{v}" for k, v in self.placements.items())


@dataclasses.dataclass(frozen=True)
class ModelView:
    """What :func:`realhf.plan.fit.call_estimate` reads of a model spec: its layout, the replica it mirrors, offload."""

    layout: Placement
    realloc_from: Optional[str]
    offload: bool


class Evaluator:
    """Estimates plans of one problem, memoised."""

    def __init__(self, problem: Problem):
        self.p = problem
        self.memo: Dict = {}
        self._held: Dict = {}
        self._call: Dict = {}
        self.n_evals = 0

    def full(self, assign: Dict[str, Placement]) -> Dict[str, Placement]:
        """``assign`` (the placeable MFCs) with every follower placed."""
        out = {}
        for c in self.p.calls:
            out[c.name] = assign[c.name] if c.follows is None else assign[c.follows]
        return out

    def replicas(self, placed: Dict[str, Placement]) -> Tuple[Dict[str, str], Dict[str, Tuple[str, Placement]]]:
        """({MFC: replica}, {replica: (role, placement)}), named as the experiments name them."""
        of_mfc, reps = {}, {}
        by_role: Dict[str, Dict[Placement, str]] = {}
        order = sorted(self.p.calls, key=lambda c: not c.trains)  # a role's training MFC names its replica
        for c in order:
            pl = placed[c.name]
            seen = by_role.setdefault(c.role, {})
            if pl not in seen:
                seen[pl] = c.role if not seen else f"{c.role}@{len(seen)}"
                reps[seen[pl]] = (c.role, pl)
            of_mfc[c.name] = seen[pl]
        return of_mfc, reps

    def step_plan(self, placed: Dict[str, Placement], budgets: Dict[str, Tuple[int, int]]) -> StepPlan:
        of_mfc, reps = self.replicas(placed)
        models = []
        for name, (role, pl) in reps.items():
            r = self.p.roles[role]
            trained = r.trains and name == role
            models.append(PlanModel(name, r.cfg, pl.mesh, r.dtype, trained,
                                    role if r.trains and not trained else None))
        calls = []
        for c in self.p.calls:
            n_mbs, mt = budgets[c.name]
            work = c.work if self.p.roles[c.role].has_weights else None
            calls.append(PlanCall(c.name, of_mfc[c.name], c.parents, work, n_mbs, mt, c.answers, c.messages))
        return StepPlan(tuple(models), tuple(calls))

    # ------------------------------------------------------------------------------------------------ memory

    def _held_total(self, role: Role, pl: Placement, stage: int, trained: bool) -> float:
        key = (role.name, pl.tp, pl.pp, stage, trained)
        v = self._held.get(key)
        if v is None:
            s = Shard(role.cfg, pl.tp, pl.pp, stage, dtype_bytes(role.dtype))
            v = self._held[key] = memory.replica_state(s, trained, role.offload and not trained).total
        return v

    def _call_total(self, c: Call, pl: Placement, stage: int, src: Optional[Placement], src_stage: Optional[int],
                    budget: Tuple[int, int]) -> float:
        key = (c.name, pl.dp, pl.tp, pl.pp, stage, src and (src.dp, src.tp, src.pp), src_stage, budget)
        v = self._call.get(key)
        if v is None:
            r = self.p.roles[c.role]
            b = dtype_bytes(r.dtype)
            s = Shard(r.cfg, pl.tp, pl.pp, stage, b)
            ss = Shard(r.cfg, src.tp, src.pp, src_stage, b) if src is not None and src_stage is not None else None
            view = ModelView(pl, r.name if src is not None else None, r.offload and not (r.trains and src is None))
            v = self._call[key] = call_estimate(view, s, c.work, budget[0], budget[1], ss).total
        return v

    def fit(self, placed: Dict[str, Placement]) -> Tuple[Optional[Dict[str, Tuple[int, int]]], str]:
        """(each MFC's budget, "") when the plan fits every device, else (None, why). Devices are taken in segments
        on which every replica's stage is the same (the meshes' and stages' bounds cut them)."""
        cap = self.p.capacity
        of_mfc, reps = self.replicas(placed)
        held_reps = [(name, role, pl) for name, (role, pl) in reps.items() if self.p.roles[role].has_weights]
        cuts = set()
        for _, _, pl in held_reps:
            step = pl.dp * pl.tp
            cuts.update(range(pl.first, pl.first + pl.world + 1, step))
        cuts = sorted(cuts)
        segs = list(zip(cuts, cuts[1:]))  # [lo, hi): every replica's stage is constant on each
        held = []
        for lo, hi in segs:
            h = 0.0
            for name, role, pl in held_reps:
                if pl.first <= lo < pl.first + pl.world:
                    r = self.p.roles[role]
                    h += self._held_total(r, pl, pl.stage(lo), r.trains and name == role)
            held.append(h)
        budgets: Dict[str, Tuple[int, int]] = {}
        for c in self.p.calls:
            r = self.p.roles[c.role]
            if c.work is None or not r.has_weights:
                budgets[c.name] = (c.n_mbs, UNBOUNDED if c.max_tokens is None else c.max_tokens)
                continue
            pl = placed[c.name]
            rep = of_mfc[c.name]
            src = reps[c.role][1] if r.trains and rep != c.role and c.role in reps else None
            worst: Dict[Tuple[int, Optional[int]], float] = {}
            for (lo, hi), h in zip(segs, held):
                if not pl.first <= lo < pl.first + pl.world:
                    continue
                k = (pl.stage(lo), src.stage(lo) if src is not None and src.first <= lo < src.first + src.world
                     else None)
                worst[k] = max(worst.get(k, 0.0), h)

            def fits(budget, c=c, pl=pl, src=src, worst=worst):
                return cap is None or all(h + self._call_total(c, pl, st, src, ss, budget) <= cap
                                          for (st, ss), h in worst.items())

            if cap is not None and max(worst.values()) > cap:
                return None, f"{rep} ({pl}) holds more than a device's memory between calls"
            budget = ((c.n_mbs, c.max_tokens) if c.max_tokens is not None
                      else budget_search(c.work, pl.dp, c.n_mbs, fits))
            if not fits(budget):
                return None, f"{c.name} does not fit on {pl} with micro-batches {budget}"
            budgets[c.name] = budget
        return budgets, ""

    def evaluate(self, assign: Dict[str, Placement]) -> Evaluated:
        self.n_evals += 1
        placed = self.full(assign)
        budgets, why = self.fit(placed)
        if budgets is None:
            return Evaluated(placed, {}, None, why)
        return Evaluated(placed, budgets, simulate_step(self.step_plan(placed, budgets), self.p.hw, memo=self.memo))


# ---------------------------------------------------------------------------------------------------- the search


@dataclasses.dataclass
class SearchResult:
    best: Evaluated
    runners_up: List[Evaluated]
    best_global: Optional[Evaluated]
    heuristic: Optional[Evaluated]
    n_evals: int
    seconds: float
    sections: Tuple[str, ...] = ()
    per_node: int = 1
    # the config's own allocation, where it gives one: (the allocation, its step estimate or None, why not)
    given: Optional[Tuple[str, Optional[float], str]] = None

    def as_dict(self) -> Dict:
        def one(e: Optional[Evaluated]):
            if e is None:
                return None
            return dict(step_s=e.step_s if e.fits else None, why=e.why or None,
                        placements={k: str(v) for k, v in e.placements.items()})

        given = None if self.given is None else dict(allocation_mode=self.given[0], step_s=self.given[1],
                                                     why=self.given[2] or None)
        return dict(chosen=one(self.best), runners_up=[one(e) for e in self.runners_up],
                    best_global=one(self.best_global), heuristic=one(self.heuristic), config=given,
                    n_evals=self.n_evals, seconds=self.seconds)

    def table(self) -> str:
        lines = [f"# plan search: {self.n_evals} plans evaluated in {self.seconds:.1f} s",
                 f"# {'plan':<10} {'step s':>10}  placements (MFC:layout@devices)"]
        rows = [("chosen", self.best)] + [("runner-up", e) for e in self.runners_up]
        if self.best_global is not None:
            rows.append(("global", self.best_global))
        if self.heuristic is not None:
            rows.append(("heuristic", self.heuristic))
        for label, e in rows:
            t = f"{e.step_s:>10.4g}" if e.fits else f"{'no fit':>10}"
            lines.append(f"# {label:<10} {t}  {e.describe()}" + ("" if e.fits else f"  ({e.why})"))
        if self.given is not None:
            label, step_s, why = self.given
            lines.append(f"# {'config':<10} " + (f"{step_s:>10.4g}  allocation_mode={label}" if step_s is not None
                                                  else f"{'no fit':>10}  allocation_mode={label}  ({why})"))
        base = [e for e in (self.heuristic, self.best_global) if e is not None and e.fits]
        for label, e in (("heuristic", self.heuristic), ("global", self.best_global)):
            if e is not None and e.fits:
                lines.append(f"# predicted speed-up over the {label} plan: {e.step_s / self.best.step_s:.2f}x")
        if self.given is not None and self.given[1] is not None:
            lines.append(f"# predicted speed-up over the config's allocation: {self.given[1] / self.best.step_s:.2f}x")
        if not base:
            lines.append("# neither the heuristic nor any global layout fits")
        return "\n".join(lines)


def _global_plans(problem: Problem) -> List[Dict[str, Placement]]:
    n = problem.n_devices
    names = problem.placeable
    common = None  # the layouts of all n devices every MFC can take
    for name in names:
        c = problem.call(name)
        ls = set(layouts(n, problem.roles[c.role].cfg, c.work, problem.per_node))
        common = ls if common is None else common & ls
    return [{k: Placement(0, *l) for k in names} for l in sorted(common or ())]


def _choices(problem: Problem) -> Dict[str, Dict[int, List[Tuple[int, Tuple[int, int, int]]]]]:
    """Per placeable MFC: {mesh size: [(first, layout)...]}."""
    meshes = mesh_choices(problem.n_nodes, problem.per_node)
    out = {}
    for name in problem.placeable:
        c = problem.call(name)
        by_size: Dict[int, List] = {}
        lay_of: Dict[int, List] = {}
        for first, size in meshes:
            if size not in lay_of:
                lay_of[size] = layouts(size, problem.roles[c.role].cfg, c.work, problem.per_node)
            if lay_of[size]:
                by_size.setdefault(size, []).append((first, lay_of[size]))
        out[name] = by_size
    return out


def search(problem: Problem, seed: int = 0, time_limit_s: float = 10.0, max_evals: int = 20000,
           top: int = 3, heuristic: Optional[Dict[str, Placement]] = None) -> SearchResult:
    """The fastest plan found (see the module docstring); :class:`SearchError` when no plan fits."""
    t0 = time.monotonic()
    ev = Evaluator(problem)
    rng = random.Random(seed)
    seen: Dict[Tuple, Evaluated] = {}

    def evaluate(assign):
        e = ev.evaluate(assign)
        seen.setdefault(e.key(), e)
        return e

    glob = [evaluate(a) for a in _global_plans(problem)]
    best_global = min(glob, key=lambda e: e.step_s) if glob else None
    heur = evaluate(heuristic) if heuristic is not None else None
    choices = _choices(problem)
    names = problem.placeable
    lay_cache: Dict[Tuple[str, int], List[Tuple[int, int, int]]] = {}

    def lays_of(k: str, size: int) -> List[Tuple[int, int, int]]:  # MFC k's layouts on a mesh of ``size`` devices
        if (k, size) not in lay_cache:
            c = problem.call(k)
            lay_cache[(k, size)] = layouts(size, problem.roles[c.role].cfg, c.work, problem.per_node)
        return lay_cache[(k, size)]

    def random_assign():
        out = {}
        for k in names:
            size = rng.choice(sorted(choices[k]))
            first, lays = rng.choice(choices[k][size])
            out[k] = Placement(first, *rng.choice(lays))
        return out

    cur = best_global if best_global is not None and best_global.fits else None
    tries = 0
    while cur is None and tries < 2000 and time.monotonic() - t0 < time_limit_s:
        tries += 1
        e = evaluate(random_assign())
        cur = e if e.fits else None
    if cur is None:
        why = (best_global.why if best_global is not None else "no layout divides the model on these devices")
        raise SearchError(f"no plan fits on {problem.n_devices} devices ({problem.hw.name}) within their memory: "
                          f"e.g. {why}. To fit: activation checkpointing (<model>.gradient_checkpointing=true), "
                          "more devices, or shorter sequences (dataset.max_prompt_len, the new tokens' limit)")
    best = cur
    temp0 = 0.05 * cur.step_s
    iters = max(1, max_evals - ev.n_evals)
    for i in range(iters):
        if time.monotonic() - t0 > time_limit_s:
            break
        temp = temp0 * (0.001 ** (i / iters))
        assign = {k: cur.placements[k] for k in names}
        k = rng.choice(names)
        move = rng.random()
        if move < 0.6 or len(names) == 1:
            size = rng.choice(sorted(choices[k]))
            first, lays = rng.choice(choices[k][size])
            assign[k] = Placement(first, *rng.choice(lays))
        elif move < 0.8:
            other = rng.choice([n for n in names if n != k])
            pl = assign[other]
            if (pl.dp, pl.tp, pl.pp) not in lays_of(k, pl.world):
                continue
            assign[k] = pl
        else:
            pl = assign[k]
            assign[k] = Placement(pl.first, *rng.choice(lays_of(k, pl.world)))
        e = evaluate(assign)
        if not e.fits:
            continue
        if e.step_s <= cur.step_s or rng.random() < math.exp(-(e.step_s - cur.step_s) / max(temp, 1e-12)):
            cur = e
            if e.step_s < best.step_s:
                best = e
    ranked = sorted((e for e in seen.values() if e.fits), key=lambda e: e.step_s)
    runners = [e for e in ranked if e.key() != best.key()][:max(0, top - 1)]
    return SearchResult(best, runners, best_global, heur, ev.n_evals, time.monotonic() - t0, problem.sections,
                        problem.per_node)
