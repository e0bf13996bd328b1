"""Launchers (``mode=local|ray|slurm``) behind one protocol, found through one registry.

A launcher registers a :class:`Launcher`: ``make(log_dir, config, n_workers)`` returns a scheduler with
``submit(name, cmd, env, worker, slots=1, first_slot=None)``,
``submit_group(names, cmd_for, env, worker, slots=1, first_slot=None, env_for=None)`` (jobs that differ only in their
rank: ``cmd_for(rank)`` builds job ``k``'s command from its rank as a string; a launcher may start the group as one
unit, e.g. one Slurm job step with one task per rank), ``wait(main)`` (returns when ``main`` exits 0, raises
``realhf.scheduler.local.JobFailure`` naming the failed job), ``wait_others()`` and ``stop_all()``;
``dry_run(log_dir, config, n_slots, out)`` makes a scheduler that prints each submitted job instead of starting it;
``check(config, n_workers)``, when given, runs before anything starts and raises ValueError with a message for the
user (e.g. a Ray cluster that is unreachable or too small); ``remote`` says its jobs may run on other nodes, which
then import this source tree from a shared file system (``PYTHONPATH``); ``own_devices`` says each job sees only the
devices it reserved (Ray actors, Slurm tasks), so no CUDA_VISIBLE_DEVICES is computed for it.

Device slots: the allocation numbers the run's devices ``0 .. n_nodes * n_devices_per_node - 1`` (node
``slot // n_devices_per_node``): model worker ``r`` holds slot ``r``, generation server ``i`` the ``tp`` slots from its
fleet's ``first_slot + i * tp``. ``first_slot`` tells a launcher that places jobs on nodes (Ray, Slurm) where a job
belongs; CPU-only jobs (``worker=False``: the master, the rollout side) have none.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional


@dataclasses.dataclass(frozen=True)
class Launcher:
    name: str
    make: Callable[[str, Any, int], Any]
    check: Optional[Callable[[Any, int], None]] = None
    remote: bool = False
    own_devices: bool = False
    # ``dry_run(log_dir, config, n_slots, out)``: a scheduler whose submits print what would run (``--dry-run``)
    dry_run: Optional[Callable[[str, Any, int, Any], Any]] = None


_LAUNCHERS: Dict[str, Launcher] = {}


def register_launcher(launcher: Launcher) -> None:
    if launcher.name in _LAUNCHERS and _LAUNCHERS[launcher.name] != launcher:
        raise ValueError(f"launcher {launcher.name!r} is registered twice")
    _LAUNCHERS[launcher.name] = launcher


def available() -> List[str]:
    _import_all()
    return sorted(_LAUNCHERS)


def get_launcher(mode: str) -> Launcher:
    """The launcher of ``mode``; ValueError naming the available ones when there is none."""
    _import_all()
    if mode not in _LAUNCHERS:
        raise ValueError(f"mode={mode!r} is not implemented yet; launchers available: {sorted(_LAUNCHERS)}")
    return _LAUNCHERS[mode]


def _import_all():
    import realhf.scheduler.local  # noqa: F401
    import realhf.scheduler.ray_launcher  # noqa: F401  (ray itself is imported only when used)
    import realhf.scheduler.slurm  # noqa: F401
