"""How a realhf compute process hands host memory back to the operating system.

glibc's malloc serves every allocation above its mmap threshold (at most 32 MiB) with a fresh ``mmap`` and
unmaps it on ``free``. A training step on CPU allocates and frees hundreds of such buffers (activations,
logits, gradients: the logits of 8 x 256 tokens over SmolLM2's 49152-word vocabulary alone are 400 MB), so
every step the kernel maps, zero-fills page by page, and unmaps gigabytes again: on a SmolLM2 step of
8 x 256 tokens that was 9.0 s against 5.5 s with the freed memory kept for reuse (``docs/performance.md``).

:func:`retain_freed_memory` (called where a model worker or a generation server starts) tells glibc to
serve large blocks from its heap and keep freed memory for the next step (``mallopt``: no mmap'd blocks,
trim only beyond 2 GiB of free top-of-heap). The cost: a process's resident memory stays near its peak
(about 8% above the peak of the same step without it, measured). ``REALHF_CPU_MALLOC=default`` keeps
glibc's behaviour; anything other than ``retain`` or ``default`` is refused. Nothing happens where the C
library is not glibc.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

from realhf.base import logging

logger = logging.getLogger("realhf.host_memory")

ENV_VAR = "REALHF_CPU_MALLOC"
MODES = ("retain", "default")
# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
# free memory at the top of the heap beyond this goes back to the system
TRIM_THRESHOLD = 2**31 - 1

_applied = None


def mode() -> str:
    """``$REALHF_CPU_MALLOC`` (default ``retain``); ValueError naming the allowed values otherwise."""
    m = os.environ.get(ENV_VAR, "retain").strip().lower() or "retain"
    if m not in MODES:
        raise ValueError(f"{ENV_VAR}={m!r} is not a host-memory mode; allowed: {', '.join(MODES)}")
    return m


def _glibc():
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def retain_freed_memory() -> bool:
    """Apply :func:`mode` to this process (once); True when glibc now keeps freed memory for reuse."""
    global _applied
    if _applied is not None:
        return _applied
    m = mode()
    libc = _glibc() if m == "retain" else None
    ok = False
    if libc is not None:
        ok = bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
        if not ok:
            logger.warning("mallopt refused the host-memory settings; freed memory goes back to the system")
    _applied = ok
    logger.debug("host memory mode %s (applied: %s)", m, ok)
    return ok
