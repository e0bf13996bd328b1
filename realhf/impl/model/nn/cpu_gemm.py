"""The matrix multiplication kernel of every linear layer on CPU.

``torch.nn.functional.linear`` on CPU calls the BLAS PyTorch was built with (MKL in the x86 wheels). On
some CPUs that is far from the machine's peak: on the AMD EPYC with AVX-512 of our CI, MKL's fp32 GEMM ran
at 150-210 GFLOP/s while oneDNN (also inside PyTorch, ``torch.ops.mkldnn``) ran the same products at
290-490 GFLOP/s (``benchmarks/bench_gemm.py`` prints both). :func:`linear` runs a layer with the kernel
chosen for this process:

- ``aten``: ``torch.nn.functional.linear``;
- ``onednn``: oneDNN's linear, forward and backward (``_OneDNNLinear``: the input gradient and the weight
  gradient are oneDNN products too), for float32, bfloat16 and float16 CPU tensors; anything else (CUDA,
  float64) and code being compiled (``torch.compile`` chooses its own kernels) go to ``aten``.

The choice is ``REALHF_CPU_GEMM`` (``auto`` | ``aten`` | ``onednn``), read once per process; ``auto`` (the
default) times both kernels on a small product when first needed and keeps oneDNN only when it is clearly
faster (:data:`AUTO_MARGIN`), so a machine where MKL is the better kernel keeps MKL. The first process to probe on
a machine records its choice (:func:`machine_choice_path`) and every later one uses it, so all processes of a run,
and a resumed run, multiply alike. Both compute in the
tensors' dtype (no lower-precision shortcut): results differ from each other only by the order of the
additions.
"""
from __future__ import annotations

import functools
import logging
import os
import statistics
import time
import weakref
from contextlib import contextmanager
from typing import Optional

import torch
import torch.nn.functional as F

from realhf.base.cache_dir import realhf_cache_dir
from realhf.impl.model.nn import decode_ops

logger = logging.getLogger("realhf.cpu_gemm")

KERNELS = ("auto", "aten", "onednn")
ENV_VAR = "REALHF_CPU_GEMM"
# auto keeps oneDNN only when its time is below this fraction of aten's on the probe product
AUTO_MARGIN = 0.85
_ONEDNN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what oneDNN's linear can take (see onednn_serves)

_choice: Optional[str] = None
# packed (oneDNN-blocked) copies of parameters, kept while a packed_weights() context is open
_pack_depth = 0
# id(parameter) -> (weak reference to it, (version, storage, dtype, shape) when packed, packed copy)
_packed: dict = {}
# the row count oneDNN packs for: a decode step's batch (a packed weight serves any row count)
PACK_ROWS = 32


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@functools.lru_cache(maxsize=None)
def onednn_serves(dtype: torch.dtype) -> bool:
    """Whether oneDNN's linear runs ``dtype`` on this CPU: fp32 always; bf16 and fp16 only where the CPU has the
    instructions its kernels need (an AVX2-only CPU has none for bf16: oneDNN then cannot build the primitive)."""
    if dtype not in _ONEDNN_DTYPES or not onednn_available():
        return False
    try:
        _onednn_linear(torch.ones(2, 4, dtype=dtype), torch.ones(3, 4, dtype=dtype))
    except RuntimeError:
        return False
    return True


def _onednn_linear(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor] = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


def _seconds(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def probe(m: int = 128, k: int = 1024, n: int = 1024, reps: int = 5) -> dict:
    """Seconds of one ``[m, k] x [k, n]`` float32 product with each kernel (alternating, median of ``reps``)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g)
    out = {"aten": [], "onednn": []}
    F.linear(x, w), _onednn_linear(x, w)  # warm-up (oneDNN builds its kernel on first use)
    for _ in range(reps):
        out["aten"].append(_seconds(lambda: F.linear(x, w)))
        out["onednn"].append(_seconds(lambda: _onednn_linear(x, w)))
    return {kname: statistics.median(v) for kname, v in out.items()}


def requested(name: Optional[str] = None) -> str:
    """The kernel asked for: ``name``, else ``$REALHF_CPU_GEMM``, else ``auto``; checked (no probing). Raises
    ValueError for an unknown name, or for ``onednn`` where this PyTorch has no oneDNN. The launcher calls it
    before any worker starts."""
    name = (name if name is not None else os.environ.get(ENV_VAR, "auto")).strip().lower() or "auto"
    if name not in KERNELS:
        raise ValueError(f"{ENV_VAR}={name!r} is not a CPU GEMM kernel; allowed: {', '.join(KERNELS)}")
    if name == "onednn" and not onednn_available():
        raise ValueError(f"{ENV_VAR}=onednn, but this PyTorch build has no oneDNN (torch.backends.mkldnn); "
                         "allowed here: aten, auto")
    return name


def choose(requested_name: Optional[str] = None) -> str:
    """Resolve the requested kernel (:func:`requested`) to ``aten`` or ``onednn``, probing for ``auto``."""
    name = requested(requested_name)
    if name != "auto":
        return name
    if not onednn_available():
        return "aten"
    path = machine_choice_path()
    kept = _read_choice(path)
    if kept is not None:
        logger.info("CPU GEMM kernel: %s (this machine's probe, %s)", kept, path)
        return kept
    t = probe()
    pick = "onednn" if t["onednn"] < AUTO_MARGIN * t["aten"] else "aten"
    first = _write_choice(path, pick)
    logger.info("CPU GEMM kernel: %s (probe 128x1024x1024: aten %.2f ms, onednn %.2f ms%s)", first,
                t["aten"] * 1e3, t["onednn"] * 1e3, "" if first == pick else "; another process chose first")
    return first


# Where two kernels are close, the probe's timing noise would let processes of one run, or a run and its resumed
# relaunch, choose differently, and their results differ in rounding. So ``auto`` probes once per machine (CPU model
# and PyTorch version) and every later process reads that choice.
def machine_choice_path() -> str:
    """The file holding this machine's ``auto`` choice, under ``$REALHF_CACHE_DIR`` (default ~/.cache/realhf)."""
    import hashlib
    import platform

    model = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    key = hashlib.sha1(f"{model}|{platform.machine()}|{torch.__version__}".encode()).hexdigest()[:16]
    return os.path.join(realhf_cache_dir(), "cpu_gemm", f"auto-{key}")


def _read_choice(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            name = f.read().strip()
    except OSError:
        return None
    return name if name in ("aten", "onednn") else None


def _write_choice(path: str, pick: str) -> str:
    """Record ``pick`` unless another process recorded a choice first; returns the recorded choice (``pick`` where
    the folder cannot be written: this process then keeps its own probe)."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(pick)
        try:
            os.link(tmp, path)  # fails where the file exists: the first process's choice stays
        finally:
            os.unlink(tmp)
    except FileExistsError:
        return _read_choice(path) or pick
    except OSError as e:
        logger.debug("cannot record the CPU GEMM choice in %s: %s", path, e)
    return pick


def kernel() -> str:
    """This process's CPU GEMM kernel, chosen on first call (see :func:`choose`)."""
    global _choice
    if _choice is None:
        _choice = choose()
    return _choice


def set_kernel(name: Optional[str]) -> str:
    """Choose the kernel again (``None``: from the environment); returns the choice. For tests and benchmarks."""
    global _choice
    _choice = None if name is None else choose(name)
    return kernel()


class _OneDNNLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        ctx.has_bias = b is not None
        return _onednn_linear(x, w, b)

    @staticmethod
    def backward(ctx, gy):
        x, w = ctx.saved_tensors
        gx = gw = gb = None
        gy2 = gy.reshape(-1, gy.shape[-1])
        if ctx.needs_input_grad[0]:
            # dx = dy @ W: a linear whose [out, in] weight is W^T
            gx = _onednn_linear(gy, w.t())
        if ctx.needs_input_grad[1]:
            # dW = dy^T @ x: a linear of dy^T [N, T] against the [K, T] "weight" x^T
            gw = _onednn_linear(gy2.t().contiguous(), x.reshape(-1, x.shape[-1]).t())
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = gy2.sum(0)
        return gx, gw, gb


@contextmanager
def packed_weights():
    """Within this context, inference (no autograd) with the oneDNN kernel multiplies by a copy of each
    weight parameter laid out in oneDNN's blocked format, made on first use and made again when the
    parameter changes (its version counter or storage): 1.6x faster products at 32 rows than the plain
    layout (which oneDNN reorders on every call), for one extra copy of the weights while the context is
    open. Generation opens it; contexts nest, and the copies are dropped when the outermost one closes.
    The version counter catches in-place changes made through the parameter itself only: a change through
    ``.data`` or through a flat buffer the parameters are views of (ReaLModel's) does not move it, so
    whoever keeps a context open across weight updates calls :func:`drop_packed` when it loads new weights
    (``generate`` opens one per call, the generation server drops the copies on every update)."""
    global _pack_depth
    _pack_depth += 1
    try:
        yield
    finally:
        _pack_depth -= 1
        if _pack_depth == 0:
            _packed.clear()


def drop_packed() -> None:
    """Forget every packed copy. Call before changing weights in a way their version counters do not see
    (``param.data.copy_``, loading a checkpoint into ``.data``) while a :func:`packed_weights` context stays
    open (a generation server's loop)."""
    _packed.clear()


def with_packed_weights(fn):
    """Decorator: run ``fn`` inside :func:`packed_weights`."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with packed_weights():
            return fn(*args, **kwargs)

    return wrapper


def _weight_key(w: torch.Tensor) -> tuple:
    return (w._version, w.data_ptr(), w.dtype, tuple(w.shape))


def pack(w: torch.Tensor) -> torch.Tensor:
    """``w`` ([out, in]) laid out in oneDNN's blocked format for :func:`_onednn_linear` (a new tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS)


def _packed_weight(w: torch.Tensor) -> torch.Tensor:
    key = _weight_key(w)
    hit = _packed.get(id(w))
    if hit is not None and hit[0]() is w and hit[1] == key:
        return hit[2]
    p = pack(w.detach())
    _packed[id(w)] = (weakref.ref(w), key, p)
    return p


def _packed_group(weights, biases):
    """The packed concatenation of ``weights`` (stacked by output rows) and the concatenated biases (or None), cached
    like :func:`_packed_weight` under the tuple of the parameters."""
    gid = tuple(id(w) for w in weights)
    key = tuple(_weight_key(t) for t in (*weights, *(b for b in biases if b is not None)))
    hit = _packed.get(gid)
    if hit is not None and all(r() is w for r, w in zip(hit[0], weights)) and hit[1] == key:
        return hit[2]
    w = torch.cat([t.detach() for t in weights])
    b = None if biases[0] is None else torch.cat([t.detach() for t in biases])
    out = (pack(w), b)
    _packed[gid] = (tuple(weakref.ref(t) for t in weights), key, out)
    return out


def linear_group(x: torch.Tensor, layers) -> tuple:
    """``tuple(layer(x) for layer in layers)`` for linear layers with ``weight`` and ``bias`` attributes that read
    the same input (q/k/v, gate/up). Under :func:`packed_weights` inference with the oneDNN kernel, one product with
    the packed concatenation of their weights (fewer, wider GEMMs: 1.2x on SmolLM2's q/k/v at 32 rows); otherwise
    each layer's own forward."""
    if (not x.is_cpu or torch.is_grad_enabled() or not packing() or x.dim() != 2 or torch.compiler.is_compiling()
            or any(not isinstance(m.weight, torch.nn.Parameter) or m.weight.dtype != x.dtype for m in layers)
            or len({m.bias is None for m in layers}) != 1):
        return tuple(m(x) for m in layers)
    w, b = _packed_group([m.weight for m in layers], [m.bias for m in layers])
    return _onednn_linear(x, w, b).split([m.weight.shape[0] for m in layers], dim=-1)


def packing() -> bool:
    """Whether a :func:`packed_weights` context is open and the oneDNN kernel is in use."""
    return _pack_depth > 0 and kernel() == "onednn"


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``torch.nn.functional.linear`` with this process's CPU GEMM kernel (see the module docstring); a decode
    step's few rows (fp32 inference) go to the tile kernel of :mod:`decode_ops` where it serves, unless oneDNN's
    packed weights are in use (:func:`packing`; as fast as the tile kernel where both were measured)."""
    if not x.is_cpu:  # on CUDA: never the CPU kernels (nor their one-off probe)
        return F.linear(x, weight, bias)
    if not packing():
        y = decode_ops.linear(x, weight, bias)  # None where it does not serve (decode_ops.for_rows)
        if y is not None:
            return y
    if (torch.compiler.is_compiling() or weight.dtype != x.dtype or x.dim() < 2 or kernel() != "onednn"
            or not onednn_serves(x.dtype)):
        return F.linear(x, weight, bias)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        return _OneDNNLinear.apply(x, weight, bias)
    if _pack_depth > 0 and isinstance(weight, torch.nn.Parameter) and weight.dim() == 2:
        return _onednn_linear(x, _packed_weight(weight), bias)
    return _onednn_linear(x, weight, bias)
