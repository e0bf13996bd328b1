"""``allocation_mode=search`` and ``python -m realhf.apps.plan ... --search``: the experiment's plan chosen by
:mod:`realhf.plan.search`, checked as a launch checks it, and written as the ``manual`` allocation that runs it.

The search's problem comes from a spec built for a stand-in allocation (``heuristic``: the same MFCs, models and
workloads whatever the layouts). The chosen plan becomes ``allocation_mode=manual`` with each MFC's
``device_mesh``/``parallel``; that config is validated and estimated as a launch would (memory plan, ``auto`` budgets,
the simulator) — a plan the config checks refuse gives way to the runner-up.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Dict, List, Optional, Tuple

from realhf.api.quickstart.allocation import parse_allocation_mode
from realhf.base import logging

logger = logging.getLogger("realhf.apps.plan")

# a launch's search: a fixed number of plans (the same plan on every relaunch of a run), bounded in time as well
LAUNCH_EVALS = 3000
LAUNCH_TIME_LIMIT_S = 60.0


def with_options(cfg, options: Dict[str, object]):
    """A copy of ``cfg`` with the dotted ``options`` set, validated again (ValueError naming what is wrong)."""
    c = copy.deepcopy(cfg)
    for key, v in options.items():
        obj = c
        *path, last = key.split(".")
        for p in path:
            obj = getattr(obj, p)
        if not dataclasses.is_dataclass(obj) or last not in {f.name for f in dataclasses.fields(obj)}:
            raise ValueError(f"{key}: no such option")
        setattr(obj, last, v)
    c.__post_init__()
    return c


def placeable_mfcs(cfg, spec) -> List[str]:
    """The MFCs of ``spec`` that the config places one by one (``<mfc>.device_mesh``, ``<mfc>.parallel``)."""
    from realhf.api.quickstart.sections import MFCPlacement

    return [f.name for f in spec.mfcs if isinstance(getattr(cfg, f.name, None), MFCPlacement)]


@dataclasses.dataclass
class Searched:
    """A search's outcome: the config that runs the chosen plan, the search's result, and the chosen plan's
    estimate as a launch of that config is estimated."""

    cfg: object
    result: object  # realhf.plan.search.SearchResult
    chosen: object  # realhf.plan.search.Evaluated
    estimate: object  # realhf.plan.simulate.StepEstimate
    memory: object  # realhf.plan.fit.MemoryPlan
    options: Dict[str, object]  # the options set on the user's config to make it
    backend: str = "gen"  # asynchronous: the generation servers' backend

    def report(self) -> str:
        if self.estimate is None:  # asynchronous: the steady state is the estimate
            return self.result.table(self.backend) + f"\n# the chosen plan: allocation_mode={self.cfg.allocation_mode}"
        return (self.result.table() + f"\n# the chosen plan as launched: step {self.estimate.step_s:.4g} s "
                f"(allocation_mode=manual; each MFC's device_mesh and parallel)")


def _ties(cfg, placeable: List[str]) -> Dict[str, str]:
    """MFCs the experiment runs on another's replica: the critic's inference and training under value
    normalisation (the running statistics training updates are the ones inference denormalises with)."""
    ppo = getattr(cfg, "ppo", None)
    if getattr(cfg, "use_critic", False) and ppo is not None and ppo.value_norm \
            and {"critic_inf", "critic_train"} <= set(placeable):
        return {"critic_inf": "critic_train"}
    return {}


def _comparable(cfg) -> bool:
    """Whether the config gives an allocation of its own for its device count (one to compare the search's with)."""
    try:
        mode = parse_allocation_mode(cfg.allocation_mode)
        return mode.kind not in ("search", "heuristic", "manual") and mode.n_devices() == cfg.n_devices
    except ValueError:
        return False


def search_config(name: str, cfg, cluster: Optional[Tuple[str, int, int]] = None, seed: int = 0,
                  max_evals: int = LAUNCH_EVALS, time_limit_s: float = LAUNCH_TIME_LIMIT_S) -> Searched:
    """Search experiment ``name``'s plan under ``cfg`` (its allocation mode ignored) on a tabled ``cluster`` (device,
    GPUs per node, nodes) or on this machine. Raises :class:`realhf.plan.search.SearchError` when no plan fits or
    the experiment cannot be placed MFC by MFC."""
    from realhf.api.quickstart.allocation import AllocationMode
    from realhf.apps.planning import context, estimate
    from realhf.experiments.memory_plan import mb_auto
    from realhf.plan.search import Placement, Problem, SearchError, search

    if cluster is not None:
        cfg = copy.deepcopy(cfg)
        cfg.n_devices_per_node, cfg.n_nodes = cluster[1], cluster[2]
    if hasattr(cfg, "async_rl"):
        return search_async_config(name, cfg, cluster)
    ctx, errors = None, []
    for mode in ("heuristic", "*:d1m1p1"):  # any allocation gives the same MFCs, models and workloads
        try:
            ctx = context(name, with_options(cfg, {"allocation_mode": mode}), cluster, check_fit=False)
            break
        except ValueError as e:
            errors.append(f"{mode}: {e}")
    if ctx is None:
        raise SearchError("cannot build the experiment to plan it: " + "; ".join(errors))
    placeable = placeable_mfcs(ctx.cfg, ctx.spec)
    if not placeable:
        raise SearchError(f"allocation_mode=search: experiment {name!r} has no per-MFC placement options "
                          "(<mfc>.device_mesh); give a layout such as d2m1p1 or heuristic")
    # the budgets are searched with the layouts (as auto chooses them) wherever the config can say them: written
    # into the chosen config where it gives numbers, left to the launch where it says auto
    budgeted = [k for k in placeable if hasattr(getattr(ctx.cfg, k), "mb_spec")]
    auto = sorted(set(budgeted) | {f.name for f in ctx.spec.mfcs if mb_auto(ctx.cfg, f.name)})
    written = [k for k in budgeted if not mb_auto(ctx.cfg, k)]
    problem = Problem.from_spec(ctx.spec, ctx.cfgs, ctx.work, ctx.hw, ctx.cap.per_rank, ctx.cfg.n_nodes,
                                ctx.cfg.n_devices_per_node, placeable, auto, ties=_ties(ctx.cfg, placeable))
    h = AllocationMode("heuristic").resolve_heuristic(problem.n_devices).default
    heuristic = {k: Placement(0, h.dp, h.tp, h.pp) for k in problem.placeable}
    result = search(problem, seed=seed, time_limit_s=time_limit_s, max_evals=max_evals, heuristic=heuristic)
    if _comparable(cfg):  # the config's own allocation, for comparison
        try:
            result.given = (cfg.allocation_mode, estimate(name, copy.deepcopy(cfg), cluster)[0].step_s, "")
        except ValueError as e:
            result.given = (cfg.allocation_mode, None, str(e).split(". To fit")[0])
    errors = []
    for cand in [result.best] + result.runners_up:
        try:
            options = cand.overrides(problem.sections, problem.per_node, written)
            chosen_cfg = with_options(cfg, options)
            est, mem = estimate(name, copy.deepcopy(chosen_cfg), cluster)
        except ValueError as e:
            errors.append(f"{cand.describe()}: {e}")
            logger.warning(f"plan search: the plan {cand.describe()} is refused at launch ({e}); trying the next")
            continue
        return Searched(chosen_cfg, result, cand, est, mem, options)
    raise SearchError("every plan the search ranked first is refused by the experiment's checks: "
                      + "; ".join(errors))


def search_async_config(name: str, cfg, cluster: Optional[Tuple[str, int, int]] = None,
                        mean_new: Optional[float] = None) -> Searched:
    """An asynchronous run's split of the devices between generation servers and the trainer, chosen under its
    staleness bound (``async_rl.max_head_offpolicyness``) on the steady-state model (:mod:`realhf.plan.async_search`);
    the servers keep the config's backend (``gen`` when it gives none). The chosen config is checked by the launcher's
    memory plan; a refused plan gives way to the runner-up."""
    from realhf.apps.planning import _hardware_and_capacity, context
    from realhf.experiments import build_spec
    from realhf.experiments.memory_plan import capacity as run_capacity, mb_auto, model_configs
    from realhf.plan import hardware
    from realhf.plan.async_search import given_split, search_async, setting_of
    from realhf.plan.cost import capacity
    from realhf.plan.fit import UNBOUNDED
    from realhf.plan.search import SearchError
    from realhf.plan.shapes import shape_of

    mode = parse_allocation_mode(cfg.allocation_mode)  # (its device count may be another cluster's)
    backend = mode.gen_backend if mode.kind == "decoupled" else "gen"
    shape = shape_of(cfg.actor.path)
    if cluster is not None:
        hw = dataclasses.replace(hardware.get(cluster[0]), devices_per_node=cluster[1])
        cap, dtype = capacity(hw), "bfloat16"
    else:
        given = cfg if mode.kind != "search" else with_options(cfg, {"allocation_mode": f"{backend}.d1m1p1+d{max(1, cfg.n_devices - 1)}m1p1"})
        spec = build_spec(name, given)
        hw, _ = _hardware_and_capacity(None, given, spec, model_configs(spec))
        cap, dtype = run_capacity(given, spec).per_rank, ("bfloat16" if hw.device == "cuda" else "float32")
    eta = cfg.async_rl.max_head_offpolicyness
    try:
        result = search_async(setting_of(cfg, shape, mean_new, dtype), hw, cfg.n_devices, cfg.n_devices_per_node, eta,
                              cap)
    except ValueError as e:
        raise SearchError(str(e)) from None
    if mode.kind == "decoupled" and mode.n_devices() == cfg.n_devices:  # the config's own split, for comparison
        t = mode.per_mfc.get("actor_train", mode.default)
        result.given = (cfg.allocation_mode, given_split(setting_of(cfg, shape, mean_new, dtype), hw, eta,
                                                         mode.gen.world_size, mode.gen.tp, (t.dp, t.tp, t.pp), cap))
    errors = []
    for cand in [result.best] + result.runners_up:
        options: Dict[str, object] = {"allocation_mode": cand.allocation(backend)}
        for k in ("actor_train", "actor_inf"):
            if not mb_auto(cfg, k) and cand.setting.train_max_tokens < UNBOUNDED:
                options[f"{k}.mb_spec.max_tokens_per_mb"] = cand.setting.train_max_tokens
        try:
            chosen = with_options(cfg, options)
            ctx = context(name, copy.deepcopy(chosen), cluster)
        except ValueError as e:
            errors.append(f"{cand.allocation(backend)}: {e}")
            continue
        return Searched(chosen, result, cand, None, ctx.mem, options, backend)
    raise SearchError("every split the search ranked first is refused by the experiment's checks: " + "; ".join(errors))


def resolve_search(name: str, cfg, write: bool = True):
    """A launch's ``allocation_mode=search``: the config of the plan the search chooses on this machine (profiled),
    its report logged and (``write``) the config written beside the run (``<run dir>/searched_plan.yaml``); ``cfg`` itself when
    its allocation is not ``search``. ValueError for a run this machine cannot profile (a cluster launch)."""
    import os

    from realhf.api.quickstart import entry

    if cfg.allocation_mode.strip() != "search":
        return cfg
    if cfg.mode != "local":
        raise ValueError(f"allocation_mode=search with mode={cfg.mode}: this host is not one of the cluster's, so the "
                         "search cannot profile it; plan on the tabled device instead: python -m realhf.apps.plan "
                         f"{name} --config X.yaml --cluster h800x8x{cfg.n_nodes} --search --write plan.yaml, then "
                         "launch with --config plan.yaml")
    found = search_config(name, cfg)
    logger.info("allocation_mode=search:\n" + found.report())
    if not write:  # a dry run writes nothing
        return found.cfg
    path = os.path.join(cfg.run_dir(), "searched_plan.yaml")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(entry.config_to_yaml(found.cfg))
    logger.info(f"allocation_mode=search: the chosen plan runs as {path} (launch it with --config to reuse it)")
    return found.cfg
