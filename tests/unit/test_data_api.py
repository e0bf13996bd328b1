import json
import random

import pytest
import torch

from realhf.api.core.data_api import (
    SequenceSample,
    balanced_partition,
    merge_by_partition,
)

ALL_DTYPES = [torch.int64, torch.int32, torch.bool, torch.float32, torch.bfloat16, torch.float16]


def make_batch(bs, seed=0, max_len=50, group=1, ids=None):
    """A PPO-like batch: prompts (1 seq/sample), group answers per sample, per-answer rewards,
    per-token values of trailing shape (2,), metadata."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    ids = ids if ids is not None else [f"q{seed}_{i}" for i in range(bs)]
    plens = [[rng.randint(1, max_len)] for _ in range(bs)]
    alens = [[rng.randint(1, max_len) for _ in range(group)] for _ in range(bs)]
    n_p = sum(map(sum, plens))
    n_a = sum(map(sum, alens))
    data = {
        "packed_prompts": torch.randint(0, 1000, (n_p,), generator=g),
        "packed_input_ids": torch.randint(0, 1000, (n_a,), generator=g),
        "prompt_mask": torch.rand(n_a, generator=g) > 0.5,
        "rewards": torch.randn(bs * group, generator=g),
        "values": torch.randn(n_a, 2, generator=g).to(torch.bfloat16),
    }
    seqlens = {
        "packed_prompts": plens,
        "packed_input_ids": alens,
        "prompt_mask": [list(x) for x in alens],
        "rewards": [[1] * group for _ in range(bs)],
        "values": [list(x) for x in alens],
    }
    return SequenceSample(
        keys=set(data),
        ids=ids,
        seqlens=seqlens,
        trailing_shapes={k: tuple(v.shape[1:]) for k, v in data.items()},
        dtypes={k: v.dtype for k, v in data.items()},
        data=data,
        metadata={"query_id": list(ids), "task": ["math"] * bs},
    )


def assert_same(a: SequenceSample, b: SequenceSample):
    assert a.keys == b.keys
    assert a.ids == b.ids
    assert a.seqlens == b.seqlens
    assert a.trailing_shapes == b.trailing_shapes
    assert a.dtypes == b.dtypes
    assert a.metadata == b.metadata
    assert (a.data is None) == (b.data is None)
    if a.data is not None:
        for k in a.keys:
            if a.data[k] is None:
                assert b.data[k] is None
                continue
            assert a.data[k].dtype == b.data[k].dtype
            assert torch.equal(a.data[k], b.data[k]), k


# ---------------------------------------------------------------------------- construction


def test_from_default_infers_per_sample_keys():
    seqlens = [3, 5, 2]
    s = SequenceSample.from_default(
        ids=[0, 1, 2],
        seqlens=seqlens,
        data={"packed_input_ids": torch.arange(10), "rewards": torch.randn(3), "v": torch.zeros(10, 4)},
        metadata={"task": ["a", "b", "c"]},
    )
    assert s.bs == 3 and len(s) == 3
    assert s.seqlens["packed_input_ids"] == [[3], [5], [2]]
    assert s.seqlens["rewards"] == [[1], [1], [1]]
    assert s.trailing_shapes["v"] == (4,)
    assert s.total_tokens() == 10 and s.total_tokens("rewards") == 3
    assert s.main_key() == "packed_input_ids"
    assert s.cu_seqlens().tolist() == [0, 3, 8, 10] and s.cu_seqlens().dtype == torch.int32
    with pytest.raises(ValueError, match="expected 10"):
        SequenceSample.from_default([0, 1, 2], seqlens, {"x": torch.arange(7)})


def test_group_seqlens_and_cu_seqlens():
    s = make_batch(4, group=3)
    flat = s.flat_seqlens("packed_input_ids")
    assert len(flat) == 12
    cu = s.cu_seqlens("packed_input_ids")
    assert cu[-1].item() == s.total_tokens("packed_input_ids") and cu[0].item() == 0
    assert s.sample_tokens() == [sum(x) for x in s.seqlens["packed_input_ids"]]


def test_validation_errors():
    good = dict(
        keys={"x"}, ids=["a", "b"], seqlens={"x": [[2], [3]]}, trailing_shapes={"x": ()},
        dtypes={"x": torch.int64}, data={"x": torch.arange(5)},
    )
    SequenceSample(**good)
    with pytest.raises(ValueError, match="shape"):
        SequenceSample(**{**good, "data": {"x": torch.arange(6)}})
    with pytest.raises(ValueError, match="unique"):
        SequenceSample(**{**good, "ids": ["a", "a"]})
    with pytest.raises(ValueError, match="one entry per sample"):
        SequenceSample(**{**good, "seqlens": {"x": [[5]]}})
    with pytest.raises(ValueError, match="list of ints"):
        SequenceSample(**{**good, "seqlens": {"x": [2, 3]}})
    with pytest.raises(ValueError, match="do not match"):
        SequenceSample(**{**good, "dtypes": {"y": torch.int64}})
    with pytest.raises(ValueError, match="dtype"):
        SequenceSample(**{**good, "data": {"x": torch.arange(5).float()}})
    with pytest.raises(ValueError, match="metadata"):
        SequenceSample(**good, metadata={"task": ["a"]})
    with pytest.raises(ValueError, match="negative"):
        SequenceSample(**{**good, "seqlens": {"x": [[-1], [6]]}})
    with pytest.raises(ValueError, match="at least one sample"):
        SequenceSample(**{**good, "ids": [], "seqlens": {"x": []}, "data": {"x": torch.arange(0)}})


# ---------------------------------------------------------------------------- views


def test_unpack_gather_take_getitem():
    s = make_batch(7, group=2)
    parts = s.unpack()
    assert [p.bs for p in parts] == [1] * 7
    assert_same(SequenceSample.gather(parts), s)
    assert_same(s[2], parts[2])
    assert_same(s[-1], parts[6])
    assert_same(s[1:4], SequenceSample.gather(parts[1:4]))
    perm = [3, 0, 6, 1, 5, 2, 4]
    r = s.reorder(perm)
    assert r.ids == [s.ids[i] for i in perm]
    inv = sorted(range(7), key=perm.__getitem__)
    assert_same(r.reorder(inv), s)
    with pytest.raises(ValueError, match="permutation"):
        s.reorder([0, 0, 1, 2, 3, 4, 5])


def test_meta_select_remap_update():
    s = make_batch(5)
    m = s.meta()
    assert m.data is None and m.seqlens == s.seqlens and m.ids == s.ids
    sel = s.select(["packed_input_ids", "rewards"])
    assert sel.keys == {"packed_input_ids", "rewards"}
    with pytest.raises(KeyError, match="nope"):
        s.select(["nope"])
    rm = sel.remap_keys({"rewards": "scores"})
    assert rm.keys == {"packed_input_ids", "scores"}
    assert torch.equal(rm.data["scores"], s.data["rewards"])
    with pytest.raises(ValueError, match="share a name"):
        sel.remap_keys({"rewards": "packed_input_ids"})

    base = s.select(["packed_input_ids"])
    extra = s.select(["rewards", "values"]).reorder([4, 3, 2, 1, 0])
    base.update_(extra)
    assert_same(base, s.select(["packed_input_ids", "rewards", "values"]))
    meta_base = s.meta().select(["packed_input_ids"])
    meta_base.update_(s.meta().select(["rewards"]))
    assert meta_base.keys == {"packed_input_ids", "rewards"} and meta_base.data is None
    with pytest.raises(ValueError, match="same ids"):
        base.update_(make_batch(5, seed=9))
    with pytest.raises(ValueError, match="mix"):
        base.update_(s.meta())


def test_gather_errors():
    a, b = make_batch(2, seed=1), make_batch(2, seed=2)
    g = SequenceSample.gather([a, b], keys=["rewards"])
    assert g.keys == {"rewards"} and g.bs == 4
    with pytest.raises(ValueError, match="unique"):
        SequenceSample.gather([a, a])
    with pytest.raises(ValueError, match="metadata-only"):
        SequenceSample.gather([a, b.meta()])


# ---------------------------------------------------------------------------- splitting


def _contig_opt(w, n):
    """Brute-force optimal max part for contiguous partitions (DP)."""
    import functools

    pre = [0]
    for x in w:
        pre.append(pre[-1] + x)

    @functools.lru_cache(None)
    def f(i, k):
        if k == 1:
            return pre[len(w)] - pre[i]
        return min(max(pre[j] - pre[i], f(j, k - 1)) for j in range(i + 1, len(w) - k + 2))

    return f(0, n)


def test_balanced_partition_optimal_random():
    rng = random.Random(0)
    for _ in range(200):
        bs = rng.randint(1, 14)
        n = rng.randint(1, bs)
        w = [rng.randint(0, 100) for _ in range(bs)]
        parts = balanced_partition(w, n)
        assert len(parts) == n and all(parts)
        assert [i for p in parts for i in p] == list(range(bs))
        assert max(sum(w[i] for i in p) for p in parts) == _contig_opt(w, n)


@pytest.mark.parametrize("n", [1, 2, 3, 8, 16])
def test_split_balance_and_restore(n):
    s = make_batch(64, seed=n, max_len=200)
    parts = s.split(n)
    assert len(parts) == n and all(p.bs >= 1 for p in parts)
    ids = [i for p in parts for i in p.ids]
    assert sorted(ids) == sorted(s.ids) and len(ids) == s.bs
    w = s.sample_tokens()
    lower = max(max(w), -(-sum(w) // n))
    worst = max(p.total_tokens() for p in parts)
    assert worst <= lower + max(w)  # contiguous bound
    assert worst == _contig_opt(w, n) if n <= 8 else True
    assert_same(SequenceSample.gather(parts), s)
    # The metadata-only batch splits identically (the master and workers agree).
    assert [p.ids for p in s.meta().split(n)] == [p.ids for p in parts]
    assert s.split_partition(n) == [list(range(s.ids.index(p.ids[0]), s.ids.index(p.ids[-1]) + 1)) for p in parts]


def test_split_bs_smaller_than_n():
    s = make_batch(3)
    with pytest.raises(ValueError, match=r"3 samples into 5"):
        s.split(5)
    assert [p.bs for p in s.split(3)] == [1, 1, 1]


def test_split_mbs_under_budget():
    rng = random.Random(1)
    for trial in range(30):
        s = make_batch(rng.randint(1, 40), seed=trial, max_len=100)
        budget = rng.randint(60, 400)
        min_n = rng.randint(1, 6)
        mbs = s.split_mbs(budget, min_n_mbs=min_n)
        assert len(mbs) >= min(min_n, s.bs)
        for mb in mbs:
            assert mb.total_tokens() <= budget or mb.bs == 1
        assert_same(SequenceSample.gather(mbs), s)
        # Never more micro-batches than needed: merging any two neighbours would break the budget
        # (unless min_n_mbs forced the count).
        if len(mbs) > min(min_n, s.bs):
            assert any(
                mbs[j].total_tokens() + mbs[j + 1].total_tokens() > budget for j in range(len(mbs) - 1)
            )


def test_split_mbs_oversized_sample_alone():
    s = SequenceSample.from_default(list(range(5)), [2, 2, 50, 2, 2], {"packed_input_ids": torch.arange(58)})
    mbs = s.split_mbs(10)
    assert [m.ids for m in mbs] == [[0, 1], [2], [3, 4]]
    assert [m.ids for m in s.split_mbs(10, min_n_mbs=5)] == [[i] for i in range(5)]
    assert len(s.split_mbs(100, min_n_mbs=9)) == 5  # capped at bs
    with pytest.raises(ValueError, match="max_tokens_per_mb"):
        s.split_mbs(0)


def test_merge_by_partition():
    s = make_batch(9)
    part = s.mb_partition(80, min_n_mbs=3)
    outs = [[f"r{i}" for i in p] for p in part]
    assert merge_by_partition(part, outs) == [f"r{i}" for i in range(9)]
    assert merge_by_partition([[2, 0], [1]], [["c", "a"], ["b"]]) == ["a", "b", "c"]
    with pytest.raises(ValueError, match="permutation"):
        merge_by_partition([[0, 0]], [["a", "b"]])


# ---------------------------------------------------------------------------- wire format


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_wire_roundtrip_each_dtype(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(12, 3, generator=g) * 100).to(dtype)
    s = SequenceSample.from_default(["a", 7, "c"], [4, 6, 2], {"x": x, "r": torch.randn(3).to(dtype)})
    header, tensors = s.to_wire()
    json.dumps(header)  # plain data only
    assert header["dtypes"]["x"] == str(dtype).removeprefix("torch.")
    assert_same(SequenceSample.from_wire(json.loads(json.dumps(header)), tensors), s)
    blob = s.to_bytes()
    assert isinstance(blob, bytes)
    back = SequenceSample.from_bytes(blob)
    assert_same(back, s)
    assert back.ids == ["a", 7, "c"]


def test_wire_roundtrip_batch_meta_and_empty():
    s = make_batch(6, group=2)
    assert_same(SequenceSample.from_bytes(s.to_bytes()), s)
    m = s.meta()
    h, t = m.to_wire()
    assert t == [] and h["tensor_keys"] is None
    assert_same(SequenceSample.from_wire(h, t), m)
    assert_same(SequenceSample.from_bytes(m.to_bytes()), m)
    # Zero-length sequences and a None tensor.
    z = SequenceSample(
        {"x", "y"}, [0, 1], {"x": [[0], [0]], "y": [[1], [1]]}, {"x": (2,), "y": ()},
        {"x": torch.bfloat16, "y": torch.float16}, {"x": torch.empty(0, 2, dtype=torch.bfloat16), "y": None},
    )
    assert_same(SequenceSample.from_bytes(z.to_bytes()), z)


def test_wire_rejects_bad_input():
    s = make_batch(2)
    h, t = s.to_wire()
    bad = json.loads(json.dumps(h))
    bad["dtypes"]["rewards"] = "complex_evil"
    with pytest.raises(ValueError, match="unknown dtype 'complex_evil'"):
        SequenceSample.from_wire(bad, t)
    with pytest.raises(ValueError, match="2 tensors|tensors"):
        SequenceSample.from_wire(h, t[:-1])
    bad2 = dict(h, format="pickle")
    with pytest.raises(ValueError, match="format"):
        SequenceSample.from_wire(bad2, t)
    bad3 = dict(h, ids=[1.5, 2])
    with pytest.raises(ValueError, match="ids"):
        SequenceSample.from_wire(bad3, t)
    with pytest.raises(ValueError, match="magic"):
        SequenceSample.from_bytes(b"\x80\x04pickle" + b"0" * 20)
    blob = s.to_bytes()
    with pytest.raises(ValueError, match="tensor bytes"):
        SequenceSample.from_bytes(blob[:-3])
    # Non-serialisable ids or metadata are refused at the sender.
    s2 = SequenceSample.from_default([(1, 2)], [2], {"x": torch.arange(2)})
    with pytest.raises(ValueError, match="str or int"):
        s2.to_wire()
    s3 = SequenceSample.from_default([1], [2], {"x": torch.arange(2)}, metadata={"obj": [object()]})
    with pytest.raises(ValueError, match="metadata"):
        s3.to_wire()
    s4 = SequenceSample.from_default([1], [2], {"x": torch.arange(2).to(torch.complex64)})
    with pytest.raises(ValueError, match="cannot be serialised"):
        s4.to_wire()


def test_bytes_malformed_header():
    s = make_batch(2)
    header, _ = s.to_wire()
    for mutate in (lambda h: h.pop("dtypes"), lambda h: h.__setitem__("seqlens", [1]),
                   lambda h: h.__setitem__("trailing_shapes", {k: 3 for k in h["keys"]})):
        blob = s.to_bytes()
        import struct

        hlen = struct.unpack("<Q", blob[8:16])[0]
        h = json.loads(blob[16 : 16 + hlen])
        mutate(h)
        hb = json.dumps(h).encode()
        bad = blob[:8] + struct.pack("<Q", len(hb)) + hb + blob[16 + hlen :]
        with pytest.raises(ValueError):
            SequenceSample.from_bytes(bad)
