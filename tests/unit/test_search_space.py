"""The execution-plan search (realhf.plan.search) on hand-made problems over tabled GPUs: its plans fit every device
(checked device by device, independently of the search's own segment-wise check), it is never slower than the best
global layout or the heuristic's, it finds the optimum of a space small enough to enumerate, it refuses a problem
where nothing fits with the reason, and it writes placements that the allocation grammar reads back."""
import dataclasses
import itertools

import pytest

from realhf.api.quickstart.allocation import parse_device_mesh
from realhf.plan import memory
from realhf.plan.fit import UNBOUNDED, Workload, call_estimate
from realhf.plan.hardware import get
from realhf.plan.memory import GiB, Shard, dtype_bytes
from realhf.plan.search import (Call, Evaluator, Placement, Problem, Role, SearchError, _choices, mesh_choices,
                                search)
from realhf.plan.shapes import model_config

QWEN15 = model_config("qwen2.5-1.5b")
QWEN7 = model_config("qwen2.5-7b")


def _problem(cfg, n_nodes, per_node, capacity_gib=None, ref=True, prompts=64, max_new=1024):
    roles = {"actor": Role("actor", cfg, "bfloat16", True, False, True),
             "ref": Role("ref", cfg, "bfloat16", False, False, True),
             "reward": Role("reward", cfg, "bfloat16", False, False, False)}
    seqs, L = prompts * 8, 512 + max_new
    calls = [Call("actor_gen", "actor", False, (), Workload("generate", prompts, 512, n=8, max_new=max_new), 1, None),
             Call("rew_inf", "reward", False, (("actor_gen", 8.0),), None, 1, UNBOUNDED, follows="actor_gen")]
    if ref:
        calls.append(Call("ref_inf", "ref", False, (("actor_gen", 9.0),), Workload("inference", seqs, L, 0.66), 1,
                          None))
    calls.append(Call("actor_train", "actor", True, (("actor_gen", 13.0),) + ((("ref_inf", 4.0),) if ref else ()),
                      Workload("train", seqs, L, 0.66, minibatches=4, checkpointing=True), 1, None))
    if not ref:
        del roles["ref"]
    hw = dataclasses.replace(get("h800"), devices_per_node=per_node)
    cap = None if capacity_gib is None else capacity_gib * GiB
    return Problem(roles, tuple(calls), n_nodes, per_node, hw, cap,
                   tuple(c.name for c in calls))


def _device_by_device(problem: Problem, ev: Evaluator, e) -> float:
    """The fullest device's estimate of plan ``e``, summed device by device from the memory model's parts."""
    of_mfc, reps = ev.replicas(e.placements)
    held = {}
    for name, (role, pl) in reps.items():
        r = problem.roles[role]
        if not r.has_weights:
            continue
        for d in range(pl.first, pl.first + pl.world):
            s = Shard(r.cfg, pl.tp, pl.pp, (d - pl.first) // (pl.dp * pl.tp), dtype_bytes(r.dtype))
            held[d] = held.get(d, 0.0) + memory.replica_state(s, r.trains and name == role).total
    worst = 0.0
    for c in problem.calls:
        r = problem.roles[c.role]
        if c.work is None or not r.has_weights:
            continue
        pl = e.placements[c.name]
        src = reps[c.role][1] if of_mfc[c.name] != c.role and r.trains else None
        for d in range(pl.first, pl.first + pl.world):
            b = dtype_bytes(r.dtype)
            s = Shard(r.cfg, pl.tp, pl.pp, pl.stage(d), b)
            ss = (Shard(r.cfg, src.tp, src.pp, src.stage(d), b)
                  if src is not None and src.first <= d < src.first + src.world else None)
            view = dataclasses.make_dataclass("V", ["layout", "realloc_from", "offload"])(
                pl, "actor" if src is not None else None, False)
            n_mbs, mt = e.budgets[c.name]
            worst = max(worst, held.get(d, 0.0) + call_estimate(view, s, c.work, n_mbs, mt, ss).total)
    return worst


@pytest.mark.parametrize("cfg,n_nodes,per_node,cap", [(QWEN15, 1, 8, 60), (QWEN7, 2, 8, 70)])
def test_the_chosen_plan_fits_and_beats_global_and_heuristic(cfg, n_nodes, per_node, cap):
    p = _problem(cfg, n_nodes, per_node, cap)
    n = n_nodes * per_node
    heuristic = {k: Placement(0, n, 1, 1) for k in p.placeable}
    r = search(p, seed=0, max_evals=1500, time_limit_s=60, heuristic=heuristic)
    ev = Evaluator(p)
    for e in [r.best] + r.runners_up:
        assert e.fits
        assert _device_by_device(p, ev, e) <= p.capacity  # every device, not only the search's segments
    assert r.best_global is not None
    assert r.best.step_s <= r.best_global.step_s
    if r.heuristic.fits:
        assert r.best.step_s <= r.heuristic.step_s
    assert all(r.best.step_s <= e.step_s for e in r.runners_up)
    # the same seed, the same plan
    again = search(p, seed=0, max_evals=1500, time_limit_s=60, heuristic=heuristic)
    assert again.best.describe() == r.best.describe() and again.best.step_s == r.best.step_s


def test_search_finds_the_optimum_of_a_space_it_can_enumerate():
    """Two devices, three placed MFCs: every assignment evaluated by brute force; the search's best is the minimum."""
    p = _problem(QWEN15, 1, 2, 70, prompts=8, max_new=256)
    ev = Evaluator(p)
    opts = []
    for name, by_size in _choices(p).items():
        opts.append([(name, Placement(first, *lay)) for size, firsts in by_size.items() for first, lays in firsts
                     for lay in lays])
    best = min((ev.evaluate(dict(combo)) for combo in itertools.product(*opts)), key=lambda e: e.step_s)
    assert best.fits
    r = search(p, seed=3, max_evals=3000, time_limit_s=60)
    assert r.best.step_s == pytest.approx(best.step_s, rel=1e-12), (r.best.describe(), best.describe())


def test_a_problem_where_nothing_fits_is_refused_with_the_reason():
    p = _problem(QWEN7, 1, 2, 10)  # 7B's training state alone is ~120 GB: 2 devices of 10 GiB hold none of it
    with pytest.raises(SearchError) as ei:
        search(p, seed=0, max_evals=300, time_limit_s=30)
    msg = str(ei.value)
    assert "no plan fits on 2 devices" in msg and "memory" in msg, msg


def test_placements_read_back_through_the_allocation_grammar():
    for n_nodes, per_node in ((1, 8), (4, 8), (3, 2)):
        for first, size in mesh_choices(n_nodes, per_node):
            for lay in ((size, 1, 1), (1, 1, size)):
                pl = Placement(first, *lay)
                assert parse_device_mesh(pl.device_mesh(per_node), n_nodes, per_node) == \
                    list(range(first, first + size)), pl
    # meshes: aligned powers of two inside a node, aligned runs of whole nodes (and all of them)
    assert sorted(mesh_choices(1, 4)) == [(0, 1), (0, 2), (0, 4), (1, 1), (2, 1), (2, 2), (3, 1)]
    assert (0, 24) in mesh_choices(3, 8) and (8, 16) not in mesh_choices(3, 8)


def test_async_search_splits_the_devices_within_memory():
    from realhf.plan.async_search import given_split, search_async
    from realhf.plan.async_sim import AsyncSetting
    from realhf.plan.cost import capacity

    hw = get("h800")
    base = AsyncSetting(model_config("r1-distill-qwen-1.5b"), 1, 1, 64, 16, 256, 8192, 4096.0)
    r = search_async(base, hw, 8, 8, 4, capacity(hw))
    s = r.best.setting
    assert s.gen_gpus + s.train_gpus == 8 and s.servers * s.gen_tp == s.gen_gpus
    assert all(r.best.state.tokens_per_s >= c.state.tokens_per_s for c in r.runners_up)
    assert r.by_eta[1].tokens_per_s > r.by_eta[0].tokens_per_s  # overlap beats alternation
    assert r.by_eta[4].mean_staleness <= 4
    # the chosen split, given by hand, runs as the search estimated it
    t = s.train_mesh
    assert given_split(base, hw, 4, s.gen_gpus, s.gen_tp, (t.dp, t.tp, t.pp), capacity(hw)) == \
        pytest.approx(r.best.state.tokens_per_s, rel=1e-9)
    with pytest.raises(ValueError, match="no split of 8 devices"):
        search_async(base, hw, 8, 8, 4, 2 * GiB)  # a 1.5B model's training state alone is ~28 GB
