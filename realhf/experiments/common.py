"""Pieces shared by the experiment builders."""
from __future__ import annotations

from typing import List

from realhf.base.topology import ParallelDims


def single_layout(config, mfc_name: str) -> ParallelDims:
    """The layout of ``mfc_name`` under the config's allocation mode (one model, one layout)."""
    mode = config.allocation()
    if mode.kind == "manual":
        raise ValueError("allocation_mode=manual is not supported by this experiment yet; give a layout such as d2m1p1")
    return mode.layout_of(mfc_name)


def check_model_fits(path: str, layout: ParallelDims, key: str):
    """Fail before any worker starts when the layout does not divide the model's heads/layers/vocab."""
    from realhf.impl.model.conversion.hf_io import config_from_hf_path

    cfg = config_from_hf_path(path)
    try:
        cfg.check_layout(layout.tp, layout.pp)
    except ValueError as e:
        raise ValueError(f"{key}={path!r} under layout {layout}: {e}") from None
    return cfg


def ranks(n: int) -> List[int]:
    return list(range(n))
