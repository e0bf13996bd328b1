"""Optimizer config, AdamW construction and the learning-rate schedule (warm-up + cosine/linear/constant)."""
from __future__ import annotations

import math
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


def build_adamw(named_params: List[tuple], cfg: OptimizerConfig) -> torch.optim.Optimizer:
    decay = [p for n, p in named_params if not no_decay(n)]
    nodecay = [p for n, p in named_params if no_decay(n)]
    groups = [g for g in ({"params": decay, "weight_decay": cfg.weight_decay}, {"params": nodecay, "weight_decay": 0.0}) if g["params"]]
    kw: Dict = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    try:  # the fused kernel serves the parameters' device (CPU and CUDA) where torch has one
        return torch.optim.AdamW(groups, fused=True, **kw)
    except (RuntimeError, TypeError):  # fused kernel unavailable for this device/dtype
        return torch.optim.AdamW(groups, foreach=True, **kw)
