"""Authenticated request/reply between the master and the model workers over ZMQ.

Wire format (no pickle anywhere), one ZMQ multipart message per payload::

    [b"RHF1", signature, header_json, tensor_0_bytes, tensor_1_bytes, ...]

``signature`` is HMAC-SHA256 under the per-run secret over the number of following frames and
every following frame, each prefixed with its 8-byte length, so frames can be neither altered,
re-split, dropped nor appended. A receiver checks the magic and the signature (constant-time)
before it parses anything; a message that fails is dropped, counted in ``n_rejected`` and logged
as a warning naming the sender (rate-limited) — never deserialised. A worker also rejects requests that
are stale or replayed (``ReplayGuard``: send time within a window, request ids never executed twice), and
every receiving socket drops a peer sending a frame over ``MAX_FRAME_BYTES`` before buffering it.

The header is UTF-8 JSON ``{"handler", "handle_name", "request_id", "data", "tensors":
[{"dtype", "shape"}, ...], "error"}``; ``data`` must be plain JSON (checked on send). Tensors travel
as raw little-endian bytes of an allow-listed dtype, always to/from CPU.

Threading: a :class:`WorkerServer` is used from one thread (the worker's main loop). A
:class:`MasterClient` owns its sockets in one background I/O thread; ``send``/``gather``/``call``
may be used from any number of threads.
"""
from __future__ import annotations

import collections
import threading
import time
import traceback as _traceback
import uuid
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import zmq

from realhf.base import logging
from realhf.base.network import gethostip
from realhf.base.run_secret import _check_secret
# the wire format (realhf.base.wire); Payload and the errors are part of this stream's interface too
from realhf.base.wire import (  # noqa: F401
    MAX_FRAME_BYTES,
    Payload,
    RejectedMessage,
    RejectionLog,
    ReplayGuard,
    _peer_address,
    decode_payload,
    encode_payload,
)

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------- worker side
def _bind_address(host: str) -> Tuple[str, str]:
    """(host to bind, host to advertise)."""
    if host in ("*", "0.0.0.0", ""):
        return "*", gethostip()
    if ":" in host and not host.startswith("["):
        return f"[{host}]", f"[{host}]"
    return host, host


def bind_socket(kind: int, host: str, port: Optional[int], what: str, name_resolve=None, key: Optional[str] = None,
                max_frame_bytes: int = MAX_FRAME_BYTES):
    """A ZMQ socket of ``kind`` bound on ``host``:``port`` (a random port when None), LINGER 0, its address
    registered under ``key`` when given. A peer that sends a frame over ``max_frame_bytes`` is disconnected before
    the frame is buffered. Returns ``(socket, address)``; a failed bind names ``what``."""
    sock = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
    try:
        address = _bind(sock, host, port)
    except zmq.ZMQError as e:
        sock.close(linger=0)
        raise RuntimeError(f"{what}: cannot bind on host {host!r} port {port}: {e}") from e
    if name_resolve is not None and key is not None:
        name_resolve.add(key, address, replace=True)
    return sock, address


def _bind(sock: zmq.Socket, host: str, port: Optional[int]) -> str:
    bind_host, adv_host = _bind_address(host)
    if ":" in bind_host:
        sock.setsockopt(zmq.IPV6, 1)
    if port is None:
        port = sock.bind_to_random_port(f"tcp://{bind_host}")
    else:
        sock.bind(f"tcp://{bind_host}:{port}")
    return f"tcp://{adv_host}:{port}"


class WorkerServer:
    """The model worker's end: a ROUTER socket that receives requests and sends replies.

    Not thread-safe: call ``poll``/``reply`` from one thread (the worker's main loop).
    """

    def __init__(self, name: str, secret: bytes, host: str = "127.0.0.1", port: Optional[int] = None,
                 name_resolve=None, key: Optional[str] = None):
        self.name = name
        self._secret = _check_secret(secret)
        self._rejections = RejectionLog(f"worker {name!r}")
        self._replay = ReplayGuard()
        self._sock, self.address = bind_socket(zmq.ROUTER, host, port, f"worker {name!r} (ROUTER)", name_resolve, key)
        logger.debug("worker %r serving on %s", name, self.address)

    def poll(self, timeout: float) -> Optional[Tuple[bytes, Payload]]:
        """The next authentic request as ``(peer identity, payload)``, or None after ``timeout`` s."""
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            left = deadline - time.monotonic()
            if not self._sock.poll(max(0, int(left * 1000))):
                return None
            frames = self._sock.recv_multipart(copy=False)
            peer = frames[0].bytes
            try:
                payload = decode_payload(self._secret, frames[1:])
                self._replay.check(payload)
                return peer, payload
            except RejectedMessage as e:
                addr = _peer_address(frames[1]) if len(frames) > 1 else "?"
                self._rejections.reject(f"peer {peer!r} ({addr})", e)
            if time.monotonic() >= deadline:
                return None

    @property
    def n_rejected(self) -> int:
        return self._rejections.count

    def reply(self, peer: bytes, payload: Payload) -> None:
        """Sends ``payload`` to the peer a request came from."""
        self._sock.send_multipart([peer, *encode_payload(self._secret, payload)], copy=False)

    def handle(self, peer: bytes, request: Payload, fn: Callable[[Payload], Any]) -> bool:
        """Runs ``fn(request)`` and replies with its result — a Payload, a dict, or
        ``(dict, tensors)`` — or with the traceback when it raises. True when ``fn`` succeeded."""
        try:
            out = fn(request)
            if isinstance(out, Payload):
                reply = out
            elif isinstance(out, tuple):
                reply = request.make_reply(data=out[0], tensors=out[1])
            else:
                reply = request.make_reply(data={} if out is None else out)
            encoded = encode_payload(self._secret, reply)  # an unsendable result is an error too
        except Exception:  # the master gets the traceback; the worker keeps serving
            tb = _traceback.format_exc()
            logger.error("worker %r: request %r (%s) failed:\n%s", self.name, request.handle_name, request.request_id, tb)
            self.reply(peer, request.make_reply(error=tb))
            return False
        self._sock.send_multipart([peer, *encoded], copy=False)
        return True

    def close(self) -> None:
        if not self._sock.closed:
            self._sock.close(linger=0)


# ---------------------------------------------------------------------------------- master side
class WorkerError(RuntimeError):
    """A worker's handler raised; carries the worker's name and traceback."""

    def __init__(self, worker: str, traceback: str, handle_name: str = "?"):
        super().__init__(f"worker {worker!r} failed to handle {handle_name!r}:\n{traceback}")
        self.worker = worker
        self.traceback = traceback
        self.handle_name = handle_name


class WorkerLostError(RuntimeError):
    """A worker that owed a reply died or stopped sending heartbeats."""

    def __init__(self, worker: str, reason: str):
        super().__init__(f"worker {worker!r} lost: {reason}")
        self.worker = worker
        self.reason = reason


class MasterClient:
    """The master's end: one DEALER per worker, all owned by one background I/O thread.

    ``send`` encodes in the caller's thread and hands the frames to the I/O thread through a queue
    (woken by an inproc socket); the I/O thread receives replies, verifies them, and files them by
    request id under a condition variable that ``gather`` waits on. Any number of threads may
    ``send``/``gather``/``call`` concurrently.
    """

    def __init__(self, secret: bytes, addresses: Dict[str, str], heartbeat=None, lost_after: float = 10.0):
        self._secret = _check_secret(secret)
        self.addresses = dict(addresses)
        self._heartbeat = heartbeat
        self.lost_after = lost_after
        self._rejections = RejectionLog("master")
        self._ctx = zmq.Context.instance()
        self._send_lock = threading.Lock()
        self._cv = threading.Condition()
        self._owner: Dict[str, str] = {}  # request id -> worker, until the reply is gathered
        self._replies: Dict[str, Payload] = {}
        self._abandoned: set = set()
        self._dead: Dict[str, str] = {}  # worker -> reason, from mark_dead
        self._outbox: collections.deque = collections.deque()
        self._io_error: Optional[BaseException] = None
        self._stop = threading.Event()
        self._closed = False

        wake_addr = f"inproc://realhf-master-client-{uuid.uuid4().hex}"
        self._wake_pull = self._ctx.socket(zmq.PULL)
        self._wake_pull.setsockopt(zmq.LINGER, 0)
        self._wake_pull.bind(wake_addr)
        self._wake_push = self._ctx.socket(zmq.PUSH)
        self._wake_push.setsockopt(zmq.LINGER, 0)
        self._wake_push.connect(wake_addr)
        self._dealers: Dict[str, zmq.Socket] = {}
        try:
            for worker, addr in self.addresses.items():
                s = self._ctx.socket(zmq.DEALER)
                s.setsockopt(zmq.LINGER, 0)
                s.setsockopt(zmq.SNDHWM, 0)  # never drop; a dead worker is detected by heartbeats
                s.setsockopt(zmq.RCVHWM, 0)
                s.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
                self._dealers[worker] = s
                s.connect(addr)
        except zmq.ZMQError as e:
            self._close_sockets()
            self._wake_push.close(linger=0)
            raise RuntimeError(f"MasterClient: cannot connect to worker {worker!r} at {addr!r}: {e}") from e
        # sockets are handed to the I/O thread here; Thread.start is a memory barrier
        self._thread = threading.Thread(target=self._io_loop, name="realhf-master-client-io", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- I/O thread
    def _io_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_pull, zmq.POLLIN)
        by_socket = {}
        for worker, s in self._dealers.items():
            poller.register(s, zmq.POLLIN)
            by_socket[s] = worker
        backlog: Dict[str, collections.deque] = {w: collections.deque() for w in self._dealers}
        try:
            while not self._stop.is_set():
                waiting = any(backlog.values())
                events = dict(poller.poll(5 if waiting else 100))
                if self._wake_pull in events:
                    while True:
                        try:
                            self._wake_pull.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                while True:
                    try:
                        worker, frames = self._outbox.popleft()
                    except IndexError:
                        break
                    backlog[worker].append(frames)
                for worker, q in backlog.items():
                    while q:
                        try:
                            self._dealers[worker].send_multipart(q[0], flags=zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        q.popleft()
                for s, worker in by_socket.items():
                    if s not in events:
                        continue
                    while True:
                        try:
                            frames = s.recv_multipart(flags=zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self._on_reply(worker, frames)
        except Exception as e:  # surfaced to every gather; nothing else can make progress
            logger.exception("MasterClient I/O thread failed")
            with self._cv:
                self._io_error = e
                self._cv.notify_all()
        finally:
            self._close_sockets()

    def _on_reply(self, worker: str, frames) -> None:
        try:
            payload = decode_payload(self._secret, frames)
        except RejectedMessage as e:
            self._rejections.reject(f"the connection to worker {worker!r} ({_peer_address(frames[0]) if frames else '?'})", e)
            return
        rid = payload.request_id
        with self._cv:
            if rid in self._abandoned:
                self._abandoned.discard(rid)
                self._owner.pop(rid, None)
                logger.debug("dropping late reply %s from %r to an abandoned request", rid, worker)
                return
            owner = self._owner.get(rid)
            if owner != worker or rid in self._replies:
                logger.warning("master dropped a reply from worker %r to request %r that it does not owe (owner: %r)",
                               worker, rid, owner)
                return
            self._replies[rid] = payload
            self._cv.notify_all()

    def _close_sockets(self) -> None:
        for s in [self._wake_pull, *self._dealers.values()]:
            if not s.closed:
                s.close(linger=0)

    # ---------------------------------------------------------------- public API
    @property
    def n_rejected(self) -> int:
        return self._rejections.count

    def send(self, payloads: List[Payload]) -> None:
        """Sends the payloads in order; a list sent together keeps its relative order on every worker
        (other threads' lists go entirely before or after it)."""
        if self._closed:
            raise RuntimeError("MasterClient is closed")
        encoded = []
        for p in payloads:
            if p.handler not in self._dealers:
                raise ValueError(f"payload {p.handle_name!r} addressed to unknown worker {p.handler!r}; "
                                 f"known workers: {sorted(self._dealers)}")
            encoded.append((p.handler, p.request_id, encode_payload(self._secret, p)))
        ids = [rid for _, rid, _ in encoded]
        if len(set(ids)) != len(ids):
            raise ValueError("duplicate request_id in one send")
        with self._send_lock:
            with self._cv:
                for _, rid, _ in encoded:
                    if rid in self._owner:
                        raise ValueError(f"request_id {rid!r} is already in flight")
                for worker, rid, _ in encoded:
                    self._owner[rid] = worker
            self._outbox.extend((worker, frames) for worker, _, frames in encoded)
            try:
                self._wake_push.send(b"", zmq.NOBLOCK)
            except zmq.Again:  # the I/O thread has unread wake-ups already
                pass

    def mark_dead(self, worker: str, reason: str) -> None:
        """Tells the client a worker's process is known dead (e.g. by the scheduler); gathers that
        wait on it raise WorkerLostError at once."""
        with self._cv:
            self._dead[worker] = reason
            self._cv.notify_all()

    def _lost(self, workers: List[str]) -> Optional[WorkerLostError]:
        for w in workers:
            if w in self._dead:
                return WorkerLostError(w, self._dead[w])
        if self._heartbeat is not None and workers:
            dead = self._heartbeat.dead_workers(sorted(set(workers)), self.lost_after)
            if dead:
                w = dead[0]
                return WorkerLostError(w, self._heartbeat.describe(w, self.lost_after)
                                       if hasattr(self._heartbeat, "describe") else f"no heartbeat for {self.lost_after} s")
        return None

    def _abandon(self, request_ids: List[str]) -> None:
        for rid in request_ids:
            if self._replies.pop(rid, None) is not None:
                self._owner.pop(rid, None)
            elif rid in self._owner:
                self._abandoned.add(rid)

    def gather(self, request_ids: List[str], timeout: Optional[float] = None) -> Dict[str, Payload]:
        """Waits for the replies to ``request_ids`` and returns them by id.

        Raises WorkerError (a reply carries an error), WorkerLostError (a worker owing a reply is
        dead) — both abandon these ids, late replies are dropped — or TimeoutError naming the
        workers still owing replies (the ids stay gatherable).
        """
        ids = list(request_ids)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            unknown = [rid for rid in ids if rid not in self._owner]
            if unknown:
                raise KeyError(f"gather: request ids {unknown} were never sent (or were already gathered)")
            while True:
                if self._io_error is not None:
                    raise RuntimeError(f"MasterClient I/O thread failed: {self._io_error!r}") from self._io_error
                for rid in ids:
                    p = self._replies.get(rid)
                    if p is not None and p.error is not None:
                        worker = self._owner[rid]
                        self._abandon(ids)
                        raise WorkerError(worker, p.error, p.handle_name)
                owing = sorted({self._owner[rid] for rid in ids if rid not in self._replies})
                if not owing:
                    out = {rid: self._replies.pop(rid) for rid in ids}
                    for rid in ids:
                        self._owner.pop(rid, None)
                    return out
                lost = self._lost(owing)
                if lost is not None:
                    self._abandon(ids)
                    raise lost
                if self._closed:
                    raise RuntimeError("MasterClient was closed while gathering")
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError(f"gather: no reply within {timeout} s from workers {owing}")
                    self._cv.wait(min(0.2, left))
                else:
                    self._cv.wait(0.2)

    def call(self, handle_name: str, data_by_worker: Dict[str, dict],
             tensors_by_worker: Optional[Dict[str, List[torch.Tensor]]] = None,
             timeout: Optional[float] = None) -> Dict[str, Payload]:
        """Sends ``handle_name`` to every worker in ``data_by_worker`` and returns replies by worker."""
        tensors_by_worker = tensors_by_worker or {}
        extra = set(tensors_by_worker) - set(data_by_worker)
        if extra:
            raise ValueError(f"call({handle_name!r}): tensors for workers {sorted(extra)} that get no data")
        payloads = [Payload(handler=w, handle_name=handle_name, data=d, tensors=list(tensors_by_worker.get(w, [])))
                    for w, d in data_by_worker.items()]
        self.send(payloads)
        replies = self.gather([p.request_id for p in payloads], timeout=timeout)
        return {p.handler: replies[p.request_id] for p in payloads}

    def close(self) -> None:
        """Stops the I/O thread and closes every socket (LINGER 0: nothing blocks)."""
        if self._closed:
            return
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._stop.set()
        with self._send_lock:
            try:
                self._wake_push.send(b"", zmq.NOBLOCK)
            except zmq.Again:
                pass
            self._wake_push.close(linger=0)
        self._thread.join(timeout=5)
        if self._thread.is_alive():
            logger.warning("MasterClient I/O thread did not stop within 5 s")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
