"""Signed HTTP requests between realhf processes and generation servers, and the serving of such services.

Every POST carries ``X-Realhf-Time`` (seconds since the epoch), ``X-Realhf-Nonce`` (unique per request),
``X-Realhf-Body-SHA256`` (the SHA-256 of the body) and ``X-Realhf-Signature``: HMAC-SHA256 under the run secret
(the same ``$REALHF_RUN_SECRET`` that signs the ZMQ stream) of the method, path, time, nonce and body digest.
Because the digest travels in a header, a request is authenticated from its headers alone, before a byte of
its body is read: a missing, malformed or wrong signature, a time that is not a finite number within the replay
window of the server's clock, or a nonce seen before is refused (401) and the connection closed without reading
the body. Only then is the body read (within a time limit and the application's ``client_max_size``) and
checked against the signed digest. A request captured on the network cannot be replayed or altered, and a
process without the secret can neither generate nor touch weights, pause or abort, nor make the server buffer
a body.

``serve_app`` serves such an application with bounds a stranger cannot push: a connection must deliver complete
request headers within ``header_timeout`` of opening (or of its previous answer), a signed body must arrive
within ``body_timeout``, and at most ``max_connections`` connections are open at once (see
:class:`realhf.gen_server.http_guard.ConnectionGuard` for who makes room for whom).
"""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import json
import math
import re
import secrets
import time
import traceback
from typing import Awaitable, Callable, Dict

from realhf.base import logging
from realhf.gen_server.http_guard import REQUEST_LIMITS, ConnectionGuard, HttpLimits, connection_cap
from realhf.base.wire import REPLAY_WINDOW_SECS, RejectedMessage, ReplayGuard

logger = logging.getLogger(__name__)

H_TIME, H_NONCE, H_SIG, H_BODY = "X-Realhf-Time", "X-Realhf-Nonce", "X-Realhf-Signature", "X-Realhf-Body-SHA256"
_HEX64 = re.compile(r"[0-9a-f]{64}")
_NONCE = re.compile(r"[0-9A-Za-z_-]{8,64}")
_MAX_TIME_CHARS = 32


def _mac(secret: bytes, method: str, path: str, ts: str, nonce: str, digest: str) -> str:
    msg = b"\n".join([method.upper().encode(), path.encode(), ts.encode(), nonce.encode(), digest.encode()])
    return hmac.new(secret, msg, hashlib.sha256).hexdigest()


def sign(secret: bytes, method: str, path: str, body: bytes) -> Dict[str, str]:
    """Headers that authenticate one request of ``body`` to ``path``."""
    ts, nonce, digest = f"{time.time():.6f}", secrets.token_hex(16), hashlib.sha256(body).hexdigest()
    return {H_TIME: ts, H_NONCE: nonce, H_BODY: digest, H_SIG: _mac(secret, method, path, ts, nonce, digest)}


class RequestVerifier:
    def __init__(self, secret: bytes, window_s: float = REPLAY_WINDOW_SECS):
        self.secret = secret
        self.guard = ReplayGuard(window_s)

    def verify_headers(self, method: str, path: str, headers) -> str:
        """Authenticate a request from its headers alone; returns the body digest its body must have. Raises
        RejectedMessage for missing or malformed signature headers, a time that is not a finite number within the
        replay window, a wrong signature or a nonce seen before (only authentic nonces are remembered)."""
        ts, nonce, sig, digest = (headers.get(h) for h in (H_TIME, H_NONCE, H_SIG, H_BODY))
        if not ts or not nonce or not sig or not digest:
            raise RejectedMessage(f"unsigned request (needs the {H_SIG}, {H_TIME}, {H_NONCE} and {H_BODY} headers)")
        if not _NONCE.fullmatch(nonce) or not _HEX64.fullmatch(sig) or not _HEX64.fullmatch(digest):
            raise RejectedMessage(f"malformed signature headers ({H_NONCE}: 8-64 letters, digits, '-' or '_'; "
                                  f"{H_SIG} and {H_BODY}: 64 lowercase hex digits)")
        try:
            sent = float(ts) if len(ts) <= _MAX_TIME_CHARS else math.nan
        except ValueError:
            sent = math.nan
        if not math.isfinite(sent):
            raise RejectedMessage(f"malformed {H_TIME} header {ts[:_MAX_TIME_CHARS]!r}: seconds since the epoch, a "
                                  "finite number")
        self.guard.check_time(sent, nonce)
        if not hmac.compare_digest(sig, _mac(self.secret, method, path, ts, nonce, digest)):
            raise RejectedMessage("bad signature (wrong secret or tampered request)")
        self.guard.check_new(nonce)
        return digest

    @staticmethod
    def verify_body(digest: str, body: bytes) -> None:
        """Raise RejectedMessage unless ``body`` is the one whose digest the authentic headers carry."""
        if not hmac.compare_digest(hashlib.sha256(body).hexdigest(), digest):
            raise RejectedMessage(f"the body does not match its signed {H_BODY} (tampered request)")

    def verify(self, method: str, path: str, headers, body: bytes) -> None:
        """Raise RejectedMessage unless the request is authentic, fresh and not seen before."""
        self.verify_body(self.verify_headers(method, path, headers), body)


def _json_error(status: int, msg: str):
    from aiohttp import web

    return web.json_response({"error": msg}, status=status)


def _parse_json(body: bytes):
    """``(data, None)``, or ``(None, an error message)`` when the body is not JSON this server can read."""
    try:
        return (json.loads(body) if body else {}), None
    except RecursionError:
        return None, "the body is JSON nested too deeply to parse (RecursionError)"
    except ValueError as e:
        return None, f"the body is not JSON: {type(e).__name__}: {e}"


def signed_route(verifier: "RequestVerifier", rejections, path: str, fn: Callable[[dict], Awaitable[dict]],
                 caller_errors: tuple, logger):
    """The aiohttp handler of ``POST path`` on a realhf HTTP service (a generation server, the rollout manager):
    the signature headers are verified before the body is read (401 otherwise, logged through ``rejections``, a
    ``RejectionLog``; the body is never read, and a connection with one pending is closed after the answer), then
    the body is read within the service's ``body_timeout`` (408) and checked against its signed digest (401),
    parsed as JSON and ``fn(data)``'s answer sent as JSON. A body that is not JSON (or nests too deeply to parse),
    or an exception of ``caller_errors`` (the caller's fault), is answered 400 (or the exception's own ``status``)
    naming the problem; any other exception 500 with its cause, logged with the traceback, and the service keeps
    serving."""
    from aiohttp import web

    def refuse(request, e):
        rejections.reject(request.remote or "?", e)
        return _json_error(401, f"rejected: {e}")

    async def handler(request):
        try:
            digest = verifier.verify_headers("POST", path, request.headers)
        except RejectedMessage as e:
            return refuse(request, e)
        limits = REQUEST_LIMITS.get(None) or HttpLimits()
        try:
            body = await asyncio.wait_for(request.read(), limits.body_timeout)
        except asyncio.TimeoutError:
            return _json_error(408, f"the body did not arrive within {limits.body_timeout:g} s")
        try:
            verifier.verify_body(digest, body)
        except RejectedMessage as e:
            return refuse(request, e)
        data, problem = _parse_json(body)
        if problem:
            return _json_error(400, problem)
        try:
            return web.json_response(await fn(data))
        except caller_errors as e:
            status = getattr(e, "status", None)
            return _json_error(status or 400, str(e) if status else f"{type(e).__name__}: {e}")
        except Exception as e:
            logger.error("%s failed: %s", path, traceback.format_exc())
            return _json_error(500, f"{type(e).__name__}: {e}")

    return handler


class HttpService:
    """A serving application (what ``serve_app`` returns): ``guard`` (its connections), ``cleanup()`` to stop."""

    def __init__(self, runner, server: asyncio.AbstractServer, guard: ConnectionGuard):
        self.runner, self.server, self.guard = runner, server, guard

    async def cleanup(self) -> None:
        self.server.close()
        await self.runner.cleanup()


async def serve_app(app, host: str, port: int, what: str, *, header_timeout: float = HttpLimits.header_timeout,
                    body_timeout: float = HttpLimits.body_timeout,
                    max_connections: int = HttpLimits.max_connections,
                    max_header_bytes: int = HttpLimits.max_header_bytes):
    """Serve aiohttp ``app`` on ``host:port`` (0: a free port) for ``what`` (named in errors); returns (an
    ``HttpService``, to ``cleanup()`` when done, the bound port). A port that cannot be bound raises OSError
    naming ``what``. The bounds (see ``HttpLimits``): complete headers (at most ``max_header_bytes``) within
    ``header_timeout`` of a connection opening or of its previous answer, a signed body within ``body_timeout``,
    at most ``max_connections`` open (see ``ConnectionGuard``); a request whose body its handler leaves unread (a
    refused one) has its connection closed after the answer instead of the body being drained."""
    from aiohttp import web

    limits = HttpLimits(header_timeout, body_timeout, max_connections, max_header_bytes)
    limits = dataclasses.replace(limits, max_connections=connection_cap(max_connections, what))
    guard = ConnectionGuard(limits, what)
    app.middlewares.insert(0, guard.middleware())
    runner = web.AppRunner(app, access_log=None, lingering_time=0, max_headers=32)
    await runner.setup()
    aio_server = runner.server
    try:
        server = await asyncio.get_running_loop().create_server(lambda: guard.wrap(aio_server()), host, port,
                                                                reuse_address=False)
    except OSError as e:
        await runner.cleanup()
        raise OSError(f"{what}: cannot listen on {host}:{port} ({e.strerror or e}); is the port taken? (port 0 picks a "
                      "free one)") from None
    return HttpService(runner, server, guard), server.sockets[0].getsockname()[1]
