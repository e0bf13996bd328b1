"""ppo-math with generation servers (``gen.`` allocations) through the quickstart launcher, with real server
processes: the run matches the colocated run step for step (weights published through a weight group and
through disk), a server killed mid-run stops the run naming it with nothing left behind, and a server that
cannot start fails the run before training with its cause. (Learning on arithmetic with servers:
tests/e2e/test_grpo_learns.py.)"""
import os
import signal
import time

import pytest

from support.tiny_ppo import STEPS, ppo_args

from realhf.testing import (read_stats, run_processes, run_quickstart, start_quickstart, wait_for_steps,
                                 wait_until_gone)

@pytest.fixture(scope="module")
def colocated(tiny_ppo_colocated):
    """The run on one device (allocation_mode=d1m1p1; tests/conftest.py)."""
    return tiny_ppo_colocated


def test_served_generation_matches_the_colocated_run(tiny_math_run, colocated, sync="disk"):
    """Seeded per sample, the gen server samples what the colocated engine samples; so if the weights reach the
    server exactly after every step, every step's stats equal the colocated run's. (Through disk here; through a
    weight group from tensor- and pipeline-parallel trainers in tests/e2e/test_realloc_e2e.py.)"""
    model, d = tiny_math_run
    exp = f"served-{sync}"
    p = run_quickstart(ppo_args(model, d, exp, 2, "allocation_mode=gen.d1m1p1+d1m1p1", f"param_realloc={sync}"))
    assert p.returncode == 0, p.stderr[-3000:]
    st = read_stats(d, exp)
    assert len(st) == len(colocated) == STEPS
    for step, (r, g) in enumerate(zip(colocated, st), 1):
        for k in ("n_tokens", "n_seqs", "no_eos_ratio", "task_reward"):
            assert g[k] == r[k], f"step {step}: {k}={g[k]} served vs {r[k]} colocated"
        for k in ("importance_weight", "actor_loss", "advantage"):
            assert abs(g[k] - r[k]) < 1e-4 * max(1.0, abs(r[k])), f"step {step}: {k}"
    assert "actor_gen/weight_sync_time" not in st[0]  # the servers start with the initial weights
    assert all(s["actor_gen/weight_sync_time"] > 0 for s in st[1:])
    log = open(os.path.join(d, exp, "trial0", "logs", "gen_server_0.log")).read()
    assert "serving on http://127.0.0.1:" in log
    assert not os.path.exists(os.path.join(d, exp, "trial0", "logs", "model_worker_1.log"))  # 1 worker + 1 server


def test_a_killed_server_stops_the_run_naming_it(tiny_math_run, tmp_path):
    model, data = tiny_math_run
    d = str(tmp_path)
    os.link(os.path.join(data, "math.jsonl"), os.path.join(d, "math.jsonl"))
    p = start_quickstart(ppo_args(model, d, "kill", 2, "allocation_mode=gen.d1m1p1+d1m1p1",
                                  "exp_ctrl.benchmark_steps=200", "worker_timeout_secs=10"))
    try:
        wait_for_steps(d, "kill", 1, timeout=240, proc=p)
        server = [q for q in run_processes(d) if "realhf.gen_server.server" in " ".join(q.cmdline())]
        assert len(server) == 1
        t0 = time.monotonic()
        server[0].send_signal(signal.SIGKILL)
        out, _ = p.communicate(timeout=60)
        took = time.monotonic() - t0
        assert p.returncode not in (0, None)
        assert "gen_server_0" in out and "killed by signal 9" in out, out[-3000:]
        print(f"run stopped {took:.1f} s after the server was killed")
        assert wait_until_gone(d, 30) == []
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)


def test_a_server_that_cannot_start_fails_the_run_before_training(tiny_math_run):
    model, d = tiny_math_run
    p = run_quickstart(ppo_args(model, d, "nostart", 2, "allocation_mode=gen.d1m1p1+d1m1p1",
                             'gen_server.extra={"no_such_option": 1}'), timeout=240)
    assert p.returncode != 0
    err = p.stderr + p.stdout
    assert "generation server 0 (gen) exited" in err and "before it served" in err, err[-3000:]
    assert "no_such_option" in err
    logs = os.path.join(d, "nostart", "trial0", "logs")
    assert not os.path.exists(os.path.join(logs, "master.log"))  # nothing else was started


def test_gen_experiment_through_servers_writes_the_colocated_rows(tiny_math_run, tmp_path):
    """`gen` with gen.d2m1p1+d1m1p1 (two servers, their client on worker 0) writes the same rows as in-process
    generation, in the same format."""
    import json

    model, _ = tiny_math_run
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{i} plus {i + 3} is", "query_id": f"q{i}"}) + "\n"
                               for i in range(6)))

    def gen(exp, *extra):
        p = run_quickstart(["gen", f"model.path={model}", f"dataset.path={prompts}", "dataset.train_bs_n_seqs=3",
                            "gen.max_new_tokens=5", "gen.n=2", "gen.temperature=1.0", "use_chat_template=false",
                            f"fileroot={tmp_path}", f"experiment_name={exp}", *extra])
        assert p.returncode == 0, p.stderr[-3000:]
        with open(os.path.join(tmp_path, exp, "trial0", "logs", "generated.jsonl")) as f:
            return [json.loads(line) for line in f]

    ref = gen("colocated", "allocation_mode=d1m1p1")
    got = gen("served", "allocation_mode=gen.d2m1p1+d1m1p1", "n_devices_per_node=3")
    assert len(got) == 12 and [sorted(r) for r in got] == [sorted(r) for r in ref]
    for a, b in zip(ref, got):
        assert (b["query_id"], b["sample_idx"], b["output_ids"]) == (a["query_id"], a["sample_idx"], a["output_ids"])
        assert max(abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"])) < 1e-4
    logs = os.path.join(tmp_path, "served", "trial0", "logs")
    assert os.path.exists(os.path.join(logs, "gen_server_1.log"))
