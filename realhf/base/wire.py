"""Wire format of the request/reply stream (``realhf.system.transport.request_reply_stream``) and of every other signed
ZMQ message of a run (heartbeats, trajectories): per-run secrets, HMAC-signed multipart frames and the
payload codec (plain-JSON header + raw tensor frames; no pickle). The secret itself is ``realhf.base.run_secret``'s.

Frames: ``[MAGIC, signature, header JSON, tensor bytes ...]``; the signature is HMAC-SHA256 over the
frame count and every following frame with an 8-byte length prefix, so frames cannot be re-split,
dropped or appended. Receivers check the magic, the count and the signature before parsing anything.

Freshness: the header carries the send time (``ts``) and a random request id; a receiver that executes
requests keeps a :class:`ReplayGuard`, which rejects a message sent outside its time window or whose id
it has seen, so a captured request cannot be executed twice. Size: no frame may exceed
``MAX_FRAME_BYTES`` (checked on send; receiving sockets drop a peer that sends a larger one before
buffering it, see ``realhf.system.transport.request_reply_stream.bind_socket``). Rejections are counted and logged
by :class:`RejectionLog`, which rate-limits its warnings so that a flood cannot fill the logs.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import hmac
import json
import math
import time
import uuid
from typing import Any, Dict, List, Optional, Tuple

import torch
import zmq

from realhf.base import logging
from realhf.base.plain_json import check_plain_json

logger = logging.getLogger(__name__)

MAGIC = b"RHF1"
SIGNATURE_BYTES = 32

# one dtype allow-list for everything that travels (this stream and the SequenceSample wire format,
# ``realhf.api.core.data_api``)
DTYPES: Dict[str, torch.dtype] = {
    "bool": torch.bool,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}
DTYPE_NAMES: Dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
_DTYPES, _DTYPE_NAMES = DTYPES, DTYPE_NAMES
_MAX_DIMS = 64
# the largest frame a request/reply may carry (requests and replies are metadata: tensors move over
# torch.distributed), and the largest heartbeat
MAX_FRAME_BYTES = 64 << 20
MAX_HEARTBEAT_BYTES = 64 << 10
REPLAY_WINDOW_SECS = 300.0


# -------------------------------------------------------------------------------------- signing
def _as_buffer(frame) -> memoryview:
    if isinstance(frame, zmq.Frame):
        return frame.buffer
    return memoryview(frame)


def _signature(secret: bytes, frames: List[memoryview]) -> bytes:
    mac = hmac.new(secret, digestmod=hashlib.sha256)
    mac.update(len(frames).to_bytes(8, "big"))
    for f in frames:
        mac.update(f.nbytes.to_bytes(8, "big"))
        mac.update(f)
    return mac.digest()


def sign_frames(secret: bytes, frames: List[Any]) -> List[Any]:
    """``[MAGIC, signature, *frames]`` for frames that are bytes or byte buffers."""
    bufs = []
    for f in frames:
        mv = _as_buffer(f)
        bufs.append(mv if (mv.ndim == 1 and mv.format == "B") else mv.cast("B"))
    return [MAGIC, _signature(secret, bufs), *bufs]


class RejectedMessage(ValueError):
    """A received message that is not authentic or not well formed (never raised to users)."""


def verify_frames(secret: bytes, frames: List[Any]) -> List[memoryview]:
    """The authenticated frames after the signature; RejectedMessage (nothing parsed) otherwise."""
    bufs = [_as_buffer(f) for f in frames]
    if not bufs or bufs[0].nbytes != len(MAGIC) or bytes(bufs[0]) != MAGIC:
        raise RejectedMessage("bad magic")
    if len(bufs) < 3:
        raise RejectedMessage(f"expected at least 3 frames (magic, signature, header), got {len(bufs)}")
    if bufs[1].nbytes != SIGNATURE_BYTES:
        raise RejectedMessage(f"signature frame has {bufs[1].nbytes} bytes, expected {SIGNATURE_BYTES}")
    body = bufs[2:]
    if not hmac.compare_digest(bytes(bufs[1]), _signature(secret, body)):
        raise RejectedMessage("bad signature (wrong secret or tampered message)")
    return body


# ---------------------------------------------------------------------------------------- JSON
# -------------------------------------------------------------------------------------- payload
@dataclasses.dataclass
class Payload:
    """One request or reply."""

    handler: str  # destination worker name, or "master"
    handle_name: str  # e.g. "generate", "train_step", "fetch", "data_transfer", "save", "exit"
    data: dict = dataclasses.field(default_factory=dict)  # plain JSON
    tensors: List[torch.Tensor] = dataclasses.field(default_factory=list)
    request_id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)
    error: Optional[str] = None  # a worker's traceback when the request failed
    sent_at: Optional[float] = None  # time.time() of sending: set by encode_payload, read on receipt

    def make_reply(self, data: Optional[dict] = None, tensors: Optional[List[torch.Tensor]] = None,
                   error: Optional[str] = None) -> "Payload":
        """The reply to this request (same ``request_id`` and ``handle_name``, addressed to the master)."""
        return Payload(handler="master", handle_name=self.handle_name, data={} if data is None else data,
                       tensors=[] if tensors is None else list(tensors), request_id=self.request_id, error=error)


def _tensor_frame(t: torch.Tensor, where: str) -> Tuple[dict, memoryview]:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{where} is a {type(t).__name__}, expected a torch.Tensor")
    name = _DTYPE_NAMES.get(t.dtype)
    if name is None:
        raise TypeError(f"{where} has dtype {t.dtype}, which cannot be sent; allowed: {sorted(_DTYPES)}")
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    shape = list(t.shape)
    flat = t.contiguous().reshape(-1)
    if t.dtype == torch.bfloat16:
        flat = flat.view(torch.int16)
    raw = flat.numpy().view("uint8")  # 1-D byte view, no copy
    return {"dtype": name, "shape": shape}, memoryview(raw)


def encode_payload(secret: bytes, payload: Payload) -> List[Any]:
    """The signed frames of ``payload``; TypeError naming what cannot be sent."""
    for field in ("handler", "handle_name", "request_id"):
        if not isinstance(getattr(payload, field), str):
            raise TypeError(f"Payload.{field} must be a str, got {type(getattr(payload, field)).__name__}")
    if payload.error is not None and not isinstance(payload.error, str):
        raise TypeError(f"Payload.error must be a str or None, got {type(payload.error).__name__}")
    if not isinstance(payload.data, dict):
        raise TypeError(f"Payload.data must be a dict, got {type(payload.data).__name__}")
    check_plain_json(payload.data, "data")
    if not isinstance(payload.tensors, (list, tuple)):
        raise TypeError(f"Payload.tensors must be a list of tensors, got {type(payload.tensors).__name__}")
    metas, bufs = [], []
    for i, t in enumerate(payload.tensors):
        meta, buf = _tensor_frame(t, f"tensors[{i}]")
        metas.append(meta)
        bufs.append(buf)
    header = {
        "handler": payload.handler,
        "handle_name": payload.handle_name,
        "request_id": payload.request_id,
        "data": payload.data,
        "tensors": metas,
        "error": payload.error,
        "ts": time.time(),
    }
    header_bytes = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    for i, b in enumerate([header_bytes, *bufs]):
        n = len(b) if i == 0 else b.nbytes
        if n > MAX_FRAME_BYTES:
            what = "its header" if i == 0 else f"tensors[{i - 1}]"
            raise ValueError(f"cannot send {payload.handle_name!r}: {what} has {n} bytes, over the {MAX_FRAME_BYTES}-byte "
                             "frame limit of the request/reply stream (move large data over torch.distributed)")
    return sign_frames(secret, [header_bytes, *bufs])


def _parse_header(raw: memoryview) -> dict:
    try:
        header = json.loads(bytes(raw).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise RejectedMessage(f"header is not UTF-8 JSON: {e}") from None
    if not isinstance(header, dict):
        raise RejectedMessage("header is not a JSON object")
    return header


def _decode_tensor(meta: Any, buf: memoryview, i: int) -> torch.Tensor:
    if not isinstance(meta, dict) or set(meta) != {"dtype", "shape"}:
        raise RejectedMessage(f"tensors[{i}] meta must be {{'dtype', 'shape'}}, got {meta!r:.200}")
    dtype = _DTYPES.get(meta["dtype"]) if isinstance(meta["dtype"], str) else None
    if dtype is None:
        raise RejectedMessage(f"tensors[{i}] dtype {meta['dtype']!r:.50} is not allowed")
    shape = meta["shape"]
    if (not isinstance(shape, list) or len(shape) > _MAX_DIMS
            or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape)):
        raise RejectedMessage(f"tensors[{i}] shape {shape!r:.200} is not a list of non-negative ints")
    storage = torch.int16 if dtype == torch.bfloat16 else dtype
    itemsize = torch.empty((), dtype=storage).element_size()
    numel = math.prod(shape)
    if buf.nbytes != numel * itemsize:
        raise RejectedMessage(f"tensors[{i}] has {buf.nbytes} bytes, expected {numel * itemsize} for {shape} {meta['dtype']}")
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    t = torch.frombuffer(bytearray(buf), dtype=storage).reshape(shape)  # own, writable copy
    return t.view(torch.bfloat16) if dtype == torch.bfloat16 else t


def decode_payload(secret: bytes, frames: List[Any]) -> Payload:
    """Verifies and decodes a received message; RejectedMessage (nothing parsed before the
    signature check) when it is not authentic or not well formed."""
    body = verify_frames(secret, frames)
    header = _parse_header(body[0])
    expected = {"handler", "handle_name", "request_id", "data", "tensors", "error", "ts"}
    if set(header) != expected:
        raise RejectedMessage(f"header keys {sorted(header)} != {sorted(expected)}")
    if not isinstance(header["ts"], (int, float)) or isinstance(header["ts"], bool) or not math.isfinite(header["ts"]):
        raise RejectedMessage("header['ts'] is not a finite number")
    for k in ("handler", "handle_name", "request_id"):
        if not isinstance(header[k], str):
            raise RejectedMessage(f"header[{k!r}] is not a str")
    if not isinstance(header["data"], dict):
        raise RejectedMessage("header['data'] is not an object")
    if header["error"] is not None and not isinstance(header["error"], str):
        raise RejectedMessage("header['error'] is not a str or null")
    metas = header["tensors"]
    if not isinstance(metas, list) or len(metas) != len(body) - 1:
        raise RejectedMessage(f"header lists {len(metas) if isinstance(metas, list) else '?'} tensors, message has {len(body) - 1}")
    tensors = [_decode_tensor(m, b, i) for i, (m, b) in enumerate(zip(metas, body[1:]))]
    return Payload(handler=header["handler"], handle_name=header["handle_name"], data=header["data"],
                   tensors=tensors, request_id=header["request_id"], error=header["error"], sent_at=float(header["ts"]))


class ReplayGuard:
    """Freshness of authentic requests: rejects one whose send time is not a finite number or lies more than
    ``window_s`` seconds from now (either way), and one whose request id was seen before. Ids are remembered for
    twice the window, after which their timestamps alone reject them. ``check`` does both; a receiver that can
    judge the time before it can authenticate (a signed HTTP request, from its headers) calls ``check_time`` first
    and ``check_new`` once the request is authentic, so that unauthenticated ids are never remembered."""

    def __init__(self, window_s: float = REPLAY_WINDOW_SECS):
        self.window_s = window_s
        self._seen: set = set()
        self._expiry: collections.deque = collections.deque()  # (monotonic expiry, request id)

    def check(self, payload: Payload) -> None:
        self.check_time(payload.sent_at, payload.request_id)
        self.check_new(payload.request_id)

    def check_time(self, sent_at: Any, request_id: Any) -> None:
        """Raise RejectedMessage unless ``sent_at`` (seconds since the epoch) is a finite number within the window."""
        if isinstance(sent_at, bool) or not isinstance(sent_at, (int, float)) or not math.isfinite(sent_at):
            raise RejectedMessage(f"message {request_id!r} carries no finite send time (got {sent_at!r}; a forged "
                                  "or corrupted message)")
        age = time.time() - sent_at
        if abs(age) > self.window_s:
            raise RejectedMessage(f"stale message {request_id!r}: sent {age:.0f} s ago, outside the "
                                  f"{self.window_s:.0f} s window (a replay, or a clock that is off)")

    def check_new(self, request_id: Any) -> None:
        """Raise RejectedMessage if ``request_id`` was seen within twice the window; remember it otherwise."""
        now = time.monotonic()
        while self._expiry and self._expiry[0][0] < now:
            self._seen.discard(self._expiry.popleft()[1])
        if request_id in self._seen:
            raise RejectedMessage(f"replayed request id {request_id!r}")
        self._seen.add(request_id)
        self._expiry.append((now + 2 * self.window_s, request_id))


class RejectionLog:
    """Counts rejected messages (``count``) and logs each as a warning naming ``what`` and the sender, at most
    ``burst`` warnings at once and then one every ``every_s`` seconds, with the number left unlogged."""

    def __init__(self, what: str, burst: int = 20, every_s: float = 5.0):
        self.what, self.burst, self.every_s = what, burst, every_s
        self.count = 0
        self._tokens = float(burst)
        self._last = time.monotonic()
        self._unlogged = 0

    def reject(self, source: str, why: Any) -> None:
        self.count += 1
        now = time.monotonic()
        self._tokens = min(self.burst, self._tokens + (now - self._last) / self.every_s)
        self._last = now
        if self._tokens < 1:
            self._unlogged += 1
            return
        self._tokens -= 1
        more = f"; {self._unlogged} rejections since the last warning not logged" if self._unlogged else ""
        self._unlogged = 0
        logger.warning("%s rejected a message from %s: %s [%d rejected so far%s]", self.what, source, why, self.count, more)


def _peer_address(frame) -> str:
    try:
        return frame.get("Peer-Address") if isinstance(frame, zmq.Frame) else "?"
    except (zmq.ZMQError, AttributeError, UnicodeDecodeError):
        return "?"
