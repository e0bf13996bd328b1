"""Generalised Advantage Estimation (GAE) over packed sequences.

A batch holds ``n`` sequences concatenated into 1-D tensors. ``cu_seqlens`` (``[n+1]``) gives the
boundaries of the per-token ``rewards`` (``T`` entries in all). ``values`` holds one more entry per
sequence (``T + n``): the value of every reward position followed by a bootstrap value for the state
after the sequence's last position. For sequence ``i`` of length ``L`` with values ``v_0 .. v_L``::

    v_L     := v_L if bootstrap[i] else 0           (0 when the sequence ended with EOS: terminal)
    delta_t  = r_t + gamma * v_{t+1} - v_t
    A_t      = delta_t + gamma * lam * A_{t+1},      A_L = 0
    R_t      = A_t + v_t                             (the critic's regression target)

Three implementations give the same numbers (all accumulate in float64, results in the input dtype):

* ``"cpp"``: a C++ kernel (``csrc/gae/gae.cpp``) compiled with ``torch.utils.cpp_extension.load`` at
  first use and cached under ``$REALHF_CACHE_DIR/torch_extensions`` (default
  ``~/.cache/realhf/torch_extensions``), so later processes only import the built library. If
  setup.py pre-built it as ``realhf._gae_ext`` and that module imports, it is used instead;
* ``"torch"``: pure PyTorch, vectorised over sequences (one step per position of the longest sequence);
* :func:`gae_reference`: a plain Python loop, the definition the tests check against.

``gae_packed(..., impl="auto")`` uses the C++ kernel when it builds and falls back to PyTorch, with one
logged warning, when there is no compiler/ninja or the build fails. ``REALHF_NO_CPP_EXT=1`` disables
the C++ path. Building and caching: ``realhf.base.cpp_ext``.
"""
from __future__ import annotations

import os
from typing import List, Tuple

import torch

from realhf.base.cpp_ext import CppKernel

_KERNEL = CppKernel("realhf_gae", os.path.join("csrc", "gae", "gae.cpp"), "realhf._gae_ext", "GAE")
EXT_NAME = _KERNEL.name
build_directory = _KERNEL.build_directory  # the cache folder of the compiled extension
load_extension = _KERNEL.load  # the module, or None (strict=True: raise the build error)
extension_load_seconds = _KERNEL.load_seconds  # seconds the build or import took in this process


def cpp_available() -> bool:
    """True when the C++ GAE kernel is built (building it now if needed) and importable."""
    return load_extension() is not None


# ----------------------------------------------------------------------------------------------
# Implementations
# ----------------------------------------------------------------------------------------------


def _check_inputs(rewards, values, cu_seqlens, bootstrap) -> int:
    assert rewards.dim() == 1 and values.dim() == 1, (
        f"rewards and values must be 1-D packed tensors, got shapes {tuple(rewards.shape)}, {tuple(values.shape)}"
    )
    n = cu_seqlens.numel() - 1
    assert n >= 0, "cu_seqlens must have n+1 >= 1 entries"
    assert values.numel() == rewards.numel() + n, (
        f"values must hold one bootstrap value per sequence: expected T + n = {rewards.numel()} + {n} "
        f"entries, got {values.numel()}"
    )
    assert bootstrap.numel() == n, f"bootstrap has {bootstrap.numel()} entries for {n} sequences"
    assert rewards.dtype.is_floating_point and values.dtype.is_floating_point, (
        f"rewards/values must be floating point, got {rewards.dtype}/{values.dtype}"
    )
    return n


def gae_reference(
    rewards: torch.Tensor,
    values: torch.Tensor,
    cu_seqlens: torch.Tensor,
    bootstrap: torch.Tensor,
    gamma: float,
    lam: float,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The definition, as a plain Python loop over sequences and positions (slow; for tests)."""
    _check_inputs(rewards, values, cu_seqlens, bootstrap)
    r = rewards.detach().double().cpu().tolist()
    v = values.detach().double().cpu().tolist()
    cu = [int(x) for x in cu_seqlens.tolist()]
    boot = [bool(x) for x in bootstrap.tolist()]
    adv: List[float] = [0.0] * len(r)
    ret: List[float] = [0.0] * len(r)
    for i in range(len(cu) - 1):
        s, e = cu[i], cu[i + 1]
        vs = v[s + i : e + i + 1]  # L + 1 values of sequence i
        L = e - s
        next_value = vs[L] if boot[i] else 0.0
        a = 0.0
        for t in reversed(range(L)):
            delta = r[s + t] + gamma * next_value - vs[t]
            a = delta + gamma * lam * a
            adv[s + t] = a
            ret[s + t] = a + vs[t]
            next_value = vs[t]
    out = lambda x: torch.tensor(x, dtype=rewards.dtype, device=rewards.device)  # noqa: E731
    return out(adv), out(ret)


def gae_torch(
    rewards: torch.Tensor,
    values: torch.Tensor,
    cu_seqlens: torch.Tensor,
    bootstrap: torch.Tensor,
    gamma: float,
    lam: float,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Pure-PyTorch GAE, vectorised over sequences: sequences are scattered into an ``[n, Lmax]``
    grid and the recursion runs backwards over the ``Lmax`` positions (works on any device)."""
    n = _check_inputs(rewards, values, cu_seqlens, bootstrap)
    T = rewards.numel()
    device = rewards.device
    if T == 0:
        return torch.zeros_like(rewards), torch.zeros_like(rewards)
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    lens = cu[1:] - cu[:-1]
    lmax = int(lens.max().item())
    seq_id = torch.repeat_interleave(torch.arange(n, device=device), lens)  # [T]
    pos = torch.arange(T, device=device) - cu[:-1][seq_id]  # [T] position inside its sequence

    r = torch.zeros(n, lmax, dtype=torch.float64, device=device)
    r[seq_id, pos] = rewards.double()
    # values of sequence i occupy values[cu[i] + i : cu[i+1] + i + 1]; grid column L_i is the bootstrap
    v = torch.zeros(n, lmax + 1, dtype=torch.float64, device=device)
    v[seq_id, pos] = values.double()[torch.arange(T, device=device) + seq_id]
    boot_idx = cu[1:] + torch.arange(n, device=device)
    boot_v = values.double()[boot_idx]
    v[torch.arange(n, device=device), lens] = torch.where(bootstrap.to(device).bool(), boot_v, torch.zeros_like(boot_v))
    valid = torch.arange(lmax, device=device)[None, :] < lens[:, None]

    delta = (r + gamma * v[:, 1:] - v[:, :-1]) * valid  # padded positions contribute nothing
    adv = torch.zeros_like(delta)
    last = torch.zeros(n, dtype=torch.float64, device=device)
    gl = gamma * lam
    for t in range(lmax - 1, -1, -1):
        last = delta[:, t] + gl * last
        adv[:, t] = last
    adv_packed = adv[seq_id, pos]
    ret_packed = adv_packed + v[seq_id, pos]
    return adv_packed.to(rewards.dtype), ret_packed.to(rewards.dtype)


def gae_cpp(
    rewards: torch.Tensor,
    values: torch.Tensor,
    cu_seqlens: torch.Tensor,
    bootstrap: torch.Tensor,
    gamma: float,
    lam: float,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """GAE with the C++ kernel (CPU; tensors on another device are copied over and back).

    float32/float64 run natively; other floating dtypes go through float32. Raises if the extension
    cannot be built.
    """
    _check_inputs(rewards, values, cu_seqlens, bootstrap)
    mod = load_extension(strict=True)
    dtype, device = rewards.dtype, rewards.device
    work = dtype if dtype in (torch.float32, torch.float64) else torch.float32
    adv, ret = mod.gae_packed(
        rewards.detach().to("cpu", work).contiguous(),
        values.detach().to("cpu", work).contiguous(),
        cu_seqlens.detach().to("cpu", torch.long).contiguous(),
        bootstrap.detach().to("cpu", torch.bool).contiguous(),
        float(gamma),
        float(lam),
    )
    return adv.to(device, dtype), ret.to(device, dtype)


def gae_packed(
    rewards: torch.Tensor,
    values: torch.Tensor,
    cu_seqlens: torch.Tensor,
    bootstrap: torch.Tensor,
    gamma: float,
    lam: float,
    impl: str = "auto",
) -> Tuple[torch.Tensor, torch.Tensor]:
    """GAE advantages and returns over packed sequences (see the module docstring for the formulas).

    Args:
        rewards: ``[T]`` per-token rewards of ``n`` concatenated sequences.
        values: ``[T + n]`` per-token values; each sequence's values are followed by its bootstrap value.
        cu_seqlens: ``[n+1]`` int boundaries over ``rewards``.
        bootstrap: ``[n]`` bool: use the trailing value (truncated sequence) or 0 (ended with EOS).
        gamma, lam: discount and GAE lambda.
        impl: ``"auto"`` (C++ if it builds, else PyTorch with one warning), ``"cpp"`` (C++ or raise),
            ``"torch"`` (PyTorch only).

    Returns:
        ``(advantages [T], returns [T])`` in ``rewards``' dtype and device; ``returns = advantages + v``.
    """
    if impl == "torch":
        return gae_torch(rewards, values, cu_seqlens, bootstrap, gamma, lam)
    if impl == "cpp":
        return gae_cpp(rewards, values, cu_seqlens, bootstrap, gamma, lam)
    if impl != "auto":
        raise ValueError(f"gae_packed: impl must be 'auto', 'cpp' or 'torch', got {impl!r}")
    if _KERNEL.load_or_warn() is None:
        return gae_torch(rewards, values, cu_seqlens, bootstrap, gamma, lam)
    return gae_cpp(rewards, values, cu_seqlens, bootstrap, gamma, lam)
