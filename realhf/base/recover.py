"""Recover checkpoints on disk: which run wrote them, swapped in with one atomic rename, checked before use.

Layout of a run's ``recover/`` folder::

    recover/LATEST                  {"dir": "ckpt-00000012-<hex>", "finished": false}
    recover/ckpt-00000012-<hex>/    written by the workers, then INFO (below) by the master
        recover_info.json           {"run_id", "fingerprint", "options", "global_step", ..., "files": {path: bytes}}

A checkpoint is written into a fresh ``ckpt-*`` folder; it becomes *the* checkpoint only when ``LATEST``
is replaced (write a temporary file, fsync, ``os.replace``) to point at it, after its ``recover_info.json``
(with the size of every file) is on disk. A crash at any moment leaves ``LATEST`` pointing at a complete
checkpoint — the new one or the previous one; folders that never became ``LATEST`` are removed by the next
commit. Before a run resumes, :meth:`RecoverStore.latest` checks that every file of the manifest exists
with its recorded size, so a truncated checkpoint is refused by name before any worker starts.

The workers' state files (``*.pt``) are read by :func:`load_state_file` with ``torch.load(weights_only=True)``: plain
tensors, numbers and containers only, so a file planted in the run folder cannot run code; one that cannot be read
so is refused as damaged, naming it.

Every checkpoint records the id of the run that wrote it and a fingerprint of the options that shape the
training (see ``BaseExperimentConfig.fingerprint``); the launcher decides from them whether a checkpoint
belongs to the run being started (``realhf.apps.main``).
"""
from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from typing import Dict, Optional, Sequence

from realhf.base import logging
from realhf.base.plain_json import write_json_atomic

logger = logging.getLogger(__name__)

INFO = "recover_info.json"
LATEST = "LATEST"
_PREFIX = "ckpt-"


class RecoverError(RuntimeError):
    """A recover checkpoint that cannot be used (missing, truncated or malformed files); names the file."""


def _read_json(path: str, what: str) -> dict:
    try:
        with open(path) as f:
            obj = json.load(f)
    except FileNotFoundError:
        raise RecoverError(f"{what} {path} is missing") from None
    except (OSError, ValueError) as e:
        raise RecoverError(f"{what} {path} cannot be read ({e}); the recover checkpoint is damaged") from None
    if not isinstance(obj, dict):
        raise RecoverError(f"{what} {path} is not a JSON object; the recover checkpoint is damaged")
    return obj


# lines of torch's load errors that advise loading with weights_only=False: that would unpickle arbitrary objects,
# which is what a planted file needs to run code; they are left out of the errors realhf shows
_UNSAFE_ADVICE = ("weights_only", "Weights only load failed", "file an issue", "torch.load")


def _load_cause(e: BaseException) -> str:
    """The gist of a failed ``torch.load``: its first statement, without the advice to load unsafely."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip() and not any(a in ln for a in _UNSAFE_ADVICE)]
    gist = lines[0].split(". ")[0].rstrip(".") if lines else ""
    if len(gist) > 200:
        gist = gist[:200] + "..."
    return f"{type(e).__name__}: {gist}" if gist else type(e).__name__


def load_state_file(path: str, keys: Sequence[str] = ()) -> dict:
    """The state a worker saved in recover file ``path`` (a dict holding at least ``keys``), read as plain tensors
    and numbers (``weights_only=True``). RecoverError naming the file when it cannot be read, is damaged, or is not
    such a state."""
    import torch

    try:
        st = torch.load(path, weights_only=True)
    except FileNotFoundError:
        raise RecoverError(f"recover file {path} is missing") from None
    except OSError as e:
        raise RecoverError(f"recover file {path} cannot be read: {e.strerror or e}") from None
    except Exception as e:  # noqa: BLE001  (any failure of the restricted unpickler: these bytes are no such state)
        raise RecoverError(f"recover file {path} is damaged or is not a realhf recover file ({_load_cause(e)}; "
                           "realhf reads recover files as plain tensors and numbers only, so that a planted file "
                           "cannot run code). Move the recover folder aside (or set recover_mode=disabled) to start "
                           "afresh") from None
    missing = [k for k in keys if not isinstance(st, dict) or k not in st]
    if missing:
        raise RecoverError(f"recover file {path} is not a realhf recover file of this kind: it lacks {missing}. Move "
                           "the recover folder aside (or set recover_mode=disabled) to start afresh")
    return st


def _manifest(root: str) -> Dict[str, int]:
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            out[os.path.relpath(p, root)] = os.path.getsize(p)
    return out


class RecoverStore:
    """The recover checkpoints of one run folder (``root`` = ``<run>/recover``)."""

    def __init__(self, root: str):
        self.root = root

    def exists(self) -> bool:
        """Whether the folder holds anything (a checkpoint, a half-written one, or an old layout's files)."""
        return os.path.isdir(self.root) and bool(os.listdir(self.root))

    def latest(self) -> Optional[dict]:
        """The info of the current checkpoint with ``"path"`` (its folder) and ``"finished"`` added, or None when
        there is none. Raises RecoverError naming the file when it is damaged or truncated. Read while a run goes on
        (a monitor, a test), the checkpoint may be replaced between reading the pointer and its folder: the new one
        is read then."""
        ptr_path = os.path.join(self.root, LATEST)
        if not os.path.exists(ptr_path):
            if os.path.isfile(os.path.join(self.root, INFO)):
                raise RecoverError(f"{self.root} holds a recover checkpoint of an older realhf layout (no {LATEST} file); "
                                   "it cannot be resumed: move or delete it")
            return None
        for _ in range(10):
            ptr = _read_json(ptr_path, "recover pointer")
            try:
                return self._checked(ptr, ptr_path)
            except RecoverError:
                if _read_json(ptr_path, "recover pointer").get("dir") == ptr.get("dir"):
                    raise  # still the current checkpoint: it is damaged
        return self._checked(_read_json(ptr_path, "recover pointer"), ptr_path)

    def _checked(self, ptr: dict, ptr_path: str) -> dict:
        """The checkpoint ``ptr`` names, its manifest checked against its files."""
        name = ptr.get("dir")
        if not isinstance(name, str) or not name.startswith(_PREFIX) or os.sep in name:
            raise RecoverError(f"recover pointer {ptr_path} names no checkpoint folder: {ptr!r}")
        path = os.path.join(self.root, name)
        info = _read_json(os.path.join(path, INFO), "recover checkpoint info")
        files = info.get("files")
        if not isinstance(files, dict):
            raise RecoverError(f"{os.path.join(path, INFO)} has no file manifest; the recover checkpoint is damaged")
        for rel, size in files.items():
            p = os.path.normpath(os.path.join(path, rel))
            if not p.startswith(path + os.sep):
                raise RecoverError(f"{os.path.join(path, INFO)} lists a file outside its checkpoint: {rel!r}")
            try:
                got = os.path.getsize(p)
            except OSError:
                raise RecoverError(f"recover checkpoint file {p} is missing") from None
            if got != size:
                raise RecoverError(f"recover checkpoint file {p} has {got} bytes, {size} were written: it is truncated "
                                   "or was changed")
        return {**info, "path": path, "finished": bool(ptr.get("finished", False))}

    def begin(self, global_step: int) -> str:
        """A fresh folder for the checkpoint of ``global_step`` (the workers write into it). Folders of earlier
        attempts that never became the current checkpoint are removed first."""
        os.makedirs(self.root, exist_ok=True)
        self._remove_others(keep=self._current_name())
        path = os.path.join(self.root, f"{_PREFIX}{global_step:08d}-{uuid.uuid4().hex[:8]}")
        os.makedirs(path)
        return path

    def commit(self, path: str, info: dict) -> None:
        """Make ``path`` (filled by the workers) the current checkpoint: its manifest and ``info`` first, then the
        pointer swap, then the previous checkpoint is removed."""
        from realhf.base import failpoint

        info = {**info, "files": _manifest(path), "written_at": time.time()}
        write_json_atomic(os.path.join(path, INFO), info)
        failpoint.hit("recover.before_swap")
        write_json_atomic(os.path.join(self.root, LATEST), {"dir": os.path.basename(path), "finished": False})
        failpoint.hit("recover.after_swap")
        self._remove_others(keep=os.path.basename(path))

    def mark_finished(self) -> None:
        """Record that the run whose checkpoint this is finished: a later fresh start will not resume from it."""
        name = self._current_name()
        if name is not None:
            write_json_atomic(os.path.join(self.root, LATEST), {"dir": name, "finished": True})

    def archive(self, reason: str) -> Optional[str]:
        """Move the whole folder aside to ``recover.stale-<time>`` next to it (nothing is deleted); returns where."""
        if not self.exists():
            return None
        stem = f"{self.root}.stale-{time.strftime('%Y%m%d-%H%M%S')}"
        dest, n = stem, 1
        while os.path.exists(dest):
            dest, n = f"{stem}-{n}", n + 1
        os.replace(self.root, dest)
        logger.warning(f"moved the recover checkpoint folder {self.root} aside to {dest} ({reason}); delete it when it "
                       "is not needed")
        return dest

    def _current_name(self) -> Optional[str]:
        try:
            with open(os.path.join(self.root, LATEST)) as f:
                name = json.load(f).get("dir")
        except (OSError, ValueError, AttributeError):
            return None
        return name if isinstance(name, str) else None

    def _remove_others(self, keep: Optional[str]) -> None:
        for name in os.listdir(self.root):
            if name.startswith(_PREFIX) and name != keep:
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
