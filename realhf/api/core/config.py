"""Config dataclasses shared by the API layer and the implementations (no implementation imports)."""
from __future__ import annotations

import dataclasses
import math


def check_finite(config, prefix: str = "") -> None:
    """Reject NaN and infinite float options anywhere in the dataclass instance ``config`` (nested sections
    and lists included), so a float option added later is covered too. The ``ValueError`` names the dotted
    key (``prefix`` + field path) and the value."""
    for f in dataclasses.fields(config):
        v = getattr(config, f.name)
        key = prefix + f.name
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            check_finite(v, key + ".")
            continue
        items = enumerate(v) if isinstance(v, (list, tuple)) else [(None, v)]
        for i, x in items:
            if isinstance(x, float) and not math.isfinite(x):
                k = key if i is None else f"{key}[{i}]"
                raise ValueError(f"{k}={x!r} is not allowed; expected a finite number (nan and inf are never "
                                 f"valid options): set {k} to a finite value")


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
    skip_nonfinite_steps: int = dataclasses.field(default=0, metadata={
        "help": "how many optimizer steps with a non-finite loss or grad norm are skipped (not applied) over the "
                "whole run before it stops with an error; 0 = stop at the first"})

    def __post_init__(self):
        check_finite(self)
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
        s = self.skip_nonfinite_steps
        if not isinstance(s, int) or isinstance(s, bool) or s < 0:
            raise ValueError(f"skip_nonfinite_steps={s!r} is not allowed; expected an integer >= 0 (the optimizer "
                             "steps with a non-finite loss or grad norm skipped over the run before it stops)")
