"""Optimizer config, AdamW construction and the learning-rate schedule (warm-up + cosine/linear/constant)."""
from __future__ import annotations

import contextlib
import functools
import inspect
import math
import sys
from typing import Dict, List

import torch

from realhf.api.core.config import OptimizerConfig  # noqa: F401  (re-exported)


def lr_multiplier(step: int, total_steps: int, cfg: OptimizerConfig) -> float:
    """Multiplier of the peak lr at optimizer step ``step`` (0-based) of ``total_steps``."""
    total = max(1, total_steps)
    warm = int(round(cfg.warmup_steps_proportion * total))
    if step < warm:
        return (step + 1) / warm
    if cfg.lr_scheduler_type == "constant":
        return 1.0
    progress = min(1.0, (step - warm) / max(1, total - warm))
    m = cfg.min_lr_ratio
    if cfg.lr_scheduler_type == "linear":
        return m + (1 - m) * (1 - progress)
    return m + (1 - m) * 0.5 * (1 + math.cos(math.pi * progress))


def no_decay(name: str) -> bool:
    """Biases and norm weights get no weight decay."""
    parts = name.split(".")
    return parts[-1] == "bias" or (len(parts) >= 2 and "norm" in parts[-2])


@contextlib.contextmanager
def _without_dynamo_guard(fn):
    """Within the block, torch's ``_disable_dynamo`` wrapper of ``fn`` (a raw function) calls it straight instead of
    importing ``torch._dynamo`` to build the guard: the wrapper looks for a ``__dynamo_disable`` attribute on the
    function and uses it where set. Outside a ``torch.compile`` trace the guard does nothing but call the function;
    nothing of an optimizer step is compiled here. Where ``torch._dynamo`` is loaded already, torch's guard is kept."""
    if "torch._dynamo" in sys.modules or "__dynamo_disable" in fn.__dict__:
        yield
        return
    setattr(fn, "__dynamo_disable", fn)
    try:
        yield
    finally:
        if fn.__dict__.get("__dynamo_disable") is fn:
            delattr(fn, "__dynamo_disable")


@functools.lru_cache(maxsize=None)
def _raw_fns() -> tuple:
    """torch's (add_param_group, state_dict, load_state_dict, zero_grad, Adam.step, functional adam) without their
    guards (``inspect.unwrap``), or () where this torch lacks one of them."""
    try:
        import torch.optim.adam as adam_mod

        O = torch.optim.Optimizer
        fns = tuple(inspect.unwrap(f) for f in (O.add_param_group, O.state_dict, O.load_state_dict, O.zero_grad,
                                                 torch.optim.Adam.step, adam_mod.adam))
    except (AttributeError, ImportError):
        return ()
    names = ("add_param_group", "state_dict", "load_state_dict", "zero_grad", "step", "adam")
    return fns if all(inspect.isfunction(f) and f.__name__ == n for f, n in zip(fns, names)) else ()


class AdamW(torch.optim.AdamW):
    """``torch.optim.AdamW``, the same update to the bit, that does not import ``torch._dynamo``.

    torch wraps the optimizer's methods (``add_param_group``, ``step``, ``state_dict``, ...) and its functional
    ``adam`` in guards that import ``torch._dynamo`` on first use: 1.7-2.5 s of CPU (sympy, triton where installed)
    in every training worker, for code that is never compiled. This class calls the raw methods instead; the
    ``step`` guard's only other work, running under ``torch.set_grad_enabled(differentiable)``, is kept.
    :func:`build_adamw` uses ``torch.optim.AdamW`` where the installed torch lacks these internals."""

    def __init__(self, *args, **kwargs):
        if not _raw_fns():
            raise RuntimeError("this torch's optimizer internals differ: use torch.optim.AdamW")
        super().__init__(*args, **kwargs)

    def add_param_group(self, param_group):
        _raw_fns()[0](self, param_group)

    def state_dict(self):
        return _raw_fns()[1](self)

    def load_state_dict(self, state_dict):
        _raw_fns()[2](self, state_dict)

    def zero_grad(self, set_to_none: bool = True):
        _raw_fns()[3](self, set_to_none)

    def step(self, closure=None):
        fns = _raw_fns()
        with torch.set_grad_enabled(self.defaults["differentiable"]), _without_dynamo_guard(fns[5]):
            return fns[4](self, closure)


def build_adamw(named_params: List[tuple], cfg: OptimizerConfig) -> torch.optim.Optimizer:
    decay = [p for n, p in named_params if not no_decay(n)]
    nodecay = [p for n, p in named_params if no_decay(n)]
    groups = [g for g in ({"params": decay, "weight_decay": cfg.weight_decay}, {"params": nodecay, "weight_decay": 0.0}) if g["params"]]
    kw: Dict = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    cls = AdamW if _raw_fns() else torch.optim.AdamW
    try:  # the fused kernel serves the parameters' device (CPU and CUDA) where torch has one
        return cls(groups, fused=True, **kw)
    except (RuntimeError, TypeError):  # fused kernel unavailable for this device/dtype
        return cls(groups, foreach=True, **kw)
