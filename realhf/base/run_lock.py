"""One launch per trial folder at a time: an exclusive ``flock`` on ``<run dir>/.lock``.

The kernel releases the lock when its holder dies, however it dies, so a stale lock never blocks a
relaunch. The file records who holds it (pid, host, start time, command) for the error a second launch
gets. The lock file itself is never removed (removing it would let two holders lock different files).
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time


class RunLocked(RuntimeError):
    """Another launcher holds the trial's lock; the message names it."""


class RunLock:
    def __init__(self, run_dir: str):
        self.path = os.path.join(run_dir, ".lock")
        self._fd = None

    def acquire(self) -> "RunLock":
        """Take the lock or raise RunLocked naming the holder (PermissionError/OSError when the folder is not
        writable)."""
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self._holder(fd)
            os.close(fd)
            raise RunLocked(f"the trial folder {os.path.dirname(self.path)} is in use by another launch ({holder}); "
                            "wait for it to end, stop it, or choose another trial_name") from None
        except OSError:
            os.close(fd)
            raise
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
              "command": " ".join(sys.argv)[:500]}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        self._fd = fd
        return self

    @staticmethod
    def _holder(fd: int) -> str:
        try:
            h = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
            return f"pid {h['pid']} on {h['host']} since {h['started']}: {h['command']}"
        except (OSError, ValueError, KeyError, UnicodeDecodeError):
            return "holder unknown"

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()
