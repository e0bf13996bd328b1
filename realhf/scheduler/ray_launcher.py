"""Ray launcher: the master and the model workers run as processes started by Ray actors, on whichever
nodes of a Ray cluster have the resources.

Each job is one actor (``_ProcessActor``) that starts the job's command as a child process on its node,
with ``REALHF_HOST`` set to that node's IP so that the job binds and advertises reachable addresses
(ZMQ sockets, the gloo rendezvous). A model worker's actor reserves ``cpus_per_worker`` CPUs and
``ray_gpus_per_worker`` GPUs; the master's reserves nothing, so it never waits for a slot.

The scheduler has the local launcher's interface (``submit``, ``wait``, ``wait_others``, ``stop_all``)
and failure semantics: a job that exits non-zero, or an actor that dies (its node is lost), is reported
with its name and the tail of its log, and every job is stopped.

Requirements on a multi-node cluster: every node sees the same ``fileroot`` (a shared file system), which
holds the logs, checkpoints and the name-resolve directory the jobs find each other through, and runs
the same Python environment. ``ray_address`` names the cluster (``auto`` for the one this machine
belongs to); left empty, a Ray instance is started on this machine for the run.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Dict, List, Optional

from realhf.base import logging
from realhf.scheduler.local import WaitMixin, start_logged, stop_groups

logger = logging.getLogger(__name__)


def _actor_class():
    import ray

    @ray.remote(max_restarts=0, max_concurrency=4)
    class _ProcessActor:
        """Runs one job's command as a child process on this actor's node."""

        def start(self, cmd: List[str], env: Dict[str, str], log_path: str):
            import ray as _ray

            host = _ray.util.get_node_ip_address()
            os.makedirs(os.path.dirname(log_path), exist_ok=True)
            self.proc = start_logged(cmd, dict(env, REALHF_HOST=host), log_path)
            return self.proc.pid, host

        def poll(self) -> Optional[int]:
            return self.proc.poll()

        def stop(self, grace: float) -> Optional[int]:
            stop_groups({"job": self.proc}, grace)
            return self.proc.poll()

    return _ProcessActor


@dataclasses.dataclass
class RayJob:
    name: str
    actor: object
    log_path: str
    pid: int
    host: str


def _check_reachable(address: str, timeout: float = 5.0):
    """Fail fast when ``host:port`` does not accept connections (``ray.init`` would retry for minutes)."""
    import socket

    addr = address.split("://")[-1]
    if addr == "auto" or ":" not in addr:
        return
    host, port = addr.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            pass
    except (OSError, ValueError) as e:
        raise ValueError(f"mode=ray: cannot connect to the Ray cluster at ray_address={address!r}: {e}") from e


def connect(address: str, need_cpus: float, need_gpus: float):
    """Join the Ray cluster at ``address`` (or start one here when empty) and check it can hold the jobs;
    raises ``ValueError`` naming what is missing."""
    try:
        import ray
    except ImportError as e:
        raise ValueError("mode=ray needs the ray package: pip install 'realhf[ray]'") from e
    if not ray.is_initialized():
        kw = dict(include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
        if address:
            _check_reachable(address)
            try:
                ray.init(address=address, **kw)
            except Exception as e:  # ConnectionError and friends, with ray's own message
                raise ValueError(f"mode=ray: cannot connect to the Ray cluster at ray_address={address!r}: {e}") from e
        else:
            # A private instance for this run; its CPU count covers the requests (they are bookkeeping
            # only: the jobs share this machine's cores as they do under the local launcher).
            ray.init(num_cpus=max(os.cpu_count() or 1, int(need_cpus + 0.999)), num_gpus=int(need_gpus + 0.999), **kw)
    res = ray.cluster_resources()
    have_cpu, have_gpu = res.get("CPU", 0.0), res.get("GPU", 0.0)
    if have_cpu < need_cpus or have_gpu < need_gpus:
        raise ValueError(
            f"mode=ray: the Ray cluster has {have_cpu:g} CPUs and {have_gpu:g} GPUs; this experiment's model "
            f"workers need {need_cpus:g} CPUs and {need_gpus:g} GPUs (cpus_per_worker, ray_gpus_per_worker)")
    return ray


def connect_for(config, n_workers: int):
    """``connect`` for an experiment config (``ray_address``, ``cpus_per_worker``, ``ray_gpus_per_worker``)
    with ``n_workers`` model workers."""
    return connect(config.ray_address, config.cpus_per_worker * n_workers, config.ray_gpus_per_worker * n_workers)


class RayScheduler(WaitMixin):
    def __init__(self, log_dir: str, config, n_workers: int):
        self.log_dir = log_dir
        os.makedirs(log_dir, exist_ok=True)
        self.cpus, self.gpus = config.cpus_per_worker, config.ray_gpus_per_worker
        self.ray = connect_for(config, n_workers)  # checked again at each (re)launch: nodes may have gone
        self.jobs: Dict[str, RayJob] = {}

    def submit(self, name: str, cmd: List[str], env: Optional[dict] = None, worker: bool = True,
               slots: int = 1, first_slot: Optional[int] = None) -> RayJob:
        """``slots``: device slots the job holds (a generation server with tp ranks holds tp of them)."""
        log_path = os.path.join(self.log_dir, f"{name}.log")
        opts = dict(num_cpus=self.cpus * slots, num_gpus=self.gpus * slots) if worker else dict(num_cpus=0, num_gpus=0)
        actor = _actor_class().options(name=None, **opts).remote()
        pid, host = self.ray.get(actor.start.remote(cmd, dict(env or {}), log_path))
        job = RayJob(name, actor, log_path, pid, host)
        self.jobs[name] = job
        logger.info(f"started {name} through Ray on {host} (pid {pid}), log: {log_path}")
        return job

    def _codes(self) -> Dict[str, Optional[int]]:
        """Exit code (None while running) of every job; a dead actor (a lost node) counts as a failure (-1)."""
        refs = {n: j.actor.poll.remote() for n, j in self.jobs.items()}
        out = {}
        for n, ref in refs.items():
            try:
                out[n] = self.ray.get(ref, timeout=60)
            except Exception as e:  # RayActorError (node or actor lost), GetTimeoutError
                logger.error(f"Ray lost the actor of {n}: {type(e).__name__}: {e}")
                out[n] = -1
        return out

    def stop_all(self, grace: float = 5.0):
        refs = []
        for j in self.jobs.values():
            try:
                refs.append(j.actor.stop.remote(grace))
            except Exception:
                pass
        for r in refs:
            try:
                self.ray.get(r, timeout=grace + 30)
            except Exception:
                pass
        for j in self.jobs.values():
            try:
                self.ray.kill(j.actor)
            except Exception:
                pass
        self.jobs.clear()


def _register():
    from realhf.scheduler import Launcher, register_launcher

    register_launcher(Launcher("ray", make=RayScheduler, check=connect_for, remote=True, own_devices=True))


_register()
