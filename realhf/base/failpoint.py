"""Named crash points for tests: ``hit(name)`` kills this process with SIGKILL when ``$REALHF_FAILPOINTS`` (a
comma-separated list) names ``name`` — or ``name@k``, which fires on the k-th hit of ``name`` in this process;
otherwise it does nothing. Used to crash a real process at an exact moment (e.g. between writing a checkpoint and
publishing it) and check that nothing is lost.

Named delay points, for property tests of timing: ``delay_secs(name)`` is a random duration in
``[0, max]`` when ``$REALHF_DELAYS`` (comma-separated ``name:max_seconds``) names ``name``, else 0; ``delay(name)``
sleeps it. The draws are seeded by ``$REALHF_DELAY_SEED`` (and the process id), so a failing run can be repeated."""
from __future__ import annotations

import collections
import os
import random
import signal
import time

_hits: collections.Counter = collections.Counter()
_rng = None


def hit(name: str) -> None:
    points = os.environ.get("REALHF_FAILPOINTS", "")
    if not points:
        return
    _hits[name] += 1
    for p in points.split(","):
        point, _, nth = p.strip().partition("@")
        if point == name and (not nth or int(nth) == _hits[name]):
            os.kill(os.getpid(), signal.SIGKILL)


def delay_secs(name: str) -> float:
    spec = os.environ.get("REALHF_DELAYS", "")
    if not spec:
        return 0.0
    global _rng
    for p in spec.split(","):
        point, _, mx = p.strip().partition(":")
        if point == name:
            if _rng is None:
                _rng = random.Random(f"{os.environ.get('REALHF_DELAY_SEED', '0')}:{os.getpid()}")
            return _rng.uniform(0.0, float(mx or 1.0))
    return 0.0


def delay(name: str) -> None:
    d = delay_secs(name)
    if d > 0:
        time.sleep(d)
