"""``mode=ray`` across nodes, on a fake multi-node Ray cluster on this machine (``ray.cluster_utils.Cluster``: a head
and a second node, each its own raylet with a custom resource naming it): the run's devices are reserved with a
placement group, each job holding device slots lands on the Ray node of its allocation node, a job that fails on a
non-head node stops the run naming it (its traceback in the report), ``recover_mode=auto`` resumes there, and a
cluster too small for the placement is refused before anything starts."""
import json
import os
import signal
import sys
import types

import pytest

pytest.importorskip("ray")

from realhf.testing import (read_stats, run_quickstart, start_quickstart, wait_for_steps,  # noqa: E402
                                 wait_until_gone)
from realhf.impl.model.tiny import ensure_tiny_model  # noqa: E402
from realhf.scheduler.local import JobFailure  # noqa: E402

N_CPUS = 2  # per fake node: bookkeeping only (the jobs share this machine's cores)


@pytest.fixture(scope="module")
def cluster():
    """A head (resource ``node0``) and one more node (``node1``); yields (cluster, {node id: "node0" | "node1"})."""
    import ray
    from ray.cluster_utils import Cluster

    with pytest.MonkeyPatch.context() as mp:
        # one authentication mode for the cluster and every run that joins it (a local ray.init elsewhere in this
        # process would turn on Ray's token authentication for it and its children)
        mp.setenv("RAY_AUTH_MODE", os.environ.get("RAY_AUTH_MODE", "disabled"))
        c = Cluster(initialize_head=True, head_node_args={"num_cpus": N_CPUS, "resources": {"node0": 1}})
        try:
            second = c.add_node(num_cpus=N_CPUS, resources={"node1": 1})
            yield c, {c.head_node.node_id: "node0", second.node_id: "node1"}
        finally:
            if ray.is_initialized():
                ray.shutdown()
            c.shutdown()


@pytest.fixture
def driver(cluster):
    """This process joined to the fake cluster (for tests that drive a RayScheduler directly)."""
    import ray

    c, names = cluster
    ray.init(address=c.address, include_dashboard=False, log_to_driver=False)
    try:
        yield c, names
    finally:
        ray.shutdown()


def _config(address, n_nodes, per_node, cpus=1):
    return types.SimpleNamespace(ray_address=address, n_nodes=n_nodes, n_devices_per_node=per_node,
                                 cpus_per_worker=cpus, ray_gpus_per_worker=0.0)


def _placement(log_dir):
    with open(os.path.join(log_dir, "placement.json")) as f:
        return json.load(f)


SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]


def test_slots_land_node_packed_and_a_crash_shows_its_traceback(driver, tmp_path):
    """n_nodes=2 x 2 slots: workers 0,1 (slots 0, 1) share one Ray node, a tp=2 generation server (slots 2, 3) takes the
    other; the master reserves nothing. A job on the non-head node that raises stops the run named, with the traceback
    in the report."""
    from realhf.scheduler.ray_launcher import RayScheduler

    c, names = driver
    log_dir = str(tmp_path / "logs")
    go = str(tmp_path / "go-")
    crash = ("import os, sys, time\nwhile not os.path.exists(sys.argv[1] + sys.argv[2]): time.sleep(0.05)\n"
             "raise RuntimeError('boom in ' + sys.argv[2])\n")
    sched = RayScheduler(log_dir, _config(c.address, 2, 2), 4, placement_timeout=30)
    try:
        sched.submit("master", SLEEPER, worker=False)
        sched.submit_group(["model_worker_0", "model_worker_1"], lambda r: [sys.executable, "-c", crash, go, f"w{r}"],
                           first_slot=0)
        sched.submit_group(["gen_server_0"], lambda i: [sys.executable, "-c", crash, go, f"g{i}"], slots=2,
                           first_slot=2)
        jobs = ("model_worker_0", "model_worker_1", "gen_server_0")
        where = _placement(log_dir)
        assert set(where) == {"master", *jobs}
        assert where["master"]["slots"] == [] and where["master"]["allocation_node"] is None
        assert [where[j]["slots"] for j in jobs] == [[0], [1], [2, 3]]
        assert [where[j]["allocation_node"] for j in jobs] == [0, 0, 1]
        assert all(where[j]["pid"] == sched.jobs[j].pid for j in where)
        node = {j: where[j]["node_id"] for j in jobs}
        assert {names[node["model_worker_0"]], names[node["gen_server_0"]]} == {"node0", "node1"}, where
        assert node["model_worker_1"] == node["model_worker_0"], where
        # the allocation node -> Ray node map is the placement group's
        import ray

        table = ray.util.placement_group_table(sched.pg)["bundles_to_node_id"]
        assert [node["model_worker_0"], node["gen_server_0"]] == [table[0], table[1]]
        victim = next(j for j in jobs if names[node[j]] == "node1")
        key = "g0" if victim == "gen_server_0" else f"w{victim[-1]}"
        open(go + key, "w").close()
        with pytest.raises(JobFailure) as e:
            sched.wait("master", timeout=60)
        assert e.value.name == victim and e.value.code == 1
        assert "Traceback (most recent call last)" in str(e.value) and f"RuntimeError: boom in {key}" in str(e.value)
    finally:
        sched.stop_all()
    assert sched.pg is None and not sched.jobs


def test_slots_of_a_job_must_share_a_node():
    from realhf.scheduler.ray_launcher import Placement

    p = Placement.of(_config("auto", 2, 2), 4)
    assert (p.n_nodes, p.n_slots, p.bundle()) == (2, 4, {"CPU": 2})
    assert p.node_of("gen_server_0", 2, 2) == 1
    with pytest.raises(ValueError, match=r"gen_server_0 holds device slots 1..2, which are not on one node"):
        p.node_of("gen_server_0", 1, 2)
    with pytest.raises(ValueError, match=r"slots 4..4"):
        p.node_of("model_worker_4", 4, 1)


def test_busy_cluster_fails_the_launch_after_the_timeout(driver, tmp_path):
    """The nodes exist but their CPUs are held by another run: the placement waits ``placement_timeout`` seconds, then
    fails the launch naming what it waited for; nothing was started, and the first run's reservation is untouched."""
    from realhf.scheduler.ray_launcher import RayScheduler

    c, _ = driver
    first = RayScheduler(str(tmp_path / "a"), _config(c.address, 2, 2), 4, placement_timeout=30)
    try:
        with pytest.raises(JobFailure, match=r"could not reserve the run's devices within 2 s: the run needs 2 "
                                             r"node\(s\) \(n_nodes\) with 1 CPUs and 0 GPUs each .* free now in the "
                                             r"cluster: 0 CPUs"):
            RayScheduler(str(tmp_path / "b"), _config(c.address, 2, 1), 2, placement_timeout=2)
        assert _placement(str(tmp_path / "b")) == {}
        first.submit("model_worker_0", SLEEPER, first_slot=0)
        assert _placement(str(tmp_path / "a"))["model_worker_0"]["slots"] == [0]
    finally:
        first.stop_all()


def test_nodes_too_small_are_named(driver):
    """The per-node check of ``connect_for`` (run before anything starts) says what is missing."""
    from realhf.scheduler.ray_launcher import connect_for

    c, _ = driver
    with pytest.raises(ValueError, match=r"needs 2 node\(s\) \(n_nodes\) with 4 CPUs and 0 GPUs each.*only 0 of its 2 "
                                         r"nodes are that large: too few CPUs per node"):
        connect_for(_config(c.address, 2, 2, cpus=2), 4)
    with pytest.raises(ValueError, match=r"it has 2 node\(s\): 1 node\(s\) missing"):
        connect_for(_config(c.address, 3, 1), 3)
    connect_for(_config(c.address, 2, 2), 4)  # fits


def test_private_instance_holds_every_node_here(tmp_path, monkeypatch):
    """ray_address empty: the Ray instance started for the run is this machine, and every allocation node's bundle is
    packed on it (as every job runs here under mode=local)."""
    import ray

    from realhf.scheduler.ray_launcher import RayScheduler

    # a new local instance turns on Ray's token authentication for this process (RAY_AUTH_MODE=token) unless the mode is
    # set: keep it from the later runs, which join the fake cluster in its own mode
    monkeypatch.setenv("RAY_AUTH_MODE", os.environ.get("RAY_AUTH_MODE", "disabled"))
    sched = RayScheduler(str(tmp_path), _config("", 2, 1), 2, placement_timeout=30)
    try:
        sched.submit_group(["model_worker_0", "model_worker_1"], lambda r: SLEEPER, first_slot=0)
        where = _placement(str(tmp_path))
        here = ray.get_runtime_context().get_node_id()
        assert where["model_worker_0"]["node_id"] == where["model_worker_1"]["node_id"] == here
        assert [where[f"model_worker_{r}"]["allocation_node"] for r in range(2)] == [0, 1]
    finally:
        sched.stop_all()
        ray.shutdown()


# ------------------------------------------------------------------ runs through the quickstart CLI


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("raymn")
    with open(d / "train.jsonl", "w") as f:
        for i in range(48):
            f.write('{"prompt": "%d+%d=", "answer": "%d"}\n' % (i % 10, (7 * i) % 10, i % 10 + (7 * i) % 10))
    return ensure_tiny_model("qwen2", tie_word_embeddings=True), str(d)


def _sft(model, root, exp, *extra):
    """Tiny SFT over two allocation nodes of one device each (12 steps: 48 rows, 4 a step)."""
    return ["sft", f"model.path={model}", "dataset.max_seqlen=512", f"dataset.train_path={root}/train.jsonl",
            "dataset.train_bs_n_seqs=4", "model.optimizer.lr=1e-3", f"fileroot={root}", f"experiment_name={exp}",
            "allocation_mode=d2m1p1", "n_nodes=2", "n_devices_per_node=1", "exp_ctrl.total_train_epochs=1", *extra]


def _ray(cluster):
    return ["mode=ray", f"ray_address={cluster[0].address}"]


def _log_dir(root, exp):
    return os.path.join(root, exp, "trial0", "logs")


def _worker_nodes(root, exp, names):
    where = _placement(_log_dir(root, exp))
    return {r: names[where[f"model_worker_{r}"]["node_id"]] for r in range(2)}, where


@pytest.fixture(scope="module")
def local_losses(setup):
    model, root = setup
    q = run_quickstart(_sft(model, root, "mn-local"), timeout=300)
    assert q.returncode == 0, q.stderr[-4000:]
    return [s["loss"] for s in read_stats(root, "mn-local")]


@pytest.mark.slow  # test_auto_recover_after_a_kill_on_other_node trains on both nodes like local with these checks
def test_workers_on_their_nodes_train_like_local(cluster, setup, local_losses):
    model, root = setup
    p = run_quickstart(_sft(model, root, "mn-ray", *_ray(cluster)), timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    nodes, where = _worker_nodes(root, "mn-ray", cluster[1])
    assert sorted(nodes.values()) == ["node0", "node1"], where  # one allocation node on each Ray node
    assert where["master"]["slots"] == [] and [where[f"model_worker_{r}"]["slots"] for r in range(2)] == [[0], [1]]
    losses = [s["loss"] for s in read_stats(root, "mn-ray")]
    assert len(losses) == len(local_losses) == 12
    for a, b in zip(losses, local_losses):
        assert abs(a - b) < 1e-5, (losses, local_losses)
    assert not wait_until_gone(os.path.join(root, "mn-ray")), "job processes left behind"


def _kill_worker_on_node1(root, exp, names, proc, after_steps):
    """kill -9 the model worker the placement put on the non-head node, once the run has ``after_steps`` steps."""
    wait_for_steps(root, exp, after_steps, proc=proc)
    nodes, where = _worker_nodes(root, exp, names)
    victim = next(r for r, n in nodes.items() if n == "node1")
    os.kill(where[f"model_worker_{victim}"]["pid"], signal.SIGKILL)
    return f"model_worker_{victim}"


@pytest.mark.slow  # test_auto_recover_after_a_kill_on_other_node names the worker killed on the other node; a lost
# worker failing the run (exit 1, nothing left): tests/e2e/test_runtime_e2e.py, and under Slurm
def test_killed_worker_on_other_node_ends_the_run_named(cluster, setup):
    model, root = setup
    exp = "mn-kill"
    p = start_quickstart(_sft(model, root, exp, *_ray(cluster), "exp_ctrl.total_train_epochs=50"))
    victim = _kill_worker_on_node1(root, exp, cluster[1], p, 1)
    out, _ = p.communicate(timeout=120)  # a hang detector: the loss is noticed within seconds
    assert p.returncode == 1, out[-3000:]
    assert f"{victim} exited with code -9" in out, out[-3000:]
    assert not wait_until_gone(os.path.join(root, exp)), "job processes left behind"


def test_auto_recover_after_a_kill_on_other_node(cluster, setup, local_losses):
    """recover_mode=auto: a worker killed on the non-head node, the run relaunched (a new placement group) resumes
    from its last recover checkpoint and ends with the losses of the uninterrupted local run. Before the kill, as after
    the relaunch, one allocation node's worker runs on each Ray node; the master holds no device slot."""
    model, root = setup
    exp = "mn-recover"
    p = start_quickstart(_sft(model, root, exp, *_ray(cluster), "recover_mode=auto", "exp_ctrl.ckpt_freq_steps=2"))
    wait_for_steps(root, exp, 1, proc=p)
    nodes, where = _worker_nodes(root, exp, cluster[1])
    assert sorted(nodes.values()) == ["node0", "node1"], where  # one allocation node on each Ray node
    assert where["master"]["slots"] == [] and [where[f"model_worker_{r}"]["slots"] for r in range(2)] == [[0], [1]]
    victim = _kill_worker_on_node1(root, exp, cluster[1], p, 3)
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0, out[-3000:]
    assert f"{victim} exited with code -9" in out and "relaunching" in out and "resuming from the last recover" in out
    losses = {s["global_step"]: s["loss"] for s in read_stats(root, exp)}
    assert sorted(losses) == list(range(1, 13))
    for step, b in enumerate(local_losses, 1):
        assert abs(losses[step] - b) < 1e-4, (losses, local_losses)
    nodes, _ = _worker_nodes(root, exp, cluster[1])
    assert sorted(nodes.values()) == ["node0", "node1"]
    assert not wait_until_gone(os.path.join(root, exp))


def test_cluster_too_small_for_the_placement_is_refused(cluster, setup):
    model, root = setup
    p = run_quickstart(_sft(model, root, "mn-small", *_ray(cluster), "n_nodes=3", "allocation_mode=d3m1p1",
                            "dataset.train_bs_n_seqs=3"), timeout=180)
    assert p.returncode == 2, p.stderr[-3000:]
    assert "the run needs 3 node(s) (n_nodes)" in p.stderr and "1 node(s) missing" in p.stderr, p.stderr[-3000:]
    assert not os.path.exists(os.path.join(_log_dir(root, "mn-small"), "master.log"))
