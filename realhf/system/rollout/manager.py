"""The rollout manager of an asynchronous RL run: which prompt is generated next, when, and on which server.

One manager process per run (``python -m realhf.apps.remote --role rollout_manager ...``, see :func:`serve`)
sits between the rollout workers, the generation servers and the trainer:

* Rollout workers ask it for *tickets* (``/allocate``): one ticket is one episode, i.e. one prompt whose group of
  answers the worker's workflow samples. A ticket names the training *batch* and *slot* it fills, the trainer's
  data-parallel *head* that receives the trajectory, the *prompt* (a dataset index) and the generation server to
  prefer. Workers report each episode's end (``/finish``): ``accepted`` (pushed to the trainer), ``rejected``
  (dropped by dynamic filtering: the slot is re-issued with the next prompt) or ``failed`` (errored: the slot and
  its prompt are re-issued, nothing is lost). The first retryable failure (a timeout ...) is a console notice; a
  prompt that fails more than ``async_rl.max_episode_retries`` times stops the run: the manager exits with code 1
  and the error (naming the prompt and the cause) as the last line of its log, which the launcher reports.
* The trainer publishes new weights (``/update_weights``): the manager pauses every live server, aborts what runs
  there (workers resubmit the rest of an aborted answer; it waits on the paused server; with
  ``async_rl.weight_update=inflight`` nothing is aborted), has them load the checkpoint folder (or, with
  ``param_realloc=memory``, the tensors the trainer shares on their host), resumes, and raises its *version*.
* Staleness (``RolloutSpec``): a ticket of batch ``b`` is issued only while ``b <= version +
  max_head_offpolicyness``, and at most ``max_concurrent_rollouts`` run at once.
* Order: prompts are handed out in the order a synchronous run trains them (``EpochIterator`` with
  ``drop_last=True``): the prompt stream's position ``c`` is sample ``c`` of the epoch-major order, and without
  rejections slot ``j`` of batch ``b`` gets position ``b * B + j``.

:class:`~realhf.system.rollout.ticket_book.TicketBook` (its own module) is that bookkeeping, pure and testable, with an
append-only JSON-lines log (``<log_dir>/rollouts.jsonl``) from which a restarted manager restores its state and
which property tests of the whole system read. :class:`RolloutManager` is the signed HTTP server around it
(requests are signed like the generation servers', ``realhf.gen_server.auth``); its clients are in
``realhf.system.transport.manager_client``.
"""
from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

from realhf.base import logging

logger = logging.getLogger("realhf.rollout_manager")

from realhf.system.transport.notices import Notices
from realhf.system.rollout.ticket_book import EpisodeRetriesExhausted, TicketBook, _int, describe_prompt

MAX_ALLOCATE_WAIT_S = 30.0  # the longest an allocation may be held (below the workers' request timeout)
HELD_REASONS = ("done", "staleness", "concurrency", "weights")  # refusals a later event may lift


def settled(got: dict) -> bool:
    """Whether an allocation's answer stands: a ticket, the run complete, or a refusal no later event lifts."""
    return got.get("ticket") is not None or got.get("reason") not in HELD_REASONS or bool(got.get("complete"))


# ====================================================================== the server
class _HTTPError(Exception):
    def __init__(self, status: int, msg: str):
        self.status = status
        super().__init__(msg)


def _body(d: Any, required: Sequence[str], optional: Sequence[str] = ()) -> dict:
    if not isinstance(d, dict):
        raise _HTTPError(400, "the body must be a JSON object")
    missing = [k for k in required if k not in d]
    unknown = sorted(set(d) - set(required) - set(optional))
    if missing or unknown:
        raise _HTTPError(400, (f"missing keys {missing}" if missing else f"unknown keys {unknown}")
                         + f"; expected {list(required)}" + (f" and optionally {list(optional)}" if optional else ""))
    return d


class RolloutManager:
    """The HTTP server around a :class:`TicketBook` and a :class:`~realhf.gen_server.client.GenClient` over the
    run's generation servers (``addresses``, in server-index order).

    ==========================  ===================================================================================
    ``POST /allocate``          ``{"worker", "wait_s"?}`` -> ``{"ticket": {id, batch, slot, head, prompt, cursor,
                                version} | null, "reason", "version", "server": i|null, "complete"}``; reason
                                ``ok``, ``done``, ``staleness``, ``concurrency``, ``weights`` (restored, until
                                the trainer publishes) or ``stopping`` (a prompt failed too often: see
                                ``fail``); 503 when every server is down. With ``wait_s`` (at most
                                ``MAX_ALLOCATE_WAIT_S``) a refusal that a later event lifts (``done`` while
                                tickets still run, ``staleness``, ``concurrency``, ``weights``) is held until
                                a ticket finishes, a worker is released, new weights load or the run stops,
                                and tried again, for up to ``wait_s`` seconds: a worker gets its ticket when
                                the version moves, not at its next poll
    ``POST /finish``            ``{"ticket": id, "status": "accepted"|"rejected"|"failed", "stats": {...}}`` -> ``{}``
    ``POST /server_down``       ``{"index", "reason"}`` -> ``{}``: stop routing to server ``index`` and updating it
    ``POST /worker_down``       ``{"worker", "reason"}`` -> ``{"released": n}``: the rollout worker is gone (the
                                launcher says so); its running tickets fail and are re-issued to the others
    ``POST /update_weights``    ``{"path" | "parts", "version"}`` -> ``{"seconds", "servers": [updated indices],
                                "version"}``: from a checkpoint folder, or from tensors the trainer shares on the
                                servers' host (``parts``, ``realhf.gen_server.weight_share``)
    ``GET /status``             ``TicketBook.stats()`` + ``complete``, ``servers`` [{index, address, live,
                                running_episodes, version}], ``weight_updates``, ``weight_update_seconds``,
                                ``allocations_held`` (requests held by ``wait_s`` now),
                                ``idle_fraction``, ``idle_window_s`` (no episode running, since the last
                                call), the means of the numeric stats accepted episodes reported since then
                                (``episode_<name>``: reward, turns ...), and the servers' load:
                                ``gen_tokens_per_s``, ``server_running``, ``server_waiting``
    ``GET /health``             ``{"status": "ok", "version", "pid"}``
    ==========================  ===================================================================================

    POSTs must be signed with the run secret (401 otherwise); malformed input answers 400 naming the problem.
    ``server`` of an allocation is the live server with the fewest running episodes of this manager (ties: the
    lowest index). ``idle_fraction``: the fraction of wall time since the previous ``/status`` call (or the start)
    during which no episode was running; each ``/status`` call starts a new window.

    A weight update runs on every live server at once: pause, abort everything (running requests return their
    partial output with ``finish_reason "abort"``, waiting ones an empty one; a worker resubmits the rest, which
    waits on the paused server and then runs on the new weights), load from disk, continue. With
    ``interrupt=False`` (``async_rl.weight_update=inflight``) nothing is aborted: the requests go on under the new
    weights when the server continues, each token labelled with the version that produced it. A server that cannot
    be reached is marked down and skipped; one that answers with an error fails the update (500 naming it; the
    servers are resumed, the version is not raised). Updates are serialized."""

    def __init__(self, book: TicketBook, addresses: Sequence[str], secret: bytes, backend: str = "gen",
                 control_timeout: float = 30.0, weight_timeout: float = 1800.0, interrupt: bool = True,
                 notices: Optional[Notices] = None):
        from realhf.gen_server.auth import RequestVerifier
        from realhf.gen_server.client import GenClient, dialect_options
        from realhf.base.wire import RejectionLog

        self.book = book
        self.interrupt = interrupt
        self.client = GenClient(list(addresses), secret, control_timeout=control_timeout,
                                weight_timeout=weight_timeout, **dialect_options(backend, secret))
        self.verifier = RequestVerifier(secret)
        self.rejections = RejectionLog("rollout manager")
        n = len(self.client.servers)
        self.live = [True] * n
        self.down_reason: List[Optional[str]] = [None] * n
        self.episodes = [0] * n  # running episodes routed to each server
        self._server_of: Dict[int, int] = {}  # running ticket id -> server index
        self._update_lock = asyncio.Lock()
        self._change = asyncio.Event()  # replaced by a fresh one at every _changed()
        self._closing = False
        self.held = 0  # allocations held now (wait_s)
        # after a restore, the servers hold the initial weights until the trainer publishes the resumed ones: no
        # ticket is issued before (its tokens would carry a version far behind the bound)
        self.awaiting_version: Optional[int] = book.version if book.version > 0 else None
        self.weight_updates, self.weight_update_seconds = 0, 0.0
        self._tokens_mark: tuple = (None, 0)  # (time, generated tokens over the servers) at the last server_load
        self._episode_stats: Dict[str, list] = {}  # stat -> [sum, count] over accepted episodes since the last status
        now = time.monotonic()
        self._window_start = self._last_tick = now
        self._idle_s = 0.0
        self.runner = None
        self.port: Optional[int] = None
        self.notices = notices if notices is not None else Notices()  # Notices(log_dir): they reach the console
        self.fatal: Optional[str] = None  # the error that stops the run (see fail)
        self.on_fatal: Optional[Callable[[], None]] = None

    # ------------------------------------------------------------------ HTTP plumbing
    def app(self):
        from aiohttp import web

        from realhf.base.wire import MAX_FRAME_BYTES

        app = web.Application(client_max_size=MAX_FRAME_BYTES)
        app.router.add_get("/health", self._health)
        app.router.add_get("/status", self._status)
        for path, fn in {"/allocate": self._allocate, "/finish": self._finish, "/server_down": self._server_down,
                         "/worker_down": self._worker_down,
                         "/update_weights": self._update_weights}.items():
            app.router.add_post(path, self._signed(path, fn))
        return app

    def _signed(self, path: str, fn):
        from realhf.gen_server.auth import signed_route

        # _HTTPError answers with its own status; a ValueError is the book refusing the input (unknown ticket ...)
        return signed_route(self.verifier, self.rejections, path, fn, (_HTTPError, ValueError), logger)

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Serve on ``host:port`` (0: a free port); returns the bound port."""
        from realhf.gen_server.auth import serve_app

        self.runner, self.port = await serve_app(self.app(), host, port, "rollout manager")
        return self.port

    async def stop(self) -> None:
        self._closing = True  # held allocations answer now: the server's shutdown waits for its handlers
        self._changed()
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None
        await self.client.close()
        self.book.close()

    # ------------------------------------------------------------------ episodes
    def _tick(self) -> None:
        """Account the time since the last change of the running count (idle when none ran)."""
        now = time.monotonic()
        if self.book.running == 0:
            self._idle_s += now - self._last_tick
        self._last_tick = now

    def fail(self, message: str) -> None:
        """Stop the run with ``message``: no more tickets are issued, and ``on_fatal`` (``serve``: end the process with
        code 1 and the message as the last line of its log, which the launcher reports) is called."""
        if self.fatal is not None:
            return
        self.fatal = message
        self._changed()
        if self.on_fatal is not None:
            self.on_fatal()
        else:
            logger.error("the run must stop: %s", message)

    def _live(self) -> List[int]:
        return [i for i, ok in enumerate(self.live) if ok]

    def mark_down(self, index: int, reason: str) -> None:
        if not self.live[index]:
            return
        self.live[index], self.down_reason[index] = False, reason
        logger.warning("generation server %s is down (%s): no more episodes are routed to it and it is left out "
                       "of weight updates", self.client.servers[index].label, reason)

    def _all_down(self) -> _HTTPError:
        why = "; ".join(f"{s.label}: {self.down_reason[s.index]}" for s in self.client.servers)
        return _HTTPError(503, f"every generation server is down ({why}); no episode can run")

    def _changed(self) -> None:
        """Something that may lift a refusal happened: wake the held allocations (they try again)."""
        ev, self._change = self._change, asyncio.Event()
        ev.set()

    async def _allocate(self, d):
        d = _body(d, ["worker"], ["wait_s"])
        worker, wait = d["worker"], d.get("wait_s", 0)
        if not isinstance(worker, str) or not worker:
            raise _HTTPError(400, f"worker must be a non-empty string, got {worker!r}")
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 <= wait <= MAX_ALLOCATE_WAIT_S:
            raise _HTTPError(400, f"wait_s must be a number of seconds in [0, {MAX_ALLOCATE_WAIT_S:g}], got {wait!r}")
        deadline = time.monotonic() + wait
        while True:
            change = self._change
            got = self._allocate_now(worker)
            left = deadline - time.monotonic()
            if settled(got) or left <= 0 or self._closing:
                return got
            self.held += 1
            try:
                await asyncio.wait_for(change.wait(), left)
            except asyncio.TimeoutError:
                return got
            finally:
                self.held -= 1

    def _allocate_now(self, worker: str) -> dict:
        live = self._live()
        if not live:
            raise self._all_down()
        self._tick()
        if self.fatal is not None:  # stopping the run: nothing more to do
            return {"ticket": None, "reason": "stopping", "version": self.book.version, "server": None,
                    "complete": False}
        if self.awaiting_version is not None:
            return {"ticket": None, "reason": "weights", "version": self.book.version, "server": None,
                    "complete": self.book.complete}
        t, reason = self.book.allocate(worker)
        server = None
        if t is not None:
            server = min(live, key=lambda i: (self.episodes[i], i))
            self.episodes[server] += 1
            self._server_of[t.id] = server
        return {"ticket": t.to_dict() if t is not None else None, "reason": reason, "version": self.book.version,
                "server": server, "complete": self.book.complete}

    async def _finish(self, d):
        d = _body(d, ["ticket", "status"], ["stats"])
        tid, stats = d["ticket"], d.get("stats") or {}
        if not isinstance(tid, int) or isinstance(tid, bool):
            raise _HTTPError(400, f"ticket must be a ticket id (an integer), got {tid!r}")
        if not isinstance(stats, dict):
            raise _HTTPError(400, f"stats must be a JSON object, got {type(stats).__name__}")
        self._tick()
        try:
            t = self.book.finish(tid, d["status"], stats)
        except EpisodeRetriesExhausted as e:  # recorded; the prompt keeps failing: stop the run with the cause
            self.fail(str(e))
        else:
            if d["status"] == "failed" and stats.get("retryable") is True:
                self.notices.add("episode_retried", f"the episode of {describe_prompt(t, stats)} failed and is "
                                 f"retried: {stats.get('error') or 'no cause reported'} (a prompt is retried at most "
                                 f"async_rl.max_episode_retries={self.book.max_retries} times; then the run stops)")
        if d["status"] == "accepted":  # the episodes' own numbers (reward, turns, length ...), averaged per /status
            for k, v in stats.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    tot = self._episode_stats.setdefault(k, [0.0, 0])
                    tot[0] += float(v)
                    tot[1] += 1
        server = self._server_of.pop(tid, None)
        if server is not None:
            self.episodes[server] -= 1
        self._changed()
        return {}

    async def _server_down(self, d):
        d = _body(d, ["index"], ["reason"])
        i = d["index"]
        if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < len(self.live):
            raise _HTTPError(400, f"index must be a server index in [0, {len(self.live)}), got {i!r}")
        self.mark_down(i, str(d.get("reason") or "reported by a rollout worker"))
        return {}

    async def _worker_down(self, d):
        d = _body(d, ["worker"], ["reason"])
        worker = d["worker"]
        if not isinstance(worker, str) or not worker:
            raise _HTTPError(400, f"worker must be a non-empty string, got {worker!r}")
        self._tick()
        tickets = self.book.release(worker, str(d.get("reason") or "reported by the launcher"))
        for t in tickets:
            server = self._server_of.pop(t.id, None)
            if server is not None:
                self.episodes[server] -= 1
        self._changed()
        logger.warning("rollout worker %s is gone (%s): its %d running ticket(s) %s are re-issued to the others",
                       worker, d.get("reason") or "reported by the launcher", len(tickets), [t.id for t in tickets])
        return {"released": len(tickets)}

    # ------------------------------------------------------------------ weights
    async def _update_weights(self, d):
        d = _body(d, ["version"], ["path", "parts"])
        if ("path" in d) == ("parts" in d):
            raise _HTTPError(400, "give one of 'path' (a checkpoint folder) or 'parts' (weights shared by reference)")
        version = _int(d["version"], "version")
        if "parts" in d:
            if not isinstance(d["parts"], list) or not d["parts"]:
                raise _HTTPError(400, "parts must be a non-empty list of shared-weight parts")
            return await self.update_weights(d["parts"], version)
        path = d["path"]
        if not isinstance(path, str) or not path:
            raise _HTTPError(400, f"path must name a checkpoint folder, got {path!r}")
        return await self.update_weights(path, version)

    async def update_weights(self, source, version: int) -> dict:
        """Load weight ``version`` on every live server (see the class docstring): from the HF folder ``source``, or
        (a list) the parts the trainer shares on the servers' host (``realhf.gen_server.weight_share``)."""
        from realhf.gen_server.client import GenServerError

        async with self._update_lock:
            if version < self.book.version:
                raise ValueError(f"version {version} is lower than the current version {self.book.version}")
            live = self._live()
            if not live:
                raise self._all_down()
            t0 = time.perf_counter()
            results = await asyncio.gather(*(self._update_one(self.client.servers[i], source, version)
                                             for i in live), return_exceptions=True)
            updated, errors = [], []
            for i, r in zip(live, results):
                if isinstance(r, GenServerError) and r.status is None:  # unreachable: a transport failure
                    self.mark_down(i, str(r))
                elif isinstance(r, BaseException):
                    errors.append(f"server {self.client.servers[i].label}: {type(r).__name__}: {r}")
                else:
                    updated.append(i)
            if errors:
                origin = source if isinstance(source, str) else "shared memory"
                raise _HTTPError(500, f"weight update to version {version} from {origin} failed on "
                                      + "; ".join(errors))
            if not updated:
                raise self._all_down()
            self.book.set_version(version)
            if self.awaiting_version is not None and version >= self.awaiting_version:
                self.awaiting_version = None
            self._changed()
            secs = time.perf_counter() - t0
            self.weight_updates += 1
            self.weight_update_seconds += secs
            logger.info("weights of version %d loaded on server(s) %s in %.2f s", version, updated, secs)
            return {"seconds": secs, "servers": updated, "version": version}

    async def _update_one(self, s, source, version: int) -> None:
        from realhf.gen_server.client import GenServerError

        dia = self.client.dialect
        marks = [("start", time.perf_counter())]
        await dia.pause(s)
        marks.append(("pause", time.perf_counter()))
        err = None
        try:
            if self.interrupt:
                await dia.abort(s, None)
                marks.append(("abort", time.perf_counter()))
            if isinstance(source, str):
                await dia.update_weights_from_disk(s, source, version)
            else:
                await dia.update_weights_from_shared(s, source, version)
            marks.append(("load", time.perf_counter()))
            s.version = version
        except GenServerError as e:
            err = e
        try:  # resume also after a failed load: a paused server would hold every resubmitted request
            await dia.resume(s)
            marks.append(("resume", time.perf_counter()))
        except GenServerError as e:
            err = err or e
        if marks[-1][1] - marks[0][1] > 1.0:  # where a slow update spent its time
            logger.info("server %s: weight update to version %d: %s", s.label, version,
                        ", ".join(f"{k} {t - p:.2f} s" for (_, p), (k, t) in zip(marks, marks[1:])))
        if err is not None:
            raise err

    # ------------------------------------------------------------------ read-only views
    async def _health(self, request):
        from aiohttp import web

        return web.json_response({"status": "ok", "version": self.book.version, "pid": os.getpid()})

    def status(self) -> dict:
        self._tick()
        now = time.monotonic()
        window = now - self._window_start
        idle = min(1.0, self._idle_s / window) if window > 0 else 0.0
        self._window_start, self._idle_s = now, 0.0
        servers = [{"index": s.index, "address": s.address, "live": self.live[s.index],
                    "running_episodes": self.episodes[s.index], "version": s.version} for s in self.client.servers]
        episodes = {f"episode_{k}": tot / n for k, (tot, n) in self._episode_stats.items() if n}
        self._episode_stats = {}
        return {**self.book.stats(), **episodes, "complete": self.book.complete, "servers": servers,
                "weight_updates": self.weight_updates, "weight_update_seconds": self.weight_update_seconds,
                "idle_fraction": idle, "idle_window_s": window, "allocations_held": self.held}

    async def server_load(self) -> Dict[str, float]:
        """Over the live servers, from their ``/metrics``: generated tokens per second since the previous call
        (``gen_tokens_per_s``), and the requests running and waiting there now (``server_running``,
        ``server_waiting``: the generation queue)."""
        from realhf.gen_server.client import GenServerError

        live = self._live()
        res = await asyncio.gather(*(self.client.dialect.metrics(self.client.servers[i]) for i in live),
                                   return_exceptions=True)
        now = time.monotonic()
        tokens = running = waiting = 0
        for r in res:
            if isinstance(r, GenServerError):
                continue
            if isinstance(r, BaseException):
                raise r
            tokens += int(r.get("generated_tokens", 0))
            running += int(r.get("running_requests", 0))
            waiting += int(r.get("waiting_requests", 0))
        last_t, last_tokens = self._tokens_mark
        self._tokens_mark = (now, tokens)
        rate = (tokens - last_tokens) / (now - last_t) if last_t is not None and now > last_t else 0.0
        return {"gen_tokens_per_s": max(rate, 0.0), "server_running": running, "server_waiting": waiting}

    async def _status(self, request):
        from aiohttp import web

        return web.json_response({**self.status(), **await self.server_load()})


# ====================================================================== the process
async def serve(spec, secret: bytes, nr, resume: bool, host: Optional[str] = None,
                stop: Optional[asyncio.Event] = None) -> int:
    """Run the manager of ``spec`` (an ExperimentSpec with ``rollout``) until SIGTERM/SIGINT/SIGHUP (or ``stop``)."""
    from realhf.base import network
    from realhf.base.name_resolve import names
    from realhf.base.recover import RecoverStore

    r, m = spec.rollout, spec.served()
    if r is None or m is None:
        raise ValueError(f"experiment {spec.experiment_name!r} has no rollout spec or no generation servers: the "
                         "rollout manager serves asynchronous runs only")
    exp, trial, fleet = spec.experiment_name, spec.trial_name, m.gen_servers
    addrs = [await asyncio.to_thread(nr.wait, names.gen_server(exp, trial, i), fleet.startup_timeout_secs)
             for i in range(fleet.n_servers)]
    log_path = os.path.join(spec.log_dir, "rollouts.jsonl")
    if not resume and os.path.exists(log_path):  # a fresh run starts the log afresh
        os.remove(log_path)
    book = TicketBook(r.batch_size, r.dp_size, r.total_batches, r.n_prompts, r.max_head_offpolicyness,
                      r.max_concurrent_rollouts, r.seed, r.shuffle, log_path=log_path,
                      max_episode_retries=r.max_episode_retries)
    if resume:
        info = RecoverStore(spec.recover_dir).latest()
        book.restore(int(info["global_step"]) if info is not None else 0)
    mgr = RolloutManager(book, addrs, secret, backend=fleet.backend, interrupt=r.weight_update == "interrupt",
                         notices=Notices(spec.log_dir))
    host = host or network.worker_host()
    port = await mgr.start(host, 0)
    nr.add(names.rollout_manager(exp, trial), f"{host}:{port}", replace=True)
    logger.info("rollout manager serving on http://%s:%d (%d generation server(s), %d batches of %d)", host, port,
                len(addrs), r.total_batches, r.batch_size)
    if stop is None:  # the process entry: stop on the launcher's signals
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.add_signal_handler(s, stop.set)
    mgr.on_fatal = stop.set
    try:
        await stop.wait()
    finally:
        logger.info("rollout manager stopping: %s", mgr.status())
        await mgr.stop()
    if mgr.fatal is not None:  # the last line of the log, which the launcher shows
        logger.error("the rollout manager stops the run: %s", mgr.fatal)
        return 1
    return 0
