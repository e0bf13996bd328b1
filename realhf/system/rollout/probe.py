"""The rollout side's own cost per episode, measured for the planner (:mod:`realhf.plan.profile` takes it as its
``rollout_probe``): the host CPU an asynchronous run's rollout worker and rollout manager spend on one episode
beside the generation itself — the ticket's allocation and report, the generation request and its answer, the
answers' decoding, the trajectory's assembly and its push to the trainer — and what a weight update through the
manager takes (the server pauses, aborts its requests, loads the checkpoint from disk and resumes).

Everything is the run's real code on this machine: a :class:`RolloutManager` over a :class:`TicketBook`, a real
``gen`` server process (:class:`realhf.gen_server.fleet.LocalFleet`) serving the tiny Qwen2 model, the RLVR workflow
with the rule-based math reward through a :class:`RolloutEngine`, and a :class:`TrajectoryPusher` sending each
trajectory over ZMQ to a local receiver. The figure is the CPU time of this process (the manager's and the worker's
side together; the server and the reward's grader run in their own processes) per episode, so that it does not
depend on how busy the host is while it is measured. The server decodes on the CPU on any machine: the figure is
the host's work, which a GPU machine's host does as well."""
from __future__ import annotations

import asyncio
import os
import statistics
import tempfile
import threading
import time
from typing import Tuple


class _Address:
    """The trainer head's address, as the run's name service would give it."""

    def __init__(self, addr: str):
        self.addr = addr

    def wait(self, name, timeout=None):
        return self.addr


def _receiver(ctx, stop: threading.Event, got: list) -> Tuple[str, threading.Thread]:
    """A PULL socket on a free local port drained by a thread (the trainer head's end of the stream), counting the
    trajectories in ``got[0]``."""
    import zmq

    sock = ctx.socket(zmq.PULL)
    port = sock.bind_to_random_port("tcp://127.0.0.1")

    def drain():
        while True:
            if sock.poll(200 if stop.is_set() else 50):  # after the stop, until nothing came for 0.2 s
                sock.recv_multipart()
                got[0] += 1
            elif stop.is_set():
                break
        sock.close(0)

    th = threading.Thread(target=drain, daemon=True, name="probe-trajectory-receiver")
    th.start()
    return f"tcp://127.0.0.1:{port}", th


async def _rounds(fleet, path: str, tokenizer, prompts, group: int, answer: int, rounds: int):
    """(CPU seconds of this process per episode for each of ``rounds`` batches of ``len(prompts)`` concurrent
    episodes after one warm-up batch, the seconds of the weight update from ``path`` after each batch, the
    trajectories the trainer's end received)."""
    import zmq

    from realhf.gen_server.client import GenClient, dialect_options
    from realhf.impl.workflow.rlvr import RLVRWorkflow
    from realhf.system.rollout.engine import RolloutEngine
    from realhf.system.rollout.manager import RolloutManager
    from realhf.system.rollout.ticket_book import TicketBook
    from realhf.system.rollout.worker import EpisodeEngine
    from realhf.system.transport.manager_client import ManagerClient
    from realhf.system.transport.trajectory_stream import TrajectoryPusher, sample_id

    B = len(prompts)
    book = TicketBook(B, 1, rounds + 1, B, max_head_offpolicyness=rounds + 1, max_concurrent_rollouts=B,
                      shuffle=False)
    mgr = RolloutManager(book, fleet.addresses, fleet.secret)
    mc = ManagerClient(f"127.0.0.1:{await mgr.start('127.0.0.1', 0)}", fleet.secret)
    client = GenClient(fleet.addresses, fleet.secret, **dialect_options("gen", fleet.secret))
    engine = RolloutEngine(client, tokenizer)
    workflow = RLVRWorkflow(None, dict(n=group, min_new_tokens=answer, max_new_tokens=answer, temperature=1.0),
                            tokenizer)
    stop, received = threading.Event(), [0]
    addr, th = _receiver(zmq.Context.instance(), stop, received)
    pusher = TrajectoryPusher(fleet.secret, _Address(addr), "probe", "probe")

    async def episode():
        got = await mc.allocate("probe")
        t = got["ticket"]
        ids, text, solution = prompts[t["prompt"]]
        data = {"query_id": f"probe-{t['prompt']}", "prompt": text, "input_ids": ids, "solutions": [solution],
                "task": "math"}
        traj = await workflow.arun_episode(EpisodeEngine(engine, got.get("server")), data)
        sent = pusher.push(t["head"], traj.to_sample(sample_id(t["batch"], t["slot"])),
                           {"batch": t["batch"], "slot": t["slot"], "ticket": t["id"]})
        await pusher.wait_sent(sent)
        await mc.finish(t["id"], "accepted", dict(traj.stats))

    per, updates = [], []
    try:
        for r in range(rounds + 1):
            c = time.process_time()
            await asyncio.gather(*(episode() for _ in range(B)))
            if r:  # the first batch builds the sessions, the tokenizer's caches, the grader
                per.append((time.process_time() - c) / B)
            t = time.perf_counter()
            await mgr.update_weights(path, r + 1)  # the next batch's version, as the trainer publishes it
            updates.append(time.perf_counter() - t)
        accepted = book.stats()["accepted"]
    finally:
        pusher.close()
        stop.set()
        th.join(timeout=5)
        await mc.close()
        await client.close()
        await mgr.stop()
    if accepted != B * (rounds + 1) or received[0] != accepted:  # every episode ran and reached the trainer's end
        raise RuntimeError(f"rollout probe: {accepted} episodes accepted and {received[0]} trajectories received, "
                           f"expected {B * (rounds + 1)}")
    return per, updates[1:], received[0]


def rollout_episode_overhead(group: int, answer: int, prompts: int = 8, rounds: int = 4) -> Tuple[float, dict]:
    """(CPU seconds the rollout side spends per episode of ``group`` answers of ``answer`` tokens, the figures behind
    it): the median over ``rounds`` batches of ``prompts`` concurrent episodes (see the module docstring); the
    figures include ``update_s``, the median seconds of a weight update through the manager, and ``weights_bytes``,
    the checkpoint's size."""
    import torch

    from realhf.base.hf_tokenizer import load_tokenizer
    from realhf.gen_server.fleet import LocalFleet
    from realhf.impl.dataset import make_arithmetic_problems
    from realhf.impl.model.tiny import ensure_tiny_model

    path = ensure_tiny_model("qwen2", tie_word_embeddings=True)
    tokenizer = load_tokenizer(path)
    problems = make_arithmetic_problems(prompts, seed=7, kind="easy")
    batch = [(tokenizer(p["prompt"])["input_ids"], p["prompt"], str(p["solutions"][0])) for p in problems]
    with tempfile.TemporaryDirectory(prefix="realhf-rollout-probe-") as d:
        with LocalFleet("gen", path, 1, dtype="float32", device="cpu", threads=torch.get_num_threads(),
                        log_dir=os.path.join(d, "logs")) as fleet:
            per, updates, received = asyncio.run(_rounds(fleet, path, tokenizer, batch, group, answer, rounds))
    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))
    return statistics.median(per), dict(episodes_per_round=prompts, group=group, answer=answer,
                                        rounds_s=[round(x, 6) for x in per], update_s=statistics.median(updates),
                                        weights_bytes=size, trajectories=received)
