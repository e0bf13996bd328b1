"""Heartbeats: how the master learns within seconds that a model worker died.

Each worker runs a :class:`HeartbeatSender` (a daemon thread with its own PUSH socket) that sends a
signed ``{"worker", "time", "pid", "status"}`` every ``interval`` seconds to the master's
:class:`HeartbeatMonitor` (a PULL socket read by its own thread). Messages use the same framing and
HMAC signing as the request/reply stream; forged, tampered or replayed heartbeats are dropped and
counted. The monitor records when (on its own monotonic clock) it last heard from each worker;
``MasterClient.gather`` asks it which of the workers owing replies went silent.
"""
from __future__ import annotations

import json
import os
import threading
import time
from typing import Dict, List, Optional

import zmq

from realhf.base import logging
from realhf.system.request_reply_stream import (
    RejectedMessage,
    bind_socket,
    _check_secret,
    _peer_address,
    sign_frames,
    verify_frames,
)

logger = logging.getLogger(__name__)


def _encode_beat(secret: bytes, worker: str, pid: int, status: Optional[str]) -> list:
    body = {"worker": worker, "time": time.time(), "pid": pid, "status": status}
    return sign_frames(secret, [json.dumps(body, separators=(",", ":")).encode("utf-8")])


def _decode_beat(secret: bytes, frames) -> dict:
    body = verify_frames(secret, frames)
    if len(body) != 1:
        raise RejectedMessage(f"a heartbeat has exactly one body frame, got {len(body)}")
    try:
        beat = json.loads(bytes(body[0]).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise RejectedMessage(f"heartbeat is not UTF-8 JSON: {e}") from None
    if not isinstance(beat, dict) or set(beat) != {"worker", "time", "pid", "status"}:
        raise RejectedMessage("heartbeat must be an object with keys worker, time, pid, status")
    if (not isinstance(beat["worker"], str) or not isinstance(beat["time"], (int, float))
            or isinstance(beat["pid"], bool) or not isinstance(beat["pid"], int)
            or not (beat["status"] is None or isinstance(beat["status"], str))):
        raise RejectedMessage("heartbeat fields have the wrong types")
    return beat


class HeartbeatMonitor:
    """Master side: binds a PULL socket and records when each worker was last heard from."""

    def __init__(self, secret: bytes, host: str = "127.0.0.1", port: Optional[int] = None,
                 name_resolve=None, key: Optional[str] = None):
        self._secret = _check_secret(secret)
        self.n_rejected = 0
        self._lock = threading.Lock()
        # worker -> {"mono": receipt time (monotonic), "wall": receipt time (time.time()), "sent": sender time, "pid", "status"}
        self._seen: Dict[str, dict] = {}
        self._created = time.monotonic()
        self._stop = threading.Event()
        self._sock, self.address = bind_socket(zmq.PULL, host, port, "HeartbeatMonitor", name_resolve, key)
        self._thread = threading.Thread(target=self._loop, name="realhf-heartbeat-monitor", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                if not self._sock.poll(100):
                    continue
                while True:
                    try:
                        frames = self._sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._on_beat(frames)
        except zmq.ZMQError as e:
            if not self._stop.is_set():
                logger.error("heartbeat monitor stopped: %s", e)
        finally:
            self._sock.close(linger=0)

    def _on_beat(self, frames) -> None:
        try:
            beat = _decode_beat(self._secret, frames)
            with self._lock:
                prev = self._seen.get(beat["worker"])
                if prev is not None and prev["pid"] == beat["pid"] and beat["time"] <= prev["sent"]:
                    raise RejectedMessage(f"replayed heartbeat of worker {beat['worker']!r}")
                self._seen[beat["worker"]] = {"mono": time.monotonic(), "wall": time.time(), "sent": beat["time"],
                                              "pid": beat["pid"], "status": beat["status"]}
        except RejectedMessage as e:
            self.n_rejected += 1
            logger.warning("heartbeat monitor rejected a message from %s: %s [%d rejected so far]",
                           _peer_address(frames[0]) if frames else "?", e, self.n_rejected)

    def last_seen(self, worker: str) -> Optional[float]:
        """``time.time()`` when the last heartbeat of ``worker`` arrived, or None if never."""
        with self._lock:
            rec = self._seen.get(worker)
            return None if rec is None else rec["wall"]

    def status(self, worker: str) -> Optional[str]:
        """The status string of the last heartbeat of ``worker`` (e.g. the request being run)."""
        with self._lock:
            rec = self._seen.get(worker)
            return None if rec is None else rec["status"]

    def pid(self, worker: str) -> Optional[int]:
        with self._lock:
            rec = self._seen.get(worker)
            return None if rec is None else rec["pid"]

    def dead_workers(self, expected: List[str], timeout_s: float) -> List[str]:
        """The workers of ``expected`` not heard from for ``timeout_s`` seconds (a worker never heard
        from counts from the monitor's creation), in the given order."""
        now = time.monotonic()
        with self._lock:
            return [w for w in expected
                    if now - (self._seen[w]["mono"] if w in self._seen else self._created) > timeout_s]

    def describe(self, worker: str, timeout_s: float) -> str:
        """Why ``worker`` counts as dead, for error messages."""
        with self._lock:
            rec = self._seen.get(worker)
            if rec is None:
                return f"no heartbeat received since the monitor started {time.monotonic() - self._created:.1f} s ago"
            return (f"no heartbeat for {time.monotonic() - rec['mono']:.1f} s (limit {timeout_s} s); "
                    f"last status {rec['status']!r}, pid {rec['pid']}")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class HeartbeatSender:
    """Worker side: a daemon thread that sends a signed heartbeat every ``interval`` seconds.

    ``set_status`` changes the status string carried by the heartbeats and sends one at once.
    """

    def __init__(self, worker_name: str, secret: bytes, address: str, interval: float = 1.0):
        if interval <= 0:
            raise ValueError(f"heartbeat interval must be > 0, got {interval}")
        self.worker_name = worker_name
        self._secret = _check_secret(secret)
        self.address = address
        self.interval = interval
        self._status: Optional[str] = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def set_status(self, status: Optional[str]) -> None:
        self._status = status
        self._wake.set()

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError(f"heartbeat sender of {self.worker_name!r} already started")
        self._thread = threading.Thread(target=self._loop, name=f"realhf-heartbeat-{self.worker_name}", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        sock = zmq.Context.instance().socket(zmq.PUSH)  # created and used only in this thread
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 4)  # stale heartbeats are worthless: never queue many
        try:
            sock.connect(self.address)
            pid = os.getpid()
            while not self._stop.is_set():
                try:
                    sock.send_multipart(_encode_beat(self._secret, self.worker_name, pid, self._status),
                                        flags=zmq.NOBLOCK, copy=False)
                except zmq.Again:  # monitor unreachable for now; the next beat tries again
                    pass
                self._wake.wait(self.interval)
                self._wake.clear()
        except zmq.ZMQError as e:
            logger.error("heartbeat sender of %r stopped: %s", self.worker_name, e)
        finally:
            sock.close(linger=0)

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval + 5)
