"""The small-row operations of a decode step in C++ (``csrc/decode_ops``): for inference on a few rows (one per
sequence of a decode step), fp32 on CPU.

- :func:`linear` (through ``cpu_gemm.linear``): ``x W^T + b`` by a tile kernel that streams each weight from memory
  once and requests the next tile's lines while computing the current one; only where the CPU has AVX-512 (its
  portable form is slower than the BLAS kernels).
- ``rms_norm`` (with the residual add before it), ``rotary_`` and ``silu_mul``: each one call where PyTorch
  dispatches several kernels of a few microseconds of arithmetic each.
- ``decode_block``: a whole block of a decode step in one call (``real_model._block_decode_whole``): the functions
  above and the decode attention kernel (``csrc/decode_attention``, compiled into this module), in the order the
  Python path calls them, so the result is the same to the bit, without the Python-level calls of each layer.

Each output comes from one thread in a fixed order of additions, so results do not depend on the thread count; they
differ from the PyTorch path only in rounding. ``REALHF_DECODE_OPS=0`` turns them off (the PyTorch path runs; for
comparisons), as does ``REALHF_NO_CPP_EXT=1`` (every C++ kernel).
"""
from __future__ import annotations

import functools
import os
from typing import Optional

import torch

from realhf.base.cpp_ext import CppKernel

_KERNEL = CppKernel("realhf_decode_ops", os.path.join("csrc", "decode_ops", "decode_ops.cpp"),
                    "realhf._decode_ops_ext", "decode ops",
                    cflags=("-O3", "-fopenmp", "-fno-trapping-math"))  # at::parallel_for runs on torch's OpenMP threads

ENV_VAR = "REALHF_DECODE_OPS"
# inputs of at most this many rows take these kernels (a decode step's batch; prefill and training do not)
MAX_ROWS = 64


@functools.lru_cache(maxsize=None)
def enabled() -> bool:
    return os.environ.get(ENV_VAR, "1").strip() not in ("0", "false", "False", "off")


def for_rows(x: torch.Tensor):
    """The C++ module where it serves ``x`` (2-d, at most :data:`MAX_ROWS` rows, fp32 on CPU, no autograd, outside
    ``torch.compile``), else None."""
    # (is_compiling first: a size test inside a trace would add a guard on the row count)
    if (torch.compiler.is_compiling() or torch.is_grad_enabled() or x.dim() != 2 or x.shape[0] > MAX_ROWS
            or x.dtype != torch.float32 or not x.is_cpu or not enabled()):
        return None
    return _KERNEL.load_or_warn()


@functools.lru_cache(maxsize=None)
def _tile_kernel_pays() -> bool:
    mod = _KERNEL.load()
    return mod is not None and bool(mod.has_avx512())


def linear_kernel(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]):
    """The C++ module where its tile kernel serves ``x W^T + b`` (see :func:`for_rows`; fp32 weight and bias with
    contiguous rows; an AVX-512 CPU), else None."""
    mod = for_rows(x)
    if (mod is None or weight.dtype != torch.float32 or weight.dim() != 2 or weight.stride(1) != 1 or not weight.is_cpu
            or (bias is not None and (bias.dtype != torch.float32 or bias.stride(0) != 1)) or not _tile_kernel_pays()):
        return None
    return mod


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``x W^T + b`` by the tile kernel where it serves (:func:`linear_kernel`), else None (the caller runs its own)."""
    mod = linear_kernel(x, weight, bias)
    if mod is None:
        return None
    return mod.skinny_linear(x if x.stride(1) == 1 else x.contiguous(), weight, bias)
