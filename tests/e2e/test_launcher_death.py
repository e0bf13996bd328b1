"""No process of a run outlives its launcher, and a master that stops responding ends the run with a named error.

Real launches of ``sft`` on the tiny model; the launcher is killed (SIGKILL) or hung up on (SIGHUP, what closing
its terminal sends), the master is stopped (SIGSTOP). Liveness is checked with generous deadlines (the
processes are expected to end within a few seconds; the deadline only keeps a broken build from hanging).
"""
import ipaddress
import signal

import psutil
import pytest

from realhf.testing import run_processes, sft_cmd, start_quickstart, wait_for_steps, wait_until_gone


def long_run(setup, root, *extra):
    return start_quickstart(sft_cmd(*setup, root, "long", "allocation_mode=d2m1p1", "n_devices_per_node=2",
                                    "exp_ctrl.total_train_epochs=500", *extra))


def _stop_all(root, p):
    """Whatever a failed test left running: the run's processes, then the launcher."""
    for q in run_processes(root):
        q.kill()
    if p.poll() is None:
        p.kill()
        p.communicate()


def _listening(procs):
    out = []
    for p in procs:
        try:
            out += [(p.cmdline()[-1], c.laddr.ip) for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
        except psutil.Error:
            pass
    return out


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGHUP], ids=["kill-9", "hangup"])
def test_every_process_ends_with_its_launcher(tiny_sft, tmp_path, sig):
    root = str(tmp_path)
    p = long_run(tiny_sft, root)
    try:
        wait_for_steps(root, "long", 2, proc=p)
        procs = [q for q in run_processes(root) if q.pid != p.pid]
        assert len(procs) == 3, procs  # master and two model workers
        if sig == signal.SIGKILL:
            # on one machine, everything the run's processes listen on is loopback only (ZMQ sockets, heartbeats,
            # and the torch.distributed rendezvous store)
            listening = _listening(procs)
            assert listening and all(ipaddress.ip_address(ip).is_loopback for _, ip in listening), listening
        p.send_signal(sig)
        left = wait_until_gone(root, timeout=30)
        assert not left, f"processes outlived their launcher: {[q.cmdline() for q in left]}"
    finally:
        for q in run_processes(root):
            q.kill()
        p.kill()
        p.communicate()


def test_a_stopped_master_ends_the_run_with_a_named_error(tiny_sft, tmp_path):
    root = str(tmp_path)
    p = long_run(tiny_sft, root, "worker_timeout_secs=4")
    try:
        wait_for_steps(root, "long", 2, proc=p)
        (master,) = [q for q in run_processes(root) if "master" in q.cmdline()]
        master.send_signal(signal.SIGSTOP)
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 1, out[-3000:]
        assert "master stopped responding" in out and "sent no heartbeat" in out, out[-3000:]
        assert not wait_until_gone(root, timeout=30), "processes left behind"
    finally:
        _stop_all(root, p)


def test_background_and_nohup_launch_interrupt_and_hangup(tiny_sft, tmp_path):
    """Started as ``nohup cmd &`` does (SIGINT and SIGHUP ignored): a hang-up does not stop the run (nohup's
    promise), and kill -INT still stops every process of it, with exit code 130."""
    root = str(tmp_path)
    p = start_quickstart(sft_cmd(*tiny_sft, root, "long", "allocation_mode=d2m1p1", "n_devices_per_node=2",
                                 "exp_ctrl.total_train_epochs=500"), ignored_signals=(signal.SIGINT, signal.SIGHUP))
    try:
        wait_for_steps(root, "long", 2, proc=p)
        p.send_signal(signal.SIGHUP)
        with open(f"{root}/long/trial0/logs/stats.jsonl") as f:
            n = sum(1 for _ in f)
        wait_for_steps(root, "long", n + 3, proc=p)  # still training after the hang-up
        p.send_signal(signal.SIGINT)
        out, _ = p.communicate(timeout=60)
        assert p.returncode == 130, out[-3000:]
        assert "interrupted: all processes stopped" in out, out[-3000:]
        assert not wait_until_gone(root, timeout=30), "processes left behind"
    finally:
        _stop_all(root, p)
