"""Heartbeats: how the master learns within seconds that a model worker died.

Each worker runs a :class:`HeartbeatSender` (a daemon thread with its own PUSH socket) that sends a
signed ``{"worker", "time", "pid", "status", "failure"}`` every ``interval`` seconds to the master's
:class:`HeartbeatMonitor` (a PULL socket read by its own thread). Messages use the same framing and
HMAC signing as the request/reply stream; forged, tampered or replayed heartbeats are dropped and
counted. The monitor records when (on its own monotonic clock) it last heard from each worker;
``MasterClient.gather`` asks it which of the workers owing replies went silent.

Work a worker runs in the background (e.g. publishing weights behind training) has no request whose reply could
carry its error: ``HeartbeatSender.report_failure`` puts the error into every later heartbeat, and the monitor
counts a worker that reported one as dead (:meth:`HeartbeatMonitor.dead_workers`), so the master's next gather
stops the run with it within a heartbeat, whichever worker it waits for.

The other direction uses the same parts: the master sends its own heartbeats to a monitor in every
worker, and :func:`exit_when_silent` ends a worker whose master went silent (stopped with SIGSTOP, hung,
or gone) with exit code ``MASTER_LOST_EXIT``, which the launchers report as a lost master.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Dict, List, Optional

import zmq

from realhf.base import logging
from realhf.base.process import MASTER_LOST_EXIT
from realhf.base.run_secret import _check_secret
from realhf.base.wire import (MAX_HEARTBEAT_BYTES, RejectedMessage, RejectionLog, _peer_address, sign_frames,
                              verify_frames)
from realhf.system.transport.request_reply_stream import bind_socket

logger = logging.getLogger(__name__)


MAX_FAILURE_CHARS = 4000  # of a reported failure: well within MAX_HEARTBEAT_BYTES


def _encode_beat(secret: bytes, worker: str, pid: int, status: Optional[str], failure: Optional[str] = None) -> list:
    body = {"worker": worker, "time": time.time(), "pid": pid, "status": status, "failure": failure}
    return sign_frames(secret, [json.dumps(body, separators=(",", ":")).encode("utf-8")])


def _decode_beat(secret: bytes, frames) -> dict:
    body = verify_frames(secret, frames)
    if len(body) != 1:
        raise RejectedMessage(f"a heartbeat has exactly one body frame, got {len(body)}")
    try:
        beat = json.loads(bytes(body[0]).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise RejectedMessage(f"heartbeat is not UTF-8 JSON: {e}") from None
    if not isinstance(beat, dict) or set(beat) != {"worker", "time", "pid", "status", "failure"}:
        raise RejectedMessage("heartbeat must be an object with keys worker, time, pid, status, failure")
    if (not isinstance(beat["worker"], str) or not isinstance(beat["time"], (int, float))
            or isinstance(beat["pid"], bool) or not isinstance(beat["pid"], int)
            or not all(beat[k] is None or isinstance(beat[k], str) for k in ("status", "failure"))):
        raise RejectedMessage("heartbeat fields have the wrong types")
    return beat


class HeartbeatMonitor:
    """Master side: binds a PULL socket and records when each worker was last heard from."""

    def __init__(self, secret: bytes, host: str = "127.0.0.1", port: Optional[int] = None,
                 name_resolve=None, key: Optional[str] = None):
        self._secret = _check_secret(secret)
        self._rejections = RejectionLog("heartbeat monitor")
        self._lock = threading.Lock()
        # worker -> {"mono": receipt time (monotonic), "wall": receipt time (time.time()), "sent": sender time, "pid",
        # "status", "failure"}
        self._seen: Dict[str, dict] = {}
        self._created = time.monotonic()
        self._stop = threading.Event()
        self._sock, self.address = bind_socket(zmq.PULL, host, port, "HeartbeatMonitor", name_resolve, key,
                                                max_frame_bytes=MAX_HEARTBEAT_BYTES)
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
                                              "pid": beat["pid"], "status": beat["status"],
                                              "failure": beat["failure"]}
        except RejectedMessage as e:
            self._rejections.reject(_peer_address(frames[0]) if frames else "?", e)

    @property
    def n_rejected(self) -> int:
        return self._rejections.count

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

    def silent_for(self, worker: str) -> Optional[float]:
        """Seconds since the last heartbeat of ``worker``, or None if never heard from."""
        with self._lock:
            rec = self._seen.get(worker)
            return None if rec is None else time.monotonic() - rec["mono"]

    def pid(self, worker: str) -> Optional[int]:
        with self._lock:
            rec = self._seen.get(worker)
            return None if rec is None else rec["pid"]

    def failure(self, worker: str) -> Optional[str]:
        """The failure ``worker`` reported (:meth:`HeartbeatSender.report_failure`), or None."""
        with self._lock:
            rec = self._seen.get(worker)
            return None if rec is None else rec["failure"]

    def dead_workers(self, expected: List[str], timeout_s: float) -> List[str]:
        """Every worker that reported a failure (of any worker: background work of one that failed ends the run,
        whichever the caller waits for), then the workers of ``expected`` not heard from for ``timeout_s`` seconds
        (a worker never heard from counts from the monitor's creation), in the given order."""
        now = time.monotonic()
        with self._lock:
            failed = sorted(w for w, rec in self._seen.items() if rec["failure"] is not None)
            return failed + [w for w in expected if w not in failed
                             and now - (self._seen[w]["mono"] if w in self._seen else self._created) > timeout_s]

    def describe(self, worker: str, timeout_s: float) -> str:
        """Why ``worker`` counts as dead, for error messages."""
        with self._lock:
            rec = self._seen.get(worker)
            if rec is not None and rec["failure"] is not None:
                return f"it reported a failure of its background work: {rec['failure']}"
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
    """A daemon thread that sends a signed heartbeat every ``interval`` seconds to one address (a worker to the
    master) or to several (the master to every worker).

    ``set_status`` changes the status string carried by the heartbeats and sends one at once;
    ``report_failure`` makes every later heartbeat carry a failure of the worker's background work (the first one
    reported is kept), which the master's monitor counts as the worker's death.
    """

    def __init__(self, worker_name: str, secret: bytes, address, interval: float = 1.0):
        if interval <= 0:
            raise ValueError(f"heartbeat interval must be > 0, got {interval}")
        self.worker_name = worker_name
        self._secret = _check_secret(secret)
        self.addresses = [address] if isinstance(address, str) else list(address)
        self.interval = interval
        self._status: Optional[str] = None
        self._failure: Optional[str] = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def set_status(self, status: Optional[str]) -> None:
        self._status = status
        self._wake.set()

    def report_failure(self, message: str) -> None:
        """Background work of this worker failed with ``message``: the run cannot go on (callable from any thread)."""
        if self._failure is None:
            text = str(message)
            self._failure = text if len(text) <= MAX_FAILURE_CHARS else text[:MAX_FAILURE_CHARS] + " [...]"
            logger.error("%s: %s; reporting it to the master", self.worker_name, self._failure)
        self._wake.set()

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError(f"heartbeat sender of {self.worker_name!r} already started")
        self._thread = threading.Thread(target=self._loop, name=f"realhf-heartbeat-{self.worker_name}", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        socks = []  # created and used only in this thread; one PUSH per address (a PUSH would round-robin)
        try:
            for address in self.addresses:
                sock = zmq.Context.instance().socket(zmq.PUSH)
                socks.append(sock)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDHWM, 4)  # stale heartbeats are worthless: never queue many
                sock.connect(address)
            pid = os.getpid()
            while not self._stop.is_set():
                frames = _encode_beat(self._secret, self.worker_name, pid, self._status, self._failure)
                for sock in socks:
                    try:
                        sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=True)
                    except zmq.Again:  # receiver unreachable for now; the next beat tries again
                        pass
                self._wake.wait(self.interval)
                self._wake.clear()
        except zmq.ZMQError as e:
            logger.error("heartbeat sender of %r stopped: %s", self.worker_name, e)
        finally:
            for sock in socks:
                sock.close(linger=0)

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval + 5)


def exit_when_silent(monitor: HeartbeatMonitor, peer: str, timeout_s: float, first_timeout_s: float,
                     what: str, exit_code: int = MASTER_LOST_EXIT, poll: float = 0.5) -> threading.Event:
    """Start a daemon thread that ends this process (``os._exit(exit_code)``, also in the middle of a computation)
    when ``peer`` was heard from and then stayed silent for ``timeout_s`` seconds, or was not heard from at all
    within ``first_timeout_s`` seconds; it logs why first. ``what`` names this process in the message. Setting the
    returned event disarms it (e.g. when the process is ending anyway)."""
    t0 = time.monotonic()
    disarm = threading.Event()

    def watch():
        while not disarm.wait(poll):
            silent = monitor.silent_for(peer)
            if silent is None and time.monotonic() - t0 > first_timeout_s:
                why = f"no heartbeat from the {peer} within {first_timeout_s:.0f} s"
            elif silent is not None and silent > timeout_s:
                why = (f"the {peer} (pid {monitor.pid(peer)}) sent no heartbeat for {silent:.1f} s (limit {timeout_s} s): "
                       "it is stopped, hung or gone")
            else:
                continue
            logger.error(f"{what}: {why}; ending this process (exit code {exit_code})")
            sys.stderr.flush()
            os._exit(exit_code)

    threading.Thread(target=watch, name=f"realhf-watch-{peer}", daemon=True).start()
    return disarm
