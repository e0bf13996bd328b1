"""Starting the rollout side of an asynchronous run (every launcher): the rollout manager, after the generation
servers and before the trainer, then the rollout workers.

``start_manager`` submits job ``rollout_manager`` and waits until it has registered its address (it does once
it serves); a manager that exits first fails the launch at once with its exit code and log tail.
``start_rollout_workers`` submits ``rollout_worker_<i>``; they find the manager, the servers and the trainer's
heads through name_resolve. Both are CPU processes (no device slot). A rollout worker or the manager that dies
fails the run, named (``recover_mode=auto`` then resumes it: the manager restores its accounting from its log).
"""
from __future__ import annotations

import time
from typing import Dict, List

from realhf.base import logging
from realhf.base.name_resolve import names
from realhf.base.process import tail

logger = logging.getLogger(__name__)

MANAGER = "rollout_manager"


def worker_job(i: int) -> str:
    return f"rollout_worker_{i}"


def start_manager(sched, spec, env: Dict[str, str], nr, common: List[str], timeout: float = 600.0,
                  wait: bool = True) -> str:
    """``common``: ``--exp NAME --config PATH --resume 0|1 ...`` of the run. Returns the manager's ``host:port``
    (``wait=False`` only submits, a dry run, and returns "")."""
    from realhf.scheduler.local import JobFailure, python_cmd

    sched.submit(MANAGER, python_cmd("realhf.apps.remote", "--role", "rollout_manager", *common), env, worker=False)
    if not wait:
        return ""
    key = names.rollout_manager(spec.experiment_name, spec.trial_name)
    t0 = time.monotonic()
    while True:
        code = sched._codes().get(MANAGER)
        if code is not None:
            raise JobFailure(MANAGER, code, tail(sched.jobs[MANAGER].log_path),
                             reason=f"the rollout manager exited with code {code} before it served; the run was not "
                                    "started")
        try:
            addr = nr.get(key)
            break
        except KeyError:
            pass
        if time.monotonic() - t0 > timeout:
            raise JobFailure(MANAGER, -1, tail(sched.jobs[MANAGER].log_path),
                             reason=f"the rollout manager did not serve within {timeout:.0f} s; the run was not started")
        time.sleep(0.2)
    logger.info("rollout manager up at %s in %.1f s", addr, time.monotonic() - t0)
    return addr


def start_rollout_workers(sched, spec, env: Dict[str, str], common: List[str]) -> None:
    """``common``: ``--exp NAME --config PATH ...`` of the run."""
    from realhf.scheduler.local import python_cmd

    sched.submit_group([worker_job(i) for i in range(spec.rollout.n_workers)],
                       lambda rank: python_cmd("realhf.apps.remote", "--role", "rollout_worker", "--rank", rank, *common),
                       env, worker=False)
