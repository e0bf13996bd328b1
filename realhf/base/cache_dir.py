"""Where realhf keeps what it builds or measures once per machine (tiny models, converted checkpoints, compiled C++
kernels, the CPU GEMM choice): ``$REALHF_CACHE_DIR``, default ``~/.cache/realhf``."""
from __future__ import annotations

import os


def realhf_cache_dir() -> str:
    """Root of realhf's local cache: ``$REALHF_CACHE_DIR`` or ``~/.cache/realhf``."""
    root = os.environ.get("REALHF_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "realhf")
    return os.path.abspath(root)
