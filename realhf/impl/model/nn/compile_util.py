"""``torch.compile`` with a fallback: compiled paths are optional speed-ups and must never stop a run."""
from __future__ import annotations

from typing import Callable, Optional

import torch

from realhf.base import logging

logger = logging.getLogger(__name__)


class CompiledOrFallback:
    """Calls ``torch.compile(fn, **compile_kw)``; if compiling or running the compiled code raises (no C++
    compiler, an op Inductor cannot handle), logs why once and calls ``fallback`` (default: ``fn`` itself)
    with the same arguments from then on. ``failed`` holds the reason, or None."""

    def __init__(self, fn: Callable, fallback: Optional[Callable] = None, **compile_kw):
        self.fn = fn
        self.fallback = fallback if fallback is not None else fn
        self.compiled = torch.compile(fn, **compile_kw)
        self.failed: Optional[str] = None

    def __call__(self, *args):
        if self.failed is None:
            try:
                return self.compiled(*args)
            except Exception as e:
                self.failed = f"{type(e).__name__}: {e}"
                logger.warning(f"compiled {getattr(self.fn, '__name__', 'function')} unavailable, "
                               f"running eagerly: {self.failed[:500]}")
        return self.fallback(*args)
