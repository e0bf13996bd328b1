"""Signed HTTP requests between realhf processes and generation servers.

Every POST carries ``X-Realhf-Time`` (seconds since the epoch), ``X-Realhf-Nonce`` (unique per request) and
``X-Realhf-Signature``: HMAC-SHA256 under the run secret (the same ``$REALHF_RUN_SECRET`` that signs the ZMQ
stream) of the method, path, time, nonce and the SHA-256 of the body. The server rejects (401) a missing or
wrong signature, a time more than the replay window away from its clock, and a nonce it has seen: a request
captured on the network cannot be replayed or altered, and a process without the secret can neither
generate nor touch weights, pause or abort.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import time
import traceback
from typing import Awaitable, Callable, Dict

from realhf.system.wire import REPLAY_WINDOW_SECS, Payload, RejectedMessage, ReplayGuard

H_TIME, H_NONCE, H_SIG = "X-Realhf-Time", "X-Realhf-Nonce", "X-Realhf-Signature"


def _mac(secret: bytes, method: str, path: str, ts: str, nonce: str, body: bytes) -> str:
    msg = b"\n".join([method.upper().encode(), path.encode(), ts.encode(), nonce.encode(),
                      hashlib.sha256(body).hexdigest().encode()])
    return hmac.new(secret, msg, hashlib.sha256).hexdigest()


def sign(secret: bytes, method: str, path: str, body: bytes) -> Dict[str, str]:
    """Headers that authenticate one request of ``body`` to ``path``."""
    ts, nonce = f"{time.time():.6f}", secrets.token_hex(16)
    return {H_TIME: ts, H_NONCE: nonce, H_SIG: _mac(secret, method, path, ts, nonce, body)}


class RequestVerifier:
    def __init__(self, secret: bytes, window_s: float = REPLAY_WINDOW_SECS):
        self.secret = secret
        self.guard = ReplayGuard(window_s)

    def verify(self, method: str, path: str, headers, body: bytes) -> None:
        """Raise RejectedMessage unless the request is authentic, fresh and not seen before."""
        ts, nonce, sig = headers.get(H_TIME), headers.get(H_NONCE), headers.get(H_SIG)
        if not ts or not nonce or not sig:
            raise RejectedMessage("unsigned request (no X-Realhf-Signature/Time/Nonce headers)")
        if len(nonce) > 64 or len(sig) != 64:
            raise RejectedMessage("malformed signature headers")
        if not hmac.compare_digest(sig, _mac(self.secret, method, path, ts, nonce, body)):
            raise RejectedMessage("bad signature (wrong secret or tampered request)")
        try:
            sent = float(ts)
        except ValueError:
            raise RejectedMessage(f"malformed {H_TIME} header") from None
        self.guard.check(Payload(handler="", handle_name=path, data=None, request_id=nonce, sent_at=sent))


def signed_route(verifier: "RequestVerifier", rejections, path: str, fn: Callable[[dict], Awaitable[dict]],
                 caller_errors: tuple, logger):
    """The aiohttp handler of ``POST path`` on a realhf HTTP service (a generation server, the rollout manager):
    the signature is verified (401 otherwise, logged through ``rejections``, a ``RejectionLog``), the body parsed
    as JSON and ``fn(data)``'s answer sent as JSON. A body that is not JSON, or an exception of ``caller_errors``
    (the caller's fault), is answered 400 (or the exception's own ``status``) naming the problem; any other
    exception 500 with its cause, logged with the traceback, and the service keeps serving."""
    from aiohttp import web

    async def handler(request):
        body = await request.read()
        try:
            verifier.verify("POST", path, request.headers, body)
        except RejectedMessage as e:
            rejections.reject(request.remote or "?", e)
            return web.json_response({"error": f"rejected: {e}"}, status=401)
        try:
            data = json.loads(body) if body else {}
        except ValueError as e:
            return web.json_response({"error": f"the body is not JSON: {type(e).__name__}: {e}"}, status=400)
        try:
            return web.json_response(await fn(data))
        except caller_errors as e:
            status = getattr(e, "status", None)
            return web.json_response({"error": str(e) if status else f"{type(e).__name__}: {e}"}, status=status or 400)
        except Exception as e:
            logger.error("%s failed: %s", path, traceback.format_exc())
            return web.json_response({"error": f"{type(e).__name__}: {e}"}, status=500)

    return handler



async def serve_app(app, host: str, port: int, what: str):
    """Serve aiohttp ``app`` on ``host:port`` (0: a free port) for ``what`` (named in errors); returns (the runner,
    to ``cleanup()`` when done, the bound port). A port that cannot be bound raises OSError naming ``what``."""
    from aiohttp import web

    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=False)
    try:
        await site.start()
    except OSError as e:
        await runner.cleanup()
        raise OSError(f"{what}: cannot listen on {host}:{port} ({e.strerror or e}); is the port taken? (port 0 picks a "
                      "free one)") from None
    return runner, site._server.sockets[0].getsockname()[1]
