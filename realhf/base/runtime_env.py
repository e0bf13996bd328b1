"""The runtime environment of one process: where its tensors live and how it talks to its peers.

A :class:`RuntimeEnv` is made once where a process starts (a model worker's entry, a test harness rank)
and passed down: the model, the engines, generation, pipeline communication, parameter reallocation, the
data manager and the topology's process groups ask it instead of assuming CPU and gloo.

What it decides (:func:`select`, a pure function of its inputs, so the decisions can be checked on any
machine; :func:`detect` fills the inputs from this machine):

============== ============================================ ==========================
                CUDA present                                 no CUDA
============== ============================================ ==========================
device          ``cuda:<local rank>``                        ``cpu``
backend         ``cpu:gloo,cuda:nccl`` (world and subgroups)  ``gloo``
dtype default   bfloat16                                     float32
attention       ``flash`` when flash_attn imports, else sdpa ``sdpa``
============== ============================================ ==========================

On CUDA the backend string is PyTorch's per-device form: one process group serves CUDA tensors with NCCL
and CPU tensors (control values that must stay on the host, ``*_object`` collectives) with gloo. Every
group gets the same string: ``init_process_group`` for the world and ``new_group`` for every subgroup
(``realhf.base.topology.ParallelGrid`` passes it explicitly).

This module is the only place that chooses a device, a backend or a default dtype; flash_attn and CUDA are
queried lazily, only by :func:`detect`.
"""
from __future__ import annotations

import dataclasses
import os
import re
from typing import Dict, Optional, Union

import torch

from realhf.base.device_slots import gpu_of_slot

ATTENTION_KERNELS = ("sdpa", "flash")
CPU_BACKEND = "gloo"
# NCCL for CUDA tensors, gloo for the CPU-side control values NCCL cannot carry
GPU_BACKEND = "cpu:gloo,cuda:nccl"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

DeviceLike = Union[str, torch.device]


@dataclasses.dataclass(frozen=True)
class RuntimeEnv:
    """Device, distributed backend, default dtype, attention kernel and name-resolve kind of one process."""

    device: torch.device
    backend: str  # for init_process_group and every new_group
    dtype: torch.dtype  # parameters' dtype when a model does not ask for one
    attention: str  # "sdpa" | "flash"
    name_resolve: str = "file"  # kind of realhf.base.name_resolve repository
    local_rank: int = 0

    def __post_init__(self):
        if not isinstance(self.device, torch.device):
            raise TypeError(f"RuntimeEnv.device must be a torch.device, got {self.device!r} ({type(self.device).__name__})")
        if self.attention not in ATTENTION_KERNELS:
            raise ValueError(f"RuntimeEnv.attention={self.attention!r}; allowed: {ATTENTION_KERNELS}")
        if self.attention == "flash" and self.device.type != "cuda":
            raise ValueError(f"RuntimeEnv.attention='flash' needs a CUDA device, got {self.device}")
        if not isinstance(self.backend, str) or not self.backend:
            raise ValueError(f"RuntimeEnv.backend must be a torch.distributed backend string, got {self.backend!r}")

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def activate(self) -> None:
        """Make this env's device the process's current CUDA device (NCCL and ``*_object`` collectives use
        it); nothing on CPU. Call before ``init_process_group``."""
        if self.is_cuda:
            torch.cuda.set_device(self.device)

    def describe(self) -> str:
        return (f"device={self.device} backend={self.backend} dtype={str(self.dtype).replace('torch.', '')} "
                f"attention={self.attention} name_resolve={self.name_resolve}")

    # ------------------------------------------------------------ memory
    def reset_peak_memory(self) -> None:
        """Start a new peak-memory window (CUDA's allocator peak; on CPU the process's peak RSS, where the
        kernel lets a process reset it, else the window is the process's lifetime)."""
        if self.is_cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            _reset_peak_rss()

    def memory_stats(self) -> Dict[str, float]:
        """``{"peak_mem_gib": ...}``: peak memory since :meth:`reset_peak_memory` (CUDA: bytes the caching
        allocator handed out on this device; CPU: peak resident set size of the process), plus on CUDA
        ``"reserved_mem_gib"``, what the allocator holds now."""
        if self.is_cuda:
            return {"peak_mem_gib": torch.cuda.max_memory_allocated(self.device) / 2**30,
                    "reserved_mem_gib": torch.cuda.memory_reserved(self.device) / 2**30}
        return {"peak_mem_gib": _peak_rss_bytes() / 2**30}


def select(
    *,
    cuda_available: bool,
    device_count: int,
    local_rank: int = 0,
    flash_attn_available: bool = False,
    device: Optional[DeviceLike] = None,
    backend: Optional[str] = None,
    dtype: Optional[Union[str, torch.dtype]] = None,
    attention: Optional[str] = None,
    name_resolve: str = "file",
) -> RuntimeEnv:
    """The environment for a process with local rank ``local_rank`` on a machine described by the other
    arguments (see the module docstring); ``device``/``backend``/``dtype``/``attention`` override a choice.
    Raises ValueError for a request this machine cannot serve, naming it and what is allowed."""
    if not isinstance(local_rank, int) or local_rank < 0:
        raise ValueError(f"local_rank must be a non-negative integer, got {local_rank!r}")
    has_cuda = bool(cuda_available) and device_count > 0
    if device is None:
        if has_cuda and local_rank >= device_count:
            raise ValueError(f"local rank {local_rank} has no GPU: {device_count} CUDA device(s) are visible. Run at "
                             "most one model worker per visible GPU (n_devices_per_node), or let the launcher give "
                             "each worker its own GPU (CUDA_VISIBLE_DEVICES, local rank 0)")
        dev = torch.device("cuda", local_rank) if has_cuda else torch.device("cpu")
    else:
        dev = torch.device(device)
    if dev.type == "cuda" and not has_cuda:
        raise ValueError(f"device {dev} was asked for, but no CUDA device is available; allowed: a CPU device")
    if dev.type == "cuda" and dev.index is not None and dev.index >= device_count:
        raise ValueError(f"device {dev} was asked for, but only {device_count} CUDA device(s) are visible")
    on_gpu = dev.type == "cuda"
    if attention is None:
        attention = "flash" if on_gpu and flash_attn_available else "sdpa"
    elif attention == "flash" and not (on_gpu and flash_attn_available):
        raise ValueError(f"attention='flash' needs a CUDA device and the flash_attn package (device {dev}, "
                         f"flash_attn importable: {flash_attn_available}); allowed here: 'sdpa'")
    if dtype is None:
        dtype = torch.bfloat16 if on_gpu else torch.float32
    elif isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype {dtype!r} is not supported; allowed: {sorted(_DTYPES)}")
        dtype = _DTYPES[dtype]
    return RuntimeEnv(device=dev, backend=backend or (GPU_BACKEND if on_gpu else CPU_BACKEND), dtype=dtype,
                      attention=attention, name_resolve=name_resolve, local_rank=local_rank)


def flash_attn_importable() -> bool:
    """Whether the flash_attn package (the GPU extra) imports here."""
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def detect(local_rank: int = 0, **overrides) -> RuntimeEnv:
    """:func:`select` with this machine's facts: whether CUDA is available, how many devices are visible,
    whether flash_attn imports (looked at only when CUDA is). ``overrides`` go to :func:`select`."""
    cuda = torch.cuda.is_available()
    count = torch.cuda.device_count() if cuda else 0
    return select(cuda_available=cuda, device_count=count, local_rank=local_rank,
                  flash_attn_available=cuda and flash_attn_importable(), **overrides)


def local_rank(rank: int, devices_per_node: int, own_devices: bool = False, gpus_per_node: int = 0) -> int:
    """Which of its node's devices the process of global slot ``rank`` uses: ``LOCAL_RANK`` where a launcher
    sets it; 0 when the launcher shows each process only its own devices (``own_devices``, e.g. Ray actors
    reserving GPUs); else :func:`gpu_of_slot` (a node's processes side by side)."""
    env_value = os.environ.get("LOCAL_RANK", "")
    if env_value:
        if not env_value.isdigit():
            raise ValueError(f"LOCAL_RANK={env_value!r} is not a non-negative integer")
        return int(env_value)
    if own_devices:
        return 0
    return gpu_of_slot(rank, devices_per_node, gpus_per_node)


def cpu_env(device: DeviceLike = "cpu") -> RuntimeEnv:
    """The CPU environment (gloo, float32, SDPA) on ``device``: what library code uses when no environment
    is passed to it (tests, benchmarks, single-process tools)."""
    return select(cuda_available=False, device_count=0, device=device)


def for_device(device: DeviceLike) -> RuntimeEnv:
    """The environment this machine gives a process that asks for ``device`` (a CUDA device gets NCCL,
    bfloat16 and flash-attn where installed; anything else the CPU choices)."""
    dev = torch.device(device)
    return detect(local_rank=dev.index or 0, device=dev) if dev.type == "cuda" else cpu_env(dev)


# ---------------------------------------------------------------- peak RSS on CPU
def _peak_rss_bytes() -> int:
    """The process's peak resident set size (VmHWM of /proc/self/status; getrusage where /proc is absent)."""
    try:
        with open("/proc/self/status") as f:
            m = re.search(r"^VmHWM:\s+(\d+) kB", f.read(), re.MULTILINE)
        if m:
            return int(m.group(1)) * 1024
    except OSError:
        pass
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def _reset_peak_rss() -> None:
    """Reset VmHWM to the current RSS (Linux: write 5 to /proc/self/clear_refs); a no-op where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
