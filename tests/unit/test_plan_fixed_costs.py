"""What the cost model and the step simulator count beside a model's products: the tensor-parallel collectives a
decode step and a training pass really run, the pipelined generation's token packets, a generation's and a training
call's own host-side work, a training call's small data-parallel reductions, and the control plane's fixed costs of a
call and of a step; and the probes that measure them on this machine (a real two-process link, a real run's steps,
the real PPO training call)."""
from __future__ import annotations

import dataclasses
import math

import pytest

from realhf.plan import comm_cost, cost, hardware
from realhf.plan.comm_cost import Mesh
from realhf.plan.fit import Workload
from realhf.plan.shapes import model_config
from realhf.plan.simulate import (TRAIN_DP_REDUCTIONS, PlanCall, PlanModel, ServerFleet, StepPlan, compute_time,
                                  simulate_step)

LAT = 1e-3  # a latency large enough that the collectives' count shows above the rest
CFG = model_config("qwen2.5-1.5b")


def _hw(lat: float, **kw):
    h = hardware.get("h100")
    return dataclasses.replace(h, intra_lat=lat, inter_lat=lat, **kw)


def _latency_part(fn, *args, **kwargs) -> float:
    """What ``fn`` (a CostModel method) spends in latency: its time at LAT less its time at no latency."""
    slow = getattr(cost.CostModel(CFG, _hw(LAT), "bfloat16"), fn)(*args, **kwargs)
    fast = getattr(cost.CostModel(CFG, _hw(0.0), "bfloat16"), fn)(*args, **kwargs)
    return slow - fast


def test_tensor_parallel_decode_step_runs_every_collective_of_the_model():
    """Per step under tp=2: two all-reduces per block, the embedding's all-reduce (2 ring steps each), the logits'
    all-gather (1 ring step) and the broadcast of the sampled tokens (1 send)."""
    L = CFG.n_layers
    assert _latency_part("decode_step", 64, 200, tp=2) == pytest.approx(((2 * L + 1) * 2 + 1 + 1) * LAT, rel=1e-6)
    # one decode step per tp=1 rank has no collective at all
    assert _latency_part("decode_step", 64, 200, tp=1) == pytest.approx(0.0, abs=1e-12)


def test_tensor_parallel_training_pass_counts_the_backward_collectives():
    """Forward: two all-reduces per block, the embedding's, the log-probs' two; backward: one per column-parallel
    product's input per block (query, key, value, gate, up) and the head's."""
    L = CFG.n_layers
    fwd = 2 * L + 1 + 2
    bwd = 5 * L + 1
    assert _latency_part("train", 4096, 1, 512, tp=2) == pytest.approx((fwd + bwd) * 2 * LAT, rel=1e-6)
    assert _latency_part("forward", 4096, 1, 512, tp=2) == pytest.approx(fwd * 2 * LAT, rel=1e-6)


def test_pipelined_decode_step_sends_each_groups_tokens_back():
    """pp=2: each of the 2 row groups sends its activations to the next stage and its samples back."""
    assert _latency_part("decode_step", 64, 200, pp=2) == pytest.approx(2 * 2 * LAT, rel=1e-6)


def test_generation_and_training_call_host_work_is_counted():
    hw = _hw(1e-5, generate_overhead_s=0.25, train_call_overhead_s=0.5)
    cm = cost.CostModel(CFG, hw, "bfloat16")
    base = cost.CostModel(CFG, dataclasses.replace(hw, generate_overhead_s=0.0), "bfloat16")
    assert cm.generate(4, 100, 2, 5) - base.generate(4, 100, 2, 5) == pytest.approx(0.25)
    train = Workload("train", 64, 512, 1.0, minibatches=2)
    m = PlanModel("actor", CFG, Mesh(2, 1, 1, 0), "bfloat16", trains=True)
    with_host = compute_time(hw, m, PlanCall("t", "actor", (), train))
    without = compute_time(dataclasses.replace(hw, train_call_overhead_s=0.0), m, PlanCall("t", "actor", (), train))
    assert with_host - without == pytest.approx(0.5)  # once per call, whatever its minibatches


def test_generation_pays_its_weights_layout_per_block_and_for_the_head():
    """A rank's generation call pays the layout of the blocks it holds (its largest pipeline stage) and the head,
    split over tensor ranks; nothing of it where the hardware lays out nothing (a tabled GPU)."""
    hw = _hw(1e-5, generate_layer_overhead_s=0.01, generate_head_overhead_s=0.3)
    cm, bare = cost.CostModel(CFG, hw, "bfloat16"), cost.CostModel(CFG, _hw(1e-5), "bfloat16")
    assert bare.weights_setup() == 0.0 and hardware.get("h100").generate_layer_overhead_s == 0.0
    L = CFG.n_layers
    assert cm.weights_setup() == pytest.approx(0.01 * L + 0.3)
    assert cm.weights_setup(tp=2) == pytest.approx((0.01 * L + 0.3) / 2)
    assert cm.weights_setup(pp=2) == pytest.approx(0.01 * cm.stage_layers(2) + 0.3)
    for tp, pp in ((1, 1), (2, 1), (1, 2)):
        assert cm.generate(4, 100, 2, 5, tp, pp) - bare.generate(4, 100, 2, 5, tp, pp) == pytest.approx(
            cm.weights_setup(tp, pp))


def test_a_served_generation_pays_the_servers_own_cost():
    """Where a server's own cost was profiled it stands in for the generation interface's in a served call; the
    colocated generation keeps the interface's."""
    hw = _hw(1e-5, generate_overhead_s=0.01, server_generate_overhead_s=0.25)
    gen = Workload("generate", 8, 64, n=4, max_new=16)
    fleet = ServerFleet(n=1, tp=1, first=1)
    served = PlanModel("actor@1", CFG, Mesh(1, 1, 1, 0), "bfloat16", realloc_from="actor", servers=fleet)
    own = PlanModel("actor", CFG, Mesh(1, 1, 1, 0), "bfloat16")
    call = PlanCall("gen", "actor", (), gen)
    base = dataclasses.replace(hw, server_generate_overhead_s=None)
    assert compute_time(hw, served, call) - compute_time(base, served, call) == pytest.approx(0.24)
    assert compute_time(hw, own, call) == compute_time(base, own, call)


def test_weight_layout_probe_times_the_decode_kernels_layout():
    """On CPU with the oneDNN kernel: the real layout of a block's weights (cpu_gemm.pack), more for more weights;
    0 with the aten kernel (nothing is laid out) and for a GPU."""
    import torch

    from realhf.impl.model.nn import cpu_gemm
    from realhf.plan.probes import pack_seconds

    was = cpu_gemm.kernel()
    try:
        cpu_gemm.set_kernel("aten")
        assert pack_seconds(((64, 64),), torch.float32, "cpu") == 0.0
        if not cpu_gemm.onednn_available():
            pytest.skip("this PyTorch has no oneDNN")
        cpu_gemm.set_kernel("onednn")
        small = pack_seconds(((64, 64),), torch.float32, "cpu")
        big = pack_seconds(((1024, 4096),) * 4, torch.float32, "cpu")
        assert 0 < small < big
        w = torch.randn(96, 64)
        x = torch.randn(5, 64)
        torch.testing.assert_close(cpu_gemm._onednn_linear(x, cpu_gemm.pack(w)), x @ w.t())
    finally:
        cpu_gemm.set_kernel(was)
    assert pack_seconds(((64, 64),), torch.float32, "cuda") == 0.0


def test_training_call_pays_its_small_data_parallel_reductions():
    train = Workload("train", 64, 512, 1.0)
    hw_slow, hw_fast = _hw(LAT), _hw(0.0)

    def latency(dp):
        m = PlanModel("actor", CFG, Mesh(dp, 1, 1, 0), "bfloat16", trains=True)
        return compute_time(hw_slow, m, PlanCall("t", "actor", (), train)) - \
            compute_time(hw_fast, m, PlanCall("t", "actor", (), train))

    # dp=2: the gradients' all-reduce and TRAIN_DP_REDUCTIONS small ones, 2 ring steps each; dp=1: none
    assert latency(2) == pytest.approx((1 + TRAIN_DP_REDUCTIONS) * 2 * LAT, rel=1e-6)
    assert latency(1) == pytest.approx(0.0, abs=1e-12)


def test_the_step_pays_the_hardwares_control_plane_costs():
    hw = _hw(1e-5, call_overhead_s=0.1, step_overhead_s=0.7)
    models = (PlanModel("a", CFG, Mesh(1, 1, 1, 0), "bfloat16"),)
    calls = (PlanCall("x", "a", (), None), PlanCall("y", "a", (("x", 4.0),), None))
    est = simulate_step(StepPlan(models, calls), hw)
    assert [c.overhead_s for c in est.calls] == [0.1, 0.1]
    assert est.step_s == pytest.approx(0.2 + 0.7)
    with pytest.raises(ValueError, match="call_overhead_s"):
        dataclasses.replace(hw, call_overhead_s=-1.0)


# ---------------------------------------------------------------------------------------------------- the probes


def test_link_latency_is_a_collectives_mean_between_computation():
    """Two real gloo processes: the small collectives timed as a step runs them (after computation), and the link's
    latency per ring step at least half such an all-reduce (it was the least back-to-back send before)."""
    from realhf.plan.interface_probe import dp_train_call, pp_generate_call, pp_train_call
    from realhf.plan.probes import comm
    from realhf.plan.profile import FIT_PROMPT, FIT_STEPS, _proxy

    cfgs = [dataclasses.asdict(_proxy(model_config("smollm2-135m"), L)) for L in (1, 2)]
    c = comm("cpu", tp_model=dict(cfgs=cfgs, dtype="float32", rows=4, prompt=FIT_PROMPT, steps=FIT_STEPS),
             calls={"dp_train": (dp_train_call, dict(cfg=cfgs[0], dtype="float32", prompts=2)),
                    "pp_generate": (pp_generate_call, dict(cfg=cfgs[1], dtype="float32")),
                    "pp_train": (pp_train_call, dict(cfg=cfgs[1], dtype="float32", prompts=2))})
    # a real decode step over the two ranks at each depth; a real data-parallel training call; a real pipelined
    # generation and training call (one block a stage)
    assert [(d["layers"], d["rows"]) for d in c["tp_decode"]] == [(1, 4), (2, 4)]
    assert all(d["step_s"] > 0 for d in c["tp_decode"])
    assert c["dp_train"]["layers"] == 1 and c["dp_train"]["prompts"] == 2 and c["dp_train"]["measured_s"] > 0
    assert c["pp_generate"]["layers"] == 2 and c["pp_generate"]["measured_s"] > 0
    assert c["pp_train"]["layers"] == 2 and c["pp_train"]["prompts"] == 2 and c["pp_train"]["measured_s"] > 0
    assert 0 < c["p2p_message"] < c["sendrecv"][-1][1]  # a batched small message, well under a 64 MB send
    assert set(c["in_step"]) == {"allreduce", "allgather", "broadcast"}
    assert all(v > 0 for v in c["in_step"].values())
    assert c["lat"] >= c["in_step"]["allreduce"] / 2 - 1e-12
    assert c["lat"] >= c["sendrecv"][0][1] - 1e-12
    # bandwidths past the caches, from the two largest sizes; the real reallocation's cost
    assert [n for n, _ in c["sendrecv"]][-1] >= 64 << 20 and c["bw"] > 0 and c["allreduce_bw"] > 0
    r = c["realloc"]
    assert r["fixed_s"] > 0 and r["bw"] > 0 and 0.0 <= r["both_ways"] <= 1.0
    pairs = {p["pair"] for p in r["points"]}
    assert pairs == {"d1m1p1:d2m1p1", "d1m2p1:d2m1p1"} and all(p["seconds"] > 0 for p in r["points"])
    assert max(p["sent"] for p in r["points"]) > 1e7  # the large shape moves tens of MB


def test_decode_latency_inverts_the_cost_models_tensor_parallel_decode_step():
    """The link's latency as a tensor-parallel decode step pays it, from probed steps at two depths: steps that took
    what the cost model gives at latency X plus a fixed F a step yield X (from what a block adds) and F (the rest,
    paid once a step); a block adding nothing beyond its computation leaves the latency as measured between
    computation; without the probe nothing changes."""
    from realhf.plan.cost import CostModel
    from realhf.plan.profile import _decode_latency, _proxy, hardware as hw_of

    cfg = model_config("smollm2-135m")

    def prof():
        return dict(key=dict(dtype="float32", machine="m", device="cpu", threads=1), measured_at="now",
                    matmul_rows=[(1, 1e9), (64, 5e10)], copy_bw=1e10, attention_flops=1e10,
                    optimizer_s_per_param=1e-9, disk_bw=1e9, memory_bytes=1e10, comm=dict(bw=1e9, lat=1e-4),
                    overheads=dict(layer_s=1e-5, elementwise_s=0.0, decode_layer_s=2e-5, decode_elementwise_s=0.0,
                                   pass_s=0.0, decode_step_s=1e-4))

    p = prof()
    _decode_latency(p, cfg, "float32", "cpu")
    assert p["comm"] == dict(bw=1e9, lat=1e-4)
    x, F = 7e-4, 3e-3
    h = dataclasses.replace(hw_of(p), intra_lat=x, inter_lat=x)
    p["comm"]["tp_decode"] = [dict(layers=L, rows=16, cached=42.0, step_s=F + CostModel(
        _proxy(cfg, L), h, "float32").decode_step(16, 42.0, tp=2)) for L in (1, 3)]
    _decode_latency(p, cfg, "float32", "cpu")
    assert p["comm"]["lat"] == pytest.approx(x) and p["comm"]["lat_in_step"] == 1e-4
    assert p["comm"]["tp_decode_step_s"] == pytest.approx(F)
    fitted = hw_of(p)
    assert fitted.tp_decode_step_overhead_s == pytest.approx(F)
    for L in (1, 3, 30):  # the fitted figures give back the probed steps, and extrapolate by blocks
        cm = CostModel(_proxy(cfg, L), fitted, "float32")
        assert cm.decode_step(16, 42.0, tp=2) == pytest.approx(
            F + CostModel(_proxy(cfg, L), h, "float32").decode_step(16, 42.0, tp=2))
        assert cm.decode_step(16, 42.0, tp=1) == pytest.approx(
            CostModel(_proxy(cfg, L), h, "float32").decode_step(16, 42.0, tp=1))  # no tensor parallelism: no F
    flat = prof()  # the deeper step no slower: no latency to find in a block
    flat["comm"]["tp_decode"] = [dict(layers=L, rows=16, cached=42.0, step_s=0.01) for L in (1, 3)]
    _decode_latency(flat, cfg, "float32", "cpu")
    assert flat["comm"]["lat"] == 1e-4 and flat["comm"]["tp_decode_step_s"] > 0


def test_dp_train_call_is_what_the_real_call_takes_beyond_the_simulated_one():
    """The real two-rank training call against the simulator's for the same work: what it takes beyond (the ranks
    waiting for each other at each collective) is paid once by every data-parallel training call, by no other call,
    so that the simulator gives back the probed call; a call the simulator already over-counts adds nothing."""
    from realhf.plan.interface_probe import PROBE_ANSWER_LEN, PROBE_GROUP, PROBE_PROMPT_LEN
    from realhf.plan.profile import _dp_train, _proxy, hardware as hw_of

    cfg = model_config("smollm2-135m")
    p = dict(key=dict(dtype="float32", machine="m", device="cpu", threads=1), measured_at="now",
             matmul_rows=[(1, 1e9), (64, 5e10)], copy_bw=1e10, attention_flops=1e10, optimizer_s_per_param=1e-9,
             disk_bw=1e9, memory_bytes=1e10, comm=dict(bw=1e9, lat=1e-4, allreduce_bw=3e8),
             overheads=dict(layer_s=1e-5, elementwise_s=0.0, decode_layer_s=2e-5, decode_elementwise_s=0.0,
                            pass_s=0.0, decode_step_s=1e-4, train_call_s=2e-3, train_layer_s=1e-4))
    _dp_train(p, cfg, "float32", "cpu")
    assert "dp_train_call_s" not in p["comm"] and hw_of(p).dp_train_call_overhead_s == 0.0  # not probed
    work = Workload("train", seqs=2 * 4 * PROBE_GROUP, seq_len=PROBE_PROMPT_LEN + PROBE_ANSWER_LEN)
    proxy = _proxy(cfg, 3)
    dp2, dp1 = (PlanModel("a", proxy, Mesh(dp, 1, 1, 0), "float32", trains=True) for dp in (2, 1))
    call = PlanCall("t", "a", (), work)
    counted = compute_time(hw_of(p), dp2, call)
    assert counted > hw_of(p).train_call_overhead_s  # the passes, the gradients' all-reduce, the small ones
    extra = 7e-3
    p["comm"]["dp_train"] = dict(layers=3, prompts=4, measured_s=counted + extra)
    _dp_train(p, cfg, "float32", "cpu")
    assert p["comm"]["dp_train_call_s"] == pytest.approx(extra)
    assert p["comm"]["dp_train"]["simulated_s"] == pytest.approx(counted)
    fitted = hw_of(p)
    assert fitted.dp_train_call_overhead_s == pytest.approx(extra)
    assert compute_time(fitted, dp2, call) == pytest.approx(counted + extra)  # gives back the probed call
    assert compute_time(fitted, dp1, call) == compute_time(dataclasses.replace(fitted, dp_train_call_overhead_s=0.0),
                                                           dp1, call)  # one rank: nothing to wait for
    inf = PlanCall("i", "a", (), dataclasses.replace(work, kind="inference"))
    assert compute_time(fitted, dp2, inf) == compute_time(dataclasses.replace(fitted, dp_train_call_overhead_s=0.0),
                                                          dp2, inf)
    p["comm"]["dp_train"]["measured_s"] = counted / 2  # faster than counted: nothing added, nothing taken
    _dp_train(p, cfg, "float32", "cpu")
    assert p["comm"]["dp_train_call_s"] == 0.0


def _fit_profile(cfg_lat: float = 1e-4) -> dict:
    return dict(key=dict(dtype="float32", machine="m", device="cpu", threads=1), measured_at="now",
                matmul_rows=[(1, 1e9), (64, 5e10)], copy_bw=1e10, attention_flops=1e10, optimizer_s_per_param=1e-9,
                disk_bw=1e9, memory_bytes=1e10, comm=dict(bw=1e9, lat=cfg_lat, allreduce_bw=3e8),
                overheads=dict(layer_s=1e-5, elementwise_s=0.0, decode_layer_s=2e-5, decode_elementwise_s=0.0,
                               pass_s=0.0, decode_step_s=1e-4, train_call_s=2e-3, train_layer_s=1e-4))


def test_pp_train_call_is_what_the_real_pipelined_call_takes_beyond_the_simulated_one():
    """The real two-stage training call against the simulator's 1F1B schedule for the same work: its excess is paid
    once by every pipelined training call and by no other, so that the simulator gives back the probed call."""
    from realhf.plan.interface_probe import PROBE_ANSWER_LEN, PROBE_GROUP, PROBE_PROMPT_LEN
    from realhf.plan.profile import _pp_train, _proxy, hardware as hw_of

    cfg = model_config("smollm2-135m")
    p = _fit_profile()
    _pp_train(p, cfg, "float32", "cpu")
    assert "pp_train_call_s" not in p["comm"] and hw_of(p).pp_train_call_overhead_s == 0.0  # not probed
    work = Workload("train", seqs=8 * PROBE_GROUP, seq_len=PROBE_PROMPT_LEN + PROBE_ANSWER_LEN)
    proxy = _proxy(cfg, 2)
    pp2, pp1, dp2 = (PlanModel("a", proxy, Mesh(dp, 1, pp, 0), "float32", trains=True)
                     for dp, pp in ((1, 2), (1, 1), (2, 1)))
    call = PlanCall("t", "a", (), work)
    counted = compute_time(hw_of(p), pp2, call)
    extra = 5e-3
    p["comm"]["pp_train"] = dict(layers=2, prompts=8, measured_s=counted + extra)
    _pp_train(p, cfg, "float32", "cpu")
    assert p["comm"]["pp_train_call_s"] == pytest.approx(extra)
    fitted = hw_of(p)
    assert fitted.pp_train_call_overhead_s == pytest.approx(extra)
    assert compute_time(fitted, pp2, call) == pytest.approx(counted + extra)  # gives back the probed call
    unfitted = dataclasses.replace(fitted, pp_train_call_overhead_s=0.0)
    for m in (pp1, dp2):  # no pipeline: nothing of it
        assert compute_time(fitted, m, call) == compute_time(unfitted, m, call)
    p["comm"]["pp_train"]["measured_s"] = counted / 2
    _pp_train(p, cfg, "float32", "cpu")
    assert p["comm"]["pp_train_call_s"] == 0.0


def test_pp_decode_latency_inverts_the_cost_models_pipelined_generation():
    """The stages' message latency in a pipelined decode step, from the real two-stage generation: a call that took
    what the cost model gives at latency X yields X, and the fitted profile gives the call back; it moves pipelined
    decode steps only (not a single stage's, not a tensor-parallel one's); a call faster than the model's without
    any latency yields 0; without the probe the link's latency stays."""
    from realhf.plan.cost import CostModel
    from realhf.plan.interface_probe import PROBE_ANSWER_LEN, PROBE_GROUP, PROBE_PROMPT_LEN, PROBE_PROMPTS
    from realhf.plan.profile import _pp_decode_latency, _proxy, hardware as hw_of

    cfg, lat = model_config("smollm2-135m"), 6e-4
    p = _fit_profile(lat)
    _pp_decode_latency(p, cfg, "float32", "cpu")
    assert "pp_decode_lat" not in p["comm"] and hw_of(p).pp_decode_lat is None
    proxy, x = _proxy(cfg, 2), 5e-5
    args = (PROBE_PROMPTS, PROBE_PROMPT_LEN, PROBE_GROUP, PROBE_ANSWER_LEN)
    at_x = CostModel(proxy, dataclasses.replace(hw_of(p), pp_decode_lat=x), "float32").generate(*args, 1, 2)
    at_link = CostModel(proxy, hw_of(p), "float32").generate(*args, 1, 2)
    assert at_link > at_x  # the link's latency (a collective's, waits included) on every message
    p["comm"]["pp_generate"] = dict(layers=2, measured_s=at_x)
    _pp_decode_latency(p, cfg, "float32", "cpu")
    assert p["comm"]["pp_decode_lat"] == pytest.approx(x)
    fitted = hw_of(p)
    assert fitted.pp_decode_lat == pytest.approx(x)
    cm, plain = CostModel(proxy, fitted, "float32"), CostModel(proxy, dataclasses.replace(fitted, pp_decode_lat=None),
                                                               "float32")
    assert cm.generate(*args, 1, 2) == pytest.approx(at_x)
    # each of a step's pp slots sends two messages (activations forward, tokens back)
    assert plain.decode_step(16, 30, 1, 2) - cm.decode_step(16, 30, 1, 2) == pytest.approx(2 * 2 * (lat - x))
    assert cm.decode_step(16, 30, 1, 1) == plain.decode_step(16, 30, 1, 1)
    assert cm.decode_step(16, 30, 2, 1) == plain.decode_step(16, 30, 2, 1)
    p["comm"]["pp_generate"]["measured_s"] = at_x / 10  # faster than any latency explains
    _pp_decode_latency(p, cfg, "float32", "cpu")
    assert p["comm"]["pp_decode_lat"] == 0.0


def test_realloc_rates_from_one_way_and_two_way_reallocations():
    """The fit of the reallocation probe: a fixed cost, a rate from the two one-way sizes, and the share of the
    lesser direction that a two-way exchange adds (0 at full duplex, 1 taking turns, held in [0, 1])."""
    from realhf.plan.probes import realloc_rates

    def pts(t_two: float):
        return [dict(pair="d1m1p1:d2m1p1", hidden=64, seconds=0.001, sent=1e5, received=0.0, bytes_per=4),
                dict(pair="d1m2p1:d2m1p1", hidden=64, seconds=0.001, sent=5e4, received=5e4, bytes_per=4),
                dict(pair="d1m1p1:d2m1p1", hidden=512, seconds=0.041, sent=1e7 + 1e5, received=0.0, bytes_per=4),
                dict(pair="d1m2p1:d2m1p1", hidden=512, seconds=t_two, sent=5e6, received=5e6, bytes_per=4)]

    full = realloc_rates(pts(0.001 + 0.02))  # 20 MB one way at 1 GB/s: both directions at once
    assert full["fixed_s"] == 0.001 and full["bw"] == pytest.approx(1e9) and full["both_ways"] == pytest.approx(0.0)
    turns = realloc_rates(pts(0.001 + 0.04))
    assert turns["both_ways"] == pytest.approx(1.0)
    assert realloc_rates(pts(0.5))["both_ways"] == 1.0  # contention beyond turns is held at 1


def test_measured_link_rates_drive_allreduce_realloc_and_publication():
    """A profiled machine's all-reduce rate and reallocation cost replace the link's; a publication through a weight
    group pays one broadcast per tensor of the HF checkpoint."""
    h = dataclasses.replace(hardware.get("h100"), intra_bw=10e9, intra_lat=0.0)
    assert comm_cost.allreduce(dataclasses.replace(h, allreduce_bw=2e9), 4e9, 2) == pytest.approx(2.0)
    assert comm_cost.allreduce(h, 4e9, 2) == pytest.approx(0.4)
    cfg = model_config("smollm2-135m")
    src, dst = Mesh(1, 2, 1), Mesh(2, 1, 1)
    t = comm_cost.realloc_traffic(cfg, src, dst)
    busiest = max(max(s, r) + min(s, r) for s, r, _ in t.values()) * 4
    measured = dataclasses.replace(h, realloc_fixed_s=0.01, realloc_bw=1e9, realloc_both_ways=1.0)
    assert comm_cost.realloc(measured, cfg, src, dst, 4) == pytest.approx(0.01 + busiest / 1e9)
    pub = dataclasses.replace(h, inter_lat=1e-3, broadcast_lat=2e-4)
    one = comm_cost.publish_weights(pub, 1e8, 4, 1, "broadcast")
    many = comm_cost.publish_weights(pub, 1e8, 4, 1, "broadcast", tensors=comm_cost.hf_tensor_count(cfg))
    assert many - one == pytest.approx((30 * 9 + 2 - 1) * 2e-4)


@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3", "gpt2"])
def test_hf_tensor_count_is_the_checkpoints(family):
    """The tensors a publication sends one by one: as many as the real HF state of a tiny model of each family."""
    import torch

    from realhf.impl.model.conversion.hf_io import stage_hf_state
    from realhf.impl.model.tiny import ensure_tiny_model
    from realhf.plan.profile import _model

    cfg = model_config(ensure_tiny_model(family))
    assert comm_cost.hf_tensor_count(cfg) == len(stage_hf_state(_model(cfg, torch.float32, "cpu")))


def _stats_row(step: float, mfcs: dict) -> dict:
    """A run's stats row: ``mfcs`` {name: (time, compute_time)}."""
    row = {"step_time": step}
    for name, (t, c) in mfcs.items():
        row[f"{name}/time"], row[f"{name}/compute_time"] = t, c
    return row


def test_control_costs_are_a_runs_time_beyond_its_computation():
    """An MFC's cost is its time less its worker's computation, a step's its time less its MFCs' (medians over the
    steps after the first, the call's also over the MFCs); a run whose stats lack a figure is refused by name."""
    from realhf.apps.control_probe import costs

    rows = [_stats_row(9.0, dict(actor_gen=(5.0, 1.0), rew_inf=(1.0, 0.0), actor_train=(2.0, 1.0))),  # warm-up
            _stats_row(0.060, dict(actor_gen=(0.020, 0.018), rew_inf=(0.003, 0.001), actor_train=(0.030, 0.029))),
            _stats_row(0.070, dict(actor_gen=(0.022, 0.019), rew_inf=(0.004, 0.002), actor_train=(0.040, 0.038))),
            _stats_row(0.065, dict(actor_gen=(0.021, 0.018), rew_inf=(0.003, 0.002), actor_train=(0.035, 0.034)))]
    got = costs(rows)
    # per call over 3 steps x 3 MFCs: 2,2,1 / 3,2,2 / 3,1,1 ms -> median 2 ms; per step: 7, 4, 6 ms -> 6 ms
    assert got["call_s"] == pytest.approx(0.002) and got["step_s"] == pytest.approx(0.006)
    assert got["steps"] == 3 and got["mfcs"] == pytest.approx(dict(actor_gen=0.003, rew_inf=0.002, actor_train=0.001))
    with pytest.raises(ValueError, match="rew_inf/compute_time"):
        costs([{k: v for k, v in r.items() if k != "rew_inf/compute_time"} for r in rows])


def test_control_probe_measures_a_real_run_and_the_profile_uses_it():
    """The probe launches a real run (``ppo-math`` on the tiny model, one worker) and reads its steps: each MFC
    costs more than nothing beside its computation and far less than a step; the profile's hardware takes them."""
    from realhf.apps.control_probe import MFCS, control_plane_costs
    from realhf.plan.profile import hardware as hw_of

    c = control_plane_costs(steps=4)
    assert c["steps"] == 3 and set(c["mfcs"]) == set(MFCS)
    assert 0 < c["call_s"] < 0.5 and 0 <= c["step_s"] < 1.0
    p = dict(key=dict(dtype="float32", machine="m", device="cpu", threads=1), measured_at="now",
             matmul_rows=[(1, 1e9)], copy_bw=1e10, attention_flops=1e9, optimizer_s_per_param=1e-9, disk_bw=1e9,
             memory_bytes=1e9, comm=dict(bw=1e9, lat=1e-4), control=c,
             overheads=dict(layer_s=0.0, elementwise_s=0.0, decode_layer_s=0.0, decode_elementwise_s=0.0, pass_s=0.0,
                            decode_step_s=0.0, generate_s=0.002, train_call_s=0.003, train_layer_s=0.004,
                            generate_layer_s=0.005, generate_head_s=0.006))
    hw = hw_of(p)
    assert (hw.call_overhead_s, hw.step_overhead_s) == (c["call_s"], c["step_s"])
    assert (hw.generate_overhead_s, hw.train_call_overhead_s, hw.train_layer_overhead_s) == (0.002, 0.003, 0.004)
    assert (hw.generate_layer_overhead_s, hw.generate_head_overhead_s) == (0.005, 0.006)
    assert hw_of({k: v for k, v in p.items() if k != "control"}).call_overhead_s == hardware.CALL_OVERHEAD_S


def test_a_calls_probe_times_each_call_after_an_idle_gap():
    """The call probes' timing (``probes.timed`` with ``gap_s``): two warm-up calls back to back, then each timed call
    after the gap, as a model worker's call follows its wait for the request."""
    import time

    from realhf.plan.interface_probe import CALL_GAP_S
    from realhf.plan.probes import timed

    spans = []

    def fn():
        spans.append([time.perf_counter(), None])
        spans[-1][1] = time.perf_counter()

    timed(fn, "cpu", reps=3, budget_s=math.inf, gap_s=0.02)
    assert len(spans) == 5
    assert all(spans[i][0] - spans[i - 1][1] >= 0.02 for i in range(2, 5))
    assert CALL_GAP_S > 0


def test_train_call_probe_runs_the_real_ppo_training_call():
    """The PPO actor's train_step on a one-block model: timed whole, with the cost model's passes beside it."""
    from realhf.plan.interface_probe import train_call_overhead
    from realhf.plan.profile import _proxy

    small = _proxy(model_config("smollm2-135m"), 1)
    left, info = train_call_overhead(small, _hw(1e-5), "float32", "cpu", reps=2)
    assert info["measured_s"] > 0 and info["passes_s"] > 0
    assert left == pytest.approx(max(0.0, info["measured_s"] - info["passes_s"]))
    assert math.isfinite(left)


def test_generate_call_probe_runs_the_real_ppo_generation():
    """The PPO actor's generate on a one-block model, answers of a fixed length: timed whole, the cost model's
    prefill and decode steps beside it."""
    from realhf.plan.interface_probe import generate_call_overhead
    from realhf.plan.profile import _proxy

    small = _proxy(model_config("smollm2-135m"), 1)
    left, info = generate_call_overhead(small, _hw(1e-5), "float32", "cpu", reps=2)
    assert info["measured_s"] > 0 and info["passes_s"] > 0
    assert left == pytest.approx(max(0.0, info["measured_s"] - info["passes_s"]))


def test_rule_based_reward_grades_its_share_of_the_answers():
    """A weightless reward call costs its data-parallel rank's share of the generated answers at the measured grading
    rate; the probe grades real answers with the real grader; plan_of gives the call every answer of the step."""
    from realhf.plan.interface_probe import reward_per_answer

    per, info = reward_per_answer(n=16, reps=2)
    assert per > 0 and info["answers"] == 16 and info["round_s"] == pytest.approx(16 * per)
    h = dataclasses.replace(hardware.get("h100"), reward_s_per_answer=1e-3)
    m = PlanModel("reward", CFG, Mesh(2, 1, 1))
    assert compute_time(h, m, PlanCall("rew_inf", "reward", answers=256)) == pytest.approx(0.128)
    assert compute_time(hardware.get("h100"), m, PlanCall("rew_inf", "reward", answers=256)) == 0.0


def test_inputs_from_another_mesh_pay_a_message_per_sample_and_key():
    """Moving a parent's outputs between meshes: the bytes at the link's rate, and each destination data-parallel
    rank's share of the batch's messages at a batched message's cost; on the same mesh nothing moves."""
    h = dataclasses.replace(hardware.get("h100"), intra_bw=1e9, intra_lat=1e-3, p2p_msg_s=1e-5)
    src, dst = Mesh(2, 1, 1, 0), Mesh(1, 2, 1, 0)
    plain = comm_cost.data_transfer(h, 1000, 8.0, src, dst)
    assert plain == pytest.approx(1e-3 + 8000 / 1e9)
    assert comm_cost.data_transfer(h, 1000, 8.0, src, dst, messages=64) == pytest.approx(plain + 63 * 1e-5)
    assert comm_cost.data_transfer(h, 1000, 8.0, src, Mesh(2, 1, 1, 2), messages=64) > plain
    assert comm_cost.data_transfer(h, 1000, 8.0, src, src, messages=64) == 0.0


def test_the_hardware_summary_reports_the_fixed_costs():
    """``python -m realhf.apps.profile`` prints the fixed costs the simulator adds (ms), and a pipelined decode
    step's message latency where it was measured."""
    import json

    hw = dataclasses.replace(hardware.get("h100"), call_overhead_s=0.002, pp_train_call_overhead_s=0.001,
                             dp_train_call_overhead_s=0.0035)
    d = hardware.describe(hw, "bfloat16")
    assert d["fixed_ms"] == dict(call=2.0, step=round(hardware.STEP_OVERHEAD_S * 1e3, 3),
                                 train_call=round(hardware.TRAIN_CALL_OVERHEAD_S * 1e3, 3), tp_decode_step=0.0,
                                 dp_train_call=3.5, pp_train_call=1.0)
    assert "pp_decode_lat_us" not in d  # not measured: the link's latency
    assert hardware.describe(dataclasses.replace(hw, pp_decode_lat=2.5e-4))["pp_decode_lat_us"] == 250.0
    json.dumps(d)
