"""Bounded episode retries in asynchronous RL.

A prompt whose episode keeps failing retryably (a timeout: a reward function or a workflow that hangs) is retried at
most ``async_rl.max_episode_retries`` times; then the run stops with an error naming the prompt and the cause, and
the first such failure is a warning on the console.

* The rollout manager's process entry (``serve``) and a real rollout worker (``setup`` + ``run``, a workflow whose
  reward function hangs, both plugged in by import path) over real HTTP, with the launcher's console watching.
* The ticket book's counting on its own.
* ``slow``: a whole asynchronous run (tiny model, real processes) with a hanging reward function.
"""
import asyncio
import io
import json
import os
import threading
import time
import types

import pytest

from realhf.api.core.workflow_api import RolloutWorkflow
from realhf.testing import start_quickstart, wait_until_gone
from support.log_lines import LogLines

HANGING_REWARD = '''
import time


def reward(completion_text, data):
    time.sleep(3600)  # a grader that never answers
    return 0.0
'''


async def never_answers(completion_text, data):
    """A reward function that hangs (an async grader waiting for an answer that never comes)."""
    await asyncio.Event().wait()


class GradeOnly(RolloutWorkflow):
    """A workflow that grades a fixed answer (no generation server needed): its episodes hang in the reward."""

    def __init__(self, reward_fn, gconfig, tokenizer):
        self.reward_fn = reward_fn

    async def arun_episode(self, engine, data):
        from realhf.impl.workflow.rewards import call_reward

        await call_reward(self.reward_fn, "4", data)


def test_a_prompt_that_keeps_timing_out_stops_the_rollout_manager(tiny_math_run, tmp_path):
    """Every episode of a real rollout worker times out (its reward function hangs): the first timeout is posted
    once as a console notice; the second of a prompt (``max_episode_retries=1``) makes the manager's ``serve`` return
    1 with the error naming the prompt (index, query id, text) and the cause as the last line of its log; no ticket
    is issued after it."""
    from realhf.api.core.system_api import DatasetSpec, GenServersSpec, RolloutSpec
    from realhf.apps.console import Console
    from realhf.base import logging as rlogging
    from realhf.base import name_resolve
    from realhf.base.name_resolve import names
    from realhf.system.rollout import manager as rollout_manager
    from realhf.base.run_secret import new_run_secret
    from realhf.system.rollout.worker import RolloutWorker

    model, d = tiny_math_run
    nr = name_resolve.make_repository("file", root=str(tmp_path / "nr"))
    nr.add(names.gen_server("e", "t", 0), "127.0.0.1:9")  # never contacted: the workflow does not generate
    served = types.SimpleNamespace(gen_servers=GenServersSpec(backend="gen", n_servers=1))
    ds = DatasetSpec(kind="math_prompt", args=dict(path=f"{d}/math.jsonl", max_prompt_len=64, use_chat_template=False,
                                                   prompt_template="{prompt}"), batch_size=2, holder_model="actor")
    spec = types.SimpleNamespace(
        experiment_name="e", trial_name="t", log_dir=str(tmp_path / "logs"), recover_dir=str(tmp_path / "recover"),
        served=lambda: served,
        rollout=RolloutSpec(n_workers=1, batch_size=2, dp_size=1, total_batches=2, n_prompts=32, dataset=ds,
                            workflow=f"{__name__}:GradeOnly", reward_fn=f"{__name__}:never_answers",
                            tokenizer_path=model, episode_timeout_secs=0.5, max_episode_retries=1,
                            max_concurrent_rollouts=2))
    os.makedirs(spec.log_dir)
    console_out = io.StringIO()
    console = Console(stream=console_out)
    console.watch(spec.log_dir)
    log = LogLines()
    rlogging.getLogger("realhf.rollout_manager").addHandler(log)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    secret = new_run_secret()
    try:
        mgr = asyncio.run_coroutine_threadsafe(
            rollout_manager.serve(spec, secret, nr, False, host="127.0.0.1", stop=asyncio.Event()), loop)
        worker = RolloutWorker(spec, 0, secret, nr)
        worker.setup()
        run = asyncio.run_coroutine_threadsafe(worker.run(), loop)
        while not mgr.done():  # the launcher's console, watching the run's log folder
            console.poll()
            time.sleep(0.05)
        assert mgr.result(timeout=0) == 1
        run.cancel()  # (the launcher stops a real run's workers)
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0.2), loop).result(10)  # its clean-up runs
    finally:
        rlogging.getLogger("realhf.rollout_manager").removeHandler(log)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
    console.poll()
    shown = [ln for ln in console_out.getvalue().splitlines() if ln.startswith("warning:")]
    assert len(shown) == 1, console_out.getvalue()
    assert "failed and is retried: the episode timed out after 0.5 s" in shown[0], shown
    assert "async_rl.max_episode_retries=1" in shown[0], shown

    events = [json.loads(line) for line in open(os.path.join(spec.log_dir, "rollouts.jsonl"))]
    issued = {e["ticket"]: e for e in events if e["event"] == "issue"}
    assert all(e["status"] == "failed" and e["retryable"] is True for e in events if e["event"] == "finish")
    count = {}
    for stop_at, e in enumerate(events):
        if e["event"] == "finish":
            p = issued[e["ticket"]]["prompt"]
            count[p] = count.get(p, 0) + 1
            if count[p] == 2:
                break
    assert count[p] == 2 and not [e for e in events[stop_at:] if e["event"] == "issue"], events
    row = [json.loads(line) for line in open(f"{d}/math.jsonl")][p]
    assert log.lines[-1] == (
        f"the rollout manager stops the run: the episode of prompt {p} (query {row['query_id']!r}: {row['prompt']!r}) "
        "failed 2 times (async_rl.max_episode_retries=1 retries are allowed); the last time: the episode timed out "
        "after 0.5 s (async_rl.episode_timeout_secs); does the reward function or the workflow hang?"), log.lines[-3:]


def _args(model, d, exp, *extra):
    return ["async-ppo-math", f"actor.path={model}", f"dataset.path={d}/math.jsonl", "dataset.train_bs_n_seqs=4",
            "group_size=2", "ppo.gen.max_new_tokens=4", "ppo.ppo_n_minibatches=1", "use_chat_template=false",
            "prompt_template={prompt}", "use_critic=false", "ppo.kl_ctl=0", "exp_ctrl.benchmark_steps=2",
            f"fileroot={d}", f"experiment_name={exp}", "n_devices_per_node=2", "allocation_mode=gen.d1m1p1+d1m1p1",
            "param_realloc=disk", *extra]


@pytest.mark.slow
def test_a_hanging_reward_stops_the_run_after_the_allowed_retries(tiny_math_run, tmp_path):
    """Every episode times out (the reward function hangs): the console warns at the first timeout, and after
    ``max_episode_retries=1`` retries of a prompt the run stops (exit code 1) with an error naming the prompt (its
    index, query id and first characters) and the cause; no more tickets are issued after that."""
    model, d = tiny_math_run
    (tmp_path / "hanging_reward.py").write_text(HANGING_REWARD)
    exp = "retries-hang"
    from realhf.base.process import env_with_source_path

    env = {"PYTHONPATH": env_with_source_path()["PYTHONPATH"] + os.pathsep + str(tmp_path)}
    proc = start_quickstart(_args(model, d, exp, "async_rl.reward_fn=hanging_reward:reward",
                                  "async_rl.episode_timeout_secs=2", "async_rl.max_episode_retries=1"), env=env)
    try:
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, out[-4000:]
    # the console notice at the first timeout, before the failure
    notice = [ln for ln in out.splitlines() if ln.startswith("warning: the episode of prompt")]
    assert len(notice) == 1, out[-4000:]
    assert "timed out after 2 s" in notice[0] and "async_rl.max_episode_retries=1" in notice[0], notice
    assert out.index(notice[0]) < out.index("run failed")
    # the final error: the rollout manager stopped the run, naming the prompt and the cause
    assert "rollout_manager exited with code 1" in out, out[-4000:]
    err = [ln for ln in out.splitlines() if "the rollout manager stops the run:" in ln]
    assert len(err) == 1, out[-4000:]
    with open(os.path.join(str(d), exp, "trial0", "logs", "rollouts.jsonl")) as f:
        events = [json.loads(line) for line in f if line.strip()]
    issued = {e["ticket"]: e for e in events if e["event"] == "issue"}
    failed = [e for e in events if e["event"] == "finish"]
    assert failed and all(e["status"] == "failed" and e["retryable"] is True for e in failed), failed
    # the prompt named: the one whose second failure came first
    by_prompt = {}
    for e in failed:
        p = issued[e["ticket"]]["prompt"]
        by_prompt[p] = by_prompt.get(p, 0) + 1
        if by_prompt[p] == 2:
            first_twice = e
            break
    rows = [json.loads(line) for line in open(os.path.join(str(d), "math.jsonl"))]
    p = issued[first_twice["ticket"]]["prompt"]
    assert f"the episode of prompt {p} (query {rows[p]['query_id']!r}: {rows[p]['prompt']!r})" in err[0], err[0]
    assert ("failed 2 times (async_rl.max_episode_retries=1 retries are allowed); the last time: the episode timed out "
            "after 2 s (async_rl.episode_timeout_secs); does the reward function or the workflow hang?") in err[0], err
    # nothing was issued after the stopping failure, and nothing was retried a third time
    stop_at = events.index(first_twice)
    assert not [e for e in events[stop_at:] if e["event"] == "issue"]
    assert max(by_prompt.values()) <= 2
    assert not wait_until_gone(os.path.join(str(d), exp)), "processes left behind"


def test_the_book_counts_retryable_failures_per_prompt():
    """TicketBook: retryable failures count against the prompt (across tickets and workers), a worker's loss and a
    non-retryable failure do not, an accepted prompt starts afresh, and the limit raises after the finish is
    recorded."""
    from realhf.system.rollout.ticket_book import EpisodeRetriesExhausted, TicketBook

    book = TicketBook(batch_size=2, dp_size=1, total_batches=2, n_prompts=8, max_concurrent_rollouts=4,
                      max_episode_retries=2)
    why = {"error": "the episode timed out after 5 s", "retryable": True, "query_id": "q", "prompt_text": "What is"}
    t, _ = book.allocate("w0")
    book.finish(t.id, "failed", why)
    t2, _ = book.allocate("w1")
    assert (t2.batch, t2.slot, t2.prompt) == (t.batch, t.slot, t.prompt)  # the same prompt again
    assert book.failures(t2) == 1
    book.release("w1", "killed")  # a lost worker does not count
    t3, _ = book.allocate("w0")
    assert book.failures(t3) == 1
    book.finish(t3.id, "failed", {"error": "ValueError: bug", "retryable": False})  # the worker stops on those
    t4, _ = book.allocate("w0")
    book.finish(t4.id, "failed", why)
    t5, _ = book.allocate("w0")
    assert book.failures(t5) == 2 and t5.prompt == t.prompt
    with pytest.raises(EpisodeRetriesExhausted) as e:
        book.finish(t5.id, "failed", why)
    assert e.value.ticket.id == t5.id and book.running == 0  # recorded before raising
    assert str(e.value) == (f"the episode of prompt {t.prompt} (query 'q': 'What is') failed 3 times "
                            "(async_rl.max_episode_retries=2 retries are allowed); the last time: the episode timed "
                            "out after 5 s")
    # a prompt accepted after a failure starts afresh
    book = TicketBook(batch_size=2, dp_size=1, total_batches=2, n_prompts=8, max_episode_retries=1)
    a, _ = book.allocate("w0")
    book.finish(a.id, "failed", why)
    a2, _ = book.allocate("w0")
    assert a2.prompt == a.prompt and book.failures(a2) == 1
    book.finish(a2.id, "accepted", {})
    assert book.failures(a2) == 0
