"""The cost model of execution plans (realhf.plan: shapes, hardware, cost, comm_cost, profile)."""
from __future__ import annotations

import dataclasses
import json
import os

import pytest

from realhf.plan import comm_cost, cost, hardware
from realhf.plan.shapes import SHAPES, config_from_hf_dict, model_config, n_params


@pytest.mark.parametrize("name,published", [
    ("qwen2.5-0.5b", 0.494e9), ("qwen2.5-1.5b", 1.54e9), ("qwen2.5-7b", 7.62e9), ("qwen2.5-14b", 14.77e9),
    ("qwen2.5-32b", 32.76e9), ("r1-distill-qwen-1.5b", 1.78e9), ("llama-3.1-8b", 8.03e9), ("smollm2-135m", 134.5e6),
])
def test_table_shapes_have_the_published_parameter_counts(name, published):
    assert SHAPES[name].source.startswith("https://huggingface.co/")
    assert abs(n_params(model_config(name)) / published - 1) < 0.01


def test_a_config_json_dict_gives_the_tables_shape():
    hf = dict(SHAPES["qwen2.5-7b"].hf_config(), architectures=["Qwen2ForCausalLM"])
    a, b = config_from_hf_dict(hf), model_config("Qwen2.5-7B")
    assert (a.hidden_dim, a.n_layers, a.n_kv_heads, a.intermediate_dim, a.use_attention_bias) == \
        (b.hidden_dim, b.n_layers, b.n_kv_heads, b.intermediate_dim, True)
    with pytest.raises(ValueError, match="known shapes"):
        model_config("no-such-model")


def _h200_7b():
    hw = hardware.get("H200")
    assert hw.matmul_rate("bfloat16") == pytest.approx(788e12, rel=1e-3)  # the measured figure is the derated peak
    return cost.CostModel(model_config("qwen2.5-7b"), hw, "bfloat16")


def test_tensor_parallelism_halves_the_products_and_adds_two_all_reduces_per_block():
    cm = _h200_7b()
    T = 8192
    prods = {tp: sum(cm.matmul(T, k, n) for k, n in cm.linears(tp)) for tp in (1, 2)}
    assert prods[2] == pytest.approx(prods[1] / 2, rel=0.01)
    ar = cm.tp_allreduce(T, 2)
    hw = cm.hw
    assert ar == pytest.approx(T * 3584 * 2 / hw.intra_bw + 2 * hw.intra_lat)  # ring over 2: bytes once, 2 steps
    attn = {tp: cm.block(T, T * 1024, tp) - prods[tp] - (2 * ar if tp == 2 else 0) for tp in (1, 2)}
    assert attn[2] < attn[1]  # attention splits by heads too; the rest (overheads) stays
    assert cm.block(T, T * 1024, 2) == pytest.approx(prods[2] + attn[2] + 2 * ar)


def test_pipeline_bubble_is_p_minus_1_over_m_plus_p_minus_1():
    cfg = dataclasses.replace(model_config("qwen2.5-7b"), is_critic=True)  # a one-wide head: the stages are equal
    hw = dataclasses.replace(hardware.get("h200"), intra_lat=0.0, intra_bw=1e30)  # free sends
    cm = cost.CostModel(cfg, hw, "bfloat16")
    for m, p in ((1, 2), (4, 4), (8, 4), (3, 7)):
        work = cm.forward(16384, m, 1024, tp=1, pp=1) / p  # the same work spread over p stages, no bubble
        total = cm.forward(16384, m, 1024, tp=1, pp=p)
        assert 1 - work / total == pytest.approx((p - 1) / (m + p - 1), rel=0.02), (m, p)
        assert cm.train(16384, m, 1024, pp=p) == pytest.approx(3 * total, rel=0.02)
    assert cm.train(16384, 4, 1024, checkpointing=True) > cm.train(16384, 4, 1024)


def test_decode_is_bandwidth_bound_at_few_rows_and_compute_bound_at_many():
    cm = _h200_7b()
    bw, rate = cm.hw.memory_bw, cm.hw.matmul_rate("bfloat16")
    k, n = cm.linears(1)[2]  # the MLP's gate and up projections
    assert cm.matmul(1, k, n) == pytest.approx((k * n + k + n) * 2 / bw)
    assert cm.matmul(8192, k, n) == pytest.approx(2 * 8192 * k * n / rate)
    # few rows: reading the weights dominates, so 8x the rows costs about the same; many: twice the rows, twice
    assert cm.decode_step(8, 100) / cm.decode_step(1, 100) < 1.1
    assert cm.decode_step(8192, 100) / cm.decode_step(4096, 100) == pytest.approx(2.0, rel=0.05)
    # 7.6B bf16 weights (15.2 GB) at 4.2 TB/s: a one-row step takes at least 3.6 ms
    assert cm.decode_step(1, 100) > 15.2e9 / 4.2e12
    # a generation is its prefill plus its decode steps
    g = cm.generate(4, 100, 2, 5)
    assert g == pytest.approx(cm.prefill(400, 4) + sum(cm.decode_step(8, 100 + i) for i in range(1, 5)))


def test_optimizer_gradient_all_reduce_and_publication_scale_with_the_bytes():
    cm = _h200_7b()
    hw = cm.hw
    assert cm.optimizer_step(2e9) == pytest.approx(2 * cm.optimizer_step(1e9))
    one_node = comm_cost.grad_allreduce(hw, 1e9, 2, comm_cost.Mesh(dp=8))
    two_nodes = comm_cost.grad_allreduce(hw, 1e9, 2, comm_cost.Mesh(dp=16))
    assert two_nodes > one_node > 0 and comm_cost.grad_allreduce(hw, 1e9, 2, comm_cost.Mesh(tp=8)) == 0
    disk = comm_cost.publish_weights(hw, 7.6e9, 2, servers=4, method="disk")
    assert disk == pytest.approx(5 * 15.2e9 / hw.disk_bw)
    with pytest.raises(ValueError, match="allowed"):
        comm_cost.publish_weights(hw, 1e9, 2, 1, method="carrier-pigeon")


@pytest.mark.parametrize("src,dst", [
    ((1, 1, 2), (2, 1, 1)), ((1, 2, 2), (2, 1, 2)), ((2, 1, 2, 0), (2, 2, 1, 4)), ((4, 2, 1), (8, 1, 1)),
    ((2, 2, 2), (1, 2, 4)),
])
def test_reallocation_traffic_follows_the_reallocation_planner(src, dst):
    cfg = model_config("qwen2.5-7b")
    a, b = comm_cost.Mesh(*src), comm_cost.Mesh(*dst)
    closed, exact = comm_cost.realloc_traffic(cfg, a, b), comm_cost.realloc_exact(cfg, a, b)
    busiest = [max([max(s, r) for s, r, _ in t.values()] or [0.0]) for t in (closed, exact)]
    assert busiest[0] == pytest.approx(busiest[1], rel=0.15, abs=1.0)
    assert sum(v[1] for v in closed.values()) == pytest.approx(sum(v[1] for v in exact.values()), rel=0.02, abs=1.0)
    t = comm_cost.realloc(hardware.get("h100"), cfg, a, b, 2)
    assert (t > 0) == (busiest[1] > 0)


def test_a_plan_over_memory_is_rejected_by_the_memory_model():
    hw, cfg = hardware.get("h200"), model_config("qwen2.5-32b")
    with pytest.raises(cost.PlanDoesNotFit, match=r"optimizer .*against 119.81 GiB"):
        cost.check_fits(cfg, hw, "bfloat16", "train", 8192)
    est = cost.check_fits(cfg, hw, "bfloat16", "train", 8192, tp=8, pp=4, mb=4)
    assert est.total < cost.capacity(hw)
    with pytest.raises(ValueError, match="does not fit this model"):  # 8 key/value heads over 16 tensor ranks
        cost.check_fits(cfg, hw, "bfloat16", "train", 8192, tp=16)


def test_profile_measures_once_then_reads_its_cache(tmp_path):
    from realhf.plan import profile
    from realhf.impl.model.tiny import tiny_hf_config

    cfg = config_from_hf_dict(tiny_hf_config("qwen2", 1008).to_dict())
    p = profile.profile(cfg, "float32", "cpu", comm=True, cache_dir=str(tmp_path))
    files = os.listdir(tmp_path)
    assert files == [os.path.basename(p["path"])]
    path = p["path"]
    before = (os.stat(path).st_mtime_ns, open(path).read())
    assert json.loads(before[1])["key"]["shape"]["hidden"] == 64
    hw = profile.hardware(p)
    assert hw.matmul_rate("float32") > 0 and hw.memory_bw > 0 and hw.intra_bw > 0 and hw.intra_lat > 0
    assert [r for r, _ in hw.matmul_rows] == list(profile.CPU_ROWS)
    # a real two-rank training call of the deepest fitted proxy, half the probe's prompts on each rank
    point = p["comm"]["dp_train"]
    assert point["layers"] == max(profile._fit_layers(cfg, "float32")) and point["measured_s"] > 0
    assert hw.dp_train_call_overhead_s == p["comm"]["dp_train_call_s"] == pytest.approx(
        max(0.0, point["measured_s"] - point["simulated_s"]))
    # a real pipelined training call and generation of that proxy over two stages: their fits in the hardware
    pt, pg = p["comm"]["pp_train"], p["comm"]["pp_generate"]
    assert pt["layers"] == pg["layers"] == point["layers"] >= 2 and pt["measured_s"] > 0 and pg["measured_s"] > 0
    assert hw.pp_train_call_overhead_s == p["comm"]["pp_train_call_s"] == pytest.approx(
        max(0.0, pt["measured_s"] - pt["simulated_s"]))
    assert hw.pp_decode_lat == p["comm"]["pp_decode_lat"] >= 0
    again = profile.profile(cfg, "float32", "cpu", comm=True, cache_dir=str(tmp_path))
    assert (os.stat(path).st_mtime_ns, open(path).read()) == before  # read back, not measured again
    assert again["measured_at"] == p["measured_at"] and again["comm"] == p["comm"]
    # a generation server's own cost: measured on a real server process when a plan with servers asks, then kept
    assert hw.server_generate_overhead_s is None and hw.generate_layer_overhead_s > 0
    from realhf.gen_server.probe import served_generate_overhead

    served = profile.profile(cfg, "float32", "cpu", comm=True, cache_dir=str(tmp_path),
                             server_probe=served_generate_overhead)
    point = served["overheads"]["server_generate_point"]
    assert point["measured_s"] > 0 and point["passes_s"] > 0
    assert served["overheads"]["server_generate_s"] == pytest.approx(
        max(0.0, point["measured_s"] - point["passes_s"] - point["layout_s"]))
    assert profile.hardware(served).server_generate_overhead_s == served["overheads"]["server_generate_s"]
    assert served["measured_at"] == p["measured_at"]  # added to the cached profile, nothing else measured again
    assert profile.profile(cfg, "float32", "cpu", cache_dir=str(tmp_path),
                           server_probe=served_generate_overhead) == served
    # the rollout side's cost per episode and a weight update's, through a real rollout manager and server
    from realhf.system.rollout.probe import rollout_episode_overhead

    rolled = profile.profile(cfg, "float32", "cpu", cache_dir=str(tmp_path), rollout_probe=rollout_episode_overhead)
    o, point = rolled["overheads"], rolled["overheads"]["rollout_episode_point"]
    assert point["trajectories"] == point["episodes_per_round"] * (len(point["rounds_s"]) + 1)
    assert o["rollout_episode_s"] > 0 and point["update_s"] > 0 and o["server_update_s"] >= 0
    rhw = profile.hardware(rolled)
    assert rhw.rollout_episode_s == o["rollout_episode_s"] and rhw.server_update_s == o["server_update_s"]
    assert rhw.host_cores == len(os.sched_getaffinity(0)) and rhw.device_threads == rolled["key"]["threads"]
    assert rolled["measured_at"] == p["measured_at"] and "server_generate_s" in o
    # another shape is another profile
    other = dataclasses.replace(cfg, hidden_dim=96, n_q_heads=3, n_kv_heads=1, head_dim=32)
    assert profile.cache_path(profile.profile_key(other, "float32", "cpu", 1)) != \
        profile.cache_path(profile.profile_key(cfg, "float32", "cpu", 1))
    # a time predicted from the profile is positive and grows with the work
    cm = cost.CostModel(cfg, hw, "float32")
    assert 0 < cm.forward(256) < cm.forward(1024) < cm.train(1024)


def test_pipeline_schedule_counts_each_stage_of_the_fill_and_drain_once():
    """1F1B over stages of unequal cost (SmolLM2's last stage carries a head of 49152 rows, a third of its weights):
    the slowest stage runs every micro-batch, the others' slots are paid once each while the pipeline fills and
    drains; equal stages give (mb + pp - 1) slots."""
    assert cost.CostModel._schedule([1.0, 2.0], 3) == pytest.approx(2 * 2.0 + 3.0)
    assert cost.CostModel._schedule([2.0] * 4, 5) == pytest.approx((5 + 4 - 1) * 2.0)
    cfg, hw = model_config("smollm2-135m"), hardware.get("h100")
    cm = cost.CostModel(cfg, hw, "bfloat16")
    first, last = cm._stages(1024, 1024 * 512, 1024, 1, 2)
    assert last > 1.1 * first  # the head's stage is the slowest
    for mb in (1, 2, 8):
        t = cm.forward(1024 * mb, mb, 512, pp=2)
        slot = hw.pass_overhead_s + cm._send(1024, 2, 1)
        assert t == pytest.approx((mb - 1) * (last + slot) + (first + slot) + (last + slot))
        assert t < (mb + 1) * (last + slot)  # less than every slot at the slowest stage's cost
    assert cm.train(8192, 4, 512, pp=2) < cm.train(8192, 4, 512, pp=1)
