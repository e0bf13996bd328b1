"""realhf.base.cpu_share: a CPU worker's threads follow the host's idle cores (option cpus_per_worker_max)."""
import multiprocessing as mp
import os
import time

import pytest
import torch

from realhf.base import cpu_share
from realhf.base.cpu_share import ThreadGovernor, read_busy_seconds, threads_for


def test_threads_for_takes_the_idle_cores_within_bounds():
    assert threads_for(0.0, 2, 1, 2) == 2
    assert threads_for(0.2, 2, 1, 2) == 2  # background noise of a few percent leaves the core idle
    assert threads_for(0.67, 2, 1, 2) == 1  # a server that got 2/3 of a core while colliding with our two threads
    assert threads_for(1.0, 2, 1, 2) == 1
    assert threads_for(2.0, 2, 1, 2) == 1  # never below lo
    assert threads_for(0.0, 8, 2, 4) == 4  # never above hi
    assert threads_for(5.0, 8, 2, 4) == 3


class _Host:
    """A scripted host: the busy CPU seconds of everyone and of this process, advanced by the test."""

    def __init__(self):
        self.t, self.busy, self.own = 0.0, 0.0, 0.0

    def run(self, dt, own_cores, other_cores):
        self.t += dt
        self.own += own_cores * dt
        self.busy += (own_cores + other_cores) * dt


def test_governor_follows_the_other_processes_and_measures_only_between_intervals():
    host, calls = _Host(), []
    g = ThreadGovernor(1, 2, interval=0.25, cpus=[0, 1], set_threads=calls.append, clock=lambda: host.t,
                       sample=lambda: (host.busy, host.own))
    assert calls == [1] and g.threads == 1
    host.run(0.1, own_cores=1, other_cores=0)
    assert g.tick() == 1 and calls == [1]  # within the interval: no measurement, no change
    host.run(0.2, own_cores=1, other_cores=0.02)  # the server waits: a core stands idle
    assert g.tick() == 2 and calls == [1, 2]
    assert g.others == pytest.approx(0.02 * 0.2 / 0.3)
    host.run(0.3, own_cores=1.33, other_cores=0.67)  # the server decodes again, colliding with our two threads
    assert g.tick() == 1 and calls == [1, 2, 1]
    host.run(0.3, own_cores=1, other_cores=1)
    assert g.tick() == 1 and calls == [1, 2, 1]  # no call when the count stays
    assert g.changes == 2
    assert g.mean_threads() == pytest.approx((1 * 0.3 + 2 * 0.3 + 1 * 0.3) / 0.9)  # by time, over the windows
    assert g.mean_threads() == 1.0  # nothing measured since: the threads now


def _spin(seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def test_proc_stat_counts_another_process_and_not_this_one():
    """Real /proc: a spinning child shows up as another process's core, our own spinning does not."""
    if not os.path.exists("/proc/stat"):
        pytest.skip("no /proc/stat")
    cpus = sorted(os.sched_getaffinity(0))
    own0 = cpu_share.own_cpu_seconds()
    _spin(0.6)
    assert cpu_share.own_cpu_seconds() - own0 >= 0.4  # the spin counted as ours
    child = mp.get_context("spawn").Process(target=_spin, args=(3.0,))
    child.start()
    try:
        time.sleep(1.0)  # the child is up and spinning
        own2, busy2, t2 = cpu_share.own_cpu_seconds(), read_busy_seconds(cpus), time.monotonic()
        time.sleep(1.0)
        own3, busy3, t3 = cpu_share.own_cpu_seconds(), read_busy_seconds(cpus), time.monotonic()
    finally:
        child.join()
    others_while_child = ((busy3 - busy2) - (own3 - own2)) / (t3 - t2)
    assert others_while_child >= 0.6, others_while_child  # about a whole core, less what else the host runs
    assert own3 - own2 < 0.3  # we slept


def test_model_ticks_between_blocks_forward_and_backward():
    """With a governor installed, a forward pass ticks before every block and the backward pass between blocks
    (the compute thread sets its own OpenMP threads); the loss and gradients are those of the plain model."""
    from realhf.impl.model.conversion.hf_io import config_from_hf_path
    from realhf.impl.model.nn.real_model import PackedInput, ReaLModel
    from realhf.impl.model.tiny import ensure_tiny_model

    cfg = config_from_hf_path(ensure_tiny_model("qwen2"))
    model = ReaLModel(cfg, dtype=torch.float32)
    model.init_random(seed=0)
    model.attach_flat_grad()
    ids = torch.randint(0, cfg.vocab_size, (12,))
    inp = PackedInput(cu_seqlens=torch.tensor([0, 5, 12], dtype=torch.int32), max_seqlen=7,
                      position_ids=torch.cat([torch.arange(5), torch.arange(7)]))

    def loss_and_grad():
        model.flat_grad.zero_()
        loss = model(ids, inp).float().logsumexp(-1).mean()
        loss.backward()
        return loss.detach(), model.flat_grad.clone()

    base_loss, base_grad = loss_and_grad()
    phases, phase = [], ["fwd"]

    def sample():
        phases.append(phase[0])
        return (0.0, 0.0)

    clock = iter(range(10**6))
    g = ThreadGovernor(1, 1 if os.cpu_count() == 1 else 2, interval=0.5, cpus=[0], set_threads=lambda n: None,
                       clock=lambda: float(next(clock)), sample=sample)
    cpu_share._governor = g
    try:
        model.flat_grad.zero_()
        out = model(ids, inp).float().logsumexp(-1).mean()
        phase[0] = "bwd"
        out.backward()
    finally:
        cpu_share.uninstall()
    n = cfg.n_layers
    assert phases.count("fwd") == 1 + n  # the governor's first sample, then one tick before every block
    assert phases.count("bwd") == n  # one tick as the backward pass reaches each block's output
    loss, grad = loss_and_grad()
    assert torch.equal(loss, base_loss) and torch.equal(grad, base_grad)
