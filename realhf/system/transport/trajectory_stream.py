"""The stream of finished trajectories of an asynchronous run: rollout workers push, trainer heads pull.

Every data-parallel head of the trainer binds one ZMQ PULL socket and registers it under
``names.trajectory_head(exp, trial, dp_rank)``; a rollout worker pushes each finished episode to the head its
ticket names (the rollout manager assigns slots to heads as a synchronous run splits a batch, see
``realhf.system.rollout.manager``). Messages use the run's wire format (``realhf.base.wire``): HMAC-signed
frames with a plain-JSON header and raw tensor frames, never pickle; a message that fails the signature, is
stale or replayed is dropped and counted.

:class:`TrajectoryStreamSource` stands where a synchronous run's ``EpochIterator`` stands on a trainer head:
``next_batch()`` returns the head's share of batch ``b`` (the trajectories of every slot of ``b`` assigned to
it, in slot order) once all of them have arrived, and keeps trajectories of later batches (they come early
when ``max_head_offpolicyness > 0``) for their own step. Its position (the next batch) is part of the worker's
recover checkpoint, like the dataset position of a synchronous run.
"""
from __future__ import annotations

import asyncio
import time
from typing import Dict, List, Optional, Tuple

import zmq

from realhf.api.core.data_api import SequenceSample
from realhf.base import logging
from realhf.base.name_resolve import names
from realhf.base.wire import (Payload, RejectedMessage, RejectionLog, ReplayGuard, decode_payload,
                                encode_payload)

logger = logging.getLogger(__name__)

HANDLE = "trajectory"


def sample_id(batch: int, slot: int) -> str:
    """The buffer id of the trajectory of ``slot`` in ``batch`` (unique within a run's in-flight samples)."""
    return f"b{int(batch)}s{int(slot)}"


def head_slots(batch_size: int, dp_size: int, dp_rank: int) -> List[int]:
    """The slots of a batch that head ``dp_rank`` trains: a contiguous slice, lower ranks get the extras (as
    ``EpochIterator.rank_share`` splits a synchronous batch)."""
    base, extra = divmod(batch_size, dp_size)
    start = dp_rank * base + min(dp_rank, extra)
    return list(range(start, start + base + (1 if dp_rank < extra else 0)))


class TrajectoryPusher:
    """A rollout worker's end: one PUSH socket per trainer head, connected on first use."""

    def __init__(self, secret: bytes, nr, experiment: str, trial: str, timeout: float = 300.0):
        self.secret, self.nr, self.exp, self.trial, self.timeout = secret, nr, experiment, trial, timeout
        self.socks: Dict[int, zmq.Socket] = {}

    def _sock(self, head: int) -> zmq.Socket:
        if head not in self.socks:
            addr = self.nr.wait(names.trajectory_head(self.exp, self.trial, head), timeout=self.timeout)
            s = zmq.Context.instance().socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, 5000)  # a trajectory pushed just before exit still leaves
            s.copy_threshold = 0  # every send zero-copy, so that its tracker says when libzmq let go of it
            s.connect(addr)
            self.socks[head] = s
        return self.socks[head]

    def push(self, head: int, sample: SequenceSample, info: dict) -> "zmq.MessageTracker":
        """Send one trajectory (``sample``: one id, the group's sequences) with ``info`` (plain JSON: batch,
        slot, ticket, ...) to trainer head ``head``. Returns the send's tracker (see :meth:`wait_sent`)."""
        header, tensors = sample.to_wire()
        frames = encode_payload(self.secret, Payload(handler=f"head_{head}", handle_name=HANDLE,
                                                     data={"info": info, "sample": header}, tensors=tensors))
        return self._sock(head).send_multipart(frames, copy=False, track=True)

    async def wait_sent(self, tracker: "zmq.MessageTracker", timeout: Optional[float] = None) -> None:
        """Wait until libzmq has written the pushed trajectory to its connection (the kernel delivers it even if
        this process is killed right after), so that a trajectory reported ``accepted`` is never one that died
        in this process's send queue. TimeoutError after ``timeout`` (default: the pusher's) seconds."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while not tracker.done:
            if time.monotonic() > deadline:
                raise TimeoutError("a pushed trajectory was not sent to its trainer head in time; is the trainer up?")
            await asyncio.sleep(0.001)

    def close(self):
        for s in self.socks.values():
            s.close()
        self.socks = {}


class TrajectoryStreamSource:
    """A trainer head's source of batches in an asynchronous run (the ``EpochIterator`` interface the model worker
    uses: ``steps_per_epoch``, ``epoch``, ``position``, ``next_batch``, ``state_dict``/``load_state_dict``)."""

    def __init__(self, secret: bytes, nr, experiment: str, trial: str, dp_rank: int, dp_size: int, batch_size: int,
                 steps_per_epoch: int, n_prompts: int, host: str, device=None):
        from realhf.system.transport.request_reply_stream import bind_socket

        self.secret, self.dp_rank = secret, dp_rank
        self.slots = head_slots(batch_size, dp_size, dp_rank)
        self._steps_per_epoch, self.n_prompts = steps_per_epoch, n_prompts
        self.device = device
        self.batch = 0  # the next batch to return
        self.pending: Dict[int, Dict[int, Tuple[SequenceSample, dict]]] = {}  # batch -> slot -> (sample, info)
        self.guard = ReplayGuard()
        self.rejections = RejectionLog(f"trajectory head {dp_rank}")
        self.sock, self.address = bind_socket(zmq.PULL, host, None, f"trajectory head {dp_rank}", name_resolve=nr,
                                              key=names.trajectory_head(experiment, trial, dp_rank))
        self.last_stats: Dict[str, float] = {}
        self.received = 0

    # EpochIterator's interface
    @property
    def steps_per_epoch(self) -> int:
        return self._steps_per_epoch

    @property
    def epoch(self) -> int:
        return self.batch // self._steps_per_epoch

    @property
    def position(self) -> int:
        return self.batch % self._steps_per_epoch

    def __len__(self) -> int:
        return self._steps_per_epoch

    def state_dict(self) -> dict:
        return {"batch": self.batch}

    def load_state_dict(self, st: dict) -> None:
        self.batch = int(st["batch"])

    # receiving
    def _receive(self, timeout_ms: int) -> bool:
        if not self.sock.poll(timeout_ms):
            return False
        frames = self.sock.recv_multipart(copy=False)
        try:
            p = decode_payload(self.secret, frames)
            self.guard.check(p)
            if p.handle_name != HANDLE:
                raise RejectedMessage(f"unexpected message {p.handle_name!r} on the trajectory stream")
            info = p.data.get("info")
            if not isinstance(info, dict) or not all(isinstance(info.get(k), int) for k in ("batch", "slot")):
                raise RejectedMessage("trajectory info lacks integer 'batch' and 'slot'")
            sample = SequenceSample.from_wire(p.data["sample"], p.tensors)
        except (RejectedMessage, ValueError, KeyError, TypeError) as e:
            self.rejections.reject("rollout worker", e)
            return True
        b, slot = info["batch"], info["slot"]
        if slot not in self.slots:
            logger.warning("trajectory head %d: got slot %d of batch %d, which belongs to another head; dropped",
                           self.dp_rank, slot, b)
        elif b < self.batch:
            logger.warning("trajectory head %d: got slot %d of batch %d, already trained (now at batch %d); dropped",
                           self.dp_rank, slot, b, self.batch)
        elif slot in self.pending.get(b, {}):
            logger.warning("trajectory head %d: slot %d of batch %d arrived twice; the second is dropped",
                           self.dp_rank, slot, b)
        else:
            self.pending.setdefault(b, {})[slot] = (sample, info)
            self.received += 1
        return True

    def poll(self, timeout: float = 0.0) -> None:
        """Take every trajectory that has arrived (waiting up to ``timeout`` seconds for the first)."""
        got = self._receive(int(timeout * 1000))
        while got:
            got = self._receive(0)

    def ready(self) -> bool:
        return len(self.pending.get(self.batch, {})) == len(self.slots)

    def next_batch(self, timeout: Optional[float] = None) -> SequenceSample:
        """This head's share of the next batch, once every trajectory of it has arrived; TimeoutError after
        ``timeout`` seconds (None: wait as long as it takes; the master's heartbeats keep running meanwhile)."""
        t0 = time.monotonic()
        while not self.ready():
            if timeout is not None and time.monotonic() - t0 > timeout:
                have = sorted(self.pending.get(self.batch, {}))
                raise TimeoutError(f"trajectory head {self.dp_rank}: batch {self.batch} incomplete after {timeout:.0f} s "
                                   f"(slots {have} of {self.slots} arrived)")
            self.poll(0.5)
        got = self.pending.pop(self.batch)
        parts = []
        for slot in self.slots:
            sample, _ = got[slot]
            sample.ids = [sample_id(self.batch, slot)]
            parts.append(sample)
        batch = SequenceSample.gather(parts)
        if self.device is not None:
            batch.data = {k: v.to(self.device) for k, v in batch.data.items()}
        waiting = sum(len(v) for v in self.pending.values())
        self.last_stats = {"async/trainer_wait_time": time.monotonic() - t0, "async/head_queue": float(waiting)}
        self.batch += 1
        return batch

    def close(self):
        self.sock.close(linger=0)
