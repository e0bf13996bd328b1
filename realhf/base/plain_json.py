"""Checking that a value is plain JSON (what may travel in a wire header: no pickled objects)."""
from __future__ import annotations

from typing import Any


class PlainJSONError(TypeError, ValueError):
    """A value that is not plain JSON (dict with str keys, list, str, int, float, bool, None)."""


def check_plain_json(obj: Any, path: str = "data") -> None:
    """Raise :class:`PlainJSONError` naming the first path in ``obj`` that is not plain JSON."""
    if obj is None or isinstance(obj, (str, bool, int, float)):
        return
    if isinstance(obj, list):
        for i, v in enumerate(obj):
            check_plain_json(v, f"{path}[{i}]")
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, str):
                raise PlainJSONError(f"{path}: dict key {k!r} is a {type(k).__name__}; plain JSON needs str keys")
            check_plain_json(v, f"{path}[{k!r}]")
        return
    raise PlainJSONError(
        f"{path} is a {type(obj).__name__}, which is not plain JSON "
        f"(use dict/list/str/int/float/bool/None; tensors travel separately)"
    )
