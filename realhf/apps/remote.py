"""Entry point of one experiment process: ``--role master``, ``--role model_worker --rank i``, and in asynchronous
runs ``--role rollout_manager`` and ``--role rollout_worker --rank i``.

Every process loads the experiment spec the launcher built from the spec file beside the config file it is given
(``realhf.apps.launch_spec``), and builds it from the config file only when that file is missing or belongs to another
launch (a process started by hand). Each one ends itself within about a second when its parent (the launcher, or the
Ray actor that started it) is gone, so killing the launcher, even with SIGKILL, never leaves a run training
unsupervised.
"""
from __future__ import annotations

import argparse
import traceback

from realhf.base import logging

logger = logging.getLogger("realhf.remote")


def load_config(exp_name: str, path: str):
    from realhf.api.quickstart.entry import load_config as load
    from realhf.experiments import config_class

    return load(config_class(exp_name), [path])


def load_run(exp_name: str, config_path: str, secret: bytes):
    """(config, spec) of this process: the launcher's, from the spec file beside ``config_path`` when it belongs to
    this launch; else parsed and built from the config file (with every check of the launcher)."""
    from realhf.apps.launch_spec import load_launch_spec
    from realhf.experiments import build_spec

    shipped = load_launch_spec(exp_name, config_path, secret)
    if shipped is not None:
        return shipped
    config = load_config(exp_name, config_path)
    return config, build_spec(exp_name, config)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", choices=["master", "model_worker", "rollout_manager", "rollout_worker"], required=True)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--exp", required=True)
    ap.add_argument("--config", required=True)
    ap.add_argument("--resume", type=int, default=0)
    ap.add_argument("--run-id", default="")
    a = ap.parse_args(argv)
    from realhf.base.process import exit_when_parent_dies

    exit_when_parent_dies()
    if a.role == "model_worker":
        from realhf.base.host_memory import retain_freed_memory

        retain_freed_memory()  # big CPU tensors reuse freed memory instead of fresh mmaps every step
    from realhf.apps.main import name_resolve_root
    from realhf.base import name_resolve
    from realhf.base.run_secret import run_secret_from_env

    secret = run_secret_from_env()
    config, spec = load_run(a.exp, a.config, secret)
    nr = name_resolve.make_repository("file", root=name_resolve_root(config))
    if a.role == "model_worker":
        from realhf.base.runtime_env import detect, local_rank
        from realhf.system.trainer.model_worker import ModelWorker

        # the launch-time runtime environment of this worker (device, backends, dtype, attention kernel);
        # under Ray each worker's actor sees only the GPUs it reserved
        from realhf.scheduler import get_launcher

        env = detect(local_rank(a.rank, config.n_devices_per_node, own_devices=get_launcher(config.mode).own_devices,
                                gpus_per_node=config.gpus_per_node), name_resolve="file")
        nr = name_resolve.make_repository(env.name_resolve, root=name_resolve_root(config))
        w = ModelWorker(spec, a.rank, secret, nr, resume=bool(a.resume), env=env)
        try:
            w.setup()
            return w.run()
        finally:
            w.close()
    if a.role == "rollout_manager":
        import asyncio

        from realhf.system.rollout.manager import serve

        return asyncio.run(serve(spec, secret, nr, bool(a.resume)))
    if a.role == "rollout_worker":
        import asyncio

        from realhf.system.rollout.worker import RolloutWorker

        rw = RolloutWorker(spec, a.rank, secret, nr)
        rw.setup()
        return asyncio.run(rw.run())
    identity = {"run_id": a.run_id, "fingerprint": config.fingerprint(), "options": config.resume_options()}
    return run_master(spec, secret, nr, bool(a.resume), identity)


def run_master(spec, secret, nr, resume: bool, identity: dict) -> int:
    from realhf.base import network
    from realhf.base.name_resolve import names
    from realhf.experiments import final_hook
    from realhf.system.transport.heartbeat import HeartbeatMonitor, HeartbeatSender
    from realhf.system.trainer.master_worker import MasterWorker
    from realhf.system.trainer.model_worker import worker_name
    from realhf.system.transport.request_reply_stream import MasterClient, WorkerError, WorkerLostError

    exp, trial = spec.experiment_name, spec.trial_name
    monitor = HeartbeatMonitor(secret, host=network.worker_host(), name_resolve=nr, key=names.master_heartbeat(exp, trial))
    addrs = {worker_name(r): nr.wait(names.worker_address(exp, trial, worker_name(r)), timeout=600)
             for r in range(spec.n_workers)}
    # the master's own heartbeats, so that workers end the run when the master stops or hangs
    beats = HeartbeatSender("master", secret, [nr.wait(names.worker_heartbeat(exp, trial, worker_name(r)), timeout=600)
                                               for r in range(spec.n_workers)])
    beats.start()
    client = MasterClient(secret, addrs, heartbeat=monitor, lost_after=spec.worker_timeout_secs)
    try:
        code = MasterWorker(spec, client, resume, identity, name_resolve=nr, secret=secret).run()
        if code == 0 and spec.final_hook:
            final_hook(spec.final_hook)(spec)
        return code
    except WorkerError as e:
        logger.error(f"model worker {e.worker} failed:\n{e.traceback}")
        return 1
    except WorkerLostError as e:
        logger.error(f"model worker {e.worker} is lost ({e.reason}); stopping the run")
        return 1
    finally:
        client.close()
        beats.stop()
        monitor.close()


if __name__ == "__main__":
    from realhf.base.process import exit_done

    try:
        code = main()
    except SystemExit:
        raise
    except BaseException:  # make sure the launcher sees a non-zero code and the traceback in the log
        traceback.print_exc()
        code = 1
    exit_done(code)
