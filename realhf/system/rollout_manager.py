"""The rollout manager of an asynchronous RL run: which prompt is generated next, when, and on which server.

One manager process per run (``python -m realhf.system.rollout_manager --exp NAME --config PATH --resume 0|1``)
sits between the rollout workers, the generation servers and the trainer:

* Rollout workers ask it for *tickets* (``/allocate``): one ticket is one episode, i.e. one prompt whose group of
  answers the worker's workflow samples. A ticket names the training *batch* and *slot* it fills, the trainer's
  data-parallel *head* that receives the trajectory, the *prompt* (a dataset index) and the generation server to
  prefer. Workers report each episode's end (``/finish``): ``accepted`` (pushed to the trainer), ``rejected``
  (dropped by dynamic filtering: the slot is re-issued with the next prompt) or ``failed`` (errored: the slot and
  its prompt are re-issued, nothing is lost).
* The trainer publishes new weights (``/update_weights``): the manager pauses every live server, aborts what runs
  there (workers resubmit the rest of an aborted answer; it waits on the paused server), loads the checkpoint
  folder, resumes, and raises its *version*.
* Staleness (``RolloutSpec``): a ticket of batch ``b`` is issued only while ``b <= version +
  max_head_offpolicyness``, and at most ``max_concurrent_rollouts`` run at once.
* Order: prompts are handed out in the order a synchronous run trains them (``EpochIterator`` with
  ``drop_last=True``): the prompt stream's position ``c`` is sample ``c`` of the epoch-major order, and without
  rejections slot ``j`` of batch ``b`` gets position ``b * B + j``.

:class:`TicketBook` is that bookkeeping, pure and testable, with an append-only JSON-lines log
(``<log_dir>/rollouts.jsonl``) from which a restarted manager restores its state (:meth:`TicketBook.restore`) and
which property tests of the whole system read. :class:`RolloutManager` is the signed HTTP server around it
(requests are signed like the generation servers', ``realhf.gen_server.auth``); its clients are in
``realhf.system.manager_client``.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import heapq
import json
import os
import signal
import sys
import time
import traceback
from typing import Any, Dict, List, Optional, Sequence, Tuple

from realhf.base import logging

logger = logging.getLogger("realhf.rollout_manager")

STATUSES = ("accepted", "rejected", "failed")
_FINISH_KEYS = {"event", "ticket", "status", "t"}  # a worker's stats may not use these names


@dataclasses.dataclass
class Ticket:
    id: int  # unique over the run (restarts included)
    batch: int  # the training batch (= global step - 1) it fills
    slot: int  # 0 .. batch_size - 1
    head: int  # the trainer's data-parallel rank that receives the trajectory
    prompt: int  # dataset index
    cursor: int  # position in the prompt stream
    version: int  # the servers' weight version when it was issued

    def to_dict(self) -> Dict[str, int]:
        return dataclasses.asdict(self)


def _int(v: Any, what: str, lo: int = 0) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        raise ValueError(f"{what} must be an integer >= {lo}, got {v!r}")
    return v


class TicketBook:
    """Tickets of one run (see the module docstring). Not thread-safe: the server calls it from one event loop.

    State: the next never-issued slot (slots are numbered ``batch * B + slot``), a heap of *returned* slots
    (``(batch, slot, cursor)``; cursor -1: take the next prompt of the stream), the running tickets, and the
    next fresh position of the prompt stream. :meth:`allocate` issues the lowest free slot."""

    def __init__(self, batch_size: int, dp_size: int, total_batches: int, n_prompts: int,
                 max_head_offpolicyness: int = 0, max_concurrent_rollouts: int = 64, seed: int = 1,
                 shuffle: bool = True, log_path: Optional[str] = None):
        from realhf.impl.dataset.jsonl import EpochIterator

        self.B = _int(batch_size, "batch_size", 1)
        self.dp_size = _int(dp_size, "dp_size", 1)
        self.total_batches = _int(total_batches, "total_batches")
        self.ofp = _int(max_head_offpolicyness, "max_head_offpolicyness")
        self.max_concurrent = _int(max_concurrent_rollouts, "max_concurrent_rollouts", 1)
        self.log_path = log_path
        # the synchronous order: dataset indices only need len(), the permutation is EpochIterator's own
        self._it = EpochIterator(range(_int(n_prompts, "n_prompts", 1)), self.B, seed=seed, dp_size=self.dp_size,
                                 shuffle=shuffle, drop_last=True)
        self._heads = [r for r in range(self.dp_size) for _ in self._it.rank_share(range(self.B), r)]
        self._batches: Dict[Tuple[int, int], List[int]] = {}  # (epoch, step) -> prompts, a small cache
        self.version = 0
        self._next_id = 0
        self._next_new = 0
        self._cursor = 0
        self._queue: List[Tuple[int, int, int]] = []
        self._running: Dict[int, Ticket] = {}
        self._accepted: Dict[Tuple[int, int], Ticket] = {}  # accepted slots (set_version drops trained batches)
        self._counts = dict(issued=0, accepted=0, rejected=0, failed=0, refused_staleness=0, refused_concurrency=0)
        self._log_f = None
        self._log_mode = "w"  # a fresh run starts the log afresh; restore() appends
        self._replaying = False

    # ------------------------------------------------------------------ the prompt stream
    def prompt_at(self, cursor: int) -> int:
        """Dataset index at position ``cursor`` of the prompt stream (epoch-major, each epoch's last partial
        batch dropped)."""
        e, k = divmod(cursor, self._it.steps_per_epoch * self.B)
        step, j = divmod(k, self.B)
        if (e, step) not in self._batches:
            if len(self._batches) >= 64:
                self._batches.clear()
            self._batches[(e, step)] = self._it.global_batch_indices(e, step)
        return self._batches[(e, step)][j]

    def head_of(self, slot: int) -> int:
        return self._heads[slot]

    # ------------------------------------------------------------------ issuing and finishing
    def _peek(self) -> Optional[Tuple[int, int, int]]:
        if self._queue:
            return self._queue[0]
        if self._next_new < self.total_batches * self.B:
            b, j = divmod(self._next_new, self.B)
            return b, j, -1
        return None

    def allocate(self, worker: str) -> Tuple[Optional[Ticket], str]:
        """(the ticket of the lowest free slot, "ok"), or (None, why): "done" (no free slot: every slot of every
        batch is running or accepted; a running one may still fail and come back), "staleness" (that slot's
        batch is more than ``max_head_offpolicyness`` ahead of the version) or "concurrency"."""
        cand = self._peek()
        if cand is None:
            return None, "done"
        b, j, cursor = cand
        if b > self.version + self.ofp:
            self._counts["refused_staleness"] += 1
            return None, "staleness"
        if len(self._running) >= self.max_concurrent:
            self._counts["refused_concurrency"] += 1
            return None, "concurrency"
        if self._queue:
            heapq.heappop(self._queue)
        else:
            self._next_new += 1
        if cursor < 0:
            cursor, self._cursor = self._cursor, self._cursor + 1
        t = Ticket(id=self._next_id, batch=b, slot=j, head=self.head_of(j), prompt=self.prompt_at(cursor),
                   cursor=cursor, version=self.version)
        self._next_id += 1
        self._running[t.id] = t
        self._counts["issued"] += 1
        self._write({"event": "issue", "ticket": t.id, "batch": b, "slot": j, "head": t.head, "prompt": t.prompt,
                     "cursor": cursor, "version": t.version, "worker": str(worker)})
        return t, "ok"

    def finish(self, ticket_id: int, status: str, stats: Optional[Dict[str, Any]] = None) -> Ticket:
        """End a running ticket: ``accepted`` fills its slot; ``rejected`` consumes its prompt and returns the slot
        (re-issued with the next prompt of the stream); ``failed`` returns slot and prompt. ``stats`` (plain JSON,
        e.g. reward or token counts) go into the log line."""
        if status not in STATUSES:
            raise ValueError(f"status must be one of {list(STATUSES)}, got {status!r}")
        stats = dict(stats or {})
        clash = sorted(_FINISH_KEYS & set(stats))
        if clash:
            raise ValueError(f"stats may not use the keys {clash} (reserved for the log line)")
        try:
            json.dumps(stats, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"stats must be plain JSON: {e}") from None
        t = self._running.pop(ticket_id, None) if isinstance(ticket_id, int) else None
        if t is None:
            raise ValueError(f"ticket {ticket_id!r} is not running: unknown, or already finished")
        self._apply_finish(t, status)
        self._write({"event": "finish", "ticket": t.id, "status": status, **stats})
        return t

    def _apply_finish(self, t: Ticket, status: str) -> None:
        self._counts[status] += 1
        if status == "accepted":
            self._accepted[(t.batch, t.slot)] = t
        else:
            heapq.heappush(self._queue, (t.batch, t.slot, t.cursor if status == "failed" else -1))

    def set_version(self, v: int) -> None:
        """The servers now hold weights of version ``v`` (= trained steps); versions only grow."""
        v = _int(v, "version")
        if v < self.version:
            raise ValueError(f"version {v} is lower than the current version {self.version}; versions only grow")
        if v == self.version:
            return
        self.version = v
        # trained batches' tickets are never needed again (restore replays the whole log, without set_version)
        self._accepted = {k: t for k, t in self._accepted.items() if t.batch >= v}
        self._write({"event": "version", "version": v})

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def complete(self) -> bool:
        """Every slot of every batch accepted: nothing will be issued any more."""
        return self._peek() is None and not self._running

    def stats(self) -> Dict[str, int]:
        return dict(version=self.version, issued=self._counts["issued"], accepted=self._counts["accepted"],
                    rejected=self._counts["rejected"], failed=self._counts["failed"], running=len(self._running),
                    queued=len(self._queue), refused_staleness=self._counts["refused_staleness"],
                    refused_concurrency=self._counts["refused_concurrency"])

    # ------------------------------------------------------------------ restart
    def restore(self, trained_batches: int) -> None:
        """Continue after a crash: the trainer resumed with ``trained_batches`` (G) steps trained. The previous
        incarnation's log (if any) is replayed; then the version becomes G, batches < G are done, and every
        slot of a batch >= G whose trajectory is not known to be trained (accepted or still running at the
        crash) is re-queued with the same prompt; rejected prompts stay consumed and the prompt stream continues
        after the last position used. Without a log the stream continues at ``G * B``. The log then goes on."""
        if self._counts["issued"] or self.version or self._log_f is not None:
            raise RuntimeError("restore() must be the first call on a fresh TicketBook")
        G = _int(trained_batches, "trained_batches")
        if G > self.total_batches:
            raise ValueError(f"trained_batches={G} exceeds total_batches={self.total_batches}")
        if self.log_path and os.path.exists(self.log_path):
            self._replay(self.log_path)
        self._restore_state(G)
        self._log_mode = "a"
        self._write({"event": "restore", "trained_batches": G})
        logger.info("rollout manager restored after %d trained batches: version %d, %d slot(s) re-queued, "
                    "prompt stream at %d", G, self.version, len(self._queue), self._cursor)

    def _restore_state(self, G: int) -> None:
        requeue = [(t.batch, t.slot, t.cursor) for t in [*self._accepted.values(), *self._running.values()]
                   if t.batch >= G]
        lost = [t.id for t in self._running.values() if t.batch < G]
        if lost:
            logger.warning("tickets %s of batches already trained were still running at the crash; ignored", lost)
        dropped = [e for e in self._queue if e[0] < G]
        if dropped:
            logger.warning("returned slots %s of batches already trained were still queued at the crash; "
                           "dropped", dropped)
        self._queue = [e for e in self._queue if e[0] >= G] + requeue
        heapq.heapify(self._queue)
        # trained batches stay accepted (a later restore from an older checkpoint re-queues them); set_version prunes
        self._accepted = {k: t for k, t in self._accepted.items() if t.batch < G}
        self._running = {}
        self.version = G
        self._next_new = max(self._next_new, G * self.B)
        self._cursor = max(self._cursor, G * self.B)

    def _replay(self, path: str) -> None:
        with open(path, "rb") as f:
            data = f.read()
        end = data.rfind(b"\n") + 1
        if end < len(data):  # the crash cut the last line: drop it so the log stays one JSON object a line
            logger.warning("%s: dropping a torn last line (%d bytes)", path, len(data) - end)
            with open(path, "r+b") as f:
                f.truncate(end)
        self._replaying = True
        try:
            for n, line in enumerate(data[:end].splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    self._replay_event(json.loads(line))
                except (ValueError, KeyError, TypeError) as e:
                    raise ValueError(f"{path}: line {n} cannot be replayed ({type(e).__name__}: {e}); the rollout "
                                     "log is damaged") from None
        finally:
            self._replaying = False

    def _replay_event(self, rec: dict) -> None:
        ev = rec["event"]
        if ev == "issue":
            t = Ticket(id=rec["ticket"], batch=rec["batch"], slot=rec["slot"], head=rec["head"],
                       prompt=rec["prompt"], cursor=rec["cursor"], version=rec["version"])
            at = [i for i, e in enumerate(self._queue) if e[:2] == (t.batch, t.slot)]
            if at:
                self._queue.pop(at[0])
                heapq.heapify(self._queue)
            elif t.batch * self.B + t.slot == self._next_new:
                self._next_new += 1
            else:
                raise ValueError(f"ticket {t.id} takes slot (batch {t.batch}, slot {t.slot}), which was not free")
            self._running[t.id] = t
            self._cursor = max(self._cursor, t.cursor + 1)
            self._next_id = max(self._next_id, t.id + 1)
            self._counts["issued"] += 1
        elif ev == "finish":
            t = self._running.pop(rec["ticket"], None)
            if t is None:
                raise ValueError(f"ticket {rec['ticket']} finishes but is not running")
            if rec["status"] not in STATUSES:
                raise ValueError(f"unknown status {rec['status']!r}")
            self._apply_finish(t, rec["status"])
        elif ev == "version":
            self.version = _int(rec["version"], "version")
        elif ev == "restore":
            self._restore_state(_int(rec["trained_batches"], "trained_batches"))
        else:
            raise ValueError(f"unknown event {ev!r}")

    # ------------------------------------------------------------------ the log
    def _write(self, rec: dict) -> None:
        if self.log_path is None or self._replaying:
            return
        if self._log_f is None:
            d = os.path.dirname(self.log_path)
            if d:
                os.makedirs(d, exist_ok=True)
            self._log_f = open(self.log_path, self._log_mode)
        rec["t"] = round(time.time(), 6)
        self._log_f.write(json.dumps(rec) + "\n")
        self._log_f.flush()

    def close(self) -> None:
        if self._log_f is not None:
            self._log_f.close()
            self._log_f = None


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
    ``POST /allocate``          ``{"worker"}`` -> ``{"ticket": {id, batch, slot, head, prompt, cursor, version} |
                                null, "reason": "ok"|"done"|"staleness"|"concurrency", "version", "server": i|null,
                                "complete"}``; 503 when every server is down
    ``POST /finish``            ``{"ticket": id, "status": "accepted"|"rejected"|"failed", "stats": {...}}`` -> ``{}``
    ``POST /server_down``       ``{"index", "reason"}`` -> ``{}``: stop routing to server ``index`` and updating it
    ``POST /update_weights``    ``{"path", "version"}`` -> ``{"seconds", "servers": [updated indices], "version"}``
    ``GET /status``             ``TicketBook.stats()`` + ``complete``, ``servers`` [{index, address, live,
                                running_episodes, version}], ``weight_updates``, ``weight_update_seconds``,
                                ``idle_fraction``, ``idle_window_s``
    ``GET /health``             ``{"status": "ok", "version", "pid"}``
    ==========================  ===================================================================================

    POSTs must be signed with the run secret (401 otherwise); malformed input answers 400 naming the problem.
    ``server`` of an allocation is the live server with the fewest running episodes of this manager (ties: the
    lowest index). ``idle_fraction``: the fraction of wall time since the previous ``/status`` call (or the start)
    during which no episode was running; each ``/status`` call starts a new window.

    A weight update runs on every live server at once: pause, abort everything (running requests return their
    partial output with ``finish_reason "abort"``, waiting ones an empty one; a worker resubmits the rest, which
    waits on the paused server and then runs on the new weights), load from disk, continue. A server that cannot
    be reached is marked down and skipped; one that answers with an error fails the update (500 naming it; the
    servers are resumed, the version is not raised). Updates are serialized."""

    def __init__(self, book: TicketBook, addresses: Sequence[str], secret: bytes, backend: str = "gen",
                 control_timeout: float = 30.0, weight_timeout: float = 1800.0):
        from realhf.gen_server.auth import RequestVerifier
        from realhf.gen_server.client import GenClient, dialect_options
        from realhf.system.wire import RejectionLog

        self.book = book
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
        self.weight_updates, self.weight_update_seconds = 0, 0.0
        now = time.monotonic()
        self._window_start = self._last_tick = now
        self._idle_s = 0.0
        self.runner = None
        self.port: Optional[int] = None

    # ------------------------------------------------------------------ HTTP plumbing
    def app(self):
        from aiohttp import web

        from realhf.system.wire import MAX_FRAME_BYTES

        app = web.Application(client_max_size=MAX_FRAME_BYTES)
        app.router.add_get("/health", self._health)
        app.router.add_get("/status", self._status)
        for path, fn in {"/allocate": self._allocate, "/finish": self._finish, "/server_down": self._server_down,
                         "/update_weights": self._update_weights}.items():
            app.router.add_post(path, self._signed(path, fn))
        return app

    def _signed(self, path: str, fn):
        from aiohttp import web

        from realhf.system.wire import RejectedMessage

        async def handler(request):
            body = await request.read()
            try:
                self.verifier.verify("POST", path, request.headers, body)
            except RejectedMessage as e:
                self.rejections.reject(request.remote or "?", e)
                return web.json_response({"error": f"rejected: {e}"}, status=401)
            try:
                try:
                    data = json.loads(body) if body else {}
                except ValueError as e:
                    raise _HTTPError(400, f"the body is not JSON: {e}") from None
                return web.json_response(await fn(data))
            except _HTTPError as e:
                return web.json_response({"error": str(e)}, status=e.status)
            except ValueError as e:  # the book refused the input (unknown ticket, lower version ...)
                return web.json_response({"error": str(e)}, status=400)
            except Exception as e:
                logger.error("%s failed: %s", path, traceback.format_exc())
                return web.json_response({"error": f"{type(e).__name__}: {e}"}, status=500)

        return handler

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Serve on ``host:port`` (0: a free port); returns the bound port."""
        from aiohttp import web

        self.runner = web.AppRunner(self.app(), access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, host, port, reuse_address=False)
        try:
            await site.start()
        except OSError as e:
            raise OSError(f"rollout manager: cannot listen on {host}:{port} ({e.strerror or e})") from None
        self.port = site._server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
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

    async def _allocate(self, d):
        worker = _body(d, ["worker"])["worker"]
        if not isinstance(worker, str) or not worker:
            raise _HTTPError(400, f"worker must be a non-empty string, got {worker!r}")
        live = self._live()
        if not live:
            raise self._all_down()
        self._tick()
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
        self.book.finish(tid, d["status"], stats)
        server = self._server_of.pop(tid, None)
        if server is not None:
            self.episodes[server] -= 1
        return {}

    async def _server_down(self, d):
        d = _body(d, ["index"], ["reason"])
        i = d["index"]
        if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < len(self.live):
            raise _HTTPError(400, f"index must be a server index in [0, {len(self.live)}), got {i!r}")
        self.mark_down(i, str(d.get("reason") or "reported by a rollout worker"))
        return {}

    # ------------------------------------------------------------------ weights
    async def _update_weights(self, d):
        d = _body(d, ["path", "version"])
        path, version = d["path"], d["version"]
        if not isinstance(path, str) or not path:
            raise _HTTPError(400, f"path must name a checkpoint folder, got {path!r}")
        version = _int(version, "version")
        return await self.update_weights(path, version)

    async def update_weights(self, path: str, version: int) -> dict:
        """Load the HF folder ``path`` as weight ``version`` on every live server (see the class docstring)."""
        from realhf.gen_server.client import GenServerError

        async with self._update_lock:
            if version < self.book.version:
                raise ValueError(f"version {version} is lower than the current version {self.book.version}")
            live = self._live()
            if not live:
                raise self._all_down()
            t0 = time.perf_counter()
            results = await asyncio.gather(*(self._update_one(self.client.servers[i], path, version) for i in live),
                                           return_exceptions=True)
            updated, errors = [], []
            for i, r in zip(live, results):
                if isinstance(r, GenServerError) and r.status is None:  # unreachable: a transport failure
                    self.mark_down(i, str(r))
                elif isinstance(r, BaseException):
                    errors.append(f"server {self.client.servers[i].label}: {type(r).__name__}: {r}")
                else:
                    updated.append(i)
            if errors:
                raise _HTTPError(500, f"weight update to version {version} from {path} failed on "
                                      + "; ".join(errors))
            if not updated:
                raise self._all_down()
            self.book.set_version(version)
            secs = time.perf_counter() - t0
            self.weight_updates += 1
            self.weight_update_seconds += secs
            logger.info("weights of version %d loaded on server(s) %s in %.2f s", version, updated, secs)
            return {"seconds": secs, "servers": updated, "version": version}

    async def _update_one(self, s, path: str, version: int) -> None:
        from realhf.gen_server.client import GenServerError

        dia = self.client.dialect
        await dia.pause(s)
        err = None
        try:
            await dia.abort(s, None)
            await dia.update_weights_from_disk(s, path, version)
            s.version = version
        except GenServerError as e:
            err = e
        try:  # resume also after a failed load: a paused server would hold every resubmitted request
            await dia.resume(s)
        except GenServerError as e:
            err = err or e
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
        return {**self.book.stats(), "complete": self.book.complete, "servers": servers,
                "weight_updates": self.weight_updates, "weight_update_seconds": self.weight_update_seconds,
                "idle_fraction": idle, "idle_window_s": window}

    async def _status(self, request):
        from aiohttp import web

        return web.json_response(self.status())


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
                      r.max_concurrent_rollouts, r.seed, r.shuffle, log_path=log_path)
    if resume:
        info = RecoverStore(spec.recover_dir).latest()
        book.restore(int(info["global_step"]) if info is not None else 0)
    mgr = RolloutManager(book, addrs, secret, backend=fleet.backend)
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
    try:
        await stop.wait()
    finally:
        logger.info("rollout manager stopping: %s", mgr.status())
        await mgr.stop()
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="realhf rollout manager (asynchronous RL)")
    ap.add_argument("--exp", required=True)
    ap.add_argument("--config", required=True)
    ap.add_argument("--resume", type=int, default=0)
    a = ap.parse_args(argv)
    from realhf.base.process import exit_when_parent_dies

    exit_when_parent_dies()
    # the config is loaded like realhf.apps.remote does for the master (an upward import, in the entry point only)
    from realhf.apps.main import name_resolve_root
    from realhf.apps.remote import load_config
    from realhf.base import name_resolve
    from realhf.experiments import build_spec
    from realhf.system.wire import run_secret_from_env

    config = load_config(a.exp, a.config)
    spec = build_spec(a.exp, config)
    nr = name_resolve.make_repository("file", root=name_resolve_root(config))
    return asyncio.run(serve(spec, run_secret_from_env(), nr, bool(a.resume)))


if __name__ == "__main__":
    try:
        sys.exit(main())
    except SystemExit:
        raise
    except BaseException:  # the launcher sees a non-zero code and the cause in the log
        traceback.print_exc()
        sys.exit(1)
