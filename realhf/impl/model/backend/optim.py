"""Optimizer config, AdamW construction and the learning-rate schedule (warm-up + cosine/linear/constant)."""
from __future__ import annotations

import dataclasses
import math
from typing import Dict, List

import torch


@dataclasses.dataclass
class OptimizerConfig:
    lr: float = dataclasses.field(default=1e-5, metadata={"help": "peak learning rate"})
    weight_decay: float = dataclasses.field(default=0.0, metadata={"help": "AdamW weight decay (not on norms/biases)"})
    beta1: float = dataclasses.field(default=0.9, metadata={"help": "AdamW beta1"})
    beta2: float = dataclasses.field(default=0.999, metadata={"help": "AdamW beta2"})
    eps: float = dataclasses.field(default=1e-8, metadata={"help": "AdamW epsilon"})
    lr_scheduler_type: str = dataclasses.field(default="constant", metadata={"help": "constant | cosine | linear"})
    warmup_steps_proportion: float = dataclasses.field(default=0.0, metadata={"help": "fraction of steps for linear warm-up"})
    min_lr_ratio: float = dataclasses.field(default=0.0, metadata={"help": "final lr / peak lr for cosine and linear"})
    gradient_clipping: float = dataclasses.field(default=1.0, metadata={"help": "max global grad norm; <= 0 disables"})

    def __post_init__(self):
        if not self.lr >= 0:
            raise ValueError(f"optimizer lr must be >= 0, got {self.lr}")
        if self.weight_decay < 0:
            raise ValueError(f"optimizer weight_decay must be >= 0, got {self.weight_decay}")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ValueError(f"optimizer betas must be in [0, 1), got ({self.beta1}, {self.beta2})")
        if self.lr_scheduler_type not in ("constant", "cosine", "linear"):
            raise ValueError(
                f"lr_scheduler_type must be one of constant, cosine, linear; got {self.lr_scheduler_type!r}"
            )
        if not 0 <= self.warmup_steps_proportion <= 1:
            raise ValueError(f"warmup_steps_proportion must be in [0, 1], got {self.warmup_steps_proportion}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")


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
    return name.endswith(".bias") or "norm" in name.split(".")[-2] if "." in name else False


def build_adamw(named_params: List[tuple], cfg: OptimizerConfig) -> torch.optim.Optimizer:
    decay = [p for n, p in named_params if not no_decay(n)]
    nodecay = [p for n, p in named_params if no_decay(n)]
    groups = [g for g in ({"params": decay, "weight_decay": cfg.weight_decay}, {"params": nodecay, "weight_decay": 0.0}) if g["params"]]
    kw: Dict = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    dev = named_params[0][1].device
    try:
        return torch.optim.AdamW(groups, fused=True, **kw) if dev.type in ("cpu", "cuda") else torch.optim.AdamW(groups, **kw)
    except (RuntimeError, TypeError):  # fused kernel unavailable for this device/dtype
        return torch.optim.AdamW(groups, foreach=True, **kw)
