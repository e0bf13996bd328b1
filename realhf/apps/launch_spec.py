"""The experiment spec a launch builds once and hands to its processes.

The launcher writes the run's ``config.yaml`` and, beside it, ``spec.pkl``: the config and the experiment spec it
built and checked (``auto`` budgets resolved), pickled and signed with the launch's run secret (HMAC-SHA256). A process
(``realhf.apps.remote``) loads them from there instead of parsing the config and building the spec again (the model
folder, tokenizer and data checks: seconds a process on a small machine). The file travels where the config file
already does (the run's log folder, on the shared fileroot of a Slurm or Ray cluster).

A spec file is used only when it belongs to this launch: signed with this process's run secret (each launch, and each
relaunch of ``recover_mode=auto``, makes a fresh secret and writes a fresh file) and written for the very bytes of the
config file the process was given. Otherwise (an earlier launch's file, a config edited since, a process started by
hand without the file) the process builds the spec from the config file, as before, and says so in its log. Nothing is
unpickled before its signature checks out.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import pickle
from typing import Any, Optional, Tuple

from realhf.api.quickstart.entry import config_to_yaml
from realhf.base import logging

logger = logging.getLogger("realhf.launch_spec")

CONFIG_FILE = "config.yaml"
SPEC_FILE = "spec.pkl"
_FORMAT = 1


def spec_path(config_path: str) -> str:
    """The spec file that belongs beside the config file ``config_path``."""
    return os.path.join(os.path.dirname(os.path.abspath(config_path)), SPEC_FILE)


def _mac(secret: bytes, body: bytes) -> bytes:
    return hmac.new(secret, body, hashlib.sha256).hexdigest().encode()


def _atomic_write(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def write_launch_files(log_dir: str, exp_name: str, config, spec, secret: bytes) -> str:
    """Write ``<log_dir>/config.yaml`` (``config`` as YAML) and ``<log_dir>/spec.pkl`` (``config`` and ``spec``, signed
    with ``secret``); returns the config file's path, which the processes are given."""
    cfg_path = os.path.join(log_dir, CONFIG_FILE)
    text = config_to_yaml(config).encode("utf-8")
    _atomic_write(cfg_path, text)
    header = json.dumps({"format": _FORMAT, "experiment": exp_name,
                         "config_sha256": hashlib.sha256(text).hexdigest()}).encode()
    body = header + b"\n" + pickle.dumps((config, spec), protocol=pickle.HIGHEST_PROTOCOL)
    _atomic_write(spec_path(cfg_path), _mac(secret, body) + b"\n" + body)
    return cfg_path


def _refuse(path: str, config_path: str, why: str) -> None:
    logger.warning(f"experiment spec: not using {path} ({why}); building the spec from {config_path}")


def load_launch_spec(exp_name: str, config_path: str, secret: bytes) -> Optional[Tuple[Any, Any]]:
    """(config, spec) from the spec file beside ``config_path`` when the launcher of this run wrote it for that config
    file; None (after a log line that says why) when there is none or it belongs to something else."""
    path = spec_path(config_path)
    try:
        with open(config_path, "rb") as f:
            config_sha = hashlib.sha256(f.read()).hexdigest()
    except FileNotFoundError:  # loading the config reports it
        return None
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        logger.info(f"experiment spec: no {SPEC_FILE} beside {config_path}; building the spec from it")
        return None
    mac, _, body = data.partition(b"\n")
    if not hmac.compare_digest(mac, _mac(secret, body)):
        _refuse(path, config_path, "not signed with this run's secret: written by another launch, or damaged")
        return None
    raw_header, _, payload = body.partition(b"\n")
    header = json.loads(raw_header)
    if header.get("format") != _FORMAT or header.get("experiment") != exp_name:
        _refuse(path, config_path, f"written for experiment {header.get('experiment')!r} in format "
                                   f"{header.get('format')}, not {exp_name!r} in format {_FORMAT}")
        return None
    if header.get("config_sha256") != config_sha:
        _refuse(path, config_path, f"written for another content of {os.path.basename(config_path)}")
        return None
    try:
        config, spec = pickle.loads(payload)
    except (pickle.UnpicklingError, AttributeError, ImportError, EOFError, TypeError, ValueError) as e:
        _refuse(path, config_path, f"it does not load with this source tree: {type(e).__name__}: {e}")
        return None
    logger.info(f"experiment spec: loaded from {path} (built by the launcher)")
    return config, spec
