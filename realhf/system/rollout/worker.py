"""Rollout worker of an asynchronous run: runs many episodes at once and pushes the finished ones to the trainer.

``python -m realhf.apps.remote --role rollout_worker --rank i ...`` (started by the launcher, after the generation
servers and the rollout manager). One asyncio loop runs ``ceil(max_concurrent_rollouts / n_workers)``
episode tasks; each task repeats:

1. ask the rollout manager for a ticket (``/allocate``): a (batch, slot) to fill, the prompt, the trainer head that
   trains it and the generation server to prefer. No ticket: the staleness bound or the concurrency limit holds
   it back (the manager holds the request until a ticket finishes or new weights load, up to ``ALLOCATE_WAIT_S``,
   then the task asks again), or every batch of the run is taken (the task ends);
2. run the workflow's episode (``RolloutWorkflow.arun_episode``) on the prompt through a :class:`RolloutEngine`
   (generation requests survive weight updates: aborted samples are resumed under the new weights);
3. push the trajectory to its trainer head (``realhf.system.transport.trajectory_stream``) and report ``accepted``;
   a rejected episode (the workflow returned None, or ``dynamic_filtering`` found every reward equal) is
   reported ``rejected`` (the manager gives the slot a new prompt); an episode that timed out or lost its server is
   reported ``failed`` and ``retryable`` with the prompt's id and first characters (the manager re-issues the same
   prompt, at most ``async_rl.max_episode_retries`` times before it stops the run); any other error (a malformed
   request, a bug in the workflow or the reward) is reported ``failed`` and stops the worker with the cause, as it
   would repeat.

The prompt order and every count live in the manager, so a worker holds no state worth saving: the manager
resumes the run's accounting after a restart. The worker exits 0 when all its tasks end, and ends itself when
its parent (the launcher) is gone or the manager cannot be reached for ``manager_timeout`` seconds (a named error).
"""
from __future__ import annotations

import asyncio
import inspect
import math
import time
import traceback
from typing import Optional

from realhf.base import failpoint, logging
from realhf.system.rollout.manager import HELD_REASONS, settled

logger = logging.getLogger("realhf.rollout_worker")
# how long the manager may hold an allocation it cannot serve yet (a fresh request follows at once)
ALLOCATE_WAIT_S = 5.0


def episode_seed(seed: int, version: int, query_id: str) -> int:
    """Seed of an episode's samples: from the sampling seed, the weight version at its start and the prompt's id,
    exactly as a synchronous run seeds a prompt's samples (``gen_interface``): with ``max_head_offpolicyness=0``
    the servers then sample what a synchronous run's would."""
    from realhf.impl.model.interface.gen_interface import prompt_seed

    return prompt_seed(seed, version, query_id)


def retryable(e: BaseException) -> bool:
    """An episode failure worth another try: a timeout or a server that could not be reached (or refused for want of
    capacity). Anything else (a request the server calls malformed, an error in the workflow or the reward) would
    fail the same way again."""
    from realhf.gen_server.client import GenServerError

    if isinstance(e, asyncio.TimeoutError):
        return True
    return isinstance(e, GenServerError) and (e.status is None or e.status == 503)


def timed_out(e: BaseException, elapsed: float, timeout: float) -> bool:
    """Whether the episode ran into its own time limit (not a request's inside it)."""
    return isinstance(e, asyncio.TimeoutError) and elapsed + 0.05 >= timeout


def failure_text(e: BaseException, elapsed: float, timeout: float) -> str:
    """What went wrong in an episode, for the logs and the rollout manager (whose error names it when the prompt
    keeps failing)."""
    if timed_out(e, elapsed, timeout):
        return (f"the episode timed out after {timeout:g} s (async_rl.episode_timeout_secs); does the reward function "
                "or the workflow hang?")
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def _head(prompt, n: int = 60) -> str:
    """The first ``n`` characters of a prompt (its text, or its chat turns' contents), on one line."""
    if isinstance(prompt, list):
        prompt = " ".join(str(m.get("content", "")) if isinstance(m, dict) else str(m) for m in prompt)
    text = " ".join(str(prompt).split())
    return text if len(text) <= n else text[:n] + "..."


class EpisodeEngine:
    """The engine one episode sees: the worker's :class:`RolloutEngine`, preferring the server the manager chose."""

    def __init__(self, engine, prefer: Optional[int]):
        self.engine, self.prefer = engine, prefer
        self.tokenizer = engine.tokenizer

    async def agenerate(self, input_ids, sampling, rid: str):
        return await self.engine.agenerate(input_ids, sampling, rid, prefer=self.prefer)

    @property
    def version(self) -> int:
        return self.engine.version


class RolloutWorker:
    def __init__(self, spec, index: int, secret: bytes, nr, manager_timeout: float = 60.0):
        self.spec, self.index, self.secret, self.nr = spec, index, secret, nr
        self.rs = spec.rollout
        self.name = f"rollout_worker_{index}"
        self.manager_timeout = manager_timeout
        self.counts = {"accepted": 0, "rejected": 0, "failed": 0}

    def setup(self):
        import realhf.impl.workflow  # noqa: F401  (registers the built-in workflows)
        from realhf.api.core.workflow_api import make_workflow, workflow_class
        from realhf.impl.workflow.rewards import load_reward_fn
        from realhf.base.hf_tokenizer import load_tokenizer
        from realhf.base.name_resolve import names
        from realhf.impl.dataset import make_dataset
        from realhf.system.transport.trajectory_stream import TrajectoryPusher

        spec, rs = self.spec, self.rs
        self.tokenizer = load_tokenizer(rs.tokenizer_path)
        self.dataset = make_dataset(rs.dataset.kind, tokenizer=self.tokenizer, **rs.dataset.args)
        reward = load_reward_fn(rs.reward_fn, **rs.reward_args)
        args = dict(rs.workflow_args)
        # what the run knows and a workflow may take: the servers' sequence budget, the prompts' chat format
        takes = inspect.signature(workflow_class(rs.workflow)).parameters
        for k, v in (("max_seq_len", rs.max_seq_len or None), ("use_chat_template", rs.use_chat_template)):
            if k in takes and v is not None:
                args.setdefault(k, v)
        self.workflow = make_workflow(rs.workflow, reward_fn=reward, gconfig=dict(rs.gconfig), tokenizer=self.tokenizer,
                                      **args)
        exp, trial = spec.experiment_name, spec.trial_name
        self.manager_address = self.nr.wait(names.rollout_manager(exp, trial), timeout=600)
        self.pusher = TrajectoryPusher(self.secret, self.nr, exp, trial)

    async def run(self) -> int:
        from realhf.gen_server.client import GenClient, dialect_options, server_addresses
        from realhf.system.transport.manager_client import ManagerClient
        from realhf.system.rollout.engine import RolloutEngine

        spec, rs = self.spec, self.rs
        fleet = spec.served().gen_servers
        addrs = server_addresses(self.nr, spec.experiment_name, spec.trial_name, fleet.n_servers, timeout=600)
        self.manager = ManagerClient(self.manager_address, self.secret)
        client = GenClient(addrs, self.secret, routing=fleet.routing, request_timeout=fleet.request_timeout_secs,
                           retries=max(1, fleet.n_servers - 1), **dialect_options(fleet.backend, self.secret))

        async def down(index: int, reason: str):
            try:
                await self.manager.server_down(index, reason)
            except Exception as e:  # the manager also finds it at the next weight update
                logger.warning("could not tell the rollout manager that server %d is down: %s", index, e)

        self.engine = RolloutEngine(client, self.tokenizer, on_server_down=down)
        n_tasks = max(1, math.ceil(rs.max_concurrent_rollouts / rs.n_workers))
        logger.info("%s: %d concurrent episodes, workflow %s, %d generation server(s)", self.name, n_tasks, rs.workflow,
                    len(addrs))
        try:
            await asyncio.gather(*(self._episodes(k) for k in range(n_tasks)))
        finally:
            await client.close()
            await self.manager.close()
            self.pusher.close()
        logger.info("%s: done (%s)", self.name, ", ".join(f"{k} {v}" for k, v in self.counts.items()))
        return 0

    async def _allocate(self) -> dict:
        """A ticket, or the manager's refusal. After a refusal that a later event may lift, one task of this worker
        asks again held in the manager (``wait_s``) until such an event; the worker's other tasks wait for that
        request to come back and then all ask at once. Held requests so never take up the connections that carry
        the episodes' ``finish`` reports, and a new version's tickets go out in one round."""
        while True:
            got = await self._ask(0.0)
            if settled(got):
                return got
            waiter = getattr(self, "_waiter", None)
            if waiter is not None:  # another task's request is held: wait for it, then ask again
                await asyncio.shield(waiter)
                continue
            self._waiter = asyncio.get_running_loop().create_future()
            t0 = time.monotonic()
            try:
                got = await self._ask(ALLOCATE_WAIT_S)
            finally:
                self._waiter.set_result(None)
                self._waiter = None
            if settled(got):
                return got
            if time.monotonic() - t0 < 0.01:  # answered without being held (the manager is closing): not a busy loop
                await asyncio.sleep(0.1)

    async def _ask(self, wait_s: float) -> dict:
        from realhf.system.transport.manager_client import ManagerError

        t0 = time.monotonic()
        while True:
            try:
                return await self.manager.allocate(self.name, wait_s=wait_s)
            except ManagerError as e:
                if e.status is not None and e.status != 503:
                    raise
                if time.monotonic() - t0 > self.manager_timeout:
                    raise RuntimeError(f"{self.name}: {e} (for {self.manager_timeout:.0f} s); stopping") from None
                await asyncio.sleep(1.0)

    async def _episodes(self, k: int):
        from realhf.system.transport.trajectory_stream import sample_id

        rs = self.rs
        idle = 0.02
        while True:
            got = await self._allocate()
            t = got.get("ticket")
            if t is None:
                # "done" only says no slot is free now: a ticket running elsewhere may still fail (its worker
                # killed) and come back, so the worker stays until every slot is accepted (``complete``)
                if got.get("complete"):
                    return
                if got.get("reason") in HELD_REASONS:  # the manager held the request until a change or its wait
                    continue
                await asyncio.sleep(idle)
                idle = min(idle * 2, 0.5)
                continue
            idle = 0.02
            sid = sample_id(t["batch"], t["slot"])
            data = self._episode_data(t["prompt"])
            data["seed"] = episode_seed(rs.gconfig.get("seed", rs.seed), t.get("version", 0), data["query_id"])
            t0 = time.monotonic()
            try:
                traj = await asyncio.wait_for(self.workflow.arun_episode(EpisodeEngine(self.engine, got.get("server")),
                                                                         data), timeout=rs.episode_timeout_secs)
            except Exception as e:  # a failed episode is retried by the manager with the same prompt
                elapsed = time.monotonic() - t0
                why = failure_text(e, elapsed, rs.episode_timeout_secs)
                where = "" if timed_out(e, elapsed, rs.episode_timeout_secs) else "\n" + traceback.format_exc(limit=5)
                logger.warning("%s: episode of ticket %s (prompt %s) failed: %s%s", self.name, t["id"], t["prompt"],
                               why, where)
                self.counts["failed"] += 1
                await self.manager.finish(t["id"], "failed", {"error": why[:500], "retryable": retryable(e),
                                                              "query_id": data["query_id"],
                                                              "prompt_text": _head(data.get("prompt"))})
                if not retryable(e):  # it would fail again: stop the run with the cause rather than loop
                    raise RuntimeError(f"{self.name}: the episode of prompt {t['prompt']} (query "
                                       f"{data.get('query_id')!r}) failed: {why}") from e
                continue
            stats = {"seconds": time.monotonic() - t0}
            if traj is None or (rs.dynamic_filtering and traj.rewards_all_equal()):
                self.counts["rejected"] += 1
                await self.manager.finish(t["id"], "rejected", stats)
                continue
            if rs.reward_output_scaling != 1.0 or rs.reward_output_bias != 0.0:
                for smp in traj.samples:  # as a synchronous run's rw-math: (reward + bias) * scaling
                    smp.reward = (smp.reward + rs.reward_output_bias) * rs.reward_output_scaling
            lag = failpoint.delay_secs("rollout.episode")  # tests: a random delay ($REALHF_DELAYS)
            if lag:
                await asyncio.sleep(lag)
            versions = [traj.min_version(), traj.max_version()]
            stats = {**traj.stats, **stats, "reward": sum(s.reward for s in traj.samples) / len(traj.samples),
                     "versions": versions, "n_tokens": sum(len(s.input_ids) for s in traj.samples)}
            sent = self.pusher.push(t["head"], traj.to_sample(sid), {"batch": t["batch"], "slot": t["slot"],
                                                                     "ticket": t["id"], "versions": versions})
            # reported accepted only once on the wire: a kill -9 right after cannot lose an accepted group
            await self.pusher.wait_sent(sent)
            self.counts["accepted"] += 1
            await self.manager.finish(t["id"], "accepted", stats)

    def _episode_data(self, index: int) -> dict:
        from realhf.api.core.workflow_api import episode_data

        return episode_data(self.dataset, index)
