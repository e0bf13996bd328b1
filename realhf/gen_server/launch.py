"""Starting a run's generation servers before its master and workers (every launcher: local, Ray).

``start_servers`` submits one job ``gen_server_<i>`` per server through the run's scheduler, then waits until
every server has registered its address (which it does only once its engine has loaded) and answers
``/health``. A server that exits first fails the launch at once with its exit code and the tail of its log
(a bad model path, a port taken, out of memory ...); one that is still not up after ``startup_timeout_secs``
fails it too. Once running, the servers are jobs like the workers: a server that dies stops the run, named.

A server can also run and serve nothing (stopped, hung, its engine stuck): :class:`ServersLiveness` has the
launcher probe every server's ``/health`` (``realhf.gen_server.liveness``) while it waits for the run, and a running
server that answers none for ``gen_server.health_timeout_secs``, or whose engine reports no progress with work for
as long, stops the run, named with its address and log. The launcher watches because it is the one process of every
run (synchronous or asynchronous, local, Ray or Slurm) that already decides which job failed and stops the others.
A stopped or hung server stops the run even where a dead one would not (an asynchronous run goes on while one
server is left): its requests hang instead of failing over, and no launcher can end one server of a Slurm job step.
"""
from __future__ import annotations

import json
import sys
import time
from typing import Dict, List, Optional

from realhf.base import logging
from realhf.base.name_resolve import names
from realhf.base.process import tail

logger = logging.getLogger(__name__)


def server_name(i: int) -> str:
    return f"gen_server_{i}"


def server_cmd(backend: str, model_path: str, index, dtype: str = "auto", device: str = "auto", tp: int = 1,
               max_model_len: int = 2048, max_num_seqs: int = 64, threads: int = 0, extra: Optional[dict] = None,
               *where: str) -> List[str]:
    """The command of generation server ``index`` (SGLang's wrapper for ``sglang``); ``where``: the flags saying
    where it registers (``--exp/--trial/--name-resolve-root`` or ``--address-file``)."""
    module = "realhf.gen_server.sglang" if backend == "sglang" else "realhf.gen_server.server"
    return [sys.executable, "-m", module, "--backend", backend, "--model", model_path, "--dtype", dtype,
            "--device", device, "--tp", str(tp), "--max-model-len", str(max_model_len),
            "--max-num-seqs", str(max_num_seqs), "--threads", str(threads), "--extra", json.dumps(extra or {}),
            "--index", str(index), *where]


def device_env(fleet, i: int, n_devices_per_node: int, gpus_per_node: int = 0) -> Dict[str, str]:
    """The GPUs of server ``i`` on its node (local launcher on a CUDA machine): those of its ``tp`` device slots
    (:func:`realhf.base.device_slots.gpu_of_slot`)."""
    from realhf.base.device_slots import gpu_of_slot, visible_cuda_devices

    if not visible_cuda_devices():
        return {}
    slots = [fleet.first_slot + i * fleet.tp + k for k in range(fleet.tp)]
    return {"CUDA_VISIBLE_DEVICES": ",".join(str(gpu_of_slot(s, n_devices_per_node, gpus_per_node)) for s in slots)}


def start_servers(sched, spec, config, env: Dict[str, str], nr, nr_root: str, own_devices: bool,
                  wait: bool = True) -> List[str]:
    """Submit and wait for the servers of ``spec``'s served replica; returns their ``host:port`` addresses.
    ``own_devices``: the launcher gives each job its own devices (Ray, Slurm), so no CUDA_VISIBLE_DEVICES is set
    here. ``wait=False`` only submits (a dry run) and returns []."""
    from realhf.scheduler.local import JobFailure

    m = spec.served()
    fleet = m.gen_servers
    exp, trial = spec.experiment_name, spec.trial_name
    sched.submit_group(
        [server_name(i) for i in range(fleet.n_servers)],
        lambda i: server_cmd(fleet.backend, m.path, i, fleet.dtype, "auto", fleet.tp, fleet.max_model_len,
                             fleet.max_num_seqs, fleet.cpus_per_worker, fleet.extra, "--exp", exp, "--trial", trial,
                             "--name-resolve-root", nr_root),
        env, worker=True, slots=fleet.tp, first_slot=fleet.first_slot,
        env_for=None if own_devices else lambda i: device_env(fleet, i, config.n_devices_per_node,
                                                                        config.gpus_per_node))
    if not wait:
        return []
    t0 = time.monotonic()
    addrs: Dict[int, str] = {}
    logger.info("waiting for %d %s generation server(s) to load %s (at most %.0f s)", fleet.n_servers, fleet.backend,
                m.path, fleet.startup_timeout_secs)
    while len(addrs) < fleet.n_servers:
        codes = sched._codes()
        for i in range(fleet.n_servers):
            name = server_name(i)
            code = codes.get(name)
            if code is not None:
                raise JobFailure(name, code, tail(sched.jobs[name].log_path),
                                 reason=f"generation server {i} ({fleet.backend}) exited with code {code} before it "
                                        "served; the run was not started")
            if i not in addrs:
                try:
                    addrs[i] = nr.get(names.gen_server(exp, trial, i))
                except KeyError:
                    pass
        if len(addrs) == fleet.n_servers:
            break
        if time.monotonic() - t0 > fleet.startup_timeout_secs:
            late = [i for i in range(fleet.n_servers) if i not in addrs]
            name = server_name(late[0])
            raise JobFailure(name, -1, tail(sched.jobs[name].log_path),
                             reason=f"generation server(s) {late} ({fleet.backend}) did not serve within "
                                    f"gen_server.startup_timeout_secs={fleet.startup_timeout_secs:g}; the run was not "
                                    "started")
        time.sleep(0.2)
    logger.info("%d %s generation server(s) up in %.1f s: %s", fleet.n_servers, fleet.backend, time.monotonic() - t0,
                ", ".join(addrs[i] for i in range(fleet.n_servers)))
    return [addrs[i] for i in range(fleet.n_servers)]


class ServersLiveness:
    """The launcher's watch over the running generation servers of ``spec`` (at ``addresses``): ``check()``, called at
    every poll of the launcher, raises JobFailure naming a server whose process runs but which is not live (see the
    module docstring). A server whose process exited is left to the launcher's exit rule."""

    def __init__(self, sched, spec, addresses: List[str], secret: bytes):
        from realhf.gen_server.liveness import ServerWatch

        self.sched = sched
        self.fleet = spec.served().gen_servers
        self.watch = ServerWatch(addresses, secret, self.fleet.backend, self.fleet.health_timeout_secs)

    def check(self) -> None:
        from realhf.scheduler.local import JobFailure

        suspects = self.watch.suspects()
        if suspects:  # rarely: a server whose process exited is the exit rule's (it may be survivable)
            codes = self.sched._codes()
            for i in suspects:
                if codes.get(server_name(i)) is not None:
                    self.watch.ignore(i)
        for i, why in self.watch.not_live("gen_server.health_timeout_secs"):
            name = server_name(i)
            log = self.sched.jobs[name].log_path
            server = f"generation server {i} ({name} at {self.watch.addresses[i]})"
            logger.error("%s is not live; stopping the run", server)
            raise JobFailure(name, -1, tail(log), reason=f"{server} runs but is not live: {why}; its log: {log}; the "
                                                         "run was stopped")

    def close(self) -> None:
        self.watch.close()
