"""Helpers for child processes."""
from __future__ import annotations

import gc
import os
import sys
import threading
import time

# exit code of a worker that ended itself because its master stopped sending heartbeats (the launchers report
# the master as the failed process)
MASTER_LOST_EXIT = 75


LEASE_ENV = "REALHF_LAUNCHER_LEASE"  # a file the launcher touches while it lives (launchers whose jobs are not its children)
LEASE_SECS_ENV = "REALHF_LAUNCHER_LEASE_SECS"


def exit_when_parent_dies(exit_code: int = 1, interval: float = 1.0) -> None:
    """Start a daemon thread that ends this process (``os._exit``) as soon as its parent is gone, even in
    the middle of a long computation, so a child is never left running. (Not ``PR_SET_PDEATHSIG``: that
    fires when the parent *thread* that started us exits.) Where the launcher is not an ancestor (Slurm), it names
    a lease file in ``$REALHF_LAUNCHER_LEASE`` that it touches while it lives: a lease older than
    ``$REALHF_LAUNCHER_LEASE_SECS`` (default 60) means the launcher is gone (killed outright), and so does this
    process."""
    parent = os.getppid()
    lease = os.environ.get(LEASE_ENV)
    stale = float(os.environ.get(LEASE_SECS_ENV) or 60.0)

    def lease_expired() -> bool:
        try:
            return time.time() - os.stat(lease).st_mtime > stale
        except OSError:
            return True  # removed: the launcher finished or was stopped

    def watch():
        while True:
            time.sleep(interval)
            if os.getppid() != parent or (lease and lease_expired()):
                os._exit(exit_code)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def exit_done(code) -> None:
    """``sys.exit(code)`` for a process whose work is done. Python's shutdown ends with full garbage collections
    over every object left (torch, transformers and the model code: 0.5-1 s of CPU in each of a run's processes,
    while the launcher waits for the master to exit). Frozen first (``gc.freeze``), those objects are not
    traversed; everything else of the shutdown runs as usual: atexit handlers, logging's flush, module teardown."""
    gc.freeze()
    sys.exit(code)


def source_root() -> str:
    """The folder that holds the ``realhf/`` package (and, in a source checkout, ``evaluation/``)."""
    import realhf

    return os.path.dirname(os.path.dirname(os.path.abspath(realhf.__file__)))


def env_with_source_path(env=None) -> dict:
    """A copy of ``env`` (default ``os.environ``) with :func:`source_root` first on ``PYTHONPATH``, so a
    child started with ``python -m realhf...`` imports this same source tree."""
    env = dict(os.environ if env is None else env)
    root = source_root()
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


FULL_DISK_BYTES = 1 << 20  # a file system with less free space than this cannot take a log or a checkpoint


def full_disk_note(path: str) -> str:
    """A line saying that the file system holding ``path`` is full (whatever was written there last, e.g. a
    process's dying words in its log, may be cut), or ``""`` when it has room or cannot be asked."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        st = os.statvfs(folder)
    except OSError:
        return ""
    free = st.f_bavail * st.f_frsize
    if free >= FULL_DISK_BYTES:
        return ""
    return (f"(no space left on device: the file system of {folder} has {free} bytes free, so the lines above may "
            "be cut or missing; free some space there, or point fileroot elsewhere, and launch again)")


def tail(path: str, n: int = 25) -> str:
    """The last ``n`` lines of a (log) file, or ``(no log)`` when it cannot be read; followed by
    :func:`full_disk_note` when the file's disk is full (its last lines may then be cut)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - 16384))
            lines = f.read().decode(errors="replace").splitlines()
        out = "\n".join(lines[-n:])
    except OSError:
        out = "(no log)"
    note = full_disk_note(path)
    return "\n".join(x for x in (out, note) if x)
