"""async-ppo-math end to end, with real processes: generation servers, the rollout manager, rollout workers, the
trainer's master and model workers (tiny model, ``gen.`` servers).

* With random delays in the servers, the rollout workers and the trainer, no trained sample is ever more than
  ``max_head_offpolicyness`` versions stale and the manager issues no ticket past the bound, also across a kill -9
  of the rollout manager and the ``recover_mode=auto`` resume that follows.
* kill -9 of one of two generation servers and then of one of two rollout workers mid-run: the run finishes on the
  others and every slot of every batch was trained exactly once, with the prompts of the synchronous order.
* Bad async options fail before anything starts.

(``max_head_offpolicyness=0`` reproducing the synchronous run, and the learning tests: tests/e2e/test_grpo_learns.py.)
"""
import json
import os
import signal
import time

import pytest

from realhf.testing import read_stats, run_quickstart, start_quickstart, wait_for_steps

STEPS = 3  # default run length of these tests


def _args(model, d, exp, n_devices=2, alloc="gen.d1m1p1+d1m1p1", *extra):
    return ["async-ppo-math", f"actor.path={model}", f"dataset.path={d}/math.jsonl", "dataset.train_bs_n_seqs=4",
            "group_size=4", "ppo.gen.max_new_tokens=6", "ppo.gen.temperature=1.0", "ppo.ppo_n_minibatches=1",
            "use_chat_template=false", "prompt_template={prompt}", "reward_allow_last_number=true",
            "actor.optimizer.lr=1e-3", "use_critic=false", "ppo.kl_ctl=0", "ppo.entropy_coef=0.05",
            f"exp_ctrl.benchmark_steps={STEPS}", f"fileroot={d}", f"experiment_name={exp}",
            f"n_devices_per_node={n_devices}", f"allocation_mode={alloc}", "param_realloc=disk", *extra]


def _rollout_log(d, exp, trial="trial0"):
    """The rollout manager's event log of a run (issue / finish / version events)."""
    with open(os.path.join(str(d), exp, trial, "logs", "rollouts.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def _check_staleness(events, ofp):
    """Every ticket was issued while its batch was within ``ofp`` versions of the servers' weights."""
    issued = [e for e in events if e["event"] == "issue"]
    assert issued
    for e in issued:
        assert e["batch"] <= e["version"] + ofp, e
    return issued


def test_a_killed_generation_server_and_rollout_worker_do_not_stop_the_run(tiny_math_run):
    """Two servers and two rollout workers; server 1 is killed with SIGKILL after the first step, rollout worker 1
    after the second: the server's requests go to the other, the worker's running episodes are re-issued to the other
    worker, and every slot of every batch is trained once, with the prompts of the synchronous order."""
    model, d = tiny_math_run
    from realhf.testing import run_processes

    steps, exp = 4, "async-kill-server"
    proc = start_quickstart(_args(model, d, exp, 3, "gen.d2m1p1+d1m1p1", f"exp_ctrl.benchmark_steps={steps}",
                                  "async_rl.max_concurrent_rollouts=4", "async_rl.n_rollout_workers=2",
                                  "async_rl.max_head_offpolicyness=1"),
                            env={"REALHF_DELAYS": "rollout.episode:0.3", "REALHF_DELAY_SEED": "3"})
    try:
        wait_for_steps(d, exp, 1, timeout=240, proc=proc)
        servers = [p for p in run_processes(str(d)) if "realhf.gen_server.server" in " ".join(p.cmdline())
                   and " --index 1 " in " ".join(p.cmdline()) + " "]
        assert servers, "server 1 not found"
        os.kill(servers[0].pid, signal.SIGKILL)
        wait_for_steps(d, exp, 2, timeout=240, proc=proc)
        workers = [p for p in run_processes(str(d)) if "rollout_worker" in p.cmdline()
                   and p.cmdline()[p.cmdline().index("--rank") + 1] == "1"]
        assert len(workers) == 1, workers
        os.kill(workers[0].pid, signal.SIGKILL)
        err, _ = proc.communicate(timeout=300)  # the launcher's output (stderr joined to stdout)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert "gen_server_1 exited with code -9; the run goes on with gen_server_0" in err, err[-3000:]
    assert "rollout_worker_1 exited with code -9; the run goes on with rollout_worker_0" in err, err[-3000:]
    assert "running episode(s) go to the other rollout workers" in err, err[-3000:]
    stats = read_stats(d, exp)
    assert len(stats) == steps
    events = _rollout_log(d, exp)
    accepted = {e["ticket"] for e in events if e["event"] == "finish" and e["status"] == "accepted"}
    issued = {e["ticket"]: e for e in events if e["event"] == "issue"}
    trained = sorted((issued[t]["batch"], issued[t]["slot"], issued[t]["prompt"]) for t in accepted
                     if issued[t]["batch"] < steps)
    assert [(b, s) for b, s, _ in trained] == [(b, s) for b in range(steps) for s in range(4)]
    # the prompts a synchronous run trains, in its order
    from realhf.impl.dataset.jsonl import EpochIterator

    it = EpochIterator(range(32), 4, seed=1, shuffle=True)
    want = [p for b in range(steps) for p in it.global_batch_indices(0, b)]
    assert [p for _, _, p in trained] == want
    # after its death, worker 1 was issued nothing: worker 0 ran the rest
    released = [e for e in events if e["event"] == "finish" and "rollout_worker_1 lost" in str(e.get("error"))]
    last = max(e["ticket"] for e in events if e["event"] == "issue" and e["worker"] == "rollout_worker_1")
    assert all(e["ticket"] <= last for e in released)
    time.sleep(0.5)


def test_bad_async_options_fail_before_anything_starts(tiny_math_run, tmp_path):
    """A workflow or reward that cannot be found, or a synchronous allocation, fails when the spec is built."""
    from realhf.api.quickstart.entry import ConfigError, load_config
    from realhf.experiments import build_spec, config_class

    model, d = tiny_math_run
    base = _args(model, d, "async-bad")[1:] + [f"fileroot={tmp_path}"]
    for extra, match in ((["async_rl.workflow=no_such_flow"], "no_such_flow"),
                         (["async_rl.reward_fn=nowhere.at_all:Reward"], "nowhere.at_all"),
                         (["async_rl.workflow=realhf.reward:MathVerifier"], "RolloutWorkflow")):
        with pytest.raises((ValueError, ConfigError), match=match):
            build_spec("async-ppo-math", load_config(config_class("async-ppo-math"), [], base + extra))
    with pytest.raises(ConfigError, match="decoupled"):
        load_config(config_class("async-ppo-math"), [], base + ["allocation_mode=d1m1p1", "n_devices_per_node=1"])
    with pytest.raises(ConfigError, match="weight_update=inflight needs servers that label every token"):
        load_config(config_class("async-ppo-math"), [], base + ["allocation_mode=sglang.d1m1p1+d1m1p1",
                                                                 "async_rl.weight_update=inflight"])
    # weights in memory: shared with realhf's own servers only, never over a weight group
    with pytest.raises(ValueError, match="param_realloc=memory: an asynchronous run shares weights with realhf's"):
        build_spec("async-ppo-math", load_config(config_class("async-ppo-math"), [], base + [
            "allocation_mode=sglang.d1m1p1+d1m1p1", "param_realloc=memory"]))
    with pytest.raises(ConfigError, match="weight_transport=group: async-ppo-math moves weights in memory only by"):
        load_config(config_class("async-ppo-math"), [], base + ["param_realloc=memory",
                                                                 "gen_server.weight_transport=group"])


def test_weights_shared_in_memory_train_as_weights_from_disk(tiny_math_run):
    """param_realloc=memory: the rollout manager has the servers copy the tensors the trainer shares on their host
    (a shared-memory file on CPU) instead of loading a checkpoint. At off-policyness 0 every batch is generated by the
    weights that train on it, so the run equals the run through disk step for step: the weights arrived exactly."""
    model, d = tiny_math_run
    runs = {}
    for sync in ("disk", "memory"):
        exp = f"async-weights-{sync}"
        args = [a for a in _args(model, d, exp) if not a.startswith("param_realloc=")]
        p = run_quickstart(args + [f"param_realloc={sync}", "async_rl.max_head_offpolicyness=0",
                                   "async_rl.prox_logp=behaviour"])
        assert p.returncode == 0, p.stderr[-3000:]
        runs[sync] = read_stats(d, exp)
    assert len(runs["disk"]) == len(runs["memory"]) == STEPS
    for step, (a, b) in enumerate(zip(runs["disk"], runs["memory"]), 1):
        assert b["version_lag_max"] == 0, (step, b)
        for k in ("task_reward", "avg_seq_len", "no_eos_ratio", "n_tokens"):
            assert a[k] == b[k], (step, k, a[k], b[k])
        assert b["actor_loss"] == pytest.approx(a["actor_loss"], rel=0.1, abs=1e-4), (step, a["actor_loss"],
                                                                                     b["actor_loss"])
    logs = os.path.join(str(d), "async-weights-memory", "trial0", "logs")
    with open(os.path.join(logs, "model_worker_0.log")) as f:
        assert "servers: shared (by reference: a shared-memory file)" in f.read()
    with open(os.path.join(logs, "rollout_manager.log")) as f:
        loaded = f.read().count("weights of version")
    assert loaded >= STEPS - 1, loaded


def test_shared_gpus_hold_a_server_beside_the_trainer_and_nothing_else(tiny_math_run, tmp_path):
    """gpus_per_node: a generation server may share its node's GPU with the trainer's model worker; two model workers,
    a server's tensor-parallel ranks, a share above the node's slots or a launcher that reserves GPUs per job are
    refused before anything starts, each naming the option."""
    from realhf.api.quickstart.entry import ConfigError, load_config
    from realhf.experiments import build_spec, config_class

    model, d = tiny_math_run
    base = _args(model, d, "async-gpus")[1:] + [f"fileroot={tmp_path}"]

    def spec(*extra):
        return build_spec("async-ppo-math", load_config(config_class("async-ppo-math"), [], base + list(extra)))

    shared = spec("gpus_per_node=1")
    assert shared.device_slots() == 2  # the server (slot 1) beside the trainer (slot 0) on GPU 0
    # in-memory weight updates then go through gloo (NCCL cannot hold two ranks of one GPU)
    assert shared.served().gen_servers.shares_gpus and not spec().served().gen_servers.shares_gpus
    with pytest.raises(ValueError, match=r"gpus_per_node=1 would put 2 model workers .* at least 2"):
        spec("gpus_per_node=1", "n_devices_per_node=3", "allocation_mode=gen.d1m1p1+d2m1p1")
    with pytest.raises(ValueError, match="gpus_per_node=1 cannot hold a generation server of tp=2"):
        spec("gpus_per_node=1", "n_devices_per_node=3", "allocation_mode=vllm.d1m2p1+d1m1p1")
    with pytest.raises(ConfigError, match="gpus_per_node=3 is above n_devices_per_node=2"):
        spec("gpus_per_node=3")
    with pytest.raises(ConfigError, match="gpus_per_node=1 applies to mode=local.*ray_gpus_per_worker"):
        spec("gpus_per_node=1", "mode=ray")


def test_killed_manager_is_named_and_the_resumed_run_keeps_the_bound(tiny_math_run):
    """kill -9 of the rollout manager: the launcher names it at once; recover_mode=auto relaunches the run, which
    resumes from the last recover checkpoint; the manager restores its accounting from its log and issues nothing
    until the servers hold the resumed weights; every step is trained once and no sample is staler than the bound,
    before or after the crash."""
    model, d = tiny_math_run
    from realhf.testing import run_processes, wait_until_gone

    exp, steps = "async-recover", 6
    proc = start_quickstart(_args(model, d, exp, 2, "gen.d1m1p1+d1m1p1", "async_rl.max_head_offpolicyness=1",
                                  "async_rl.max_concurrent_rollouts=8", "async_rl.n_rollout_workers=2",
                                  f"exp_ctrl.benchmark_steps={steps}", "exp_ctrl.ckpt_freq_steps=2",
                                  "recover_mode=auto"),
                            env={"REALHF_DELAYS": "gen_server.generate:0.3,rollout.episode:0.5,trainer.step:0.6",
                                 "REALHF_DELAY_SEED": "5"})
    try:
        wait_for_steps(d, exp, 3, timeout=240, proc=proc)
        mgr = [p for p in run_processes(str(d)) if "rollout_manager" in p.cmdline() and exp in " ".join(p.cmdline())]
        assert len(mgr) == 1, mgr
        mgr[0].send_signal(signal.SIGKILL)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    assert "rollout_manager exited with code -9" in out and "relaunching" in out, out[-3000:]
    stats = read_stats(d, exp)
    assert [s["global_step"] for s in stats] == list(range(1, steps + 1))
    assert all(0 <= s["version_lag_max"] <= 1 for s in stats), [s["version_lag_max"] for s in stats]
    assert any(s["version_lag_max"] == 1 for s in stats), "no sample was ever off-policy: the bound was never tested"
    assert all("behave_imp_weight" in s for s in stats)  # the decoupled loss ran (proximal log-probs recomputed)
    # the single-process trainer published its weights behind training (realhf.system.trainer.served), and the bound
    # held all the same (below)
    with open(os.path.join(str(d), exp, "trial0", "logs", "model_worker_0.log")) as f:
        assert "behind training" in f.read()
    # the rollout side's stats reach stats.jsonl with every step
    # (the step whose /status call met the killed manager logs a warning and no manager counters: at most one)
    with_mgr = [s for s in stats if "async/idle_fraction" in s]
    assert len(with_mgr) >= steps - 1, [sorted(k for k in s if k.startswith("async/")) for s in stats]
    assert any(s["async/gen_tokens_per_s"] > 0 for s in with_mgr[1:])
    assert all(s["async/trainer_wait_time"] >= 0 for s in stats)
    assert all(0 <= s["async/idle_fraction"] <= 1 for s in with_mgr)
    assert all(s["async/episode_reward"] <= 5 for s in stats if "async/episode_reward" in s)
    events = _rollout_log(d, exp)
    restores = [e for e in events if e["event"] == "restore"]
    assert len(restores) == 1 and restores[0]["trained_batches"] >= 2
    _check_staleness(events, 1)
    after = events[events.index(restores[0]):]
    assert all(e["version"] >= restores[0]["trained_batches"] for e in after if e["event"] == "issue")
    assert not wait_until_gone(os.path.join(str(d), exp)), "processes left behind"
