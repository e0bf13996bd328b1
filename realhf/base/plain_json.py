"""Plain JSON: checking that a value is plain JSON (what may travel in a wire header: no pickled objects), and
writing a JSON file atomically (readers see the old or the new file, never a partial one)."""
from __future__ import annotations

import json
import os
import uuid
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


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_json_atomic(path: str, obj: Any, durable: bool = True) -> None:
    """Write ``obj`` as JSON to ``path`` so that readers see the old or the new file, never a partial one;
    ``durable`` also fsyncs the file and its folder (for files that must survive a power loss)."""
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "w") as f:
            json.dump(obj, f)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:  # e.g. a full disk: say which file, and leave no partial temporary behind
        try:
            os.remove(tmp)
        except OSError:
            pass
        if e.filename is not None:
            raise
        raise OSError(e.errno, e.strerror or str(e), path) from None
    if durable:
        _fsync_dir(os.path.dirname(os.path.abspath(path)))
