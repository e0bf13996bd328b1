"""``python -m realhf.apps.check_cluster``: local mode on this machine, Ray mode on a fake two-node cluster
(``ray.cluster_utils.Cluster``), Slurm mode on the real one-node Slurm of the ``slurm_cluster`` fixture."""
import json
import os
import subprocess
import sys
import time

import pytest

from realhf.apps.cluster import check as check_cluster, collect as cluster_collect
from realhf.base import network
from realhf.base.process import source_root

ROOT = source_root()


def run_check(*args, timeout=240, env=None):
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "realhf.apps.check_cluster", *args], capture_output=True, text=True,
                       timeout=timeout, cwd=ROOT, env=env)
    return p, time.monotonic() - t0


def as_json(p):
    assert p.stdout.strip().startswith("{"), p.stdout + p.stderr
    return json.loads(p.stdout)


def assert_node_checks_pass(node, n_nodes):
    assert node["fileroot_ok"], node
    assert node["shared"] == {str(j): "ok" for j in range(n_nodes)}, node
    assert node["ports"] == {str(j): "ok" for j in range(n_nodes)}, node
    for key in ("hostname", "ip", "cpus", "gpus", "mem_free_gib", "python", "torch", "realhf"):
        assert node.get(key) is not None, (key, node)


# ----------------------------------------------------------------------------- local
def test_local_ready(tmp_path):
    p, _ = run_check("--fileroot", str(tmp_path / "root"))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "READY: 1 node(s) answered" in p.stdout
    assert "127.0.0.1" in p.stdout  # what REALHF_HOST is for a local run
    p, _ = run_check("--mode", "local", "--fileroot", str(tmp_path / "root"), "--json")
    rep = as_json(p)
    assert p.returncode == 0 and rep["ok"], rep
    assert len(rep["nodes"]) == 1
    assert_node_checks_pass(rep["nodes"][0], 1)
    assert not os.listdir(tmp_path / "root")  # the probe's files are cleaned up


def test_local_unwritable_fileroot(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    bad = str(blocker / "root")  # a path below a regular file cannot be created, even by root
    p, _ = run_check("--fileroot", bad)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "NOT READY" in p.stdout
    assert f"fileroot={bad!r} is not writable" in p.stdout
    assert "choose a folder every node can write" in p.stdout


def test_local_too_many_gpus_and_nodes(tmp_path):
    have = check_cluster.node_info()["gpus"]
    p, _ = run_check("--fileroot", str(tmp_path), "--gpus-per-node", str(have + 1), "--nodes", "2")
    assert p.returncode == 1, p.stdout + p.stderr
    assert f"has {have} GPU(s) but the run needs {have + 1} per node" in p.stdout
    assert "the run needs 2 nodes (n_nodes) but mode=local runs every process on this machine" in p.stdout


def test_options_from_config(tmp_path):
    # a CPU example config, its model path absent here: its cluster options are read anyway (with a note)
    cfg = os.path.join(ROOT, "examples", "configs", "grpo-tiny-arith-cpu.yaml")
    p, _ = run_check("--config", cfg, "--exp", "ppo-math", f"fileroot={tmp_path}", "mode=local", "--json")
    rep = as_json(p)
    assert p.returncode == 0, p.stdout + p.stderr
    assert rep["request"]["fileroot"] == str(tmp_path) and rep["request"]["mode"] == "local"
    assert rep["request"]["nodes"] == 1 and rep["request"]["devices_per_node"] == 1
    # options given as flags win over the config's; a config that does not name GPUs needs none on a CPU node
    p, _ = run_check("--config", cfg, "--exp", "ppo-math", f"fileroot={tmp_path}", "--gpus-per-node", "64")
    assert p.returncode == 1 and "needs 64 per node" in p.stdout, p.stdout + p.stderr


def test_usage_errors():
    p, _ = run_check("--exp", "ppo-math")
    assert p.returncode == 2 and "--exp needs --config" in p.stderr
    p, _ = run_check("n_nodes=2")
    assert p.returncode == 2 and "need --config" in p.stderr


# ----------------------------------------------------------------------------- Ray
@pytest.fixture(scope="module")
def fake_ray_cluster():
    pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        c.add_node(num_cpus=1)
        c.wait_for_nodes()
        yield c
    finally:
        c.shutdown()


def test_ray_two_nodes(fake_ray_cluster, tmp_path):
    p, took = run_check("--mode", "ray", "--ray-address", fake_ray_cluster.address, "--nodes", "2",
                        "--fileroot", str(tmp_path), "--timeout", "60", "--json")
    rep = as_json(p)
    assert p.returncode == 0 and rep["ok"], p.stdout + p.stderr
    nodes = rep["nodes"]
    assert len(nodes) == 2
    assert len({n["ray_node_id"] for n in nodes}) == 2  # one probe on each node
    for n in nodes:
        assert_node_checks_pass(n, 2)
        assert n["ray_cpus"] == 1.0
    # the same probes judged against a run that needs a third node and GPUs
    req = check_cluster.Request(mode="ray", nodes=3, gpus_per_node=1, ray_address=fake_ray_cluster.address,
                                fileroot=str(tmp_path))
    rep3 = check_cluster.judge(check_cluster.Report(req, nodes=nodes))
    text = " ".join(rep3.problems)
    assert "needs 3 nodes (n_nodes) but the Ray cluster at" in text and "has 2 alive" in text
    assert "has 0 GPU(s) but the run needs 1 per node" in text


def test_ray_unreachable_address_fails_fast(tmp_path):
    port = network.find_free_port()
    p, took = run_check("--mode", "ray", "--ray-address", f"127.0.0.1:{port}", "--fileroot", str(tmp_path))
    assert p.returncode == 1, p.stdout + p.stderr
    assert "cannot connect to the Ray cluster" in p.stdout
    assert took < 30


# ----------------------------------------------------------------------------- Slurm
def _check_jobs(slurm):
    p = slurm.run(["squeue", "-h", "-o", "%j"], check=False)
    return [j for j in p.stdout.split() if j.startswith("realhf-check-")]


def test_slurm_probe_runs_through_srun(slurm_cluster, tmp_path):
    p, _ = run_check("--mode", "slurm", "--partition", "debug", "--fileroot", str(tmp_path), "--timeout", "60",
                     "--json")
    rep = as_json(p)
    assert p.returncode == 0 and rep["ok"], p.stdout + p.stderr
    assert len(rep["nodes"]) == 1
    node = rep["nodes"][0]
    assert node["hostname"].split(".")[0] == slurm_cluster.node
    assert_node_checks_pass(node, 1)
    assert any(n.startswith("srun: srun --nodes=1 --ntasks=1 --ntasks-per-node=1") and "--partition=debug" in n
               for n in rep["notes"])
    assert not _check_jobs(slurm_cluster)


def test_slurm_more_nodes_than_exist(slurm_cluster, tmp_path):
    p, took = run_check("--mode", "slurm", "--nodes", "2", "--fileroot", str(tmp_path), "--alloc-timeout", "5")
    assert p.returncode == 1, p.stdout + p.stderr
    assert "the default partition has 1 node(s) but the run needs 2 (n_nodes)" in p.stdout
    assert took < 30
    assert not _check_jobs(slurm_cluster)


def test_slurm_step_that_cannot_start_ends(slurm_cluster, tmp_path, monkeypatch):
    # past the sinfo pre-check, srun itself asks for 2 nodes: Slurm queues the step; --immediate ends the wait
    monkeypatch.setattr(cluster_collect, "_slurm_preflight", lambda req: None)  # where collect_slurm finds it
    req = check_cluster.Request(mode="slurm", nodes=2, fileroot=str(tmp_path), alloc_timeout=3, timeout=10)
    t0 = time.monotonic()
    rep = check_cluster.judge(check_cluster.collect(req))
    assert time.monotonic() - t0 < 40
    assert not rep.ok
    assert "Slurm did not give 2 node(s) in the default partition within 3 s" in " ".join(rep.errors), rep.errors
    assert not _check_jobs(slurm_cluster)
