"""Name resolving: a small key-value store through which processes find each other's addresses.

Keys are ``/``-separated paths such as ``"my-exp/trial0/worker_address/model_worker/0"``; values are
strings. The file backend (the default, good for one machine or a shared file system) stores the
value of key ``k`` in the file ``<root>/k/.value``, so a key can have both a value and sub-keys.
Writes are atomic (temp file + ``os.replace``/``os.link``), so a reader sees either nothing or the
whole value, and several processes may add and read concurrently.

A run clears the stale entries an earlier run of the same experiment/trial left behind with
``repo.clear_subtree(names.trial_root(experiment, trial))`` before any worker registers itself.
"""
from __future__ import annotations

import getpass
import os
import shutil
import tempfile
import time
import uuid
from typing import List

from realhf.base import logging

logger = logging.getLogger(__name__)

_VALUE_FILE = ".value"  # a reserved segment name: keys may not contain it (nor its temp files)


class NameEntryExistsError(KeyError):
    """``add`` without ``replace=True`` on a key that already has a value."""


class NameEntryNotFoundError(KeyError):
    """``get`` (or ``delete``) of a key that has no value."""


def default_root() -> str:
    """``$REALHF_NAME_RESOLVE_ROOT``, else ``<fileroot>/name_resolve`` where fileroot is
    ``$REALHF_FILEROOT`` or ``<tmp>/realhf-<user>``."""
    explicit = os.environ.get("REALHF_NAME_RESOLVE_ROOT")
    if explicit:
        return explicit
    fileroot = os.environ.get("REALHF_FILEROOT")
    if not fileroot:
        try:
            user = getpass.getuser()
        except (KeyError, OSError):  # no passwd entry (containers)
            user = str(os.getuid())
        fileroot = os.path.join(tempfile.gettempdir(), f"realhf-{user}")
    return os.path.join(fileroot, "name_resolve")


def _split_key(key: str, allow_empty: bool = False) -> List[str]:
    """Checks a key and returns its segments; rejects anything that could leave the root."""
    if not isinstance(key, str):
        raise TypeError(f"name_resolve key must be a str, got {type(key).__name__}: {key!r}")
    if key == "" and allow_empty:
        return []
    if key == "":
        raise ValueError("name_resolve key must not be empty")
    if key.startswith("/") or key.startswith("\\"):
        raise ValueError(f"name_resolve key {key!r} must be relative (no leading '/')")
    if "\x00" in key or "\\" in key:
        raise ValueError(f"name_resolve key {key!r} must not contain NUL or backslash characters")
    segments = key.rstrip("/").split("/") if allow_empty else key.split("/")
    for seg in segments:
        if seg == "":
            raise ValueError(f"name_resolve key {key!r} has an empty segment (leading/trailing or double '/')")
        if seg in (".", ".."):
            raise ValueError(f"name_resolve key {key!r} must not contain '.' or '..' segments")
        if seg.startswith(_VALUE_FILE):
            raise ValueError(f"name_resolve key {key!r}: segments starting with {_VALUE_FILE!r} are reserved")
    return segments


class NameResolveRepository:
    """The interface every backend implements."""

    def add(self, key: str, value: str, replace: bool = False) -> None:
        """Stores ``value`` under ``key``; raises NameEntryExistsError if it has one and not ``replace``."""
        raise NotImplementedError()

    def get(self, key: str) -> str:
        """The value of ``key``; raises NameEntryNotFoundError naming the key."""
        raise NotImplementedError()

    def wait(self, key: str, timeout: float = 60, poll: float = 0.05) -> str:
        """Polls until ``key`` has a value and returns it; TimeoutError naming the key after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.get(key)
            except NameEntryNotFoundError:
                pass
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"name_resolve: key {key!r} did not appear within {timeout:.1f} s ({self!r})")
            time.sleep(min(poll, left))

    def get_subtree(self, prefix: str) -> List[str]:
        """Values of ``prefix`` itself and every key under it, in key order."""
        out = []
        for k in self.find_subtree(prefix):
            try:
                out.append(self.get(k))
            except NameEntryNotFoundError:  # deleted between listing and reading
                continue
        return out

    def find_subtree(self, prefix: str) -> List[str]:
        """Keys equal to or under ``prefix``, sorted."""
        raise NotImplementedError()

    def delete(self, key: str) -> None:
        """Removes the value of ``key``; NameEntryNotFoundError if it has none."""
        raise NotImplementedError()

    def clear_subtree(self, prefix: str) -> None:
        """Removes ``prefix`` and every key under it (no error if there are none)."""
        raise NotImplementedError()


class FileNameResolve(NameResolveRepository):
    """File-system backend rooted at ``root`` (created on demand)."""

    def __init__(self, root: str | None = None):
        self.root = os.path.abspath(root if root is not None else default_root())
        os.makedirs(self.root, exist_ok=True)

    def __repr__(self):
        return f"FileNameResolve(root={self.root!r})"

    def _dir(self, key: str, allow_empty: bool = False) -> str:
        segments = _split_key(key, allow_empty=allow_empty)
        path = os.path.join(self.root, *segments)
        # belt and braces: after normalisation the path must still be inside the root
        real_root = os.path.realpath(self.root)
        real = os.path.realpath(path)
        if real != real_root and not real.startswith(real_root + os.sep):
            raise ValueError(f"name_resolve key {key!r} resolves outside the root {self.root!r}")
        return path

    def add(self, key: str, value: str, replace: bool = False) -> None:
        if not isinstance(value, str):
            raise TypeError(f"name_resolve value for {key!r} must be a str, got {type(value).__name__}")
        d = self._dir(key)
        target = os.path.join(d, _VALUE_FILE)
        for attempt in range(20):
            try:
                os.makedirs(d, exist_ok=True)
                tmp = os.path.join(d, f"{_VALUE_FILE}.tmp.{os.getpid()}.{uuid.uuid4().hex}")
                with open(tmp, "w", encoding="utf-8") as f:
                    f.write(value)
                    f.flush()
                    os.fsync(f.fileno())
            except FileNotFoundError:  # a concurrent delete/clear removed the directory: retry
                time.sleep(0.001 * (attempt + 1))
                continue
            try:
                if replace:
                    os.replace(tmp, target)
                    return
                try:
                    os.link(tmp, target)  # atomic and exclusive: fails if the key has a value
                except FileExistsError:
                    raise NameEntryExistsError(f"name_resolve key {key!r} already exists") from None
                return
            except FileNotFoundError:
                time.sleep(0.001 * (attempt + 1))
                continue
            finally:
                try:
                    os.unlink(tmp)
                except FileNotFoundError:
                    pass
        raise RuntimeError(f"name_resolve: could not add {key!r} under {self.root!r}: directory kept disappearing")

    def get(self, key: str) -> str:
        path = os.path.join(self._dir(key), _VALUE_FILE)
        try:
            with open(path, "r", encoding="utf-8") as f:
                return f.read()
        except (FileNotFoundError, NotADirectoryError):
            raise NameEntryNotFoundError(f"name_resolve key {key!r} not found ({self!r})") from None

    def find_subtree(self, prefix: str) -> List[str]:
        d = self._dir(prefix, allow_empty=True)
        base = _split_key(prefix, allow_empty=True)
        keys = []
        for dirpath, dirnames, filenames in os.walk(d):
            if _VALUE_FILE in filenames:
                rel = os.path.relpath(dirpath, d)
                segs = base + ([] if rel == "." else rel.split(os.sep))
                if segs:
                    keys.append("/".join(segs))
        return sorted(keys)

    def delete(self, key: str) -> None:
        d = self._dir(key)
        try:
            os.unlink(os.path.join(d, _VALUE_FILE))
        except (FileNotFoundError, NotADirectoryError):
            raise NameEntryNotFoundError(f"name_resolve key {key!r} not found ({self!r})") from None
        # remove now-empty directories up to (not including) the root; a concurrent add may
        # re-create them, which ``add`` tolerates by retrying
        while os.path.abspath(d) != self.root:
            try:
                os.rmdir(d)
            except OSError:  # not empty (sub-keys, or a concurrent add), or already gone
                break
            d = os.path.dirname(d)

    def clear_subtree(self, prefix: str) -> None:
        d = self._dir(prefix, allow_empty=True)
        if os.path.abspath(d) == self.root:
            for entry in os.listdir(self.root):
                shutil.rmtree(os.path.join(self.root, entry), ignore_errors=True)
            return
        shutil.rmtree(d, ignore_errors=True)
        if os.path.isdir(d):  # something was added concurrently or could not be removed
            logger.warning("name_resolve: %s was not entirely cleared (concurrent writers?)", d)


_BACKENDS = {"file": FileNameResolve}


def make_repository(kind: str = "file", **kw) -> NameResolveRepository:
    """A repository of the given kind; ``"file"`` takes ``root`` (default: :func:`default_root`)."""
    if kind not in _BACKENDS:
        raise ValueError(f"unknown name_resolve kind {kind!r}; allowed: {sorted(_BACKENDS)}")
    return _BACKENDS[kind](**kw)


def _seg(what: str, value: str) -> str:
    if not isinstance(value, str) or value == "" or "/" in value or value in (".", ".."):
        raise ValueError(f"name_resolve: {what} must be a non-empty str without '/', got {value!r}")
    return value


class names:
    """Key builders; every key of a run lives under ``f"{experiment}/{trial}/"``."""

    @staticmethod
    def trial_root(experiment_name: str, trial_name: str) -> str:
        return f"{_seg('experiment_name', experiment_name)}/{_seg('trial_name', trial_name)}"

    @staticmethod
    def worker_address(experiment_name: str, trial_name: str, worker_name: str) -> str:
        # worker names such as "model_worker/3" become nested keys; each part is checked by the backend
        return f"{names.trial_root(experiment_name, trial_name)}/worker_address/{worker_name}"

    @staticmethod
    def worker_root(experiment_name: str, trial_name: str) -> str:
        return f"{names.trial_root(experiment_name, trial_name)}/worker_address"

    @staticmethod
    def master_heartbeat(experiment_name: str, trial_name: str) -> str:
        return f"{names.trial_root(experiment_name, trial_name)}/master_heartbeat"

    @staticmethod
    def worker_heartbeat(experiment_name: str, trial_name: str, worker_name: str) -> str:
        """Where a worker receives the master's heartbeats."""
        return f"{names.trial_root(experiment_name, trial_name)}/worker_heartbeat/{worker_name}"

    @staticmethod
    def master_address(experiment_name: str, trial_name: str) -> str:
        return f"{names.trial_root(experiment_name, trial_name)}/master_address"

    @staticmethod
    def distributed_init(experiment_name: str, trial_name: str) -> str:
        return f"{names.trial_root(experiment_name, trial_name)}/distributed_init"

    @staticmethod
    def gen_server(experiment_name: str, trial_name: str, index: int) -> str:
        """``host:port`` of generation server ``index`` (registered once it serves)."""
        return f"{names.trial_root(experiment_name, trial_name)}/gen_server/{int(index)}"

    @staticmethod
    def rollout_manager(experiment_name: str, trial_name: str) -> str:
        """``host:port`` of the rollout manager of an asynchronous run (registered once it serves)."""
        return f"{names.trial_root(experiment_name, trial_name)}/rollout_manager"

    @staticmethod
    def trajectory_head(experiment_name: str, trial_name: str, dp_rank: int) -> str:
        """ZMQ address where trainer data-parallel head ``dp_rank`` pulls finished trajectories."""
        return f"{names.trial_root(experiment_name, trial_name)}/trajectory_head/{int(dp_rank)}"
