"""benchmarks/bench_scale.py: real quickstart launches on the tiny shape report every MFC's time beside its hardware floor,
and the floors' formulas give the known floors of the Qwen2.5-1.5B work on an H200."""
import json
import os
import subprocess
import sys

import pytest

from realhf.base.process import env_with_source_path, source_root

BENCH_DIR = os.path.join(source_root(), "benchmarks")


def run_bench(root, *args, timeout=900):
    """bench_scale.py in a subprocess, launches under ``root``: (the process, its JSON lines by part, its stdout)."""
    p = subprocess.run([sys.executable, os.path.join(BENCH_DIR, "bench_scale.py"), *args, "--root", str(root)],
                       cwd=source_root(), capture_output=True, text=True, timeout=timeout, env=env_with_source_path())
    parts = {}
    for line in p.stdout.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            parts.setdefault(row["part"], []).append(row)
    return p, parts, p.stdout


def check_mfc_rows(mode: str, rows: list, stdout: str):
    for m in rows:
        assert m["time_s"] > 0 and m["compute_time_s"] > 0 and m["floor_s"] > 0, m
        assert m["ratio"] == pytest.approx(m["time_s"] / m["floor_s"], rel=2e-3), m  # one step used: its own ratio
        assert m["est_mem_gib"] is None or m["est_mem_gib"] > 0, m
        assert f"| {mode} | {m['mfc']} | {m['time_s']} |" in stdout and f"| {m['ratio']}x |" in stdout, m


def test_tiny_colocated_run_prints_every_mfc_beside_its_floor(tmp_path):
    p, parts, out = run_bench(tmp_path, "--shape", "tiny", "--modes", "colocated", "--steps", "2")
    assert p.returncode == 0, p.stderr[-3000:]
    for key in ("env", "ceilings", "model", "work", "mfc", "mode"):
        assert key in parts, f"no {key!r} line in:\n{out[-3000:]}"
    assert parts["env"][0]["device"] == "cpu" and parts["env"][0]["card"]
    c = parts["ceilings"][0]
    assert c["matmul_tflops"] > 0 and c["copy_gb_per_s"] > 0 and c["dtype"] == "float32"
    mode = parts["mode"][0]
    assert (mode["mode"], mode["rc"], mode["timed_out"], mode["steps_done"], mode["steps_used"]) == (
        "colocated", 0, False, 2, [2]), mode
    mfcs = {m["mfc"]: m for m in parts["mfc"]}
    assert set(mfcs) == {"actor_gen", "ref_inf", "actor_train"}, mfcs  # rew_inf grades on the CPU: no floor
    check_mfc_rows("colocated", mfcs.values(), out)
    for m in mfcs.values():
        assert m["peak_mem_gib"] > 0 and m["est_mem_gib"] > 0, m
    # a training pass is the forward pass plus a backward pass of twice its products, over the reference's tokens
    assert mfcs["actor_train"]["floor_s"] == pytest.approx(3 * mfcs["ref_inf"]["floor_s"], rel=2e-3)
    # one device does everything in turn: the step's floor is the sum of its MFCs'
    assert mode["step_floor_s"] == pytest.approx(sum(m["floor_s"] for m in mfcs.values()), rel=2e-3)
    assert mode["ratio"] == pytest.approx(mode["step_time_s"] / mode["step_floor_s"], rel=2e-3)
    assert mode["other"]["rew_inf/time_s"] > 0
    # the floors came from the work the run did: 4 prompts x 2 answers of exactly 16 tokens
    with open(os.path.join(tmp_path, "scale-tiny-colocated-a16", "trial0", "logs", "stats.jsonl")) as f:
        stats = [json.loads(line) for line in f]
    assert [(s["n_seqs"], s["n_valid_tokens"]) for s in stats] == [(8, 128), (8, 128)]
    # the planner's step simulator beside the launch (bench_plan.py scale: what PLAN=1 of the GPU check runs)
    log = tmp_path / "bench.log"
    log.write_text(out)
    q = subprocess.run([sys.executable, os.path.join(BENCH_DIR, "bench_plan.py"), "scale", "--bench-log", str(log)],
                       cwd=source_root(), capture_output=True, text=True, timeout=600, env=env_with_source_path())
    assert q.returncode == 0, q.stderr[-3000:]
    (sim,) = [json.loads(line) for line in q.stdout.splitlines() if line.startswith("{")]
    assert (sim["mode"], sim["plan"], sim["steps"]) == ("colocated", "d1m1p1", 1), sim
    assert sim["measured_s"] == pytest.approx(mode["step_time_s"], abs=1e-3) and sim["simulated_s"] > 0
    assert sim["ratio"] == pytest.approx(sim["simulated_s"] / sim["measured_s"], rel=2e-3)
    assert set(sim["mfcs"]) == {"actor_gen", "rew_inf", "ref_inf", "actor_train"}, sim
    assert all(m["simulated_s"] > 0 and m["measured_s"] > 0 for m in sim["mfcs"].values()), sim


# the published config.json of Qwen2.5-1.5B-Instruct and Qwen2.5-7B-Instruct (the keys the floors read)
QWEN25 = dict(model_type="qwen2", max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1e6, hidden_act="silu")
QWEN25_1_5B = dict(QWEN25, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                   num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)
QWEN25_7B = dict(QWEN25, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                 num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False)


def test_floors_of_the_1_5b_work_are_the_h200_figures(tmp_path):
    """At the ceilings measured on an H200 (bf16 788 TFLOP/s, copy 4.2 TB/s), 16 GSM8K prompts (~130 tokens with the
    chat template) x 8 answers x 1,024 tokens on Qwen2.5-1.5B: generation ~1.2 s (3.1 GB of weights and up to 1.9 GB of
    KV cache read a decode step), reference ~0.6 s, training ~1.8 s."""
    sys.path.insert(0, BENCH_DIR)
    import _floors

    def shape(name, config):
        os.makedirs(tmp_path / name)
        with open(tmp_path / name / "config.json", "w") as f:
            json.dump(config, f)
        return _floors.ModelShape.from_path(str(tmp_path / name), "bfloat16")

    m = shape("1.5b", QWEN25_1_5B)
    assert m.weight_bytes == pytest.approx(3.09e9, rel=0.01) and m.kv_bytes_per_token == 2 * 28 * 2 * 128 * 2
    h200 = _floors.Ceilings(788e12, 4.2e12, "bfloat16", "cuda")
    stats = dict(n_seqs=128, avg_prompt_len=130, n_valid_tokens=128 * 1024, n_tokens=128 * (130 + 1024))
    floors = {k: _floors.mfc_floor(k, m, h200, stats, group=8) for k in ("actor_gen", "ref_inf", "actor_train", "rew_inf")}
    assert 1.1 < floors["actor_gen"] < 1.35 and 0.55 < floors["ref_inf"] < 0.65 and 1.65 < floors["actor_train"] < 1.9
    assert floors["rew_inf"] is None
    # Qwen2.5-7B's untied input embedding is a lookup: a decode step reads its 7.07B other parameters
    assert shape("7b", QWEN25_7B).weight_bytes == pytest.approx(2 * 7.07e9, rel=0.01)


@pytest.mark.slow
def test_tiny_served_and_async_runs_print_their_floors(tmp_path):
    p, parts, out = run_bench(tmp_path, "--shape", "tiny", "--modes", "served,async", "--steps", "2")
    assert p.returncode == 0, p.stderr[-3000:]
    modes = {m["mode"]: m for m in parts["mode"]}
    assert {k: (m["rc"], m["steps_done"]) for k, m in modes.items()} == {"served": (0, 2), "async": (0, 2)}
    by = {}
    for m in parts["mfc"]:
        by.setdefault(m["mode"], {})[m["mfc"]] = m
    assert set(by["served"]) == {"actor_gen", "ref_inf", "actor_train"}
    assert set(by["async"]) == {"actor_inf", "ref_inf", "actor_train"}  # generation runs on the server, overlapped
    for mode, rows in by.items():
        check_mfc_rows(mode, rows.values(), out)
    gen = by["served"]["actor_gen"]
    assert gen["weight_sync_s"] > 0 and gen["peak_mem_gib"] is None  # the client's worker is not the server
    # one CPU shared by the server and the trainer: the asynchronous step's floor is generation's plus the trainer's
    a = modes["async"]
    assert a["other"]["gen_floor_s"] > 0
    assert a["step_floor_s"] == pytest.approx(a["other"]["gen_floor_s"] + sum(m["floor_s"] for m in by["async"].values()),
                                              rel=2e-3)


@pytest.mark.slow
def test_a_launch_over_its_budget_is_stopped_and_reported(tmp_path):
    p, parts, out = run_bench(tmp_path, "--shape", "tiny", "--modes", "colocated", "--steps", "1000",
                              "--budget-s", "75")
    assert p.returncode == 0, p.stderr[-3000:]
    mode = parts["mode"][0]
    assert mode["timed_out"] and 0 <= mode["steps_done"] < 1000 and mode["wall_s"] < 75, mode
    assert f"{mode['steps_done']} of 1000 done, stopped" in out
    left = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout.split()
    assert not left, f"processes of the stopped run are still running: {left}"


@pytest.mark.slow
def test_smoke_cpu_compares_with_transformers(tmp_path):
    p, parts, out = run_bench(tmp_path, "--smoke-cpu")
    assert p.returncode == 0, p.stderr[-3000:]
    impls = {(r["part"], r["impl"]) for k in ("gen", "gen_server", "train") for r in parts[k] if "impl" in r}
    assert impls == {("gen", "realhf"), ("gen", "hf"), ("gen_server", "gen_server"), ("gen_server", "gen_server_eager"),
                     ("train", "realhf"), ("train", "hf")}
    assert "| gen | 4x8 |" in out and "| train | 2x32 |" in out
