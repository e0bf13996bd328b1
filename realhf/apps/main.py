"""Launch an experiment: master + model workers as processes (on this machine, or through Ray with
``mode=ray``), with automatic recovery.

``run_experiment(exp_name, config)`` validates the config and builds the experiment spec *before*
anything starts (so bad input fails fast; the quickstart hands it the spec it built), takes the trial's lock (one
launch per trial folder), decides whether a recover checkpoint is resumed (only one written by this run: the same
options, not finished; a fresh start moves an earlier ``recover/`` aside), clears stale name-resolve
entries of the same experiment/trial, writes the config and the spec next to the logs (the processes load the spec
from there instead of building it again: ``realhf.apps.launch_spec``), starts the processes and waits.
When a process fails, every process is stopped and the failure (process name, exit code, log tail) is
reported. With ``recover_mode=auto`` a failed run is relaunched (resuming from the last recover
checkpoint of this run) up to ``recover_retries`` times; ``recover_mode=resume`` must find one to resume.
SIGTERM and SIGHUP (a closed terminal) stop every process of the run; if the launcher is killed outright,
its processes notice their parent is gone and exit within seconds (``realhf.apps.remote``).
"""
from __future__ import annotations

import os
import signal
import sys
import time
import uuid
from typing import List, Optional, Tuple

from realhf.apps.console import Console
from realhf.apps.launch_spec import CONFIG_FILE, write_launch_files
from realhf.base import logging, name_resolve
from realhf.base.name_resolve import names
from realhf.base.progress import clear_progress
from realhf.base.recover import RecoverError, RecoverStore
from realhf.base.run_lock import RunLock, RunLocked
from realhf.base.process import env_with_source_path
from realhf.experiments import build_spec
from realhf.scheduler import get_launcher
from realhf.scheduler.local import JobFailure, python_cmd
from realhf.base.run_secret import new_run_secret

logger = logging.getLogger(__name__)


def name_resolve_root(config) -> str:
    return os.path.join(os.path.expanduser(config.fileroot), "name_resolve")


class LaunchError(ValueError):
    """Something found before any process starts (a locked trial, an unwritable fileroot, a recover checkpoint
    that cannot be used); the message is for the user as is."""


def _run_env(spec, launcher, secret: str) -> dict:
    env = {"REALHF_RUN_SECRET": secret, "OMP_NUM_THREADS": str(spec.cpus_per_worker), "TOKENIZERS_PARALLELISM": "false"}
    if launcher.remote:  # jobs on other nodes import the same source tree (a shared file system holds it and fileroot)
        env["PYTHONPATH"] = env_with_source_path()["PYTHONPATH"]
    return env


def _start_jobs(sched, spec, config, launcher, env: dict, nr, common: list,
                wait: bool = True) -> Tuple[Optional[str], List[str]]:
    """Submit every job of the run in order: generation servers (waited for: the workers connect to them at start),
    the rollout manager (waited for: it restores its accounting), the master, the model workers, the rollout
    workers. ``wait=False`` (a dry run) only submits. Returns the rollout manager's address (asynchronous runs) and
    the generation servers' addresses."""
    manager, servers = None, []
    if spec.served() is not None:
        from realhf.gen_server.launch import start_servers

        servers = start_servers(sched, spec, config, env, nr, name_resolve_root(config),
                                own_devices=launcher.own_devices, wait=wait)
    if spec.rollout is not None:  # asynchronous RL
        from realhf.system.rollout.launch import start_manager

        manager = start_manager(sched, spec, env, nr, common, wait=wait)
    sched.submit("master", python_cmd("realhf.apps.remote", "--role", "master", *common), env, worker=False)
    sched.submit_group([f"model_worker_{r}" for r in range(spec.n_workers)],
                       lambda rank: python_cmd("realhf.apps.remote", "--role", "model_worker", "--rank", rank, *common),
                       env, first_slot=0)
    if spec.rollout is not None:
        from realhf.system.rollout.launch import start_rollout_workers

        start_rollout_workers(sched, spec, env, common)
    return manager, servers


def _worker_lost(manager: Optional[str], secret: str):
    """``on_survived`` of an asynchronous run: a rollout worker that died while others run has its tickets
    re-issued (the rollout manager's ``/worker_down``); a generation server's loss is handled by the workers."""

    def lost(name: str, code: int) -> None:
        if manager is None or not name.startswith("rollout_worker_"):
            return
        from realhf.system.transport.manager_client import ManagerError, manager_call

        try:
            out = manager_call(manager, bytes.fromhex(secret), "/worker_down",
                               {"worker": name, "reason": f"exited with code {code}"}, timeout=60)
            logger.warning(f"{name} exited with code {code}; its {out.get('released', 0)} running episode(s) go to the "
                           "other rollout workers")
        except ManagerError as e:
            logger.error(f"{name} exited with code {code} and the rollout manager could not be told: {e}")

    return lost


def _common_args(exp_name: str, cfg_path: str, resume: bool, run_id: str) -> list:
    return ["--exp", exp_name, "--config", cfg_path, "--resume", "1" if resume else "0", "--run-id", run_id]


def _launch_once(exp_name: str, config, spec, resume: bool, run_id: str, console: Console) -> None:
    nr = name_resolve.make_repository("file", root=name_resolve_root(config))
    nr.clear_subtree(names.trial_root(config.experiment_name, config.trial_name))
    os.makedirs(spec.log_dir, exist_ok=True)
    clear_progress(spec.log_dir)
    secret = new_run_secret()  # fresh for every launch and relaunch: it signs this launch's spec file
    cfg_path = write_launch_files(spec.log_dir, exp_name, config, spec, secret)
    launcher = get_launcher(config.mode)
    env = _run_env(spec, launcher, secret.hex())
    sched = launcher.make(spec.log_dir, config, spec.device_slots())
    servers = None
    try:
        manager, addresses = _start_jobs(sched, spec, config, launcher, env, nr,
                                         _common_args(exp_name, cfg_path, resume, run_id))
        if addresses:  # a running server that stops answering /health stops the run (realhf.gen_server.launch)
            from realhf.gen_server.launch import ServersLiveness

            servers = ServersLiveness(sched, spec, addresses, bytes.fromhex(env["REALHF_RUN_SECRET"]))
        console.watch(spec.log_dir)

        def poll():
            console.poll()
            if servers is not None:
                servers.check()

        # an asynchronous run goes on while one generation server is left (the others' requests move to it) and while
        # one rollout worker is left (a lost worker's episodes are re-issued to the others)
        sched.wait("master", on_poll=poll,
                   survivable=("gen_server_", "rollout_worker_") if spec.rollout is not None else (),
                   on_survived=_worker_lost(manager, env["REALHF_RUN_SECRET"]))
        sched.wait_others(skip=("gen_server_", "rollout_"))  # servers and the rollout side serve until stopped
    finally:
        if servers is not None:
            servers.close()
        console.close()
        sched.stop_all()


def dry_run(exp_name: str, config, out=None) -> int:
    """Print what a launch of ``config`` would submit (``--dry-run``): the command of every job, and under
    ``mode=slurm`` each ``sbatch`` command with its batch script and task wrapper. Nothing is started or written."""
    from realhf.experiments.memory_plan import plan_run

    out = out or sys.stdout
    config, spec, memory = plan_run(exp_name, config, lambda c: build_spec(exp_name, c))
    launcher = get_launcher(config.mode)
    if launcher.dry_run is None:
        raise ValueError(f"mode={config.mode} has no dry run")
    sched = launcher.dry_run(spec.log_dir, config, spec.device_slots(), out)
    out.write(f"# dry run of {exp_name} {config.experiment_name}/{config.trial_name}, mode={config.mode}: "
              f"{config.n_nodes} node(s) x {config.n_devices_per_node} device(s), allocation {config.allocation_mode}; "
              f"{spec.device_slots()} device slot(s), {spec.n_workers} model worker(s)"
              + (f", {spec.served().gen_servers.n_servers} generation server(s)" if spec.served() is not None else "")
              + "\n")
    env = _run_env(spec, launcher, "<a fresh secret per launch>")
    cfg_path = os.path.join(spec.log_dir, CONFIG_FILE)
    _start_jobs(sched, spec, config, launcher, env, None, _common_args(exp_name, cfg_path, False, "<run id>"),
                wait=False)
    if memory is not None:  # every MFC's estimate on its fullest rank
        out.write(memory.table() + "\n")
    return 0


def _option_diff(old: dict, new: dict) -> str:
    keys = sorted(set(old) | set(new))
    diff = [f"{k}: {old.get(k, '(absent)')!r} -> {new.get(k, '(absent)')!r}" for k in keys if old.get(k) != new.get(k)]
    return "; ".join(diff[:8]) + (f"; and {len(diff) - 8} more" if len(diff) > 8 else "") if diff else "(none listed)"


def _first_launch(config, store: RecoverStore):
    """(run id, resume?) of a new launch. A checkpoint is resumed only when it belongs to this run: written under
    the same options and not by a run that finished. A fresh start moves any earlier recover folder aside."""
    mode = config.recover_mode
    try:
        latest = store.latest()
    except RecoverError as e:
        if mode != "disabled":
            raise LaunchError(f"recover_mode={mode}: {e}") from None
        latest = None
    fp, options = config.fingerprint(), config.resume_options()
    if mode == "resume":
        if latest is None:
            raise LaunchError(f"recover_mode=resume but {store.root} holds no recover checkpoint; start the run with "
                              "recover_mode=auto or recover_mode=disabled")
        if latest["finished"]:
            raise LaunchError(f"recover_mode=resume: the run that wrote the checkpoint in {store.root} finished (global "
                              f"step {latest['global_step']}); there is nothing to resume")
        if latest.get("fingerprint") != fp:
            raise LaunchError(f"recover_mode=resume: the checkpoint in {store.root} was written with other options "
                              f"({_option_diff(latest.get('options', {}), options)}); resume with the same options, or "
                              "start afresh with recover_mode=disabled (the old checkpoint is then moved aside)")
        return latest["run_id"], True
    if mode == "auto" and latest is not None and not latest["finished"] and latest.get("fingerprint") == fp:
        logger.info(f"recover_mode=auto: resuming run {latest['run_id']} from its recover checkpoint at global step "
                    f"{latest['global_step']}")
        return latest["run_id"], True
    if store.exists():
        if latest is None:
            why = "no usable checkpoint in it"
        elif latest["finished"]:
            why = f"its run {latest['run_id']} finished"
        elif latest.get("fingerprint") != fp:
            why = f"written with other options: {_option_diff(latest.get('options', {}), options)}"
        else:
            why = f"recover_mode={mode} starts afresh"
        store.archive(why)
    return uuid.uuid4().hex[:12], False


def check_process_env() -> None:
    """The environment variables the workers read for their CPU settings (``REALHF_CPU_GEMM``,
    ``REALHF_CPU_MALLOC``), checked here so that a bad value fails before any process starts."""
    from realhf.base import host_memory

    if os.environ.get("REALHF_CPU_GEMM", "").strip():  # unset means auto: nothing to check, and no torch to import
        from realhf.impl.model.nn import cpu_gemm

        cpu_gemm.requested()
    host_memory.mode()


def run_experiment(exp_name: str, config, console: Optional[Console] = None, spec=None) -> int:
    """Run the experiment; ``console`` shows its progress (default: a normal one on stdout). ``spec``: the experiment
    spec the caller built from ``config`` (the quickstart's memory plan), shipped to the processes as it is; without
    it the spec is built here."""
    console = console or Console()
    if spec is None:
        spec = build_spec(exp_name, config)  # validates: raises before any process starts
    check_process_env()  # (the quickstart checked both already, with exit code 2)
    run_dir = os.path.dirname(spec.log_dir)
    lock = RunLock(run_dir)
    try:
        lock.acquire()
        store = RecoverStore(spec.recover_dir)
        run_id, resume = _first_launch(config, store)
    except (LaunchError, RunLocked) as e:
        lock.release()
        sys.stderr.write(f"error: {e}\n")
        return 2
    except OSError as e:  # an unwritable or missing fileroot, found before anything starts
        lock.release()
        msg = (f"fileroot={config.fileroot!r}: cannot write the run folder {run_dir} ({e.strerror or e}); set fileroot "
               "to a writable folder")
        sys.stderr.write(f"error: {msg}\n")
        return 2
    retries = config.recover_retries if config.recover_mode == "auto" else 0
    attempt = 0
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    for s, h in handlers.items():
        # Ctrl-C or kill -INT (also when a shell started the launcher in the background, which ignores SIGINT), a
        # kill (SIGTERM) or a closed terminal (SIGHUP) stops every process of the run; under nohup (SIGHUP
        # ignored) the run outlives its terminal
        if not (s == signal.SIGHUP and h == signal.SIG_IGN):
            signal.signal(s, lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        while True:
            t0 = time.time()
            try:
                _launch_once(exp_name, config, spec, resume=resume, run_id=run_id, console=console)
                store.mark_finished()
                logger.info(f"experiment {config.experiment_name}/{config.trial_name} finished in {time.time() - t0:.1f}s; logs in {spec.log_dir}")
                console.finish(spec.log_dir, f"{config.experiment_name}/{config.trial_name}")
                return 0
            except JobFailure as e:
                logger.error(f"run failed: {e}")
                if attempt >= retries:
                    return 1
                attempt += 1
                try:
                    latest = store.latest()
                except RecoverError as err:
                    logger.error(f"recover_mode=auto: cannot relaunch: {err}")
                    return 1
                resume = latest is not None and latest["run_id"] == run_id
                logger.warning(
                    f"recover_mode=auto: relaunching (attempt {attempt}/{retries}), "
                    + (f"resuming from the last recover checkpoint (global step {latest['global_step']})" if resume
                       else "no recover checkpoint of this run yet: starting over")
                )
    except KeyboardInterrupt:
        logger.error("interrupted: all processes stopped")
        return 130
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
        lock.release()
