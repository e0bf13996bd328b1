"""Planning a run for a cluster this machine is not part of: the run's model folders and data files exist there, not
here. ``python -m realhf.apps.plan --cluster ...`` registers each absent path with what stands for it while it builds
the spec: a model folder by the ``config.json`` fields of a tabled shape (``realhf.plan.shapes``), a data file by
nothing (the plan reads the batch sizes and bounds from the options). The config checks accept a registered path, the
experiments take a stand-in model's shape from here (no weights, no tokenizer to check), and count a stand-in dataset
as one batch. Nothing is registered in a run: a launch checks every path.
"""
from __future__ import annotations

import contextlib
import os
from typing import Dict, Iterator, Optional

# the rows a stand-in data file counts as: the run's length (and so its learning-rate schedule) does not change a
# step's plan
STAND_IN_ROWS = 1_000_000
_STAND_INS: Dict[str, Optional[dict]] = {}  # path -> config.json fields (a model folder) or None (a data file)


def _key(path: str) -> str:
    return os.path.abspath(os.path.expanduser(path))


def is_stand_in(path: Optional[str]) -> bool:
    return bool(path) and _key(path) in _STAND_INS


def hf_config(path: str) -> Optional[dict]:
    """The ``config.json`` fields standing in for model folder ``path`` (None: not a stand-in model)."""
    return _STAND_INS.get(_key(path)) if path else None


@contextlib.contextmanager
def standing_in(paths: Dict[str, Optional[dict]]) -> Iterator[None]:
    """Within the block, each path of ``paths`` stands in as given (see the module docstring)."""
    keys = {_key(p): v for p, v in paths.items()}
    old = {k: _STAND_INS[k] for k in keys if k in _STAND_INS}
    _STAND_INS.update(keys)
    try:
        yield
    finally:
        for k in keys:
            _STAND_INS.pop(k, None)
        _STAND_INS.update(old)
