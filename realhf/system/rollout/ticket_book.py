"""The bookkeeping of the rollout manager (``realhf.system.rollout.manager``), pure and testable: tickets in the
synchronous prompt order under the staleness bound, rejected and failed episodes re-issued, and an append-only
JSON-lines log (``<log_dir>/rollouts.jsonl``) from which a restarted manager restores its state and which property
tests of the whole system read.

Retries: a prompt whose episode fails *retryably* (the worker reports ``"retryable": true`` in the stats of a
``failed`` finish: a timeout, a server that could not be reached) more than ``max_episode_retries`` times makes
:meth:`TicketBook.finish` raise :class:`EpisodeRetriesExhausted` naming the prompt and the cause (the rollout manager
then stops the run). A worker lost with its tickets does not count against their prompts.

Staleness (``RolloutSpec``): a ticket of batch ``b`` is issued only while ``b <= version + max_head_offpolicyness``,
and at most ``max_concurrent_rollouts`` run at once. Order: prompts are handed out in the order a synchronous run
trains them (``EpochIterator`` with ``drop_last=True``): the prompt stream's position ``c`` is sample ``c`` of the
epoch-major order, and without rejections slot ``j`` of batch ``b`` gets position ``b * B + j``.
"""
from __future__ import annotations

import dataclasses
import heapq
import json
import os
import time
from typing import Any, Dict, List, Optional, Tuple

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


class EpisodeRetriesExhausted(RuntimeError):
    """A prompt's episode failed more often than the retries allow; the ticket's finish was recorded."""

    def __init__(self, ticket: Ticket, message: str):
        self.ticket = ticket
        super().__init__(message)


def describe_prompt(t: Ticket, stats: Dict[str, Any]) -> str:
    """``prompt <index> (query <id>: '<its first characters>')``, from what a worker reported with a finish."""
    about = [f"query {stats['query_id']!r}" if "query_id" in stats else "",
             repr(str(stats["prompt_text"])) if "prompt_text" in stats else ""]
    about = [a for a in about if a]
    return f"prompt {t.prompt}" + (f" ({': '.join(about)})" if about else "")


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
                 shuffle: bool = True, log_path: Optional[str] = None, max_episode_retries: Optional[int] = None):
        from realhf.impl.dataset.jsonl import EpochIterator

        self.B = _int(batch_size, "batch_size", 1)
        self.dp_size = _int(dp_size, "dp_size", 1)
        self.total_batches = _int(total_batches, "total_batches")
        self.max_head_offpolicyness = _int(max_head_offpolicyness, "max_head_offpolicyness")
        self.max_concurrent = _int(max_concurrent_rollouts, "max_concurrent_rollouts", 1)
        self.max_retries = None if max_episode_retries is None else _int(max_episode_retries, "max_episode_retries")
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
        self._worker_of: Dict[int, str] = {}  # running ticket -> the rollout worker running it
        self._accepted: Dict[Tuple[int, int], Ticket] = {}  # accepted slots (set_version drops trained batches)
        self._failures: Dict[int, int] = {}  # prompt-stream position -> retryable failures of its episode
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
        if b > self.version + self.max_head_offpolicyness:
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
        self._worker_of[t.id] = str(worker)
        self._counts["issued"] += 1
        self._write({"event": "issue", "ticket": t.id, "batch": b, "slot": j, "head": t.head, "prompt": t.prompt,
                     "cursor": cursor, "version": t.version, "worker": str(worker)})
        return t, "ok"

    def finish(self, ticket_id: int, status: str, stats: Optional[Dict[str, Any]] = None) -> Ticket:
        """End a running ticket: ``accepted`` fills its slot; ``rejected`` consumes its prompt and returns the slot
        (re-issued with the next prompt of the stream); ``failed`` returns slot and prompt. ``stats`` (plain JSON,
        e.g. reward or token counts) go into the log line. A ``failed`` finish with ``"retryable": true`` counts
        against the prompt (see the module docstring): EpisodeRetriesExhausted, after the finish is recorded, when
        the prompt has failed more than ``max_episode_retries`` times."""
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
        self._worker_of.pop(t.id, None)
        self._apply_finish(t, status)
        self._write({"event": "finish", "ticket": t.id, "status": status, **stats})
        if status != "failed":
            self._failures.pop(t.cursor, None)
        elif stats.get("retryable") is True:
            self._count_failure(t, stats)
        return t

    def failures(self, t: Ticket) -> int:
        """How often the episode of ``t``'s prompt failed retryably so far (in this process: a restart starts
        afresh)."""
        return self._failures.get(t.cursor, 0)

    def _count_failure(self, t: Ticket, stats: Dict[str, Any]) -> None:
        n = self._failures[t.cursor] = self._failures.get(t.cursor, 0) + 1
        if self.max_retries is not None and n > self.max_retries:
            raise EpisodeRetriesExhausted(t, f"the episode of {describe_prompt(t, stats)} failed {n} times "
                                             f"(async_rl.max_episode_retries={self.max_retries} retries are allowed); "
                                             f"the last time: {stats.get('error') or 'no cause reported'}")

    def release(self, worker: str, reason: str) -> List[Ticket]:
        """A rollout worker is gone: every ticket it was running fails (slot and prompt come back, re-issued to the
        others). A trajectory it pushed before dying is not trained twice: a trainer head keeps the first of a slot."""
        tickets = [self._running[tid] for tid, w in list(self._worker_of.items()) if w == worker]
        for t in tickets:
            self.finish(t.id, "failed", {"error": f"{worker} lost: {reason}"[:500]})
        return tickets

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
        self._worker_of = {}
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
