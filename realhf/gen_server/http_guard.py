"""Bounds on what a peer can make a realhf HTTP service hold, whoever it is: complete request headers within a time
limit and a size, a signed body within a time limit, and a cap on open connections where room is made by closing
idle ones (:class:`ConnectionGuard`). ``realhf.gen_server.auth.serve_app`` serves every signed service (generation
servers, the rollout manager) through it."""
from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import math
import resource
from typing import Any, Dict, Optional

from realhf.base import logging
from realhf.base.wire import RejectionLog

logger = logging.getLogger(__name__)

# file descriptors left to the rest of the process (model files, ZMQ sockets, logs) below the connection cap
_FD_RESERVE = 256


@dataclasses.dataclass(frozen=True)
class HttpLimits:
    """Bounds on what one peer can make a realhf HTTP service hold (see ``serve_app``)."""

    header_timeout: float = dataclasses.field(default=20.0, metadata={"help": (
        "seconds a connection may take, from opening or from its previous answer, to deliver the complete headers "
        "of its next request; it is closed otherwise. Also how long an idle keep-alive connection is kept: above "
        "the 15 s for which aiohttp clients keep idle connections, so none is closed while a client reuses it")})
    body_timeout: float = dataclasses.field(default=60.0, metadata={"help": (
        "seconds the body of an authenticated request may take to arrive; answered 408 and closed otherwise")})
    max_connections: int = dataclasses.field(default=4096, metadata={"help": (
        "connections open at once; beyond it an idle one is closed to make room, or the new one if none is idle. "
        "The open-file limit is raised to fit it where the hard limit allows; it is lowered otherwise")})
    max_header_bytes: int = dataclasses.field(default=16 << 10, metadata={"help": (
        "bytes of request line and headers one request may send; the connection is closed beyond it")})

    def __post_init__(self):
        for key in ("header_timeout", "body_timeout"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"{key}={v!r}: must be a finite number of seconds > 0")
        for key in ("max_connections", "max_header_bytes"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{key}={v!r}: must be an integer >= 1")


# the limits of the service a request arrived at, set by its ConnectionGuard's middleware for the request's task
REQUEST_LIMITS: contextvars.ContextVar[HttpLimits] = contextvars.ContextVar("realhf_http_limits")


class _Conn:
    __slots__ = ("transport", "peer", "busy", "served", "timer", "head_bytes", "tail")

    def __init__(self, transport, peer: str):
        self.transport, self.peer = transport, peer
        self.busy = 0  # requests of this connection inside the application now
        self.served = 0  # requests of this connection that reached the application
        self.timer: Optional[asyncio.TimerHandle] = None
        self.head_bytes: Optional[int] = 0  # bytes of the next request's head so far; None once it is complete
        self.tail = b""  # the last bytes of it (a blank line may straddle two reads)


class ConnectionGuard:
    """Admission, header deadlines and header sizes for the connections of one HTTP service.

    A connection is *idle* while none of its requests is inside the application: it is opening, sending headers,
    or waiting between requests. An idle connection must complete the headers of a request within
    ``header_timeout`` (aiohttp itself keeps a half-sent request line open for an hour) and in at most
    ``max_header_bytes``, or it is closed.

    At ``max_connections`` open, a new connection makes room by closing an idle one: one that never brought a
    request to the application if there is any, else one that did; of those, one of the peer address holding the
    most connections, its oldest. So strangers who open connections and never finish them cannot lock a signed
    client out: each arrival pushes the oldest unfinished one out, and a request whose headers are complete is
    never interrupted. Only when every connection has a request inside the application is a new one refused
    (closed at once). Per-peer caps alone would not do: on one machine the strangers and the signed clients share
    the loopback address; the per-peer order still shields clients on other machines from a flooding host."""

    def __init__(self, limits: HttpLimits, what: str):
        self.limits = limits
        self.log = RejectionLog(f"{what} (connections)")
        self._conns: Dict[Any, _Conn] = {}  # aiohttp protocol -> its connection
        self._per_peer: Dict[str, int] = {}  # peer address -> connections open
        # idle connections, [never brought a request, brought one]: peer address -> {protocol: None}, oldest first
        self._idle: tuple = ({}, {})
        self.timed_out = self.evicted = self.refused = 0

    def __len__(self) -> int:
        return len(self._conns)

    def wrap(self, inner) -> asyncio.Protocol:
        return _GuardedProtocol(self, inner)

    def admit(self, inner, transport) -> bool:
        if len(self._conns) >= self.limits.max_connections:
            victim = self._victim()
            if victim is None:
                self.refused += 1
                self.log.reject(_peer(transport), f"{len(self._conns)} connections open, all busy: new one refused")
                return False
            self.evicted += 1
            self._close(victim, f"closed an idle connection to make room ({len(self._conns)} open)")
        conn = self._conns[inner] = _Conn(transport, _peer(transport))
        self._per_peer[conn.peer] = self._per_peer.get(conn.peer, 0) + 1
        self._go_idle(inner, conn)
        return True

    def forget(self, inner) -> None:
        conn = self._conns.pop(inner, None)
        if conn is None:
            return
        if conn.timer is not None:
            conn.timer.cancel()
        if not conn.busy:
            self._leave_idle(inner, conn)
        left = self._per_peer[conn.peer] - 1
        if left:
            self._per_peer[conn.peer] = left
        else:
            del self._per_peer[conn.peer]

    def received(self, inner, data: bytes) -> bool:
        """Account ``data`` arriving on an idle connection to its request head (line and headers, up to the blank
        line); False, the connection closed, when the head grows past ``max_header_bytes``."""
        conn = self._conns.get(inner)
        if conn is None or conn.busy or conn.head_bytes is None:
            return True
        limit = self.limits.max_header_bytes
        seen = conn.tail + data[:limit + 4]
        if b"\r\n\r\n" in seen:
            conn.head_bytes = None  # complete: what follows is its body
            return True
        conn.head_bytes += len(data)
        conn.tail = seen[-3:]
        if conn.head_bytes > limit:
            self._close(inner, f"request headers over {limit} bytes")
            return False
        return True

    def request_started(self, inner) -> None:
        conn = self._conns.get(inner)
        if conn is None:
            return
        if not conn.busy:
            self._leave_idle(inner, conn)
            if conn.timer is not None:
                conn.timer.cancel()
                conn.timer = None
        conn.busy += 1
        conn.served += 1
        conn.head_bytes = None

    def request_ended(self, inner) -> None:
        conn = self._conns.get(inner)
        if conn is None:
            return
        conn.busy -= 1
        if not conn.busy:
            conn.head_bytes, conn.tail = 0, b""
            self._go_idle(inner, conn)

    def _go_idle(self, inner, conn: _Conn) -> None:
        self._idle[conn.served > 0].setdefault(conn.peer, {})[inner] = None
        conn.timer = asyncio.get_running_loop().call_later(self.limits.header_timeout, self._expire, inner)

    def _leave_idle(self, inner, conn: _Conn) -> None:
        peers = self._idle[conn.served > 0]
        group = peers.get(conn.peer)
        if group is not None:
            group.pop(inner, None)
            if not group:
                del peers[conn.peer]

    def _expire(self, inner) -> None:
        conn = self._conns.get(inner)
        if conn is not None and not conn.busy:
            self.timed_out += 1
            self._close(inner, f"no complete request headers within {self.limits.header_timeout:g} s")

    def _victim(self):
        for peers in self._idle:
            if peers:
                peer = max(peers, key=self._per_peer.__getitem__)
                return next(iter(peers[peer]))
        return None

    def _close(self, inner, why: str) -> None:
        transport, peer = self._conns[inner].transport, self._conns[inner].peer
        self.forget(inner)
        self.log.reject(peer, why)
        transport.abort()

    def middleware(self):
        """An aiohttp middleware that marks a connection busy while its request is inside the application, and
        gives the request's task the service's limits (``signed_route`` reads ``body_timeout`` there)."""
        from aiohttp import web

        @web.middleware
        async def track_busy(request, handler):
            inner = request.protocol
            self.request_started(inner)
            REQUEST_LIMITS.set(self.limits)
            try:
                return await handler(request)
            finally:
                self.request_ended(inner)

        return track_busy


def _peer(transport) -> str:
    peer = transport.get_extra_info("peername")
    return str(peer[0]) if isinstance(peer, (tuple, list)) and peer else "?"


class _GuardedProtocol(asyncio.Protocol):
    """aiohttp's protocol for one connection, behind ``ConnectionGuard.admit`` (a refused connection never
    reaches aiohttp)."""

    def __init__(self, guard: ConnectionGuard, inner):
        self._guard, self._inner, self._admitted = guard, inner, False

    def connection_made(self, transport):
        if not self._guard.admit(self._inner, transport):
            transport.abort()
            return
        self._admitted = True
        self._inner.connection_made(transport)

    def connection_lost(self, exc):
        if self._admitted:
            self._guard.forget(self._inner)
            self._inner.connection_lost(exc)

    def data_received(self, data):
        if self._guard.received(self._inner, data):
            self._inner.data_received(data)

    def eof_received(self):
        return self._inner.eof_received()

    def pause_writing(self):
        self._inner.pause_writing()

    def resume_writing(self):
        self._inner.resume_writing()


def connection_cap(wanted: int, what: str) -> int:
    """``wanted``, after raising the open-file limit to fit it (as far as the hard limit allows); else the most
    connections the limit leaves room for."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = wanted + _FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(hard, need)
        if target > soft:
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
                logger.info("%s: open-file limit raised from %d to %d for %d connections", what, soft, target, wanted)
                soft = target
            except (ValueError, OSError) as e:
                logger.warning("%s: cannot raise the open-file limit from %d to %d: %s", what, soft, target, e)
    if soft == resource.RLIM_INFINITY or wanted <= soft - _FD_RESERVE:
        return wanted
    cap = max(8, soft - _FD_RESERVE)
    logger.warning("%s: max_connections=%d lowered to %d: the open-file limit is %d (hard %d; raise it with "
                   "`ulimit -n`)", what, wanted, cap, soft, hard)
    return cap
