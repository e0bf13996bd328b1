"""``mode=slurm`` on a real one-node Slurm (slurmctld, slurmd and munge started by the ``slurm_cluster`` fixture):
runs train as under ``mode=local``; a killed worker, Ctrl-C and a killed launcher leave no job and no process;
``recover_mode=auto`` resumes to the parameters of an uninterrupted run; bad requests fail before anything starts.
Deadlines only keep a broken build from hanging (no wall-clock assertions)."""
import os
import signal
import time

import pytest
import torch

from realhf.testing import (read_stats, run_processes, run_quickstart, run_worker, sft_cmd, start_quickstart,
                                 wait_for_steps, wait_until_gone)

SLURM_CPU = ["mode=slurm", "slurm.gpus_per_slot=0"]


def _ppo(model, d, exp, *extra):
    return ["ppo-math", f"actor.path={model}", f"critic.path={model}", f"dataset.path={d}/math.jsonl",
            "dataset.train_bs_n_seqs=4", "group_size=2", "ppo.gen.max_new_tokens=6", "ppo.gen.temperature=1.0",
            "ppo.ppo_n_minibatches=2", "use_chat_template=false", "prompt_template={prompt}",
            "reward_allow_last_number=true", "actor.optimizer.lr=1e-3", "critic.optimizer.lr=1e-3", "ppo.kl_ctl=0.1",
            f"fileroot={d}", f"experiment_name={exp}", "allocation_mode=d2m1p1", "n_devices_per_node=2",
            "exp_ctrl.benchmark_steps=3", *extra]


def _no_job_left(slurm, timeout=30.0):
    deadline = time.monotonic() + timeout
    while slurm.jobs() and time.monotonic() < deadline:
        time.sleep(0.2)
    return slurm.jobs()


def test_ppo_math_under_slurm_equals_local(slurm_cluster, tiny_math_run):
    model, d = tiny_math_run
    p = run_quickstart(_ppo(model, d, "viaslurm", *SLURM_CPU), timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    assert "submitted model_workers as Slurm job" in p.stderr and "2 task(s) on 1 node(s)" in p.stderr, p.stderr[-3000:]
    q = run_quickstart(_ppo(model, d, "vialocal"), timeout=300)
    assert q.returncode == 0, q.stderr[-4000:]
    got, ref = read_stats(str(d), "viaslurm"), read_stats(str(d), "vialocal")
    assert len(got) == len(ref) == 3
    for a, b in zip(got, ref):
        for k in ("task_reward", "n_tokens", "actor_loss", "critic_loss", "kl_reward", "importance_weight"):
            assert abs(a[k] - b[k]) <= 1e-5 * max(1.0, abs(b[k])), (k, a[k], b[k])
    logs = os.path.join(str(d), "viaslurm", "trial0", "logs")
    for name in ("master", "model_worker_0", "model_worker_1"):  # a log per worker under the run's log folder
        with open(os.path.join(logs, f"{name}.log")) as f:
            assert f"[slurm] {name}: job" in f.read()
    assert not _no_job_left(slurm_cluster) and not wait_until_gone(os.path.join(str(d), "viaslurm"))


def _long(tiny_sft, root, *extra):
    return start_quickstart(sft_cmd(*tiny_sft, root, "long", "allocation_mode=d2m1p1", "n_devices_per_node=2",
                                    "exp_ctrl.total_train_epochs=500", *SLURM_CPU, *extra))


@pytest.mark.slow  # test_recover_auto_under_slurm_matches_an_uninterrupted_run kills a worker in the job with these
# checks (named, no job or process left); a lost worker failing the run (exit 1): tests/e2e/test_runtime_e2e.py
def test_killed_worker_in_the_job_ends_the_run_named(slurm_cluster, tiny_sft, tmp_path):
    root = str(tmp_path)
    p = _long(tiny_sft, root)
    try:
        wait_for_steps(root, "long", 2, proc=p)
        assert len(slurm_cluster.jobs()) == 2  # the master's job and the model workers' job
        run_worker(root, 1).send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        out, _ = p.communicate(timeout=90)
        print(f"the run ended {time.monotonic() - t0:.1f} s after the kill")
        assert p.returncode == 1
        assert "model_worker_1 exited with code -9 (killed by signal 9)" in out, out[-3000:]
        assert not _no_job_left(slurm_cluster), "Slurm jobs left in the queue"
        assert not wait_until_gone(root), "processes left behind"
    finally:
        p.kill()
        for q in run_processes(root):
            q.kill()


@pytest.mark.parametrize("sig", [signal.SIGINT, pytest.param(signal.SIGKILL, marks=pytest.mark.slow)],
                         ids=["ctrl-c", "launcher-kill-9"])
def test_stopping_the_launcher_cancels_the_run(slurm_cluster, tiny_sft, tmp_path, sig):
    """Ctrl-C: every job is cancelled at once. kill -9 of the launcher: its lease goes stale and every process of
    the jobs ends (so the jobs end too)."""
    root = str(tmp_path)
    p = _long(tiny_sft, root, "slurm.launcher_lease_secs=10")
    try:
        wait_for_steps(root, "long", 2, proc=p)
        p.send_signal(sig)
        p.communicate(timeout=60)
        assert p.returncode == (130 if sig == signal.SIGINT else -9)
        assert not _no_job_left(slurm_cluster, timeout=90), "Slurm jobs left in the queue"
        assert not wait_until_gone(root, timeout=30), "processes left behind"
    finally:
        p.kill()
        for q in run_processes(root):
            q.kill()


def _saved(root, exp):
    import glob

    from safetensors.torch import load_file

    (path,) = glob.glob(os.path.join(root, exp, "trial0", "checkpoints", "default", "*"))
    sd = {}
    for f in glob.glob(os.path.join(path, "*.safetensors")):
        sd.update(load_file(f))
    assert sd, path
    return sd


def test_recover_auto_under_slurm_matches_an_uninterrupted_run(slurm_cluster, tiny_sft, tmp_path):
    root = str(tmp_path)
    base = ["allocation_mode=d2m1p1", "n_devices_per_node=2", "exp_ctrl.total_train_epochs=3",
            "exp_ctrl.save_freq_epochs=3", "exp_ctrl.ckpt_freq_steps=4"]
    ref = run_quickstart(sft_cmd(*tiny_sft, root, "ref", *base), timeout=300)
    assert ref.returncode == 0, ref.stderr[-3000:]
    p = start_quickstart(sft_cmd(*tiny_sft, root, "auto", *base, *SLURM_CPU, "recover_mode=auto"))
    try:
        wait_for_steps(root, "auto", 6, proc=p)
        assert len(slurm_cluster.jobs()) == 2  # the master's job and the model workers' job
        run_worker(root, 1).send_signal(signal.SIGKILL)
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out[-3000:]
        assert "model_worker_1 exited with code -9 (killed by signal 9)" in out, out[-3000:]
        assert "relaunching" in out and "resuming from the last recover checkpoint" in out, out[-3000:]
    finally:
        p.kill()
    a, b = _saved(root, "ref"), _saved(root, "auto")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-5), f"{k} differs after recovery"
    assert [s["global_step"] for s in read_stats(root, "auto")] == list(range(1, 13))
    assert not _no_job_left(slurm_cluster) and not wait_until_gone(root)


@pytest.mark.parametrize("extra,needle", [
    (["n_nodes=2", "allocation_mode=d2m1p1", "n_devices_per_node=1"], "n_nodes=2 but the partition has 1 node(s)"),
    (["slurm.gpus_per_slot=1", "allocation_mode=d4m1p1", "n_devices_per_node=4"],
     "a node must hold 4 GPUs (n_devices_per_node=4 x slurm.gpus_per_slot=1) but the partition's nodes have at most 2"),
    (["slurm.partition=nosuch"], "nosuch"),
], ids=["too-many-nodes", "too-many-gpus", "no-partition"])
def test_requests_the_cluster_cannot_hold_fail_before_start(slurm_cluster, tiny_sft, tmp_path, extra, needle):
    root = str(tmp_path)
    p = run_quickstart(sft_cmd(*tiny_sft, root, "big", "mode=slurm", "slurm.gpus_per_slot=0", *extra), timeout=120)
    assert p.returncode == 2, p.stderr[-2000:]
    assert needle in p.stderr, p.stderr[-2000:]
    assert not slurm_cluster.jobs() and not os.path.exists(os.path.join(root, "big", "trial0", "logs", "master.log"))


@pytest.mark.slow  # ~20 s; the async run's roles under the local and Ray launchers are in the default suite
def test_async_run_under_slurm_starts_every_role(slurm_cluster, tiny_math_run):
    """An asynchronous run: generation server, rollout manager, master, model worker and two rollout workers, each
    group its own Slurm job; it trains its steps and leaves nothing behind."""
    model, d = tiny_math_run
    p = run_quickstart(["async-ppo-math", f"actor.path={model}", f"dataset.path={d}/math.jsonl", f"fileroot={d}",
                        "experiment_name=asyncslurm", "allocation_mode=gen.d1m1p1+d1m1p1", "n_devices_per_node=2",
                        "use_critic=false", "ppo.kl_ctl=0", "dataset.train_bs_n_seqs=4", "group_size=2",
                        "ppo.gen.max_new_tokens=6", "exp_ctrl.benchmark_steps=3", "param_realloc=disk",
                        "use_chat_template=false", "prompt_template={prompt}", "async_rl.max_head_offpolicyness=1",
                        "async_rl.n_rollout_workers=2", *SLURM_CPU], timeout=400)
    assert p.returncode == 0, p.stderr[-4000:]
    for group in ("gen_server_0", "rollout_manager", "master", "model_worker_0", "rollout_workers"):
        assert f"submitted {group} as Slurm job" in p.stderr, (group, p.stderr[-3000:])
    st = read_stats(str(d), "asyncslurm")
    assert [s["global_step"] for s in st] == [1, 2, 3] and all(s["version_lag_max"] <= 1 for s in st)
    assert not _no_job_left(slurm_cluster) and not wait_until_gone(os.path.join(str(d), "asyncslurm"))


def test_a_task_that_dies_with_its_wrapper_is_named_with_the_job_state(slurm_cluster, tiny_sft, tmp_path):
    """The worker and its task wrapper die at once (kill -9 of both, as when a node is lost): no exit code can be
    recorded; the job ends and the launcher names the worker with the job's Slurm state."""
    root = str(tmp_path)
    p = start_quickstart(sft_cmd(*tiny_sft, root, "long", "allocation_mode=d1m1p1", "n_devices_per_node=1",
                                 "exp_ctrl.total_train_epochs=500", *SLURM_CPU))
    try:
        wait_for_steps(root, "long", 2, proc=p)
        jobs = slurm_cluster.run(["squeue", "-h", "-o", "%i %j"]).stdout.split("\n")
        (job,) = [line.split()[0] for line in jobs if line.endswith(":model_worker_0")]
        victims = [q for q in run_processes(root) if q.name() == "bash"
                   and any(a.endswith("model_worker_0.task.sh") for a in q.cmdline())]
        victims.append(run_worker(root, 0))
        assert len(victims) == 2, victims
        for q in victims:
            q.send_signal(signal.SIGKILL)
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 1
        assert f"model_worker_0 was lost: Slurm job {job} ended: " in out, out[-3000:]
        assert not _no_job_left(slurm_cluster) and not wait_until_gone(root)
    finally:
        p.kill()
        for q in run_processes(root):
            q.kill()


@pytest.mark.slow  # Slurm checks time limits every 30 s: 30-40 s
def test_a_time_limit_is_named_with_slurms_state_and_the_option(slurm_cluster, tiny_sft, tmp_path):
    """A job ended by its Slurm time limit: the failure says Slurm's state and reason (TIMEOUT, TimeLimit), the option
    behind the limit (slurm.time) and what to do, not only the signal its processes got. slurmctld checks time limits
    every 30 s; once the worker's task runs, its job's end time is moved to now (scontrol update EndTime=now), so the
    next check ends it."""
    root = str(tmp_path)
    p = start_quickstart(sft_cmd(*tiny_sft, root, "long", "allocation_mode=d1m1p1", "n_devices_per_node=1",
                                 "exp_ctrl.total_train_epochs=500", "slurm.time=10", *SLURM_CPU))
    log = os.path.join(root, "long", "trial0", "logs", "model_worker_0.log")
    try:
        deadline = time.monotonic() + 120
        while not (os.path.exists(log) and "[slurm] model_worker_0: job" in open(log).read()):
            assert p.poll() is None and time.monotonic() < deadline, "the worker's task did not start"
            time.sleep(0.2)
        jobs = slurm_cluster.run(["squeue", "-h", "-o", "%i %j"]).stdout.split("\n")
        (job,) = [line.split()[0] for line in jobs if line.endswith(":model_worker_0")]
        slurm_cluster.run(["scontrol", "update", f"jobid={job}", "EndTime=now"])
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 1, out[-3000:]
        assert f"model_worker_0 exited with code -15 (killed by signal 15) because Slurm job {job} ended: TIMEOUT " \
               "(TimeLimit): the job reached its time limit" in out, out[-3000:]
        assert "(slurm.time='10'); raise slurm.time" in out and "recover_mode=auto" in out, out[-3000:]
        assert not _no_job_left(slurm_cluster) and not wait_until_gone(root)
    finally:
        p.kill()
        for q in run_processes(root):
            q.kill()
