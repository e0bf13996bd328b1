"""The trajectory stream of asynchronous runs, over real ZMQ sockets: rollout workers push signed trajectories to
the trainer head their slot belongs to; a head returns a batch once every one of its slots has arrived (in slot
order, whatever the arrival order), keeps early trajectories of later batches, and drops what is forged, a
duplicate, another head's or already trained."""
import time

import pytest

from realhf.api.core.workflow_api import AnswerSample, Trajectory
from realhf.base import name_resolve
from realhf.impl.dataset.jsonl import EpochIterator
from realhf.base.run_secret import new_run_secret
from realhf.system.transport.trajectory_stream import (TrajectoryPusher, TrajectoryStreamSource, head_slots, sample_id)


@pytest.mark.parametrize("bs,dp", [(4, 1), (4, 2), (5, 2), (7, 3), (3, 3)])
def test_head_slots_split_a_batch_as_a_synchronous_run_does(bs, dp):
    for r in range(dp):
        it = EpochIterator(range(bs), bs, dp_rank=r, dp_size=dp, shuffle=False)
        assert head_slots(bs, dp, r) == it.rank_share(list(range(bs)))


def _traj(qid: str, answer: int) -> Trajectory:
    prompt = [5, 6, 7]
    s = AnswerSample(input_ids=prompt + [answer, 2], prompt_mask=[True] * 3 + [False] * 2,
                     logprobs=[0.0, 0.0, -0.5, -0.25, 0.0], versions=[-1, -1, -1, 3, 3], no_eos=False, reward=1.0)
    return Trajectory(query_id=qid, samples=[s, s])


@pytest.fixture
def stream(tmp_path):
    nr = name_resolve.make_repository("file", root=str(tmp_path))
    secret = new_run_secret()
    heads = [TrajectoryStreamSource(secret, nr, "e", "t", r, 2, batch_size=4, steps_per_epoch=3, n_prompts=12,
                                    host="127.0.0.1") for r in range(2)]
    pusher = TrajectoryPusher(secret, nr, "e", "t", timeout=10)
    yield nr, secret, heads, pusher
    pusher.close()
    for h in heads:
        h.close()


def _push(pusher, batch, slot, answer=9):
    head = 0 if slot < 2 else 1
    pusher.push(head, _traj(f"q{batch}-{slot}", answer).to_sample(sample_id(batch, slot)), {"batch": batch, "slot": slot})


def test_a_head_returns_its_share_in_slot_order_and_keeps_later_batches(stream):
    _, _, heads, pusher = stream
    # batch 1 arrives before batch 0, and batch 0's slots out of order
    for b, s in [(1, 1), (1, 0), (0, 1), (1, 3), (0, 3), (0, 0), (0, 2), (1, 2)]:
        _push(pusher, b, s, answer=10 * b + s)
    first = heads[0].next_batch(timeout=10)
    assert first.ids == ["b0s0", "b0s1"] and first.metadata["query_id"] == ["q0-0", "q0-1"]
    # each sample carries its group of two sequences and every trajectory key
    assert first.seqlens["packed_input_ids"] == [[5, 5], [5, 5]]
    assert first.data["packed_input_ids"].view(4, 5)[:, 3].tolist() == [0, 0, 1, 1]
    assert first.data["packed_versions"].tolist().count(3) == 8
    assert heads[0].last_stats["async/head_queue"] == 2.0  # batch 1's two trajectories wait for their step
    second = heads[0].next_batch(timeout=10)
    assert second.ids == ["b1s0", "b1s1"]
    assert heads[0].state_dict() == {"batch": 2} and heads[0].epoch == 0 and heads[0].position == 2
    assert heads[1].next_batch(timeout=10).ids == ["b0s2", "b0s3"]


def test_forged_duplicate_misrouted_and_trained_trajectories_are_dropped(stream):
    nr, secret, heads, pusher = stream
    head = heads[0]
    forger = TrajectoryPusher(new_run_secret(), nr, "e", "t", timeout=10)  # another run's secret
    try:
        forger.push(0, _traj("forged", 1).to_sample("b0s0"), {"batch": 0, "slot": 0})
        time.sleep(0.3)
        head.poll(0.5)
        assert head.rejections.count == 1 and not head.pending
    finally:
        forger.close()
    _push(pusher, 0, 0, answer=1)
    _push(pusher, 0, 0, answer=2)  # the same slot again: the first stays
    pusher.push(0, _traj("misrouted", 3).to_sample("b0s3"), {"batch": 0, "slot": 3})  # head 1's slot
    _push(pusher, 0, 1, answer=4)
    batch = head.next_batch(timeout=10)
    assert batch.data["packed_input_ids"].view(4, 5)[:, 3].tolist() == [1, 1, 4, 4]
    _push(pusher, 0, 1)  # batch 0 was trained: dropped
    time.sleep(0.3)
    head.poll(0.5)
    assert 0 not in head.pending


def test_an_incomplete_batch_times_out_naming_the_missing_slots(stream):
    _, _, heads, pusher = stream
    _push(pusher, 0, 2)
    with pytest.raises(TimeoutError, match=r"slots \[2\] of \[2, 3\]"):
        heads[1].next_batch(timeout=1.0)
