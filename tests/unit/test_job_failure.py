"""What the launcher names when a run's processes end in failure at once: the likeliest cause first (real processes
under the local scheduler)."""
from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from realhf.scheduler.local import JobFailure, LocalScheduler


def _until_ended(sched, names, timeout=30.0):
    t0 = time.monotonic()
    while any(sched.jobs[n].proc.poll() is None for n in names):
        assert time.monotonic() - t0 < timeout, "the jobs did not end"
        time.sleep(0.05)


def test_a_killed_worker_is_named_before_the_master_that_failed_because_of_it(tmp_path):
    """A worker killed by a signal takes its peers and the master down within milliseconds; when the launcher finds
    them all ended at one poll, it names the killed worker (the cause) and lists the others."""
    sched = LocalScheduler(str(tmp_path))
    try:
        sched.submit("master", [sys.executable, "-c", "import sys, time; time.sleep(0.3); sys.exit(1)"], worker=False)
        sched.submit("model_worker_0", [sys.executable, "-c", "import sys; sys.exit(3)"])
        w1 = sched.submit("model_worker_1", [sys.executable, "-c", "import time; time.sleep(60)"])
        os.kill(w1.proc.pid, signal.SIGKILL)
        _until_ended(sched, ["master", "model_worker_0", "model_worker_1"])
        with pytest.raises(JobFailure) as e:
            sched.wait("master", poll=0.05, timeout=30)
        assert (e.value.name, e.value.code) == ("model_worker_1", -signal.SIGKILL)
        msg = str(e.value)
        assert msg.startswith("model_worker_1 exited with code -9 (killed by signal 9); also ended: "), msg
        # the worker's own error before the master's
        assert msg.index("model_worker_0 (exit code 3)") < msg.index("master (exit code 1)"), msg
    finally:
        sched.stop_all()


def test_the_master_alone_is_named_when_only_it_failed(tmp_path):
    sched = LocalScheduler(str(tmp_path))
    try:
        sched.submit("master", [sys.executable, "-c", "import sys; print('bad config'); sys.exit(1)"], worker=False)
        sched.submit("model_worker_0", [sys.executable, "-c", "import time; time.sleep(60)"])
        _until_ended(sched, ["master"])
        with pytest.raises(JobFailure, match=r"^master exited with code 1\. Last lines of its log:\n.*bad config"):
            sched.wait("master", poll=0.05, timeout=30)
    finally:
        sched.stop_all()
