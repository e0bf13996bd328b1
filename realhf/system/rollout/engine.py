"""The engine a rollout workflow generates through: interruptible generation on the generation servers.

:class:`RolloutEngine` wraps the one :class:`~realhf.gen_server.client.GenClient` of a rollout worker. What it
adds to the client:

* **Interruptions are invisible to workflows.** When the trainer publishes new weights, the rollout manager
  pauses the servers, aborts what they run (``/abort``), loads the weights and resumes them. An aborted sample
  comes back with ``finish_reason == "abort"`` and the tokens generated so far (none when it was still waiting).
  :meth:`RolloutEngine.agenerate` resubmits such a sample as ``input_ids + partial output`` with the tokens left
  (``max_new_tokens`` and ``min_new_tokens`` reduced by what was generated, ``n=1``, a seed derived from the
  request's seed, the sample and its progress), until it ends by ``"stop"`` or ``"length"``; the pieces' output
  ids, log-probs and versions are concatenated, so every token keeps the weight version that produced it (the
  tokens after an update carry the new version). A resubmission that arrives while the servers are still paused
  waits in the server's queue and starts with the new weights. Each resubmission counts as one interruption
  (``result.interruptions``, ``engine.stats["interruptions"]``).
* **A server that cannot be reached is reported.** The client retries a request on another server when one
  cannot be reached (or times out); the engine then calls ``on_server_down(index, reason)`` (a function or a
  coroutine function) once per failure streak of that server, so that the rollout manager learns of it.
* ``prefer``: the server to try first (e.g. the one that served a previous turn, whose prefix cache may hold the
  prompt); the client falls back to normal routing when it cannot be reached.
* ``version``: the newest weight version seen in any generated token; ``tokenizer``: the policy's tokenizer.
"""
from __future__ import annotations

import asyncio
import dataclasses
import inspect
import zlib
from typing import Any, Callable, Dict, List, Optional, Sequence

from realhf.api.core.generation import GenerateRequest, GenerateResult, SampleOutput, SamplingParams
from realhf.base import logging
from realhf.gen_server.client import GenClient, GenServerError

logger = logging.getLogger("realhf.system.rollout.engine")

_MAX_RID = 200  # the servers' limit on a request id
_BACKOFF_MAX = 1.0  # seconds between resubmissions of a sample that made no progress


@dataclasses.dataclass
class RolloutResult(GenerateResult):
    """A :class:`GenerateResult` whose samples all ended by ``"stop"`` or ``"length"``; ``interruptions``: how
    many times one of its samples was aborted and resubmitted."""

    interruptions: int = 0


def continuation_seed(seed: Optional[int], j: int, done: int, k: int) -> Optional[int]:
    """Seed of the ``k``-th resubmission of sample ``j`` of a request with ``seed`` after ``done`` tokens (None
    stays None: the server's own random stream)."""
    if seed is None:
        return None
    return zlib.crc32(f"{int(seed)}:{j}:{done}:{k}".encode()) & 0x7FFFFFFF


class RolloutEngine:
    def __init__(self, client: GenClient, tokenizer: Any = None,
                 on_server_down: Optional[Callable[[int, str], Any]] = None):
        self.client = client
        self.tokenizer = tokenizer
        self.on_server_down = on_server_down
        self._version = max((s.version for s in client.servers), default=0)
        self._reported: Dict[int, int] = {}  # server index -> failure count already reported
        self.stats: Dict[str, int] = {"requests": 0, "interruptions": 0, "resubmitted_tokens": 0,
                                      "servers_reported_down": 0}

    @property
    def version(self) -> int:
        """The newest weight version behind any token this engine has received."""
        return self._version

    # ------------------------------------------------------------------ generation
    async def agenerate(self, input_ids: Sequence[int], sampling: SamplingParams, rid: str,
                        prefer: Optional[int] = None) -> RolloutResult:
        """Generate ``sampling.n`` samples of ``input_ids`` (one request: the prompt is prefilled once); aborted
        samples are resumed until they end by ``"stop"``/``"length"`` (see the module docstring). ``rid`` names
        the request on the servers and must be unique among the requests in flight."""
        sp = dataclasses.replace(sampling, stop_token_ids=list(sampling.stop_token_ids)).validate()
        ids = [int(t) for t in input_ids]
        if not ids:
            raise ValueError(f"request {rid!r}: input_ids is empty")
        rid = str(rid)[:_MAX_RID - 24]
        self.stats["requests"] += 1
        res = await self._generate(GenerateRequest(rid=rid, input_ids=ids, sampling=sp), prefer)
        if len(res.outputs) != sp.n:
            raise GenServerError("(any)", f"request {rid}: {len(res.outputs)} samples came back, {sp.n} were asked")
        outs = [SampleOutput(list(o.output_ids), list(o.logprobs), list(o.versions), o.finish_reason)
                for o in res.outputs]
        counts = await asyncio.gather(*(self._resume(ids, sp, rid, j, o, prefer) for j, o in enumerate(outs)))
        for o in outs:
            self._see(o.versions)
        return RolloutResult(rid=rid, outputs=outs, interruptions=sum(counts))

    async def _resume(self, ids: List[int], sp: SamplingParams, rid: str, j: int, acc: SampleOutput,
                      prefer: Optional[int]) -> int:
        """Resubmit sample ``j`` (``acc``, updated in place) until it ends by stop/length; returns the number of
        resubmissions."""
        stop = set(sp.stop_token_ids)
        k = 0
        stalled = 0
        while acc.finish_reason == "abort":
            done = len(acc.output_ids)
            if done >= sp.max_new_tokens:  # aborted just as it ended
                acc.finish_reason = "length"
                break
            if done and acc.output_ids[-1] in stop and done >= (sp.min_new_tokens if stop else 0):
                acc.finish_reason = "stop"
                break
            if stalled:  # aborted again before it made progress: do not spin while the servers reject work
                await asyncio.sleep(min(_BACKOFF_MAX, 0.05 * 2 ** (stalled - 1)))
            k += 1
            self.stats["interruptions"] += 1
            self.stats["resubmitted_tokens"] += done
            part = dataclasses.replace(sp, n=1, max_new_tokens=sp.max_new_tokens - done,
                                       min_new_tokens=max(0, sp.min_new_tokens - done),
                                       seed=continuation_seed(sp.seed, j, done, k))
            req = GenerateRequest(rid=f"{rid}#{j}.{k}", input_ids=ids + acc.output_ids, sampling=part)
            logger.debug("resubmitting sample %d of %s after %d tokens (interruption %d)", j, rid, done, k)
            o = (await self._generate(req, prefer)).outputs[0]
            stalled = 0 if o.output_ids else stalled + 1
            acc.output_ids += list(o.output_ids)
            acc.logprobs += list(o.logprobs)
            acc.versions += list(o.versions)
            acc.finish_reason = o.finish_reason
        return k

    async def _generate(self, req: GenerateRequest, prefer: Optional[int]) -> GenerateResult:
        try:
            return await self.client.generate(req, prefer=prefer)
        except asyncio.CancelledError:  # the episode was cancelled: free the request's rows on the servers
            self._abort_quietly(req.rid)
            raise
        except GenServerError as e:
            if e.status is None:
                await self._report_down(f"{e}")
            raise
        finally:
            await self._report_down(None)

    def _abort_quietly(self, rid: str):
        try:
            t = asyncio.get_running_loop().create_task(self.client.abort([rid]))
        except RuntimeError:
            return
        t.add_done_callback(lambda t: t.cancelled() or t.exception())

    # ------------------------------------------------------------------ failures
    async def _report_down(self, reason: Optional[str]):
        """Tell ``on_server_down`` of every server whose failure count rose since it was last reported (the
        client counts a server's consecutive transport failures and resets the count when it serves again)."""
        for s in self.client.servers:
            seen = self._reported.get(s.index, 0)
            if s.failures == 0:
                self._reported[s.index] = 0
                continue
            if s.failures <= seen:
                continue
            self._reported[s.index] = s.failures
            self.stats["servers_reported_down"] += 1
            why = reason or (f"a request to server {s.label} failed to connect or timed out "
                             f"({s.failures} failure(s) in a row); the client retried it on another server")
            logger.warning("generation server %s appears down: %s", s.label, why)
            if self.on_server_down is None:
                continue
            try:
                out = self.on_server_down(s.index, why)
                if inspect.isawaitable(out):
                    await out
            except Exception as e:  # a failing notice must not fail the episode
                logger.error("on_server_down(%d) failed: %s: %s", s.index, type(e).__name__, e)

    def _see(self, versions: Sequence[int]):
        if versions:
            self._version = max(self._version, max(versions))
