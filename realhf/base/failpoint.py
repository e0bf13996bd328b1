"""Named crash points for tests: ``hit(name)`` kills this process with SIGKILL when ``$REALHF_FAILPOINTS`` (a
comma-separated list) names ``name`` — or ``name@k``, which fires on the k-th hit of ``name`` in this process;
otherwise it does nothing. Used to crash a real process at an exact moment (e.g. between writing a checkpoint and
publishing it) and check that nothing is lost."""
from __future__ import annotations

import collections
import os
import signal

_hits: collections.Counter = collections.Counter()


def hit(name: str) -> None:
    points = os.environ.get("REALHF_FAILPOINTS", "")
    if not points:
        return
    _hits[name] += 1
    for p in points.split(","):
        point, _, nth = p.strip().partition("@")
        if point == name and (not nth or int(nth) == _hits[name]):
            os.kill(os.getpid(), signal.SIGKILL)
