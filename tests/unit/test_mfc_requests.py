"""The master's per-worker ``mfc`` requests: each worker gets its own transfers, the metas of what it receives and
its data-parallel rank's ids with their metadata, and nothing of the rest of the batch."""
from __future__ import annotations

import os

from realhf.base.wire import encode_payload
from realhf.system.trainer.data_manager import plan_transfers
from realhf.system.trainer.master_worker import mfc_requests
from realhf.system.transport.request_reply_stream import Payload

KEYS = ("packed_input_ids", "prompt_mask")


def _batch(n: int, dp: int, holders):
    """``n`` samples split over ``dp`` ranks (workers 0..dp-1 of the MFC), their tensors held round-robin by
    ``holders`` (the workers that computed them)."""
    ids = [f"s{i}" for i in range(n)]
    parts = [ids[d::dp] for d in range(dp)]
    owners = {sid: {k: holders[i % len(holders)] for k in KEYS} for i, sid in enumerate(ids)}
    metas = {sid: {k: {"dtype": "int64", "seqlens": [[20 + i % 3]], "shape": []} for k in KEYS}
             for i, sid in enumerate(ids)}
    metadata = {sid: {"prompt_id": sid, "answer": str(i)} for i, sid in enumerate(ids)}
    return ids, parts, owners, metas, metadata


def _requests(n: int, dp: int, holders):
    ids, parts, owners, metas, metadata = _batch(n, dp, holders)
    dp_of = {r: r for r in range(dp)}
    plan = plan_transfers(owners, {r: parts[d] for r, d in dp_of.items()}, KEYS)
    involved = set(dp_of) | {s for s, _, _, _ in plan} | {d for _, d, _, _ in plan}
    return plan, parts, metas, metadata, mfc_requests("actor_train", plan, metas, parts, dp_of, metadata, involved)


def test_each_worker_gets_its_transfers_its_receives_metas_and_its_ranks_ids():
    # the MFC on workers 0-3 (dp=4); the inputs held by workers 4 and 5 (another mesh), which only send
    plan, parts, metas, metadata, reqs = _requests(24, 4, holders=[4, 5])
    assert sorted(reqs) == [0, 1, 2, 3, 4, 5]
    for r, req in reqs.items():
        assert req["mfc"] == "actor_train"
        mine = [list(p) for p in plan if r in (p[0], p[1])]
        assert req["plan"] == mine  # in the plan's order: each pair posts its sends and receives alike
        received = {}
        for _, dst, sid, k in plan:
            if dst == r:
                received.setdefault(sid, {})[k] = metas[sid][k]
        assert req["metas"] == received
        if r < 4:
            assert req["ids_by_dp"] == {str(r): parts[r]}
            assert req["metadata"] == {sid: metadata[sid] for sid in parts[r]}
            assert {x for _, d, x, _ in req["plan"]} == set(parts[r])  # receives its own samples, nothing else
        else:  # a sender outside the mesh: no ids, no metadata, nothing to receive
            assert req["ids_by_dp"] == {} and req["metadata"] == {} and req["metas"] == {}
            assert all(s == r for s, _, _, _ in req["plan"])
    # every transfer reaches both of its ends, once each
    assert sorted(tuple(p) for r in reqs for p in reqs[r]["plan"]) == sorted(list(plan) * 2)


def test_a_workers_request_grows_with_its_share_not_with_the_mesh():
    """The same 16 samples per data-parallel rank: a worker's encoded request is about as large with 8 ranks as with
    2 (the whole batch's plan, metas and metadata to every worker made it grow with the ranks)."""
    secret = os.urandom(32)

    def size(dp: int) -> int:
        _, _, _, _, reqs = _requests(16 * dp, dp, holders=list(range(dp, 2 * dp)))
        frames = encode_payload(secret, Payload(handler="w0", handle_name="mfc", data=reqs[0]))
        return sum(len(f) for f in frames)

    small, large = size(2), size(8)
    assert large < 1.1 * small, (small, large)
