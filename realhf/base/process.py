"""Helpers for child processes."""
from __future__ import annotations

import os
import threading
import time


def exit_when_parent_dies(exit_code: int = 1, interval: float = 1.0) -> None:
    """Start a daemon thread that ends this process (``os._exit``) as soon as its parent is gone, even in
    the middle of a long computation, so a child is never left running. (Not ``PR_SET_PDEATHSIG``: that
    fires when the parent *thread* that started us exits.)"""
    parent = os.getppid()

    def watch():
        while True:
            time.sleep(interval)
            if os.getppid() != parent:
                os._exit(exit_code)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()
