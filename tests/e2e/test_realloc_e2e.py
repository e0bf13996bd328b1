"""ppo-math with actor_gen and actor_train on different layouts/devices: the trained parameters are
reallocated onto the generation layout every step, and the run matches a single-layout run.

Sampling is seeded per sample, so generation does not depend on the layout: if reallocation moved the
parameters exactly, every step's stats (which depend on what was generated from the trained
parameters) equal the single-layout run's. Token counts are compared exactly, float stats within 1e-4
(tensor parallelism changes summation order).
"""
import os

import pytest

from support.tiny_ppo import STEPS, ppo_args

from realhf.testing import read_stats, run_quickstart

EXACT = ("n_tokens", "n_valid_tokens", "n_seqs", "avg_seq_len", "no_eos_ratio", "task_reward")
CLOSE = ("importance_weight", "actor_loss", "ppo_approx_kl", "final_reward", "advantage")
def run(model, d, exp, n_devices, *extra):
    p = run_quickstart(ppo_args(model, d, exp, n_devices, *extra))
    assert p.returncode == 0, p.stderr[-4000:]
    return read_stats(d, exp)


def _same(ref, got, what):
    assert len(got) == len(ref) == STEPS
    for step, (r, g) in enumerate(zip(ref, got), 1):
        for k in EXACT:
            assert g[k] == r[k], f"{what}, step {step}: {k}={g[k]} vs {r[k]} in one layout"
        for k in CLOSE:
            assert abs(g[k] - r[k]) < 1e-4 * max(1.0, abs(r[k])), f"{what}, step {step}: {k}={g[k]} vs {r[k]}"


@pytest.fixture(scope="module")
def single(tiny_ppo_colocated):
    """The run on one device (allocation_mode=d1m1p1; tests/conftest.py)."""
    return tiny_ppo_colocated


def test_gen_and_train_on_different_layouts(tiny_math_run, single):
    model, d = tiny_math_run
    # the generation replica is also offloaded between its calls (and brought back for reallocation)
    st = run(model, d, "per-mfc", 2, "allocation_mode=actor_gen:d2m1p1,actor_train:d1m2p1,*:d1m1p1", "actor.offload=true")
    assert all(s["actor_grad_norm"] > 0 for s in single)
    _same(single, st, "actor_gen d2m1p1 / actor_train d1m2p1")
    # the generation replica was brought up to date before every step but the first
    assert "actor_gen/realloc_time" not in st[0]
    assert all(s["actor_gen/realloc_time"] > 0 for s in st[1:])


def _worker_log(d, exp, i=0):
    with open(os.path.join(d, exp, "trial0", "logs", f"model_worker_{i}.log")) as f:
        return f.read()


def test_decoupled_generation_devices(tiny_math_run, single):
    """gen.d1m1p1+d1m2p1: generation by realhf's own generation server on device 2, everything else on workers
    0-1 under tensor parallelism (the tp shards are gathered and published to the server every step, here over a
    weight group)."""
    model, d = tiny_math_run
    st = run(model, d, "decoupled", 3, "allocation_mode=gen.d1m1p1+d1m2p1", "gen_server.weight_transport=group")
    _same(single, st, "decoupled gen.d1m1p1+d1m2p1")
    assert "(gloo) as rank 0" in _worker_log(d, "decoupled")


@pytest.mark.parametrize("sync", ["memory", pytest.param("disk", marks=pytest.mark.slow)])
def test_generation_server_fed_by_pipeline_stages(tiny_math_run, single, sync):
    """gen.d1m1p1+d1m1p2: the trainer's two pipeline stages each publish their own layers to the generation
    server (memory: each stage writer shares its tensors by reference, the server on their host maps both parts;
    disk: one checkpoint of two shards)."""
    model, d = tiny_math_run
    st = run(model, d, f"decoupled-pp-{sync}", 3, "allocation_mode=gen.d1m1p1+d1m1p2", f"param_realloc={sync}")
    _same(single, st, f"decoupled gen.d1m1p1+d1m1p2 ({sync})")
    if sync == "memory":  # gen_server.weight_transport=auto chose shared memory (the server is on their host)
        assert "servers: shared (by reference: a shared-memory file)" in _worker_log(d, f"decoupled-pp-{sync}")


def test_manual_meshes_and_disk_reallocation(tiny_math_run, single):
    model, d = tiny_math_run
    st = run(model, d, "manual", 2, "allocation_mode=manual", "param_realloc=disk",
             "actor_gen.device_mesh=localhost:1", "actor_gen.parallel=d1m1p1",
             "actor_train.device_mesh=localhost:0-1", "actor_train.parallel=d1m1p2",
             "rew_inf.device_mesh=localhost:0", "rew_inf.parallel=d1m1p1")
    _same(single, st, "manual meshes, reallocation through disk")


@pytest.mark.parametrize("extra,fragments", [
    (["allocation_mode=manual", "actor_gen.parallel=d1m1p1"], ["actor_gen.device_mesh", "manual needs"]),
    (["allocation_mode=manual", "actor_gen.device_mesh=localhost:0,1", "actor_gen.parallel=d1m1p1",
      "actor_train.device_mesh=localhost:0", "actor_train.parallel=d1m1p1", "rew_inf.device_mesh=localhost:0",
      "rew_inf.parallel=d1m1p1"], ["actor_gen.parallel='d1m1p1' needs 1 devices", "has 2"]),
    (["allocation_mode=manual", "actor_gen.device_mesh=localhost:0,0", "actor_gen.parallel=d2m1p1"],
     ["more than once"]),
    (["allocation_mode=manual", "actor_gen.device_mesh=node02:0", "actor_gen.parallel=d1m1p1"], ["unknown node"]),
    (["allocation_mode=manual", "actor_gen.device_mesh=localhost:5", "actor_gen.parallel=d1m1p1"], ["do not exist"]),
    (["allocation_mode=gen.d1m1p2+d1m1p1", "n_devices_per_node=3"], ["do not support pipeline parallelism", "use p1"]),
    (["allocation_mode=gen.d1m2p1+d1m1p1", "n_devices_per_node=3"], ["tp=1 per server", "gen.d2m1p1"]),
    (["allocation_mode=sglang.d1m1p1+d1m1p1"], ["sglang", "vllm./gen."]),
    (["allocation_mode=actor_gen:d1m4p1,*:d1m1p1", "n_devices_per_node=4"], ["actor.path", "actor@1", "d1m4p1"]),
    (["allocation_mode=actor_gen:d1m1p1,actor_train:d1m1p5,*:d1m1p1", "n_devices_per_node=5"],
     ["actor.path", "cannot fill 5 pipeline stages"]),
])
def test_bad_allocations_fail_before_workers_start(tiny_math_run, extra, fragments):
    model, d = tiny_math_run
    p = run_quickstart(ppo_args(model, d, "bad", 2, *extra), timeout=120)
    assert p.returncode != 0
    for f in fragments:
        assert f in p.stderr, f"{f!r} not in:\n{p.stderr[-2000:]}"
    assert not os.path.exists(os.path.join(d, "bad", "trial0", "logs", "model_worker_0.log"))


def test_unknown_launcher_is_refused(tiny_math_run):
    model, d = tiny_math_run
    p = run_quickstart(ppo_args(model, d, "k8s", 1, "mode=kubernetes"), timeout=120)
    assert p.returncode == 2 and "mode='kubernetes'" in p.stderr and "local" in p.stderr, p.stderr[-2000:]
    assert not os.path.exists(os.path.join(d, "k8s", "trial0", "logs", "master.log"))
