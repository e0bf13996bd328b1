"""Whether a generation server is live: it answers ``/health``, and its engine makes progress while it has work.

A server's process may run and still serve nothing: stopped (SIGSTOP), hung in a native call, its engine thread
stuck while the event loop still answers. Watching process exits does not see that, so the launcher also watches
``/health`` (the same rule as the model workers' heartbeats: silent for longer than a limit means not live):

* :class:`EngineProgress` (server side, behind ``/health``): how long the engine has had work (running or waiting
  requests, not paused) without producing a token; ``/health`` reports it as ``stalled_s``. Until the engine has
  produced its first token nothing counts (a first decode step may compile for a long time).
* :class:`ServerWatch` (launcher side): one probe per server on an event loop of its own, every ``interval``
  seconds; :meth:`ServerWatch.not_live` names the servers that answered no ``/health`` for
  more than ``timeout_s`` seconds, or whose engine reports a stall that long.
"""
from __future__ import annotations

import asyncio
import threading
import time
from typing import List, Optional, Sequence, Tuple

from realhf.base import logging

logger = logging.getLogger("realhf.gen_server.liveness")


class EngineProgress:
    """Seconds the engine has had work without progress, from its ``metrics()`` at each ``observe`` call (no thread:
    between two calls that see the same counters, the engine made no progress)."""

    def __init__(self):
        self._mark: Optional[tuple] = None
        self._since = time.monotonic()

    def observe(self, metrics: dict) -> float:
        busy = (metrics.get("running_requests", 0) or metrics.get("waiting_requests", 0)) and not metrics.get("paused")
        mark = tuple(metrics.get(k) for k in ("generated_tokens", "steps", "prefills", "version"))
        now = time.monotonic()
        if not busy or not metrics.get("generated_tokens") or mark != self._mark:
            self._mark, self._since = mark, now
            return 0.0
        return now - self._since


class _ProbeError(Exception):
    pass


class ServerWatch:
    """Probes ``/health`` of every server of ``addresses`` every ``interval`` seconds on an event loop of its own, in
    a daemon thread (aiohttp only: a launcher that watches imports no torch). A probe waits at most a third of
    ``timeout_s``, within [0.5, 10] s. Servers are counted live from the watch's creation."""

    def __init__(self, addresses: Sequence[str], secret: bytes, backend: str, timeout_s: float,
                 interval: float = 1.0):
        if timeout_s <= 0 or interval <= 0:
            raise ValueError(f"ServerWatch needs timeout_s > 0 and interval > 0, got {timeout_s}, {interval}")
        self.addresses = list(addresses)
        self.timeout_s, self.interval = float(timeout_s), float(interval)
        self._probe_s = max(0.5, min(10.0, self.timeout_s / 3))
        self._headers = {}
        if backend == "sglang":  # SGLang's own server wants the run's API key
            from realhf.gen_server.dialect import api_key_of

            self._headers = {"Authorization": f"Bearer {api_key_of(secret)}"}
        now, n = time.monotonic(), len(self.addresses)
        self._last_ok: List[float] = [now] * n
        self._last_error: List[Optional[str]] = [None] * n
        self._stalled: List[float] = [0.0] * n
        self._ignored: set = set()
        self._warned: set = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="gen-server-watch", daemon=True)
        self._thread.start()
        self._main = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=30)

    def label(self, i: int) -> str:
        return f"{i} ({self.addresses[i]})"

    async def _start(self) -> asyncio.Task:
        return asyncio.ensure_future(self._watch())

    async def _watch(self):
        import aiohttp

        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            await asyncio.gather(*(self._probe(session, i) for i in range(len(self.addresses))))

    async def _probe(self, session, i: int):
        from realhf.base.http import request_json

        url = f"http://{self.addresses[i]}/health"
        while i not in self._ignored:
            try:
                h = await request_json(session, "GET", url, "/health", self._probe_s, lambda m, st: _ProbeError(m),
                                       headers=self._headers)
                stalled = h.get("stalled_s") if isinstance(h, dict) else None
                self._stalled[i] = float(stalled) if isinstance(stalled, (int, float)) else 0.0
                self._last_ok[i], self._last_error[i] = time.monotonic(), None
            except _ProbeError as e:
                self._last_error[i] = str(e)
            await asyncio.sleep(self.interval)

    def ignore(self, index: int) -> None:
        """Stop judging server ``index`` (e.g. its process exited: the launcher's exit rule speaks for it)."""
        self._ignored.add(index)

    def suspects(self) -> List[int]:
        """The watched servers silent (or stalled) for more than half the limit."""
        now = time.monotonic()
        return [i for i in range(len(self.addresses)) if i not in self._ignored
                and max(now - self._last_ok[i], self._stalled[i]) > self.timeout_s / 2]

    def not_live(self, key: str = "timeout_s") -> List[Tuple[int, str]]:
        """``(index, why)`` of every watched server found not live; ``key`` names the limit in the messages. A server
        silent (or stalled) for half the limit is logged once as a warning first."""
        now, out = time.monotonic(), []
        for i in range(len(self.addresses)):
            if i in self._ignored:
                continue
            silent, stalled = now - self._last_ok[i], self._stalled[i]
            if silent > self.timeout_s:
                out.append((i, f"it answered no /health for {silent:.1f} s (limit {key}={self.timeout_s:g}; last "
                               f"error: {self._last_error[i]}): its process is stopped or hung, or its machine cannot "
                               "be reached"))
            elif stalled > self.timeout_s:
                out.append((i, f"its engine had requests but produced no token for {stalled:.1f} s (limit "
                               f"{key}={self.timeout_s:g}): the engine is stuck"))
            elif max(silent, stalled) > self.timeout_s / 2:
                if i not in self._warned:
                    self._warned.add(i)
                    logger.warning("generation server %s: %s for %.1f s; the run stops at %g s (%s)", self.label(i),
                                   "no answer to /health" if silent >= stalled else "no progress of its engine",
                                   max(silent, stalled), self.timeout_s, key)
            else:
                self._warned.discard(i)
        return out

    def close(self) -> None:
        async def stop():
            self._main.cancel()
            try:
                await self._main
            except asyncio.CancelledError:
                pass

        try:
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(timeout=10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
