"""Weights handed to a generation server on the trainer's host by reference, not sent through a socket.

The trainer's HF-named tensors are *shared*: on a GPU as CUDA IPC handles of the tensors' own memory (the server
maps the trainer's memory and copies from it device to device: nothing passes through host memory or a
communication library, and it works where NCCL cannot, between two processes on one GPU); on CPU packed into one
anonymous shared-memory file (``memfd``) of the trainer, which the server maps read-only through
``/proc/<pid>/fd/<n>``, reused from one update to the next.

What a server receives is one :class:`part <SharedWriter.share>` per sharing rank (a stage writer of the trainer):
``{"host", "pid", "device", "buffers": [...], "tensors": [{"name", "dtype", "shape", "stride", "buffer",
"offset"}]}``, a tensor being a strided view of one buffer (``offset`` in elements of its dtype). The trainer keeps
the tensors alive, and does not change them, until every server has answered. Only between processes of one host
(:func:`host_id`) and one user; a server checks every field (where, how large, which dtype) before it maps anything
(:func:`open_part`).
"""
from __future__ import annotations

import base64
import math
import os
import re
import socket
from typing import Dict, Iterator, List, Optional, Tuple

import torch

from realhf.api.core.generation import RequestError
from realhf.gen_server.weight_group import dtype_name, dtype_of

_ALIGN = 64  # bytes: each tensor of a CPU buffer starts at a multiple (of every dtype's size)
_MEMFD_NAME = "realhf-weights"
_PROC_FD = re.compile(r"^/proc/(\d+)/fd/(\d+)$")


def host_id() -> str:
    """This host as the kernel knows it (boot id and host name): two processes may share memory iff theirs agree."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


_GPUS: Optional[List[str]] = None


def visible_gpus() -> List[str]:
    """The UUIDs of the GPUs this process sees (empty without CUDA): a server can map the trainer's CUDA memory only
    if the trainer's GPU is among them."""
    global _GPUS
    if _GPUS is None:
        _GPUS = ([device_uuid(torch.device("cuda", i)) for i in range(torch.cuda.device_count())]
                 if torch.cuda.is_available() else [])
    return _GPUS


def device_uuid(device: torch.device) -> Optional[str]:
    """The UUID of a CUDA device (None for the CPU)."""
    if device.type != "cuda":
        return None
    return str(torch.cuda.get_device_properties(device.index if device.index is not None
                                                else torch.cuda.current_device()).uuid)


def supported() -> Optional[str]:
    """None where this process can share weights; else why not (no memfd, no /proc)."""
    if not hasattr(os, "memfd_create"):
        return "os.memfd_create is not available (Linux only)"
    if not os.path.isdir("/proc/self/fd"):
        return "/proc/self/fd is not mounted"
    return None


def _b64(b: bytes) -> str:
    return base64.b64encode(bytes(b)).decode()


def _unb64(s, what: str) -> bytes:
    if not isinstance(s, str):
        raise RequestError(f"{what} must be a base64 string, got {type(s).__name__}")
    try:
        return base64.b64decode(s.encode(), validate=True)
    except ValueError:
        raise RequestError(f"{what} is not valid base64") from None


class SharedWriter:
    """The trainer's side: :meth:`share` makes one part of ``named`` (HF-named tensors of one device type) and keeps
    what the servers will read alive until :meth:`release` (or the next ``share``). CPU: one memfd buffer, grown when
    the tensors outgrow it and reused otherwise; CUDA: the tensors themselves, each storage shared once."""

    def __init__(self, label: str = "weights"):
        self.label = label
        self._fd: Optional[int] = None
        self._buf: Optional[torch.Tensor] = None  # the memfd mapped shared (uint8)
        self._held: List[torch.Tensor] = []

    @property
    def buffer_bytes(self) -> int:
        return 0 if self._buf is None else self._buf.numel()

    def share(self, named: Dict[str, torch.Tensor]) -> dict:
        self.release()
        devices = {t.device.type for t in named.values()}
        if len(devices) > 1:
            raise ValueError(f"weights to share are on several device types: {sorted(devices)}")
        if devices == {"cuda"}:
            return self._share_cuda(named)
        if devices - {"cpu"}:
            raise ValueError(f"weights on {sorted(devices)} cannot be shared (cpu or cuda)")
        return self._share_cpu(named)

    def _share_cpu(self, named: Dict[str, torch.Tensor]) -> dict:
        why = supported()
        if why:
            raise RuntimeError(f"cannot share weights with a server here: {why}")
        offsets, end = [], 0
        for t in named.values():
            offsets.append(end)
            end += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
        need = max(end, _ALIGN)
        if self._buf is None or self._buf.numel() < need:
            self._open(need)
        buf = self._buf
        tensors = []
        for (name, t), off in zip(named.items(), offsets):
            nb = t.numel() * t.element_size()
            buf[off:off + nb].view(t.dtype).view(t.shape).copy_(t.detach())
            stride = list(torch.empty(t.shape, device="meta").stride())
            tensors.append(dict(name=name, dtype=dtype_name(t.dtype), shape=list(t.shape), stride=stride, buffer=0,
                                offset=off // t.element_size()))
        fd_path = f"/proc/{os.getpid()}/fd/{self._fd}"
        return dict(host=host_id(), pid=os.getpid(), device="cpu", tensors=tensors,
                    buffers=[dict(kind="memfd", path=fd_path, nbytes=buf.numel())])

    def _open(self, nbytes: int):
        self.close()
        fd = os.memfd_create(f"{_MEMFD_NAME}-{self.label}", os.MFD_CLOEXEC)
        try:
            # reserve the pages now: a full memory fails here, cleanly, not with SIGBUS at the first write
            os.posix_fallocate(fd, 0, nbytes)
            self._buf = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=nbytes, dtype=torch.uint8)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def _share_cuda(self, named: Dict[str, torch.Tensor]) -> dict:
        buffers, tensors, index = [], [], {}
        for name, t in named.items():
            t = t.detach()
            st = t.untyped_storage()
            key = st.data_ptr() if st.nbytes() else ("empty", t.device.index)
            if key not in index and not st.nbytes():  # nothing to map (no CUDA allocation behind it)
                index[key] = len(buffers)
                buffers.append(dict(kind="cuda_ipc", device_uuid=device_uuid(t.device), nbytes=0))
            if key not in index:
                (device, handle, size, offset_bytes, ref_handle, ref_offset, event_handle,
                 event_sync) = st._share_cuda_()
                index[key] = len(buffers)
                buffers.append(dict(kind="cuda_ipc", device_uuid=device_uuid(torch.device("cuda", device)),
                                    handle=_b64(handle), nbytes=int(size), offset_bytes=int(offset_bytes),
                                    ref_counter_handle=_b64(ref_handle), ref_counter_offset=int(ref_offset),
                                    event_handle=_b64(event_handle) if event_handle else None,
                                    event_sync_required=bool(event_sync)))
            self._held.append(t)
            tensors.append(dict(name=name, dtype=dtype_name(t.dtype), shape=list(t.shape), stride=list(t.stride()),
                                buffer=index[key], offset=t.storage_offset()))
        return dict(host=host_id(), pid=os.getpid(), device="cuda", tensors=tensors, buffers=buffers)

    def release(self):
        """The servers are done with the last part: its CUDA tensors may change or go."""
        self._held = []

    def close(self):
        self.release()
        self._buf = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _ints(v, what: str, n: Optional[int] = None) -> List[int]:
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v):
        raise RequestError(f"{what} must be a list of non-negative integers, got {v!r}")
    if n is not None and len(v) != n:
        raise RequestError(f"{what} has {len(v)} entries, the shape {n}")
    return v


def _field(d: dict, key: str, kind, what: str):
    v = d.get(key) if isinstance(d, dict) else None
    if not isinstance(v, kind) or isinstance(v, bool) and kind is int:
        raise RequestError(f"{what}: '{key}' must be {getattr(kind, '__name__', kind)}, got {v!r}")
    return v


def check_part(part: dict, i: int = 0) -> List[dict]:
    """Refuse (RequestError) a part that is malformed, from another host, or whose tensors reach outside their
    buffers; returns its tensors' entries. Opens nothing."""
    what = f"shared weights, part {i}"
    if not isinstance(part, dict):
        raise RequestError(f"{what} must be an object")
    host = _field(part, "host", str, what)
    if host != host_id():
        raise RequestError(f"{what} comes from host {host!r}, this server runs on {host_id()!r}: weights are shared "
                           "only between processes of one host (use gen_server.weight_transport=group)")
    device = part.get("device")
    if device not in ("cpu", "cuda"):
        raise RequestError(f"{what}: 'device' must be cpu or cuda, got {device!r}")
    buffers = _field(part, "buffers", list, what)
    for j, b in enumerate(buffers):
        bw = f"{what}, buffer {j}"
        kind = "memfd" if device == "cpu" else "cuda_ipc"
        if not isinstance(b, dict) or b.get("kind") != kind:
            raise RequestError(f"{bw} must be an object of kind {kind!r} (the part's device is {device})")
        if _field(b, "nbytes", int, bw) < 0:
            raise RequestError(f"{bw}: nbytes must be >= 0")
        if kind == "memfd":
            m = _PROC_FD.match(_field(b, "path", str, bw))
            if not m:
                raise RequestError(f"{bw}: path must be /proc/<pid>/fd/<n>, got {b['path']!r}")
    tensors = _field(part, "tensors", list, what)
    for t in tensors:
        name = _field(t, "name", str, what)
        tw = f"{what}, tensor {name!r}"
        dtype = dtype_of(t.get("dtype"))
        shape = _ints(t.get("shape"), f"{tw}: shape")
        stride = _ints(t.get("stride"), f"{tw}: stride", len(shape))
        j = _field(t, "buffer", int, tw)
        off = _field(t, "offset", int, tw)
        if not 0 <= j < len(buffers) or off < 0:
            raise RequestError(f"{tw}: buffer {j} / offset {off} outside the part's {len(buffers)} buffers")
        size = dtype.itemsize
        last = off + sum((s - 1) * st for s, st in zip(shape, stride)) if math.prod(shape) else off - 1
        if (last + 1) * size > buffers[j]["nbytes"]:
            raise RequestError(f"{tw}: its elements reach byte {(last + 1) * size}, past its buffer's "
                               f"{buffers[j]['nbytes']} bytes")
    return tensors


def check_parts(parts) -> List[dict]:
    """The tensors' entries of every part of an update (:func:`check_part`), which must be a non-empty list."""
    if not isinstance(parts, list) or not parts:
        raise RequestError("'parts' must be a non-empty list of shared-weight parts")
    return [t for i, p in enumerate(parts) for t in check_part(p, i)]


def open_parts(parts: List[dict]) -> Iterator[Tuple[str, torch.Tensor]]:
    """:func:`open_part` of every part of an update, in order."""
    for i, p in enumerate(parts):
        yield from open_part(p, i)


def open_part(part: dict, i: int = 0) -> Iterator[Tuple[str, torch.Tensor]]:
    """The server's side: ``(name, tensor)`` for every tensor of ``part``, each a view of the trainer's memory
    (read-only on CPU) valid while the trainer holds the part (until the server answers). Checked first
    (:func:`check_part`)."""
    tensors = check_part(part, i)
    bufs = [_map(b, part["device"], f"shared weights, part {i}, buffer {j}") for j, b in enumerate(part["buffers"])]
    for t in tensors:
        dtype = dtype_of(t["dtype"])
        buf = bufs[t["buffer"]]
        v = torch.empty(0, dtype=dtype, device=buf.device)
        v.set_(buf.untyped_storage(), t["offset"], t["shape"], t["stride"])
        yield t["name"], v


def _map(b: dict, device: str, what: str) -> torch.Tensor:
    if device == "cpu":
        path = b["path"]
        try:
            target = os.readlink(path)
            size = os.stat(path).st_size
        except OSError as e:
            raise RequestError(f"{what}: cannot open {path} ({e.strerror}); is the trainer on this host and alive?") \
                from None
        if not target.startswith(f"/memfd:{_MEMFD_NAME}"):
            raise RequestError(f"{what}: {path} is not a shared weight buffer ({target!r})")
        if size < b["nbytes"]:
            raise RequestError(f"{what}: {path} holds {size} bytes, fewer than the {b['nbytes']} announced")
        if b["nbytes"] == 0:
            return torch.empty(0, dtype=torch.uint8)
        return torch.from_file(path, shared=False, size=b["nbytes"], dtype=torch.uint8)
    return _map_cuda(b, what)


def _map_cuda(b: dict, what: str) -> torch.Tensor:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    if not torch.cuda.is_available():
        raise RequestError(f"{what}: CUDA memory was shared, but this server has no GPU")
    uuid = _field(b, "device_uuid", str, what)
    local = [i for i, u in enumerate(visible_gpus()) if u == uuid]
    if not local:
        raise RequestError(f"{what}: the trainer's GPU {uuid} is not visible to this server (CUDA_VISIBLE_DEVICES="
                           f"{os.environ.get('CUDA_VISIBLE_DEVICES', '')!r}); use gen_server.weight_transport=group")
    event = b.get("event_handle")
    n = b["nbytes"]
    if n == 0:
        return torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", local[0]))
    return rebuild_cuda_tensor(torch.Tensor, torch.Size([n]), (1,), 0, torch.UntypedStorage, torch.uint8, local[0],
                               _unb64(b.get("handle"), f"{what}: handle"), n, _field(b, "offset_bytes", int, what),
                               False, _unb64(b.get("ref_counter_handle"), f"{what}: ref_counter_handle"),
                               _field(b, "ref_counter_offset", int, what),
                               _unb64(event, f"{what}: event_handle") if event is not None else None,
                               bool(b.get("event_sync_required")))
