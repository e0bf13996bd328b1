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
from typing import Dict, List, Optional

from realhf.base import logging
from realhf.base.process import tail

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Job:
    name: str
    proc: subprocess.Popen
    log_path: str


class JobFailure(RuntimeError):
    def __init__(self, name: str, code: int, log_tail: str):
        self.name, self.code, self.log_tail = name, code, log_tail
        sig = f" (killed by signal {-code})" if code < 0 else ""
        super().__init__(f"{name} exited with code {code}{sig}. Last lines of its log:\n{log_tail}")


class WaitMixin:
    """``wait``/``wait_others`` over ``self._codes()`` ({job name: exit code, None while running}) and
    ``self.jobs[name].log_path``: shared by the launchers."""

    def wait(self, main: str, poll: float = 0.2, timeout: Optional[float] = None) -> None:
        """Return when ``main`` exits 0; raise JobFailure when any job exits non-zero (or is lost),
        TimeoutError after ``timeout`` seconds."""
        t0 = time.monotonic()
        while True:
            codes = self._codes()
            for name, code in codes.items():
                if code is not None and code != 0:
                    raise JobFailure(name, code, tail(self.jobs[name].log_path))
            if codes[main] == 0:
                return
            if timeout is not None and time.monotonic() - t0 > timeout:
                raise TimeoutError(f"experiment did not finish within {timeout:.0f} s")
            time.sleep(poll)

    def wait_others(self, grace: float = 30.0):
        """After the master finished: give the workers ``grace`` seconds to exit on their own."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < grace:
            if all(c is not None for c in self._codes().values()):
                return
            time.sleep(0.1)


class LocalScheduler(WaitMixin):
    def __init__(self, log_dir: str):
        self.log_dir = log_dir
        os.makedirs(log_dir, exist_ok=True)
        self.jobs: Dict[str, Job] = {}
        atexit.register(self.stop_all)

    def submit(self, name: str, cmd: List[str], env: Optional[dict] = None, worker: bool = True) -> Job:
        """Start ``cmd`` as job ``name``. (``worker`` matters to launchers that reserve resources.)"""
        log_path = os.path.join(self.log_dir, f"{name}.log")
        full_env = dict(os.environ)
        full_env.update(env or {})
        full_env.setdefault("PYTHONUNBUFFERED", "1")
        with open(log_path, "ab") as logf:
            proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=full_env,
                                    start_new_session=True, stdin=subprocess.DEVNULL)
        job = Job(name, proc, log_path)
        self.jobs[name] = job
        logger.info(f"started {name} (pid {proc.pid}), log: {log_path}")
        return job

    def _codes(self) -> Dict[str, Optional[int]]:
        return {n: j.proc.poll() for n, j in self.jobs.items()}

    def stop_all(self, grace: float = 5.0):
        alive = [j for j in self.jobs.values() if j.proc.poll() is None]
        for j in alive:
            try:
                os.killpg(j.proc.pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass
        t0 = time.monotonic()
        while time.monotonic() - t0 < grace and any(j.proc.poll() is None for j in alive):
            time.sleep(0.05)
        for j in self.jobs.values():
            try:  # the group may hold grandchildren even when the leader is gone
                os.killpg(j.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                j.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                logger.error(f"{j.name} (pid {j.proc.pid}) did not die")
        self.jobs.clear()


def python_cmd(module: str, *args: str) -> List[str]:
    return [sys.executable, "-m", module, *args]
