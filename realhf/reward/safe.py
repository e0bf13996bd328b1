"""A small pool of isolated, reusable grading worker processes with a hard per-task timeout.

Each worker is a separate Python process (``python -m realhf.reward._worker``, started with
``subprocess``, not forked, so it shares nothing with a parent holding CUDA contexts or threads)
that talks JSON lines over its stdin/stdout. A task that does not answer within its timeout gets
its worker killed (SIGKILL) and replaced; the caller sees status ``"timeout"``. A worker that
dies (e.g. hits its memory cap) gives ``"error"``. Workers start lazily, are reused, are shut
down at interpreter exit (``atexit``), and exit on their own when their parent dies.

The pool is thread-safe: ``run`` blocks until a worker is free; the time spent waiting for a
free or starting worker does not count against the task's timeout.
"""
from __future__ import annotations

import atexit
import itertools
import json
import os
import select
import subprocess
import sys
import threading
import time
import weakref

from realhf.base import logging
from realhf.base.process import env_with_source_path, source_root

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT = 120.0  # seconds for a fresh worker to import sympy and report ready
_LIVE_POOLS: "weakref.WeakSet[WorkerPool]" = weakref.WeakSet()


class _Worker:
    """One worker process and the parent side of its pipe."""

    def __init__(self, mem_limit_mb: int):
        env = env_with_source_path()
        env["REALHF_REWARD_WORKER_MEM_MB"] = str(mem_limit_mb)
        for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            env[k] = "1"
        env.pop("CUDA_VISIBLE_DEVICES", None)
        env["CUDA_VISIBLE_DEVICES"] = ""
        stderr = None if os.environ.get("REALHF_REWARD_WORKER_STDERR") else subprocess.DEVNULL
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "realhf.reward._worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            env=env,
            cwd=source_root(),
            start_new_session=True,  # terminal Ctrl-C goes to the parent, which cleans up
        )
        self._buf = b""
        self.ready = False
        self.started = time.monotonic()

    def _readline(self, deadline: float) -> bytes | None:
        """One line from the worker, or None on timeout; raises EOFError if it died."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            r, _, _ = select.select([fd], [], [], left)
            if not r:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise EOFError("worker exited")
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line

    def wait_ready(self, timeout: float) -> bool:
        if self.ready:
            return True
        line = self._readline(self.started + timeout)
        self.ready = line is not None and json.loads(line).get("ready") is True
        return self.ready

    def call(self, req: dict, timeout: float):
        """Send ``req``; returns the reply dict or None on timeout; raises on a dead worker."""
        self.proc.stdin.write((json.dumps(req) + "\n").encode())
        self.proc.stdin.flush()
        line = self._readline(time.monotonic() + timeout)
        if line is None:
            return None
        return json.loads(line)

    def kill(self):
        try:
            self.proc.kill()
        except Exception:
            pass
        self._reap(timeout=2.0)

    def close(self, timeout: float = 1.0):
        try:
            self.proc.stdin.close()  # EOF: the worker exits its loop
        except Exception:
            pass
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return
        self._reap(timeout=0.1)

    def _reap(self, timeout: float):
        try:
            self.proc.wait(timeout)
        except Exception:
            pass
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except Exception:
                pass


class WorkerPool:
    """Thread-safe pool of up to ``max_workers`` grading processes.

    ``run(task, args, timeout)`` returns ``(status, value)`` with status ``"ok"``,
    ``"timeout"`` or ``"error"``; it never raises for problems of the task itself.
    """

    def __init__(self, max_workers: int = 2, mem_limit_mb: int = 4096):
        self.max_workers = max(1, int(max_workers))
        self.mem_limit_mb = mem_limit_mb
        self._cond = threading.Condition()
        self._idle: list[_Worker] = []
        self._n_alive = 0
        self._closed = False
        self._ids = itertools.count()
        self.n_killed = 0
        _LIVE_POOLS.add(self)

    # -- worker bookkeeping -------------------------------------------------------------
    def _acquire(self) -> _Worker:
        with self._cond:
            while True:
                if self._closed:
                    raise RuntimeError("WorkerPool is closed")
                if self._idle:
                    return self._idle.pop()
                if self._n_alive < self.max_workers:
                    self._n_alive += 1
                    break
                self._cond.wait()
        try:
            return _Worker(self.mem_limit_mb)
        except BaseException:
            with self._cond:
                self._n_alive -= 1
                self._cond.notify()
            raise

    def _release(self, w: _Worker, healthy: bool):
        with self._cond:
            if healthy and not self._closed:
                self._idle.append(w)
                self._cond.notify()
                return
            replace = not self._closed
            if not replace:
                self._n_alive -= 1
                self._cond.notify()
        w.kill()
        if replace:
            # start the replacement now so that its imports overlap with the caller's work
            try:
                fresh = _Worker(self.mem_limit_mb)
            except Exception as e:
                logger.warning("could not start a grading worker: %s", e)
                with self._cond:
                    self._n_alive -= 1
                    self._cond.notify()
                return
            with self._cond:
                if self._closed:
                    self._n_alive -= 1
                    closed = True
                else:
                    self._idle.append(fresh)
                    closed = False
                self._cond.notify()
            if closed:
                fresh.kill()

    def warmup(self, n: int | None = None):
        """Start ``n`` (default: all) workers now and wait until they are ready."""
        ws = []
        for _ in range(min(n or self.max_workers, self.max_workers)):
            with self._cond:
                if self._n_alive >= self.max_workers:
                    break
                self._n_alive += 1
            ws.append(_Worker(self.mem_limit_mb))
        for w in ws:
            self._release(w, w.wait_ready(STARTUP_TIMEOUT))

    # -- running tasks ------------------------------------------------------------------
    def run(self, task: str, args: list, timeout: float) -> tuple[str, object]:
        w = self._acquire()
        healthy = False
        try:
            try:
                if not w.wait_ready(STARTUP_TIMEOUT):
                    logger.warning("grading worker did not start within %.0fs", STARTUP_TIMEOUT)
                    return "error", None
                rid = next(self._ids)
                reply = w.call({"id": rid, "task": task, "args": args}, max(0.0, timeout))
            except (EOFError, OSError, ValueError) as e:
                logger.warning("grading worker died: %s", e)
                return "error", None
            if reply is None:
                with self._cond:
                    self.n_killed += 1
                return "timeout", None
            if reply.get("id") != rid:
                return "error", None
            healthy = True
            if reply.get("status") != "ok":
                logger.debug("grading task failed: %s", reply.get("msg"))
                return "error", None
            return "ok", reply.get("value")
        finally:
            self._release(w, healthy)

    def close(self):
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._cond.notify_all()
        for w in idle:
            w.close()
        with self._cond:
            self._n_alive -= len(idle)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


_default_pool: WorkerPool | None = None
_default_lock = threading.Lock()


def default_pool_size() -> int:
    env = os.environ.get("REALHF_REWARD_WORKERS")
    if env:
        return max(1, int(env))
    return max(1, min(4, os.cpu_count() or 1))


def get_default_pool() -> WorkerPool:
    """The process-wide shared pool (created on first use, ``REALHF_REWARD_WORKERS`` workers)."""
    global _default_pool
    with _default_lock:
        if _default_pool is None or _default_pool._closed:
            _default_pool = WorkerPool(default_pool_size())
        return _default_pool


@atexit.register
def _close_all_pools():
    for pool in list(_LIVE_POOLS):
        try:
            pool.close()
        except Exception:
            pass
