"""The statistics tracker of the training steps: weighted means over micro-batches and data-parallel ranks."""
import pytest

from realhf.base.stats_tracker import StatsTracker
from realhf.testing import run_distributed

# per rank, per micro-batch: (mean loss over the micro-batch's tokens, its number of tokens, its largest ratio)
RECORDS = {0: [(1.0, 10, 0.5), (3.0, 30, 2.5)], 1: [(10.0, 1, 1.5), (4.0, 3, 0.25), (2.0, 6, 0.75)]}


def _global(records):
    rows = [r for mbs in records.values() for r in mbs]
    w = sum(n for _, n, _ in rows)
    return {"loss": sum(v * n for v, n, _ in rows) / w, "n_tokens": float(w), "ratio_max": max(m for *_, m in rows)}


def _rank_tracker(rank):
    """The rank's micro-batches recorded one tracker each, merged as the engine merges them."""
    tracker = StatsTracker()
    for value, n, ratio in RECORDS[rank]:
        mb = StatsTracker()
        mb.mean("loss", value, weight=n)
        mb.sum("n_tokens", n)
        mb.max("ratio_max", ratio)
        tracker.merge(mb)
    return tracker


def _worker():
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    reduced = _rank_tracker(rank)
    head = reduced.all_reduce_(dist.group.WORLD, head=torch.tensor([float(rank + 1)], dtype=torch.float64))
    # the last pipeline stage's tracker shared with a stage that recorded something else
    shared = _rank_tracker(1) if rank == 1 else StatsTracker()
    if rank == 0:
        shared.sum("stale", 7.0)
    sent = shared.broadcast_(1, dist.group.WORLD, head=torch.tensor([5.0, 6.0], dtype=torch.float64))
    return {"reduced": reduced.export(), "head": head.tolist(), "shared": shared.export(), "sent": sent.tolist()}


def test_weighted_means_over_micro_batches_and_two_ranks():
    want = _global(RECORDS)
    # weights matter here: the plain mean of the five micro-batch means is 4.0, the weighted one 2.68
    assert abs(want["loss"] - 2.68) < 1e-12
    for res in run_distributed(_worker, 2, timeout=60):
        assert res["reduced"] == pytest.approx(want, rel=1e-12)
        assert res["head"] == [3.0]  # the caller's own values summed in the same all-reduce
        assert res["shared"] == pytest.approx(_rank_tracker(1).export(), rel=1e-12)  # rank 1's, nothing of rank 0's
        assert res["sent"] == [5.0, 6.0]


def test_minibatches_merge_by_weight():
    """Two minibatches' trackers merge as one batch: a mean of means would read 2.0, the batch's mean is 1.25."""
    a, b = StatsTracker(), StatsTracker()
    a.mean("critic_loss", 1.0, weight=30)
    b.mean("critic_loss", 4.0, weight=2)
    b.mean("critic_loss", 1.0, weight=8)  # the same key again within a minibatch
    a.merge(b)
    assert a.export() == {"critic_loss": pytest.approx((30 + 8 + 8) / 40)}
    assert StatsTracker().merge(a).export() == a.export()


def test_edge_cases_and_misuse():
    t = StatsTracker()
    t.mean("empty", float("nan"), weight=0)  # a micro-batch without loss tokens: weighs nothing, no NaN
    assert t.export() == {"empty": 0.0}
    t.mean("empty", 3.0, weight=2)
    assert t.export() == {"empty": 3.0}
    with pytest.raises(ValueError, match=r"'empty'.*mean.*now as a sum"):
        t.sum("empty", 1.0)
    with pytest.raises(ValueError, match=r"'loss': weight=-1"):
        t.mean("loss", 1.0, weight=-1)
