"""Local launcher: runs the master and the model workers as child processes on this machine.

Each process gets its own session (process group) and log file under the experiment's log dir.
``wait()`` returns as soon as the master finishes or any process fails; a failure is reported with
the process name, exit code and the tail of its log. ``stop_all()`` (also run at exit and on
SIGINT/SIGTERM) terminates every process group, then kills what is left: nothing stays behind.
"""
from __future__ import annotations

import atexit
import dataclasses
import os
import signal
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from realhf.base import logging
from realhf.base.process import MASTER_LOST_EXIT, tail

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Job:
    name: str
    proc: subprocess.Popen
    log_path: str


class JobFailure(RuntimeError):
    def __init__(self, name: str, code: int, log_tail: str, reason: Optional[str] = None, also: Sequence[str] = ()):
        self.name, self.code, self.log_tail = name, code, log_tail
        sig = f" (killed by signal {-code})" if code < 0 else ""
        more = f"; also ended: {', '.join(also)}" if also else ""
        what = reason or f"{name} exited with code {code}{sig}"
        super().__init__(f"{what}{more}. Last lines of its log:\n{log_tail}")


def _cause_first(failed: List[Tuple[str, int]], main: str) -> List[Tuple[str, int]]:
    """Jobs that ended in failure within one poll, the likeliest cause first: one killed by a signal (a kill, the
    OOM killer) before one that exited with an error (its peers' collectives and the master fail because of it),
    a worker before ``main`` (which ends when a worker's reply is an error)."""
    return sorted(failed, key=lambda nc: (nc[1] >= 0, nc[0] == main))


class WaitMixin:
    """``wait``/``wait_others`` over ``self._codes()`` ({job name: exit code, None while running}) and
    ``self.jobs[name].log_path``: shared by the launchers."""

    def submit_group(self, names: List[str], cmd_for: Callable[[str], List[str]], env: Optional[dict] = None,
                     worker: bool = True, slots: int = 1, first_slot: Optional[int] = None,
                     env_for: Optional[Callable[[int], dict]] = None) -> None:
        """Start job ``names[k]`` with ``cmd_for(str(k))`` (and ``env`` updated with ``env_for(k)``), one by one; job
        ``k`` holds the ``slots`` device slots from ``first_slot + k * slots``."""
        for k, name in enumerate(names):
            e = dict(env or {}, **(env_for(k) if env_for is not None else {}))
            self.submit(name, cmd_for(str(k)), e, worker=worker, slots=slots,
                        first_slot=None if first_slot is None else first_slot + k * slots)

    def wait(self, main: str, poll: float = 0.2, timeout: Optional[float] = None,
             on_poll: Optional[Callable[[], None]] = None, survivable: tuple = (),
             on_survived: Optional[Callable[[str, int], None]] = None) -> None:
        """Return when ``main`` exits 0; raise JobFailure when any job exits non-zero (or is lost),
        TimeoutError after ``timeout`` seconds. ``on_poll()`` is called at every poll (e.g. to show progress).
        Jobs whose names start with a prefix of ``survivable`` (e.g. an asynchronous run's generation servers, its
        rollout workers) may fail while another job of the same prefix still runs: each such failure is logged once
        as a warning and passed to ``on_survived(name, code)`` (e.g. to re-issue a lost worker's work)."""
        t0 = time.monotonic()
        tolerated: set = set()
        while True:
            if on_poll is not None:
                on_poll()
            codes = self._codes()
            failed = []
            for name, code in codes.items():
                if code == MASTER_LOST_EXIT and name != main:
                    raise JobFailure(main, code, tail(self.jobs[name].log_path),
                                     reason=f"{main} stopped responding: {name} heard no heartbeat from it and ended "
                                            f"(exit code {code}); the {main} was stopped")
                if code is not None and code != 0:
                    if name in tolerated:  # its group may end normally later (rollout workers finish their work)
                        continue
                    prefix = next((p for p in survivable if name.startswith(p)), None)
                    alive = [n for n in codes if prefix and n.startswith(prefix) and codes[n] is None]
                    if alive:
                        tolerated.add(name)
                        logger.warning(f"{name} exited with code {code}; the run goes on with {', '.join(alive)}")
                        if on_survived is not None:
                            on_survived(name, code)
                        continue
                    failed.append((name, code))
            if failed:
                (name, code), *rest = _cause_first(failed, main)
                raise JobFailure(name, code, tail(self.jobs[name].log_path), reason=getattr(self, "lost", {}).get(name),
                                 also=[f"{n} (exit code {c})" for n, c in rest])
            if codes[main] == 0:
                return
            if timeout is not None and time.monotonic() - t0 > timeout:
                raise TimeoutError(f"experiment did not finish within {timeout:.0f} s")
            time.sleep(poll)

    def wait_others(self, grace: float = 30.0, skip: tuple = ()):
        """After the master finished: give the workers ``grace`` seconds to exit on their own (jobs whose names
        start with one of ``skip``, e.g. generation servers, serve until stopped and are not waited for)."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < grace:
            if all(c is not None for n, c in self._codes().items() if not n.startswith(skip)):
                return
            time.sleep(0.1)


class LocalScheduler(WaitMixin):
    def __init__(self, log_dir: str):
        self.log_dir = log_dir
        os.makedirs(log_dir, exist_ok=True)
        self.jobs: Dict[str, Job] = {}
        atexit.register(self.stop_all)

    def submit(self, name: str, cmd: List[str], env: Optional[dict] = None, worker: bool = True,
               slots: int = 1, first_slot: Optional[int] = None) -> Job:
        """Start ``cmd`` as job ``name``. (``worker``, ``slots`` and ``first_slot``, the device slots it holds, matter
        to launchers that reserve resources and place jobs on nodes.)"""
        log_path = os.path.join(self.log_dir, f"{name}.log")
        proc = start_logged(cmd, env or {}, log_path)
        job = Job(name, proc, log_path)
        self.jobs[name] = job
        logger.info(f"started {name} (pid {proc.pid}), log: {log_path}")
        return job

    def _codes(self) -> Dict[str, Optional[int]]:
        return {n: j.proc.poll() for n, j in self.jobs.items()}

    def stop_all(self, grace: float = 5.0):
        stop_groups({j.name: j.proc for j in self.jobs.values()}, grace)
        self.jobs.clear()


class PrintScheduler(WaitMixin):
    """A dry run: each submitted job is printed (its environment and command line), nothing starts."""

    def __init__(self, log_dir: str, out, launcher: str):
        self.log_dir, self.out, self.launcher = log_dir, out, launcher
        self.jobs: Dict[str, Job] = {}

    def submit(self, name: str, cmd: List[str], env: Optional[dict] = None, worker: bool = True,
               slots: int = 1, first_slot: Optional[int] = None) -> None:
        import shlex

        where = f"device slots {first_slot}..{first_slot + slots - 1}" if first_slot is not None else "no device"
        env_s = " ".join(f"{k}={shlex.quote(str(v))}" for k, v in sorted((env or {}).items()))
        self.out.write(f"# {name} ({self.launcher}, {where}); log {os.path.join(self.log_dir, name)}.log\n"
                       f"{env_s} {' '.join(shlex.quote(a) for a in cmd)}\n")
        self.jobs[name] = Job(name, None, os.path.join(self.log_dir, f"{name}.log"))

    def _codes(self):
        return {n: None for n in self.jobs}

    def stop_all(self, grace: float = 0.0):
        self.jobs.clear()


def start_logged(cmd: List[str], env: Dict[str, str], log_path: str) -> subprocess.Popen:
    """Start ``cmd`` (environment: this one updated with ``env``) in its own session, its output appended
    to ``log_path``."""
    full_env = dict(os.environ)
    full_env.update(env)
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    with open(log_path, "ab") as logf:
        return subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=full_env,
                                start_new_session=True, stdin=subprocess.DEVNULL)


def _killpg(pid: int, sig: int):
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_groups(procs: Dict[str, subprocess.Popen], grace: float = 5.0):
    """SIGTERM the process group of every running process, give them ``grace`` seconds, then SIGKILL every
    group (a group may hold grandchildren even when its leader is gone) and reap the leaders."""
    alive = [p for p in procs.values() if p.poll() is None]
    for p in alive:
        _killpg(p.pid, signal.SIGTERM)
    t0 = time.monotonic()
    while time.monotonic() - t0 < grace and any(p.poll() is None for p in alive):
        time.sleep(0.05)
    for name, p in procs.items():
        _killpg(p.pid, signal.SIGKILL)
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            logger.error(f"{name} (pid {p.pid}) did not die")


def python_cmd(module: str, *args: str) -> List[str]:
    return [sys.executable, "-m", module, *args]


def _register():
    from realhf.scheduler import Launcher, register_launcher

    register_launcher(Launcher("local", make=lambda log_dir, config, n_workers: LocalScheduler(log_dir),
                               check=_check_devices,
                               dry_run=lambda log_dir, config, n, out: PrintScheduler(log_dir, out, "local")))


def _check_devices(config, n_slots: int) -> None:
    """On a CUDA machine, every device slot of the run must land on a visible GPU (see ``gpus_per_node``)."""
    from realhf.base.device_slots import check_slot_gpus, visible_cuda_devices

    check_slot_gpus(n_slots, config.n_devices_per_node, config.gpus_per_node, visible_cuda_devices())


_register()
