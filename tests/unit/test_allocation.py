import pytest

from realhf.api.quickstart.allocation import (
    AllocationError,
    AllocationMode,
    heuristic_layout,
    is_generation_mfc,
    parse_allocation_mode,
)
from realhf.base.topology import ParallelDims

PPO_MFCS = ["actor_gen", "rew_inf", "ref_inf", "critic_inf", "critic_train", "actor_train"]


def P(s):
    return ParallelDims.parse(s)


def test_global_layouts():
    m = parse_allocation_mode("d4m2p1", n_devices=8)
    assert m.kind == "global" and m.default == ParallelDims(4, 2, 1)
    assert m.layout_of("actor_train") == m.layout_of("anything") == P("d4m2p1")
    assert m.n_devices() == 8
    # any order, missing letters are 1, whitespace ignored
    assert parse_allocation_mode(" p2d3 ").default == ParallelDims(dp=3, tp=1, pp=2)
    assert str(parse_allocation_mode("m2")) == "d1m2p1"


def test_per_mfc():
    s = "actor_gen:d4m1p1,actor_train:d2m2p1,*:d4m1p1"
    m = parse_allocation_mode(s, mfc_names=PPO_MFCS, n_devices=4)
    assert m.kind == "per_mfc"
    assert m.layout_of("actor_gen") == P("d4")
    assert m.layout_of("actor_train") == P("d2m2")
    assert m.layout_of("ref_inf") == P("d4")
    assert m.n_devices() == 4
    assert str(m) == "actor_gen:d4m1p1,actor_train:d2m2p1,*:d4m1p1"
    # an MFC may use fewer devices than the world
    m = parse_allocation_mode("a:d1, b:d2", mfc_names=["a", "b"], n_devices=2)
    assert m.layout_of("a") == P("d1") and m.n_devices() == 2


def test_decoupled():
    m = parse_allocation_mode("sglang.d16m4p1+d8m2p4", n_devices=128)
    assert m.kind == "decoupled" and m.gen_backend == "sglang"
    assert m.gen == P("d16m4") and m.layout_of("actor_gen") == P("d16m4")
    assert m.layout_of("actor_train") == P("d8m2p4")
    assert m.n_devices() == 128 and m.rest_n_devices() == 64
    m = parse_allocation_mode("vllm.d2+actor_train:d2,*:d1", mfc_names=PPO_MFCS, n_devices=4)
    assert m.gen_backend == "vllm" and m.layout_of("ref_inf") == P("d1")
    m = parse_allocation_mode("gen.d1m1p1+d1m1p1", n_devices=2)
    assert m.gen_backend == "gen"
    assert is_generation_mfc("actor_gen") and is_generation_mfc("gen") and not is_generation_mfc("actor_train")


def test_manual_and_heuristic():
    m = parse_allocation_mode("manual", n_devices=8)
    assert m.kind == "manual"
    with pytest.raises(ValueError, match="given elsewhere"):
        m.layout_of("actor_gen")
    h = parse_allocation_mode("heuristic", n_devices=8)
    assert h.kind == "heuristic"
    g = h.resolve_heuristic(8)
    assert g.kind == "global" and g.default.world_size == 8


@pytest.mark.parametrize("n", [1, 2, 3, 4, 6, 8, 12, 16, 64])
def test_heuristic_layout(n):
    d = heuristic_layout(n)
    assert d.world_size == n and d.dp == n
    d = heuristic_layout(n, n_layers=24, n_heads=12, min_model_parallel=min(n, 4))
    assert d.world_size == n and 12 % d.tp == 0 and d.tp * d.pp >= min(n, 4) and d.pp <= 24


def test_heuristic_layout_prefers_tp_dividing_heads():
    assert heuristic_layout(8, n_heads=6, min_model_parallel=4) == ParallelDims(dp=2, tp=2, pp=2)
    assert heuristic_layout(8, n_heads=8, min_model_parallel=4) == ParallelDims(dp=2, tp=4, pp=1)
    with pytest.raises(ValueError, match="no layout"):
        heuristic_layout(4, n_heads=3, n_layers=1, min_model_parallel=4)


@pytest.mark.parametrize(
    "s, kw, fragments",
    [
        ("", {}, ["empty"]),
        ("d2x1", {}, ["'d2x1'", "not valid"]),
        ("d2d2", {}, ["more than once"]),
        ("d0", {}, ["d0"]),
        ("d4", {"n_devices": 2}, ["uses 4 devices", "has 2"]),
        ("d1m2p2", {"n_devices": 8}, ["uses 4 devices", "8"]),
        ("a:d1,,b:d2", {}, ["stray ','"]),
        ("a:d1,a:d2", {}, ["'a'", "more than once"]),
        ("*:d1,*:d2", {}, ["default", "more than once"]),
        ("a:d1,b", {}, ["'b'", "no ':'"]),
        (":d1", {}, ["no MFC name"]),
        ("a:", {}, ["no layout after"]),
        ("a:d2z", {}, ["layout of 'a'", "not valid"]),
        ("actr_train:d1,*:d1", {"mfc_names": PPO_MFCS}, ["unknown MFC 'actr_train'", "actor_train"]),
        ("actor_train:d1", {"mfc_names": PPO_MFCS}, ["no layout for MFC", "actor_gen", "'*:<layout>'"]),
        ("a:d4,*:d1", {"n_devices": 2}, ["'a' layout d4m1p1 uses 4 devices", "only 2"]),
        ("vllm.d2", {}, ["must be followed by '+"]),
        ("vlm.d2+d2", {}, ["unknown generation backend 'vlm'", "did you mean 'vllm'"]),
        ("d2+d2", {}, ["needs a backend prefix"]),
        ("sglang.d2p2+d2", {}, ["has p2", "p1"]),
        ("sglang.d2+d2+d2", {}, ["more than one '+'"]),
        ("sglang.d2+", {}, ["empty"]),
        ("sglang.d2+d2", {"n_devices": 8}, ["generation uses 2 devices", "rest uses 2", "has 8"]),
        ("vllm.d2+actor_gen:d1,*:d1", {}, ["'actor_gen' runs on the vllm generation devices"]),
        ("vllm.d1+a:d2,*:d1", {"n_devices": 2}, ["generation uses 1 devices", "rest uses 2", "3 in all"]),
        ("serach", {}, ["'serach'"]),
    ],
)
def test_bad_modes(s, kw, fragments):
    with pytest.raises(AllocationError) as ei:
        parse_allocation_mode(s, **kw)
    msg = str(ei.value)
    for frag in fragments:
        assert frag in msg, (frag, msg)


def test_layout_of_missing_default():
    m = AllocationMode(kind="per_mfc", per_mfc={"a": P("d1")})
    with pytest.raises(ValueError, match="no layout for MFC 'b'"):
        m.layout_of("b")
    with pytest.raises(ValueError, match="kind"):
        AllocationMode(kind="weird")


def test_device_mesh_strings():
    from realhf.api.quickstart.allocation import parse_device_mesh

    assert parse_device_mesh("localhost:0,1", 1, 4) == [0, 1]
    assert parse_device_mesh("node01:1-3", 1, 4) == [1, 2, 3]
    assert parse_device_mesh("node02:0,2", 2, 4) == [4, 6]
    assert parse_device_mesh("node01;node02:0-1", 2, 2) == [0, 1, 2, 3]
    for bad, frag in [("node03:0", "unknown node"), ("localhost:0", "unknown node"), ("node01:0-9", "do not exist"),
                      ("node01:1,1", "more than once"), ("node01:a", "not a device id"), ("", "empty"),
                      ("node01:3-1", "empty range")]:
        with pytest.raises(AllocationError, match=frag):
            parse_device_mesh(bad, 2, 4)
