"""Loading a model folder's tokenizer as ``transformers.AutoTokenizer`` does, without paying for AutoTokenizer in
every process.

``AutoTokenizer.from_pretrained`` decides a folder's tokenizer class from its ``config.json`` and
``tokenizer_config.json`` with tables that live in ``transformers.models.auto``. Importing that package imports every
model's configuration and the modeling and generation code: about 2.6 s on the 2-core machines here, in each process
that loads a tokenizer (the launcher's checks, every model worker, rollout worker and evaluator), where the class it
picks then loads in about 10 ms.

:func:`load_tokenizer` asks AutoTokenizer once per folder content and transformers version, keeps the answer (the
class's module and name) in realhf's cache, and from then on imports that class alone and calls its
``from_pretrained`` as AutoTokenizer would. A folder with remote code (``auto_map``) always goes through
AutoTokenizer, as does any folder whose kept class no longer imports or loads it (AutoTokenizer's new choice is kept).
"""
from __future__ import annotations

import hashlib
import importlib
import json
import os
from typing import Optional, Tuple

from realhf.base.cache_dir import realhf_cache_dir

# files whose content decides AutoTokenizer's choice (with the folder's file names and the transformers version)
_DECIDING_FILES = ("config.json", "tokenizer_config.json")


def _folder_key(path: str, versions: str, files, n_hex: int) -> Optional[str]:
    """A key of ``versions`` (text), the folder's file names and the whole content of each of ``files`` found in it;
    None where none is kept: not a folder, remote code (``auto_map``), unreadable."""
    if not os.path.isdir(path):
        return None
    h = hashlib.sha256(versions.encode())
    try:
        h.update(json.dumps(sorted(os.listdir(path))).encode())
        for name in files:
            p = os.path.join(path, name)
            if not os.path.isfile(p):
                continue
            with open(p, "rb") as f:
                data = f.read()
            if b'"auto_map"' in data:
                return None
            h.update(name.encode() + b"\0" + data + b"\0")
    except OSError:
        return None
    return h.hexdigest()[:n_hex]


def _cache_key(path: str) -> Optional[str]:
    """The key of the folder's class choice, or None where it is not kept (not a folder, remote code, unreadable)."""
    import transformers

    return _folder_key(path, f"transformers {transformers.__version__}\n", _DECIDING_FILES, 24)


def _cache_file(key: str) -> str:
    return os.path.join(realhf_cache_dir(), "tokenizer_class", key + ".json")


def _kept_class(key: str):
    try:
        with open(_cache_file(key)) as f:
            d = json.load(f)
        return getattr(importlib.import_module(d["module"]), d["name"])
    except (OSError, ValueError, KeyError, TypeError, ImportError, AttributeError):
        return None


def _write_kept(p: str, obj) -> None:
    try:
        os.makedirs(os.path.dirname(p), exist_ok=True)
        tmp = f"{p}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(obj, f)
        os.replace(tmp, p)
    except OSError:
        pass  # a read-only cache only costs the next process the work again


def _keep_class(key: str, cls) -> None:
    _write_kept(_cache_file(key), {"module": cls.__module__, "name": cls.__name__})


def check_key(path: str, files) -> Optional[str]:
    """The key of a passed load check of the folder ``path``: the transformers and tokenizers versions installed,
    the folder's file names and the whole content of config.json and each of ``files`` (the files a tokenizer reads)
    found there. None where no check is kept (see :func:`_folder_key`, or versions unknown). Imports no module of
    transformers: the installed versions come from the package metadata."""
    from importlib import metadata

    try:
        versions = f"transformers {metadata.version('transformers')} tokenizers {metadata.version('tokenizers')}\n"
    except metadata.PackageNotFoundError:
        return None
    return _folder_key(path, versions, ("config.json", *files), 32)


def _check_file(key: str) -> str:
    return os.path.join(realhf_cache_dir(), "tokenizer_checked", key + ".json")


def checked_before(key: Optional[str]) -> bool:
    """Whether a check of a folder's tokenizer passed before (:func:`note_checked`) under ``key`` (:func:`check_key`
    of that folder: the same files and library versions)."""
    return key is not None and os.path.isfile(_check_file(key))


def note_checked(key: Optional[str], path: str) -> None:
    """Keep that the tokenizer of the folder ``path`` passed its check, under its :func:`check_key` ``key``."""
    if key is not None:
        _write_kept(_check_file(key), {"path": os.path.abspath(path)})


def load_tokenizer(path: str):
    """``transformers.AutoTokenizer.from_pretrained(path)`` for the local folder ``path`` (see the module docstring);
    raises what AutoTokenizer raises."""
    tok, _ = load_tokenizer_with_route(path)
    return tok


def load_tokenizer_with_route(path: str) -> Tuple[object, str]:
    """(:func:`load_tokenizer`'s tokenizer, how it was found: ``"kept"`` (the class kept for this folder) or
    ``"auto"`` (AutoTokenizer))."""
    key = _cache_key(path)
    cls = _kept_class(key) if key is not None else None
    if cls is not None:
        try:
            return cls.from_pretrained(path, _from_auto=True), "kept"
        except Exception:  # noqa: BLE001  (whatever it is, AutoTokenizer below decides again and raises its own)
            pass
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(path)
    if key is not None:
        _keep_class(key, type(tok))
    return tok, "auto"
