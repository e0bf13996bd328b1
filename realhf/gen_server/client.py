"""The one client of generation servers: training, the ``gen`` experiment and evaluation all use it.

:class:`GenClient` (asyncio, aiohttp) knows every server of a run by name and address and

* routes each request to one server (``round_robin``, ``least_requests`` or ``least_tokens``, counted from
  what this client has in flight); the ``n`` samples of one request stay on one server (a prompt's group
  is then prefilled once);
* signs every POST with the run secret (``realhf.gen_server.auth``);
* times out (``request_timeout``) and retries a request that failed to connect or timed out on another
  server (``retries`` times); an answer the server gave (400/401/500) is not retried but raised as is;
* raises :class:`GenServerError` naming the server (index and address) and the cause, e.g. when a server
  dies or never comes up;
* broadcasts weight updates, pause/continue and abort to every server.

Backends that are servers of their own (SGLang) are spoken to through a *dialect*
(``realhf.gen_server.dialect``) with the same methods.

Synchronous callers (model workers) use :class:`SyncGenClient`, which runs one ``GenClient`` on an event
loop in a background thread.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
from typing import Any, List, Optional, Sequence

from realhf.base import logging
from realhf.base.name_resolve import names
from realhf.gen_server.api import GenerateRequest, GenerateResult, TensorMeta, WeightGroupSpec
from realhf.gen_server.auth import sign
# the client's error and its view of a server live with the dialects; importers take them from here too
from realhf.gen_server.dialect import GenServerError, RealhfDialect, ServerState, SGLangDialect, api_key_of

logger = logging.getLogger("realhf.gen_server.client")

ROUTINGS = ("round_robin", "least_requests", "least_tokens")


class GenClient:
    def __init__(self, addresses: Sequence[str], secret: bytes, routing: str = "least_requests",
                 request_timeout: float = 3600.0, weight_timeout: float = 1800.0, control_timeout: float = 30.0,
                 retries: int = 1, dialect: str = "realhf", api_key: Optional[str] = None):
        if not addresses:
            raise ValueError("GenClient needs at least one server address")
        if routing not in ROUTINGS:
            raise ValueError(f"routing={routing!r}; allowed: {list(ROUTINGS)}")
        self.servers = [ServerState(i, a) for i, a in enumerate(addresses)]
        self.secret, self.routing, self.retries = secret, routing, int(retries)
        self.request_timeout, self.weight_timeout, self.control_timeout = request_timeout, weight_timeout, control_timeout
        self._rr = itertools.count()
        self._session = None
        if dialect == "realhf":
            self.dialect = RealhfDialect(self)
        elif dialect == "sglang":
            self.dialect = SGLangDialect(self, api_key=api_key)
        else:
            raise ValueError(f"unknown server dialect {dialect!r}; allowed: realhf, sglang")

    # ------------------------------------------------------------------ transport
    async def session(self):
        if self._session is None or self._session.closed:
            import aiohttp

            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        return self._session

    async def close(self):
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def post(self, s: ServerState, path: str, data: Any, timeout: float, signed: bool = True,
                   headers: Optional[dict] = None) -> Any:
        body = json.dumps(data).encode()
        h = {"Content-Type": "application/json", **(headers or {})}
        if signed:
            h.update(sign(self.secret, "POST", path, body))
        return await self._call(s, "POST", path, timeout, data=body, headers=h)

    async def get(self, s: ServerState, path: str, timeout: float, headers: Optional[dict] = None) -> Any:
        return await self._call(s, "GET", path, timeout, headers=headers)

    async def _call(self, s: ServerState, method: str, path: str, timeout: float, **kw) -> Any:
        from realhf.base.http import request_json

        def fail(msg: str, status: Optional[int]) -> GenServerError:
            if status is None and "cannot reach" in msg:
                msg += "; did the server exit? see its log"
            return GenServerError(s.label, msg, status=status)

        return await request_json(await self.session(), method, f"http://{s.address}{path}", path, timeout, fail, **kw)

    # ------------------------------------------------------------------ routing
    def _pick(self, cost: int, exclude: set) -> ServerState:
        now = time.monotonic()
        cands = [s for s in self.servers if s.index not in exclude and s.down_until <= now]
        if not cands:
            cands = [s for s in self.servers if s.index not in exclude]
        if not cands:
            raise GenServerError("(any)", "no server left to try")
        if self.routing == "round_robin":
            return cands[next(self._rr) % len(cands)]
        key = (lambda s: (s.in_flight, s.tokens_in_flight)) if self.routing == "least_requests" else \
            (lambda s: (s.tokens_in_flight, s.in_flight))
        best = min(key(s) for s in cands)
        ties = [s for s in cands if key(s) == best]
        return ties[next(self._rr) % len(ties)]

    async def generate(self, req: GenerateRequest, server: Optional[int] = None,
                       prefer: Optional[int] = None) -> GenerateResult:
        """Serve ``req`` on one server (``server`` pins it: no retry); retried elsewhere when a server is
        unreachable. ``prefer``: try that server first (unless it is marked down after a recent failure), then
        route as usual, with the usual retries, when it cannot be reached."""
        for name, idx in (("server", server), ("prefer", prefer)):
            if idx is not None and not 0 <= idx < len(self.servers):
                raise ValueError(f"{name}={idx} is not a server index; this client has {len(self.servers)} servers")
        if server is not None:
            prefer = None
        elif prefer is not None and self.servers[prefer].down_until > time.monotonic():
            prefer = None
        cost = len(req.input_ids) + req.sampling.n * req.sampling.max_new_tokens
        tried: set = set()
        errors = []
        for attempt in range(1 + (0 if server is not None else self.retries) + (prefer is not None)):
            if server is not None:
                s = self.servers[server]
            elif prefer is not None and attempt == 0:
                s = self.servers[prefer]
            else:
                s = self._pick(cost, tried)
            tried.add(s.index)
            s.in_flight += 1
            s.tokens_in_flight += cost
            try:
                res = await self.dialect.generate(s, req)
                s.failures = 0
                return res
            except GenServerError as e:
                if e.status is not None:  # the server answered: not a transport problem
                    raise
                s.failures += 1
                s.down_until = time.monotonic() + min(60.0, 2.0 ** s.failures)
                errors.append(str(e))
                if len(tried) == len(self.servers):
                    break
                logger.warning("%s; retrying request %s on another server", e, req.rid)
            finally:
                s.in_flight -= 1
                s.tokens_in_flight -= cost
        raise GenServerError(", ".join(str(i) for i in sorted(tried)),
                             f"request {req.rid} failed on every server tried: " + " | ".join(errors))

    async def generate_many(self, reqs: Sequence[GenerateRequest]) -> List[GenerateResult]:
        return list(await asyncio.gather(*(self.generate(r) for r in reqs)))

    async def logprobs(self, seqs: List[List[int]], server: int = 0) -> List[List[float]]:
        return await self.dialect.logprobs(self.servers[server], seqs)

    # ------------------------------------------------------------------ every server
    async def _all(self, fn, *args) -> List[Any]:
        return list(await asyncio.gather(*(fn(s, *args) for s in self.servers)))

    async def update_weights_from_disk(self, path: str, version: int) -> List[dict]:
        out = await self._all(self.dialect.update_weights_from_disk, path, version)
        for s in self.servers:
            s.version = version
        return out

    async def init_weight_group(self, specs: List[WeightGroupSpec]) -> List[dict]:
        """``specs[i]``: server i's view of the group (its own ``rank_offset``)."""
        return list(await asyncio.gather(*(self.dialect.init_weight_group(s, sp) for s, sp in zip(self.servers, specs))))

    async def update_weights_from_group(self, metas: List[TensorMeta], version: int) -> List[dict]:
        out = await self._all(self.dialect.update_weights_from_group, metas, version)
        for s in self.servers:
            s.version = version
        return out

    async def update_weights_from_shared(self, parts: List[dict], version: int) -> List[dict]:
        """Every server loads the tensors shared on its host (``realhf.gen_server.weight_share``); realhf's servers
        only."""
        fn = getattr(self.dialect, "update_weights_from_shared", None)
        if fn is None:
            raise GenServerError("*", f"{type(self.dialect).__name__} servers do not take shared weights")
        out = await self._all(fn, parts, version)
        for s in self.servers:
            s.version = version
        return out

    async def pause(self):
        return await self._all(self.dialect.pause)

    async def resume(self):
        return await self._all(self.dialect.resume)

    async def abort(self, rids: Optional[List[str]] = None) -> int:
        return sum(await self._all(self.dialect.abort, rids))

    async def metrics(self) -> List[dict]:
        return await self._all(self.dialect.metrics)

    async def health(self) -> List[dict]:
        return await self._all(self.dialect.health)

    async def wait_ready(self, timeout: float, alive=None) -> None:
        """Return when every server answers /health; GenServerError naming those that do not after ``timeout``
        seconds. ``alive(i)`` (optional) says whether server i's process still runs: a dead one fails at once."""
        t0 = time.monotonic()
        pending = list(self.servers)
        while pending:
            still = []
            for s in pending:
                try:
                    await self.dialect.health(s)
                except GenServerError as e:
                    if alive is not None and not alive(s.index):
                        raise GenServerError(s.label, "exited before it served") from None
                    still.append((s, e))
            pending = [s for s, _ in still]
            if not pending:
                return
            if time.monotonic() - t0 > timeout:
                raise GenServerError(", ".join(s.label for s in pending),
                                     f"not ready after {timeout:.0f} s: {still[0][1]}")
            await asyncio.sleep(0.2)


def dialect_options(backend: str, secret: bytes) -> dict:
    """The ``dialect``/``api_key`` arguments of a client of ``backend``'s servers (SGLang: its own endpoints and an
    API key derived from the run secret)."""
    if backend != "sglang":
        return {"dialect": "realhf"}
    return {"dialect": "sglang", "api_key": api_key_of(secret)}


def server_addresses(nr, experiment: str, trial: str, n: int, timeout: float = 60.0) -> List[str]:
    """The addresses of a run's ``n`` generation servers, as they registered them in name_resolve (``nr``), waiting
    up to ``timeout`` seconds for each."""
    return [nr.wait(names.gen_server(experiment, trial, i), timeout=timeout) for i in range(n)]


class SyncGenClient:
    """A :class:`GenClient` for synchronous code: its coroutines run on an event loop in a daemon thread.
    ``call(client.method(...))`` would need the client inside the loop, so use ``run(lambda c: c.method(...))``."""

    def __init__(self, *args, **kw):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="gen-client")
        self._thread.start()
        self.client: GenClient = self.run(lambda: _make(*args, **kw))

    def run(self, fn, timeout: Optional[float] = None):
        """Run ``fn()`` (which returns a coroutine, evaluated on the client's loop) and return its result."""

        async def wrap():
            return await fn()

        return asyncio.run_coroutine_threadsafe(wrap(), self._loop).result(timeout)

    def submit(self, fn):
        """Start ``fn()`` on the client's loop without waiting: returns a concurrent Future."""

        async def wrap():
            return await fn()

        return asyncio.run_coroutine_threadsafe(wrap(), self._loop)

    def __getattr__(self, name):
        attr = getattr(self.client, name)
        if not asyncio.iscoroutinefunction(attr):
            return attr
        return lambda *a, **k: self.run(lambda: attr(*a, **k))

    def close(self):
        try:
            self.run(self.client.close, timeout=10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)


async def _make(*args, **kw) -> GenClient:
    return GenClient(*args, **kw)
