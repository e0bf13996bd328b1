"""Asynchronous RL's plan: how many GPUs serve generation (in servers of how many GPUs) and how the rest train,
chosen on the steady-state model (:mod:`realhf.plan.async_sim`) under the run's staleness bound ``eta``.

Candidates: every split of the devices (on more than two nodes, in half-node steps) into a generation fleet and a
trainer; servers of 1, 2, 4 or 8 GPUs (tensor parallel inside a node, dividing the model); every trainer layout that
divides the model and its batch. A candidate must fit: a server keeps at least one answer in flight at full length
(its parameters, the key/value cache), the trainer's replica and its training micro-batch fit a device, the budget
(``max_tokens_per_mb``) the largest that does (:func:`realhf.plan.fit.budget_search`).

Two stages, so that 512 GPUs take seconds: every candidate is ranked by a batch's generation time (the fleet streaming
a mean batch at full rows) against its training time (the trainer over the same batch, weights published), the step
``max`` of the two when ``eta >= 1`` and their sum when ``eta = 0``; the best ``refine`` of them are then run through
the steady-state model, which picks the plan. Its throughput at other bounds is reported beside it.
"""
from __future__ import annotations

import dataclasses
import random
from typing import Dict, List, Optional, Sequence, Tuple

from realhf.base.topology import ParallelDims
from realhf.plan import memory
from realhf.plan.async_sim import AsyncSetting, SteadyState, _Fleet, _lengths, _train_time, steady_state
from realhf.plan.fit import UNBOUNDED, Workload, budget_search, call_estimate, shared_body_share
from realhf.plan.hardware import Hardware
from realhf.plan.memory import Shard, dtype_bytes
from realhf.plan.search import Placement, ModelView, layouts


@dataclasses.dataclass
class AsyncCandidate:
    setting: AsyncSetting
    rank_s: float  # the first stage's estimate of a batch's time
    state: Optional[SteadyState] = None  # the steady state under the run's eta (refined candidates)

    def allocation(self, backend: str) -> str:
        """The allocation string of this plan: servers first in the string, trainer after ``+``."""
        s = self.setting
        t = s.train_mesh
        return f"{backend}.{ParallelDims(s.servers, s.gen_tp, 1)}+{ParallelDims(t.dp, t.tp, t.pp)}"

    def describe(self) -> str:
        s, t = self.setting, self.setting.train_mesh
        trainer = ParallelDims(t.dp, t.tp, t.pp)
        return (f"{s.servers} server(s) x {s.gen_tp} GPU(s) | trainer {trainer} on {s.train_gpus} GPU(s)"
                + (f", micro-batches of <= {s.train_max_tokens} tokens" if s.train_max_tokens < UNBOUNDED else ""))


@dataclasses.dataclass
class AsyncSearchResult:
    eta: int
    best: AsyncCandidate
    runners_up: List[AsyncCandidate]
    by_eta: Dict[int, SteadyState]  # the chosen plan's steady state at each reported bound
    n_candidates: int
    given: Optional[Tuple[str, Optional[float]]] = None  # the config's own split: (allocation, tokens/s or None)

    def table(self, backend: str = "gen") -> str:
        lines = [f"# asynchronous plan search (eta = {self.eta}): {self.n_candidates} fitting plans ranked, "
                 f"{1 + len(self.runners_up)} refined", f"# {'plan':<10} {'tokens/s':>10}  {'allocation':<28} layout"]
        for label, c in [("chosen", self.best)] + [("runner-up", c) for c in self.runners_up]:
            tps = f"{c.state.tokens_per_s:>10.0f}" if c.state is not None else f"{'':>10}"
            lines.append(f"# {label:<10} {tps}  {c.allocation(backend):<28} {c.describe()}")
        if self.given is not None:
            alloc, tps = self.given
            lines.append(f"# {'config':<10} " + (f"{tps:>10.0f}  {alloc}" if tps is not None else
                                                  f"{'no fit':>10}  {alloc}"))
            if tps:
                lines.append(f"# predicted speed-up over the config's split: "
                             f"{self.best.state.tokens_per_s / tps:.2f}x")
        lines.append(f"# {'eta':>4} {'tokens/s':>10} {'trainer idle':>12} {'gen idle':>9} {'staleness':>9}"
                     "  (the chosen plan under each staleness bound)")
        for eta, r in sorted(self.by_eta.items()):
            lines.append(f"# {eta:>4} {r.tokens_per_s:>10.0f} {r.trainer_idle:>12.2f} {r.generation_idle:>9.2f} "
                         f"{r.mean_staleness:>9.2f}")
        return "\n".join(lines)

    def as_dict(self, backend: str = "gen") -> Dict:
        def one(c: AsyncCandidate):
            return dict(allocation=c.allocation(backend), tokens_per_s=c.state.tokens_per_s if c.state else None,
                        train_max_tokens=c.setting.train_max_tokens)

        return dict(eta=self.eta, chosen=one(self.best), runners_up=[one(c) for c in self.runners_up],
                    by_eta={str(k): dataclasses.asdict(v) for k, v in self.by_eta.items()},
                    n_candidates=self.n_candidates,
                    config=None if self.given is None else dict(allocation=self.given[0], tokens_per_s=self.given[1]))


def splits(n_devices: int, per_node: int) -> List[int]:
    """Generation GPU counts to try: every one on up to two nodes, half-node steps beyond."""
    step = 1 if n_devices <= 2 * per_node else max(1, per_node // 2)
    return list(range(step, n_devices, step))


def _tp_choices(s: AsyncSetting, size: int, per_node: int) -> List[int]:
    out = []
    for tp in (1, 2, 4, 8):
        if tp > per_node or size % tp or not s.cfg.fits_layout(tp, 1):
            continue
        out.append(tp)
    return out


def _train_work(s: AsyncSetting) -> Workload:
    """A batch's training at full length (the memory bound)."""
    seq = s.prompt_len + s.max_new
    return Workload("train", s.prompts * s.n, seq, 1.0 - s.prompt_len / seq,
                    shared_body_share(s.prompt_len, s.max_new, s.n), minibatches=s.minibatches,
                    checkpointing=True)


def _trainer_layouts(s: AsyncSetting, size: int, per_node: int) -> List[Tuple[int, int]]:
    """(tp, pp) of the trainer's layouts on ``size`` GPUs, tensor parallel degrees of 1, 2, 4 or 8."""
    return [(tp, pp) for _, tp, pp in layouts(size, s.cfg, _train_work(s), per_node) if tp in (1, 2, 4, 8)]


def _trainer_budget(s: AsyncSetting, tp: int, pp: int, dp: int, cap: Optional[float]) -> Optional[int]:
    """The trainer's ``max_tokens_per_mb`` (``auto``'s choice) on its layout, None when its replica does not fit."""
    work = _train_work(s)
    if cap is None:
        return UNBOUNDED
    b = dtype_bytes(s.dtype)
    stages = {0, pp - 1}
    held = {st: memory.replica_state(Shard(s.cfg, tp, pp, st, b), True).total for st in stages}
    if max(held.values()) > cap:
        return None
    view = ModelView(Placement(0, dp, tp, pp), None, False)

    def fits(budget):
        return all(held[st] + call_estimate(view, Shard(s.cfg, tp, pp, st, b), work, budget[0], budget[1]).total
                   <= cap for st in stages)

    budget = budget_search(work, dp, 1, fits)
    return budget[1] if fits(budget) else None


def search_async(base: AsyncSetting, hw: Hardware, n_devices: int, per_node: int, eta: int,
                 capacity: Optional[float], etas: Sequence[int] = (0, 1, 2, 4, 8, 16), refine: int = 6,
                 seed: int = 1) -> AsyncSearchResult:
    """The plan of the module docstring for ``base`` (its model, batch and lengths; its split ignored) on
    ``n_devices`` devices of ``hw``. ValueError when no split fits."""
    if n_devices < 2:
        raise ValueError(f"asynchronous RL needs at least 2 devices (servers and trainer), got {n_devices}")
    lengths = sorted(_lengths(base, random.Random(seed)))
    mean_batch = [int(round(sum(lengths) / len(lengths)))] * len(lengths)
    cands: List[AsyncCandidate] = []
    gen_cache: Dict[Tuple[int, int], Optional[float]] = {}
    train_cache: Dict[Tuple[int, int, int, int], Optional[Tuple[float, int]]] = {}
    for g in splits(n_devices, per_node):
        rest = n_devices - g
        for gtp in _tp_choices(base, g, per_node):
            if (g, gtp) not in gen_cache:
                s = dataclasses.replace(base, gen_gpus=g, gen_tp=gtp, train_gpus=rest)
                fleet = _Fleet(s, hw)
                one = Shard(s.cfg, gtp, 1, 0, dtype_bytes(s.dtype))
                ok = capacity is None or memory.params(one) * one.bytes < capacity and fleet.rows >= 1
                gen_cache[(g, gtp)] = fleet.streamed(mean_batch, (max(1, eta) + 1) * len(lengths)) if ok else None
            gen_s = gen_cache[(g, gtp)]
            if gen_s is None:
                continue
            for tp, pp in _trainer_layouts(base, rest, per_node):
                dp = rest // (tp * pp)
                key = (rest, tp, pp, g // gtp)
                if key not in train_cache:
                    mt = _trainer_budget(base, tp, pp, dp, capacity)
                    if mt is None:
                        train_cache[key] = None
                    else:
                        s = dataclasses.replace(base, gen_gpus=g, gen_tp=gtp, train_gpus=rest, train_tp=tp,
                                                train_pp=pp, train_max_tokens=mt)
                        train_cache[key] = (_train_time(s, hw, mean_batch), mt)
                tr = train_cache[key]
                if tr is None:
                    continue
                s = dataclasses.replace(base, gen_gpus=g, gen_tp=gtp, train_gpus=rest, train_tp=tp, train_pp=pp,
                                        train_max_tokens=tr[1])
                cands.append(AsyncCandidate(s, max(gen_s, tr[0]) if eta >= 1 else gen_s + tr[0]))
    if not cands:
        raise ValueError(f"no split of {n_devices} devices ({hw.name}) between generation servers and a trainer "
                         "fits their memory: more devices, activation checkpointing, or shorter answers")
    cands.sort(key=lambda c: c.rank_s)
    top = cands[:max(1, refine)]
    for c in top:
        c.state = steady_state(c.setting, hw, eta, batches=24, warmup=6, seed=seed)
    top.sort(key=lambda c: -c.state.tokens_per_s)
    best = top[0]
    by_eta = {e: steady_state(best.setting, hw, e, batches=24, warmup=6, seed=seed) for e in sorted(set(etas) | {eta})}
    return AsyncSearchResult(eta, best, top[1:3], by_eta, len(cands))


def given_split(base: AsyncSetting, hw: Hardware, eta: int, gen_gpus: int, gen_tp: int, train: Tuple[int, int, int],
                capacity: Optional[float], seed: int = 1) -> Optional[float]:
    """Tokens per second of a split given by hand (``train``: the trainer's dp, tp, pp), None when it does not fit."""
    dp, tp, pp = train
    mt = _trainer_budget(base, tp, pp, dp, capacity)
    one = Shard(base.cfg, gen_tp, 1, 0, dtype_bytes(base.dtype))
    if mt is None or (capacity is not None and memory.params(one) * one.bytes >= capacity):
        return None
    s = dataclasses.replace(base, gen_gpus=gen_gpus, gen_tp=gen_tp, train_gpus=dp * tp * pp, train_tp=tp, train_pp=pp,
                            train_max_tokens=mt)
    return steady_state(s, hw, eta, batches=24, warmup=6, seed=seed).tokens_per_s


def setting_of(cfg, shape, mean_new: Optional[float] = None, dtype: str = "bfloat16") -> AsyncSetting:
    """The :class:`AsyncSetting` of an ``async-ppo-math`` config (its split left to the search): the actor's shape,
    ``dataset.train_bs_n_seqs`` prompts x ``group_size`` answers of up to ``dataset.max_prompt_len`` +
    ``ppo.gen.max_new_tokens`` tokens, ``mean_new`` new tokens on average (default: half the limit), the config's
    rollout workers."""
    A = cfg.ppo.gen.max_new_tokens
    return AsyncSetting(shape, 1, 1, prompts=cfg.dataset.train_bs_n_seqs, n=cfg.group_size,
                        prompt_len=cfg.dataset.max_prompt_len, max_new=A,
                        mean_new=float(mean_new) if mean_new else max(1.0, A / 2),
                        minibatches=cfg.ppo.ppo_n_minibatches,
                        recompute_logprobs=cfg.async_rl.prox_logp == "recompute", dtype=dtype,
                        weight_sync="disk" if getattr(cfg, "param_realloc", "disk") == "disk" else "memory",
                        rollout_workers=cfg.async_rl.n_rollout_workers)

