"""realhf's C++ kernels (``csrc/<kernel>/<kernel>.cpp``): built at first use, cached, with a PyTorch fallback.

A kernel is JIT-compiled with ``torch.utils.cpp_extension.load`` the first time a process needs it and cached under
``$REALHF_CACHE_DIR/torch_extensions/<python and torch version>/<name>-<hash of the sources and flags>`` (default
``~/.cache/realhf``), so later processes, from this checkout or another of the same code, only import the built
library; processes that start together wait on the build's lock instead of building
twice. A module pre-built by ``REALHF_BUILD_EXT=1 pip install -e . --no-build-isolation`` (setup.py) is used instead
when it imports. Without a compiler or ninja, or when the build fails, the callers use their PyTorch path (with one
logged warning each); ``REALHF_NO_CPP_EXT=1`` disables every kernel.
"""
from __future__ import annotations

import functools
import importlib
import os
import shutil
import sys
import time
from types import ModuleType
from typing import Optional, Sequence, Tuple

import torch

from realhf.base import logging
from realhf.base.cache_dir import realhf_cache_dir

logger = logging.getLogger(__name__)

DISABLE_VAR = "REALHF_NO_CPP_EXT"


def disabled() -> bool:
    return os.environ.get(DISABLE_VAR, "0") not in ("", "0")


def _compiler_problem() -> Optional[str]:
    """Why a JIT build cannot even start (no C++ compiler, no ninja), or None."""
    from torch.utils import cpp_extension

    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return f"no C++ compiler found (looked for {cxx!r}; set CXX to use another)"
    if not cpp_extension.is_ninja_available():
        return "ninja is not installed (pip install ninja)"
    return None


def _headers_flag(src: str) -> list:
    """A define carrying a hash of the shared headers (``csrc/common/*.h``) and of the other sources ``src`` includes
    by a relative path (decode_ops.cpp compiles decode_attention.cpp into itself): PyTorch's build cache hashes only
    the source file and the flags, so a changed header changes the flags and rebuilds every kernel that includes it."""
    import glob
    import hashlib
    import re

    with open(src) as f:
        included = re.findall(r'^#include "([^"]+\.cpp)"', f.read(), re.MULTILINE)
    h = hashlib.sha1()
    paths = sorted(glob.glob(os.path.join(os.path.dirname(os.path.dirname(src)), "common", "*.h")))
    for path in paths + [os.path.normpath(os.path.join(os.path.dirname(src), i)) for i in included]:
        with open(path, "rb") as f:
            h.update(f.read())
    return [f"-DREALHF_COMMON_HEADERS={h.hexdigest()[:12]}"]


def _content_key(src: str, cflags: Sequence[str]) -> str:
    """A hash of the source file, the sources and headers it includes (``_headers_flag``) and the flags."""
    import hashlib

    h = hashlib.sha1()
    with open(src, "rb") as f:
        h.update(f.read())
    h.update("\0".join(list(cflags) + _headers_flag(src)).encode())
    return h.hexdigest()[:16]


def _import_built(name: str, build_dir: str) -> Optional[ModuleType]:
    """The extension ``name`` already built in ``build_dir`` (whose name carries the content key of its sources),
    imported without asking ninja: PyTorch's ninja file names the sources by absolute path, so a build made from
    another checkout of the same code would be compiled again. None if there is no usable library."""
    import importlib.util

    path = os.path.join(build_dir, f"{name}.so")
    # "lock": PyTorch's build baton; while another process builds here, wait on it through cpp_extension.load
    if not os.path.isfile(path) or os.path.exists(os.path.join(build_dir, "lock")):
        return None
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    except (ImportError, OSError) as e:  # a broken or foreign library: build again
        logger.debug(f"cannot import the built {name} from {path} ({e}); building it again")
        return None


class CppKernel:
    """One C++ extension: ``name`` (the JIT module's name), its source relative to the repository (shipped as
    ``realhf/<source>`` in wheels), ``prebuilt`` (the module setup.py may build), ``what`` (for messages)."""

    def __init__(self, name: str, source: str, prebuilt: str, what: str, cflags: Sequence[str] = ("-O3",)):
        self.name, self.source, self.prebuilt, self.what = name, source, prebuilt, what
        self.cflags = list(cflags)

    def source_path(self) -> Optional[str]:
        """The repository's ``csrc/`` (editable installs, checkouts) or the copy inside the package; None if neither."""
        pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../realhf
        for c in (os.path.join(os.path.dirname(pkg_root), self.source), os.path.join(pkg_root, self.source)):
            if os.path.isfile(c):
                return c
        return None

    def build_directory(self, src: Optional[str] = None) -> str:
        """The cache folder of the compiled extension: one per Python and torch version and per content of the
        sources and flags (``src``: the source file, default :meth:`source_path`), not per checkout. Two checkouts
        of the same code share one build; two versions of the code each keep theirs (no rebuild when switching)."""
        tag = f"py{sys.version_info.major}{sys.version_info.minor}_torch{torch.__version__.replace('+', '_')}"
        src = src or self.source_path()
        key = _content_key(src, self.cflags) if src is not None else "nosource"
        return os.path.join(realhf_cache_dir(), "torch_extensions", tag, f"{self.name}-{key}")

    @functools.lru_cache(maxsize=None)
    def _load(self) -> Tuple[Optional[ModuleType], Optional[BaseException], float]:
        """Build (first time) or import (later) once per process: ``(module, error, seconds)``, one of them None."""
        if disabled():
            return None, RuntimeError(f"disabled by {DISABLE_VAR}"), 0.0
        t0 = time.perf_counter()
        try:
            return importlib.import_module(self.prebuilt), None, time.perf_counter() - t0
        except ImportError as e:  # not pre-built, or built against another torch: JIT build
            logger.debug(f"no usable prebuilt {self.prebuilt} ({e}); using the JIT build")
        src = self.source_path()
        if src is None:
            return None, FileNotFoundError(f"{self.source} not found next to the realhf package"), 0.0
        problem = _compiler_problem()
        if problem is not None:
            return None, RuntimeError(problem), 0.0
        from torch.utils import cpp_extension

        build_dir = self.build_directory(src)
        t0 = time.perf_counter()
        mod = _import_built(self.name, build_dir)
        if mod is not None:
            return mod, None, time.perf_counter() - t0
        os.makedirs(build_dir, exist_ok=True)
        fresh = not any(f.endswith((".so", ".pyd")) for f in os.listdir(build_dir))
        if fresh:
            logger.info(f"Compiling the {self.what} C++ extension into {build_dir} (first use only, ~20-60 s)...")
        t0 = time.perf_counter()
        try:
            mod = cpp_extension.load(name=self.name, sources=[src], extra_cflags=self.cflags + _headers_flag(src),
                                     build_directory=build_dir, verbose=False)
        # A JIT build fails in many ways (compiler errors -> RuntimeError, a compiler that cannot report its
        # version -> CalledProcessError, a broken cache -> ImportError/OSError). Each means "use the PyTorch path";
        # the error is kept so strict loads can raise it.
        except Exception as e:  # noqa: BLE001
            return None, e, time.perf_counter() - t0
        dt = time.perf_counter() - t0
        if fresh:
            logger.info(f"{self.what} C++ extension built in {dt:.1f} s")
        return mod, None, dt

    def load(self, strict: bool = False) -> Optional[ModuleType]:
        """The module, or None when it cannot be built (``strict``: raise the build's error instead)."""
        mod, err, _ = self._load()
        if err is not None and strict:
            raise RuntimeError(f"building the {self.name} C++ extension failed: {err}") from err
        return mod

    def load_or_warn(self) -> Optional[ModuleType]:
        """The module, or None after logging (once per process) why the PyTorch path runs instead."""
        mod, err, _ = self._load()
        if mod is None:
            self._warn_fallback(str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__)
        return mod

    def load_seconds(self) -> float:
        """Seconds the (first) build or import took in this process."""
        return self._load()[2]

    @functools.lru_cache(maxsize=None)
    def _warn_fallback(self, reason: str) -> None:
        logger.warning(f"{self.what} C++ extension unavailable ({reason}); using the PyTorch implementation.")


# the modules that define realhf's kernels (each a module-level ``_KERNEL``)
KERNEL_MODULES = ("realhf.impl.model.utils.gae", "realhf.impl.model.nn.kv_cache", "realhf.impl.model.nn.decode_ops")


def build_all() -> int:
    """Build (or find cached) every kernel now, so no run pays the first build; prints one line per kernel. Exit
    code 1 if one fails to build where a compiler exists."""
    rc = 0
    for name in KERNEL_MODULES:
        k = importlib.import_module(name)._KERNEL
        mod, err, dt = k._load()
        print(f"{k.name}: " + (f"ready in {dt:.1f} s ({k.build_directory()})" if mod is not None else f"unavailable: {err}"))
        rc |= int(mod is None and not disabled() and _compiler_problem() is None)
    return rc


if __name__ == "__main__":  # python -m realhf.base.cpp_ext
    sys.exit(build_all())
