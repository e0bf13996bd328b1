"""Ray launcher: the master, the model workers and the generation servers run as processes started by Ray actors,
placed on the nodes of a Ray cluster the way the allocation says.

Each job is one actor (``_ProcessActor``) that starts the job's command as a child process on its node,
with ``REALHF_HOST`` set to that node's IP so that the job binds and advertises reachable addresses
(ZMQ sockets, the gloo rendezvous).

Placement. The allocation numbers the run's devices ``0 .. n_nodes * n_devices_per_node - 1``; slot ``s`` belongs to
allocation node ``s // n_devices_per_node`` (see ``realhf.scheduler``). Before the first job starts, the scheduler
reserves the run's devices with one Ray placement group of ``n_nodes`` bundles, bundle ``i`` holding allocation node
``i``'s resources (``n_devices_per_node * cpus_per_worker`` CPUs and ``n_devices_per_node * ray_gpus_per_worker``
GPUs), with strategy ``STRICT_SPREAD``: every bundle on its own Ray node. (``STRICT_SPREAD`` puts at most one bundle
of a group on a node, and Ray has no "distinct nodes" constraint between groups, so one bundle holds all of a node's
slots rather than one bundle a slot.) A job that holds device slots (``first_slot``: a model worker, a generation
server with its ``tp`` slots) runs in the bundle of its allocation node and takes ``slots * cpus_per_worker`` CPUs and
``slots * ray_gpus_per_worker`` GPUs of it: the jobs of one allocation node are packed on one Ray node, distinct
allocation nodes are distinct Ray nodes, and Ray gives each job GPUs of that node no other job holds (which of the
node's GPUs is Ray's choice: slot ``s`` is not pinned to GPU ``s % n_devices_per_node``). Which Ray node hosts which
allocation node is the placement group's choice too (logged when it is ready). Jobs without device slots (the
master, the rollout manager and workers) reserve nothing and run wherever Ray puts them. A Ray instance started for
the run (``ray_address`` empty) is this one machine: there every bundle is packed on it (``STRICT_PACK``).

A cluster that cannot hold the placement is refused before anything starts (``connect_for``: too few nodes, or nodes
with too few CPUs or GPUs, named in the message); a placement group that is still not ready after
``placement_timeout`` seconds (the resources are held by others) fails the launch with a ``JobFailure`` saying what it
waited for. The placement group is removed in ``stop_all``, so a relaunch (``recover_mode=auto``) reserves afresh.
Where each job landed is written to ``<log_dir>/placement.json`` at each submit: ``{job: {"node_id", "host", "pid",
"slots", "allocation_node"}}`` (the last two empty/None for jobs without device slots).

The scheduler has the local launcher's interface (``submit``, ``wait``, ``wait_others``, ``stop_all``)
and failure semantics: a job that exits non-zero, or an actor that dies (its node is lost), is reported
with its name and the tail of its log (a Python exception's traceback), and every job is stopped.

Requirements on a multi-node cluster: every node sees the same ``fileroot`` (a shared file system), which
holds the logs, checkpoints and the name-resolve directory the jobs find each other through, and runs
the same Python environment. ``ray_address`` names the cluster (``auto`` for the one this machine
belongs to); left empty, a Ray instance is started on this machine for the run.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Dict, List, Optional

from realhf.base import logging
from realhf.scheduler.local import JobFailure, WaitMixin, start_logged, stop_groups

logger = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 120.0  # how long the placement group may wait for resources held by others


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
            return self.proc.pid, host, _ray.get_runtime_context().get_node_id()

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
    node_id: str = ""
    slots: List[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class Placement:
    """The run's devices as Ray resources: ``n_nodes`` allocation nodes of ``per_node`` device slots, each slot
    ``cpus`` CPUs and ``gpus`` GPUs; ``spread``: each allocation node on its own Ray node (a cluster) rather than all
    on this machine (a Ray instance started for the run)."""
    n_nodes: int
    per_node: int
    cpus: float
    gpus: float
    spread: bool

    @classmethod
    def of(cls, config, n_slots: int) -> "Placement":
        """For an experiment config (``n_nodes``, ``n_devices_per_node``, ``cpus_per_worker``, ``ray_gpus_per_worker``,
        ``ray_address``) whose jobs hold ``n_slots`` device slots."""
        per_node = config.n_devices_per_node
        n_nodes = max(config.n_nodes, -(-n_slots // per_node))
        return cls(n_nodes, per_node, config.cpus_per_worker, config.ray_gpus_per_worker, bool(config.ray_address))

    @property
    def n_slots(self) -> int:
        return self.n_nodes * self.per_node

    def bundle(self) -> Dict[str, float]:
        """One allocation node's resources."""
        b = {"CPU": self.cpus * self.per_node}
        if self.gpus:
            b["GPU"] = self.gpus * self.per_node
        return b

    def node_of(self, name: str, first_slot: int, slots: int) -> int:
        """The allocation node of a job holding ``slots`` slots from ``first_slot``; ValueError when they are not all
        on one node of the run."""
        node = first_slot // self.per_node
        if first_slot < 0 or first_slot + slots > self.n_slots or (first_slot + slots - 1) // self.per_node != node:
            raise ValueError(f"mode=ray: {name} holds device slots {first_slot}..{first_slot + slots - 1}, which are "
                             f"not on one node of the run's {self.n_nodes} nodes of {self.per_node} devices")
        return node

    def what(self) -> str:
        """The resources the placement needs, for messages."""
        return (f"{self.n_nodes} node(s) (n_nodes) with {self.cpus * self.per_node:g} CPUs and "
                f"{self.gpus * self.per_node:g} GPUs each (n_devices_per_node={self.per_node} x "
                f"cpus_per_worker={self.cpus:g} CPUs, ray_gpus_per_worker={self.gpus:g} GPUs)")

    def shortfall(self, nodes: List[dict]) -> Optional[str]:
        """What the cluster's nodes (``ray.nodes()``: their total resources) lack for this placement, or None."""
        if not self.spread:
            return None  # one machine: the instance is sized for the run (and its totals checked by ``connect``)
        alive = [n for n in nodes if n.get("Alive")]
        need = self.bundle()
        big_cpu = [n for n in alive if n["Resources"].get("CPU", 0.0) >= need["CPU"] - 1e-9]
        big_gpu = [n for n in alive if n["Resources"].get("GPU", 0.0) >= need.get("GPU", 0.0) - 1e-9]
        fit = [n for n in big_cpu if n in big_gpu]
        if len(fit) >= self.n_nodes:
            return None
        if len(alive) < self.n_nodes:
            missing = f"it has {len(alive)} node(s): {self.n_nodes - len(alive)} node(s) missing"
        else:
            short = [k for k, big in (("CPUs", big_cpu), ("GPUs", big_gpu)) if len(big) < self.n_nodes]
            missing = (f"only {len(fit)} of its {len(alive)} nodes are that large: too few "
                       + " and ".join(short or ["CPUs and GPUs"]) + " per node")
        have = "; ".join(f"{n.get('NodeManagerAddress', '?')} ({n['NodeID'][:8]}): {n['Resources'].get('CPU', 0.0):g} "
                         f"CPUs, {n['Resources'].get('GPU', 0.0):g} GPUs" for n in alive)
        return f"mode=ray: the run needs {self.what()}; the Ray cluster cannot hold it: {missing} ({have})"


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
                hint = ("; the cluster uses Ray token authentication: set RAY_AUTH_MODE=token (and its token) here"
                        if "auth" in str(e).lower() and os.environ.get("RAY_AUTH_MODE") != "token" else "")
                raise ValueError(f"mode=ray: cannot connect to the Ray cluster at ray_address={address!r}: {e}{hint}") \
                    from e
        else:
            # A private instance for this run ("local": never a cluster found on this machine); its CPU count covers
            # the requests (they are bookkeeping only: the jobs share this machine's cores as under mode=local).
            ray.init(address="local", num_cpus=max(os.cpu_count() or 1, int(need_cpus + 0.999)),
                     num_gpus=int(need_gpus + 0.999), **kw)
    res = ray.cluster_resources()
    have_cpu, have_gpu = res.get("CPU", 0.0), res.get("GPU", 0.0)
    if have_cpu < need_cpus or have_gpu < need_gpus:
        raise ValueError(
            f"mode=ray: the Ray cluster has {have_cpu:g} CPUs and {have_gpu:g} GPUs; this experiment's model "
            f"workers need {need_cpus:g} CPUs and {need_gpus:g} GPUs (cpus_per_worker, ray_gpus_per_worker)")
    return ray


def connect_for(config, n_workers: int):
    """``connect`` for an experiment config (``ray_address``, ``n_nodes``, ``n_devices_per_node``, ``cpus_per_worker``,
    ``ray_gpus_per_worker``) whose jobs hold ``n_workers`` device slots; also checks that the cluster's nodes can
    hold the run's placement (ValueError naming what is missing)."""
    p = Placement.of(config, n_workers)
    # on a cluster the per-node check says more than the totals (which it implies)
    ray = connect(config.ray_address, 0 if p.spread else p.cpus * p.n_slots, 0 if p.spread else p.gpus * p.n_slots)
    why = p.shortfall(ray.nodes())
    if why:
        raise ValueError(why)
    return ray


class RayScheduler(WaitMixin):
    def __init__(self, log_dir: str, config, n_workers: int, placement_timeout: float = PLACEMENT_TIMEOUT_S):
        self.log_dir = log_dir
        os.makedirs(log_dir, exist_ok=True)
        self.placement_path = os.path.join(log_dir, "placement.json")
        self.placement = Placement.of(config, n_workers)
        self.ray = connect_for(config, n_workers)  # checked again at each (re)launch: nodes may have gone
        self.jobs: Dict[str, RayJob] = {}
        self._write_placement()
        self.pg = self._reserve(placement_timeout)

    def _reserve(self, timeout: float):
        """The run's placement group, ready; JobFailure when it is not within ``timeout`` seconds."""
        from ray.util import placement_group, remove_placement_group

        p = self.placement
        pg = placement_group([p.bundle()] * p.n_nodes, strategy="STRICT_SPREAD" if p.spread else "STRICT_PACK")
        t0 = time.monotonic()
        if not pg.wait(timeout_seconds=max(1, int(timeout + 0.999))):
            remove_placement_group(pg)
            free = self.ray.available_resources()
            raise JobFailure("placement", 1, "(no job started)", reason=(
                f"mode=ray: the Ray cluster could not reserve the run's devices within {timeout:g} s: the run needs "
                f"{p.what()}, free now in the cluster: {free.get('CPU', 0.0):g} CPUs and {free.get('GPU', 0.0):g} GPUs "
                f"(other jobs may hold them){'' if p.spread else ' on this machine'}; no job was started"))
        table = self.ray.util.placement_group_table(pg).get("bundles_to_node_id", {})
        nodes = [table.get(i) for i in range(p.n_nodes)]
        logger.info(f"reserved {p.n_nodes} node(s) of {p.per_node} device slot(s) through a Ray placement group in "
                    f"{time.monotonic() - t0:.1f}s (Ray node ids by allocation node: {nodes})")
        return pg

    def submit(self, name: str, cmd: List[str], env: Optional[dict] = None, worker: bool = True,
               slots: int = 1, first_slot: Optional[int] = None) -> RayJob:
        """``slots``: device slots the job holds from ``first_slot`` (a generation server with tp ranks holds tp of
        them); the job runs in its allocation node's bundle. Without ``first_slot`` it reserves nothing."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        log_path = os.path.join(self.log_dir, f"{name}.log")
        opts, held = dict(num_cpus=0, num_gpus=0), []
        if worker and first_slot is not None:
            node = self.placement.node_of(name, first_slot, slots)
            held = list(range(first_slot, first_slot + slots))
            opts = dict(num_cpus=self.placement.cpus * slots, num_gpus=self.placement.gpus * slots,
                        scheduling_strategy=PlacementGroupSchedulingStrategy(
                            placement_group=self.pg, placement_group_bundle_index=node))
        actor = _actor_class().options(name=None, **opts).remote()
        pid, host, node_id = self.ray.get(actor.start.remote(cmd, dict(env or {}), log_path))
        job = RayJob(name, actor, log_path, pid, host, node_id, held)
        self.jobs[name] = job
        self._write_placement()
        logger.info(f"started {name} through Ray on {host} (pid {pid}), log: {log_path}")
        return job

    def _write_placement(self):
        per = self.placement.per_node
        doc = {n: {"node_id": j.node_id, "host": j.host, "pid": j.pid, "slots": j.slots,
                   "allocation_node": j.slots[0] // per if j.slots else None} for n, j in self.jobs.items()}
        tmp = self.placement_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1)
        os.replace(tmp, self.placement_path)

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
        if self.pg is not None:  # a relaunch reserves afresh
            try:
                self.ray.util.remove_placement_group(self.pg)
            except Exception as e:
                logger.warning(f"could not remove the run's Ray placement group: {e}")
            self.pg = None


def _register():
    from realhf.scheduler import Launcher, register_launcher

    from realhf.scheduler.local import PrintScheduler

    register_launcher(Launcher("ray", make=RayScheduler, check=connect_for, remote=True, own_devices=True,
                               dry_run=lambda log_dir, config, n, out: PrintScheduler(log_dir, out, "ray")))


_register()
