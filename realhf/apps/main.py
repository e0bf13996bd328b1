"""Launch an experiment: master + model workers as processes (on this machine, or through Ray with
``mode=ray``), with automatic recovery.

``run_experiment(exp_name, config)`` validates the config and builds the experiment spec *before*
anything starts (so bad input fails fast), clears stale name-resolve entries of the same
experiment/trial, writes the config next to the logs, starts the processes and waits. When a
process fails, every process is stopped and the failure (process name, exit code, log tail) is
reported. With ``recover_mode=auto`` a failed run is relaunched (resuming from the last recover
checkpoint) up to ``recover_retries`` times; ``recover_mode=resume`` resumes on the first launch.
"""
from __future__ import annotations

import os
import signal
import time

from realhf.api.quickstart.entry import config_to_yaml
from realhf.base import logging, name_resolve
from realhf.base.name_resolve import names
from realhf.base.process import env_with_source_path
from realhf.experiments import build_spec
from realhf.scheduler.local import JobFailure, LocalScheduler, python_cmd
from realhf.system.request_reply_stream import new_run_secret

logger = logging.getLogger(__name__)


def name_resolve_root(config) -> str:
    return os.path.join(os.path.expanduser(config.fileroot), "name_resolve")


def _launch_once(exp_name: str, config, spec, resume: bool) -> None:
    nr = name_resolve.make_repository("file", root=name_resolve_root(config))
    nr.clear_subtree(names.trial_root(config.experiment_name, config.trial_name))
    os.makedirs(spec.log_dir, exist_ok=True)
    cfg_path = os.path.join(spec.log_dir, "config.yaml")
    with open(cfg_path, "w") as f:
        f.write(config_to_yaml(config))
    env = {"REALHF_RUN_SECRET": new_run_secret().hex(), "OMP_NUM_THREADS": str(spec.threads_per_worker),
           "TOKENIZERS_PARALLELISM": "false"}
    if config.mode == "ray":
        from realhf.scheduler.ray_launcher import RayScheduler

        # jobs on other nodes import the same source tree (a shared file system holds it and fileroot)
        env["PYTHONPATH"] = env_with_source_path()["PYTHONPATH"]
        sched = RayScheduler(spec.log_dir, config, spec.n_workers)
    else:
        sched = LocalScheduler(spec.log_dir)
    common = ["--exp", exp_name, "--config", cfg_path, "--resume", "1" if resume else "0"]
    try:
        sched.submit("master", python_cmd("realhf.apps.remote", "--role", "master", *common), env, worker=False)
        for r in range(spec.n_workers):
            sched.submit(f"model_worker_{r}", python_cmd("realhf.apps.remote", "--role", "model_worker", "--rank", str(r), *common), env)
        sched.wait("master")
        sched.wait_others()
    finally:
        sched.stop_all()


def run_experiment(exp_name: str, config) -> int:
    spec = build_spec(exp_name, config)  # validates: raises before any process starts
    mode = config.recover_mode
    retries = config.recover_retries if mode == "auto" else 0
    resume = mode == "resume"
    from realhf.system.model_worker import load_recover_info

    attempt = 0
    prev_handler = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        while True:
            t0 = time.time()
            try:
                _launch_once(exp_name, config, spec, resume=resume and load_recover_info(spec) is not None)
                logger.info(f"experiment {config.experiment_name}/{config.trial_name} finished in {time.time() - t0:.1f}s; logs in {spec.log_dir}")
                return 0
            except JobFailure as e:
                logger.error(f"run failed: {e}")
                if attempt >= retries:
                    return 1
                attempt += 1
                resume = True
                has_ckpt = load_recover_info(spec) is not None
                logger.warning(
                    f"recover_mode=auto: relaunching (attempt {attempt}/{retries}), "
                    + ("resuming from the last recover checkpoint" if has_ckpt else "no recover checkpoint yet: starting over")
                )
    except KeyboardInterrupt:
        logger.error("interrupted: all processes stopped")
        return 130
    finally:
        signal.signal(signal.SIGTERM, prev_handler)
