"""``mode=ray``: the master and model workers start through Ray actors (a real Ray instance on this
machine), bind the node's address, and train exactly as under the local launcher."""
import functools
import os
import re

import psutil
import pytest

pytest.importorskip("ray")

from realhf.testing import read_stats, run_quickstart  # noqa: E402
from realhf.impl.model.tiny import ensure_tiny_model  # noqa: E402


def _sft(model, data, root, exp, *extra):
    return ["sft", f"model.path={model}", "dataset.max_seqlen=512", f"dataset.train_path={data}", "dataset.train_bs_n_seqs=8",
            "model.optimizer.lr=1e-3", f"fileroot={root}", f"experiment_name={exp}", "allocation_mode=d2m1p1",
            "n_devices_per_node=2", "exp_ctrl.benchmark_steps=3", *extra]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("ray")
    path = d / "train.jsonl"
    with open(path, "w") as f:
        for i in range(48):
            f.write('{"prompt": "%d+%d=", "answer": "%d"}\n' % (i % 10, (7 * i) % 10, i % 10 + (7 * i) % 10))
    return ensure_tiny_model("qwen2", tie_word_embeddings=True), str(path), str(d)


@pytest.mark.slow  # test_ray_starts_generation_servers_first runs through a private Ray instance with these checks;
# test_ray_multinode.py trains data-parallel workers through Ray like a local run
def test_ray_run_trains_like_local(setup):
    model, data, root = setup
    p = run_quickstart(_sft(model, data, root, "viaray", "mode=ray"), timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    out = p.stdout + p.stderr
    started = re.findall(r"started (\S+) through Ray on (\S+) \(pid (\d+)\)", out)
    assert {n for n, _, _ in started} == {"master", "model_worker_0", "model_worker_1"}, out[-3000:]
    for _, _, pid in started:  # every job is gone after the run
        assert not psutil.pid_exists(int(pid)) or psutil.Process(int(pid)).status() == psutil.STATUS_ZOMBIE
    q = run_quickstart(_sft(model, data, root, "local"), timeout=300)
    assert q.returncode == 0, q.stderr[-4000:]
    ray_loss = [s["loss"] for s in read_stats(root, "viaray")]
    local_loss = [s["loss"] for s in read_stats(root, "local")]
    assert len(ray_loss) == 3 and len(local_loss) == 3
    for a, b in zip(ray_loss, local_loss):
        assert abs(a - b) < 1e-5, (ray_loss, local_loss)
    # the jobs bound and advertised the node's address Ray gave them, not the loopback default
    host = started[0][1]
    nr_files = [os.path.join(dp, f) for dp, _, fs in os.walk(os.path.join(root, "name_resolve")) for f in fs]
    if host != "127.0.0.1":
        assert any(host in open(f).read() for f in nr_files if "viaray" in f), "no address on the node's IP"


def test_unreachable_ray_cluster_fails_before_start(setup):
    model, data, root = setup
    p = run_quickstart(_sft(model, data, root, "noray", "mode=ray", "ray_address=127.0.0.1:1"), timeout=180)
    assert p.returncode == 2, p.stderr[-3000:]
    assert "cannot connect to the Ray cluster at ray_address='127.0.0.1:1'" in p.stderr
    assert not os.path.exists(os.path.join(root, "noray", "trial0", "logs", "master.log"))


def test_cluster_too_small_is_refused():
    import ray

    from realhf.scheduler.ray_launcher import connect

    ray.init(num_cpus=1, num_gpus=0, include_dashboard=False, log_to_driver=False)
    try:
        with pytest.raises(ValueError, match=r"has 1 CPUs and 0 GPUs; this experiment's model workers need 4 CPUs and 2 GPUs"):
            connect("", need_cpus=4, need_gpus=2)
        assert connect("", need_cpus=1, need_gpus=0) is ray  # enough: joins the running instance
    finally:
        ray.shutdown()


@pytest.mark.slow  # the default suite kills a worker on a fake cluster's other node (tests/e2e/test_ray_multinode.py)
def test_killed_worker_under_ray_fails_fast_and_leaves_nothing(setup):
    """kill -9 of a model worker started through Ray: the run stops within seconds, names the worker,
    and no job process stays behind."""
    import signal
    import subprocess
    import sys
    import time

    from realhf.base.process import env_with_source_path, source_root

    model, data, root = setup
    exp = "raykill"
    args = _sft(model, data, root, exp, "mode=ray", "exp_ctrl.benchmark_steps=null", "exp_ctrl.total_train_epochs=50")
    p = subprocess.Popen([sys.executable, "-m", "realhf.apps.quickstart", *args], cwd=source_root(),
                         env=env_with_source_path(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    stats_path = os.path.join(root, exp, "trial0", "logs", "stats.jsonl")
    t0 = time.time()
    while time.time() - t0 < 180 and not (os.path.exists(stats_path) and os.path.getsize(stats_path) > 0):
        assert p.poll() is None, p.communicate()[0][-3000:]
        time.sleep(0.1)

    def jobs():
        out = []
        for q in psutil.process_iter(["cmdline"]):
            try:
                cmd = q.info["cmdline"] or []
                if "realhf.apps.remote" in cmd and any(os.path.join(root, exp) in a for a in cmd):
                    out.append(q)
            except psutil.Error:
                pass
        return out

    victim = [q for q in jobs() if "--rank" in q.cmdline() and q.cmdline()[q.cmdline().index("--rank") + 1] == "1"]
    assert victim, "model_worker_1 not found"
    victim[0].send_signal(signal.SIGKILL)
    out, _ = p.communicate(timeout=90)  # a hang detector: the loss is noticed within seconds
    assert p.returncode != 0
    assert "model_worker_1" in out and "-9" in out, out[-3000:]
    time.sleep(1)
    assert not jobs(), "job processes left behind"


def _served_args(model, d, exp, *extra):
    """A 2-step ppo-math run on the tiny math task with one gen server (gen.d1m1p1+d1m1p1)."""
    return ["ppo-math", f"actor.path={model}", f"dataset.path={d}/math.jsonl", "dataset.train_bs_n_seqs=4",
            "group_size=2", "ppo.gen.max_new_tokens=4", "ppo.ppo_n_minibatches=1", "use_chat_template=false",
            "prompt_template={prompt}", "reward_allow_last_number=true", "use_critic=false", "ppo.kl_ctl=0",
            "exp_ctrl.benchmark_steps=2", f"fileroot={d}", f"experiment_name={exp}", "n_devices_per_node=2",
            "allocation_mode=gen.d1m1p1+d1m1p1", *extra]


def test_ray_starts_generation_servers_first(tiny_math_run, tiny_ppo_colocated):
    """ppo-math with gen.d1m1p1+d1m1p1 under mode=ray: the generation server is a Ray job too, started and up
    before the master and the worker; the run trains as the local one does (a served run samples what the colocated
    run samples, step for step: tests/e2e/test_gen_server_e2e.py)."""
    from support.tiny_ppo import ppo_args

    model, d = tiny_math_run
    p = run_quickstart(ppo_args(model, d, "served-ray", 2, "allocation_mode=gen.d1m1p1+d1m1p1", "mode=ray"),
                       timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    out = p.stdout + p.stderr
    started = re.findall(r"started (\S+) through Ray on (\S+) \(pid (\d+)\)", out)
    assert [n for n, _, _ in started] == ["gen_server_0", "master", "model_worker_0"], out[-3000:]
    for _, _, pid in started:  # every job is gone after the run
        assert not psutil.pid_exists(int(pid)) or psutil.Process(int(pid)).status() == psutil.STATUS_ZOMBIE
    a, b = read_stats(d, "served-ray"), tiny_ppo_colocated
    assert len(a) == len(b)
    assert [(s["n_tokens"], s["task_reward"]) for s in a] == [(s["n_tokens"], s["task_reward"]) for s in b]
    # the jobs bound and advertised the node's address Ray gave them, not the loopback default
    host = started[0][1]
    nr_files = [os.path.join(dp, f) for dp, _, fs in os.walk(os.path.join(str(d), "name_resolve")) for f in fs]
    if host != "127.0.0.1":
        assert any(host in open(f).read() for f in nr_files if "served-ray" in f), "no address on the node's IP"


@pytest.mark.slow
def test_ray_runs_asynchronous_rl(tiny_math_run):
    """async-ppo-math under mode=ray: the rollout manager and the rollout worker are Ray jobs too (the manager before
    the trainer); with max_head_offpolicyness=0 it trains as the synchronous run through a server does."""
    model, d = tiny_math_run

    args = functools.partial(_served_args, model, d)

    q = run_quickstart(args("sync-local-for-async"), timeout=300)
    assert q.returncode == 0, q.stderr[-4000:]
    b = read_stats(d, "sync-local-for-async")
    args_async = ["async-ppo-math"] + args("async-ray", "mode=ray", "param_realloc=disk",
                                            "async_rl.prox_logp=behaviour")[1:]
    p = run_quickstart(args_async, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    out = p.stdout + p.stderr
    started = [n for n, _, _ in re.findall(r"started (\S+) through Ray on (\S+) \(pid (\d+)\)", out)]
    assert started == ["gen_server_0", "rollout_manager", "master", "model_worker_0", "rollout_worker_0"], out[-3000:]
    c = read_stats(d, "async-ray")
    assert [(s["n_tokens"], s["task_reward"]) for s in c] == [(s["n_tokens"], s["task_reward"]) for s in b]
    assert all(s["version_lag_max"] == 0 for s in c)
