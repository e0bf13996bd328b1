"""Hooks the master runs around every MFC: ``before(mfc)`` returns stats to log with the MFC, ``after(mfc)`` sees
its stats. They make the system's own work around an algorithm's MFCs visible in one place instead of special
cases inside the call path:

* :class:`ParamVersionHook` counts parameter versions: +1 for a model replica after each of its training MFCs.
* :class:`ParamReallocHook` brings a mirror replica (e.g. the actor's generation layout) the trained parameters
  of its source before it runs, when they changed since it last got them: point-to-point between the workers
  of both layouts, or through a checkpoint on disk (``param_realloc=disk``).
* :class:`PublishAfterTrainHook` (asynchronous runs) publishes the trained weights to the generation servers right
  after each training MFC, as no generation MFC comes to ask for them.
* :class:`OffloadHook` moves an offloaded inference replica's parameters to host memory after each of its MFCs
  (the workers bring them back when a request uses them).

A replica served by generation servers (``ModelSpec.gen_servers``) is brought up to date the same way, by
publishing its source's weights to the servers (``publish_weights``: through disk or a weight group; see
``realhf.system.trainer.served``).
"""
from __future__ import annotations

import os
import shutil
import threading
import time
from typing import Callable, Dict

from realhf.api.core.dfg import MFCDef
from realhf.api.core.system_api import ExperimentSpec
from realhf.base import logging

logger = logging.getLogger(__name__)

# call(handle_name, {worker rank: request data}) -> replies; the master's request/reply client
Call = Callable[[str, Dict[int, dict]], dict]


class MFCHook:
    def before(self, mfc: MFCDef) -> dict:
        return {}

    def after(self, mfc: MFCDef, stats: dict) -> None:
        pass


class ParamVersionHook(MFCHook):
    """Parameter versions of every model replica. Trained replicas that come back from a recover checkpoint start
    at version 1, so that their mirrors are reallocated before they first run."""

    def __init__(self, spec: ExperimentSpec, resumed: bool):
        self.spec = spec
        self.lock = threading.Lock()
        self.versions: Dict[str, int] = {m.name: int(resumed and m.optimizer is not None) for m in spec.models}

    def version(self, model: str) -> int:
        with self.lock:
            return self.versions[model]

    def set(self, model: str, version: int) -> None:
        with self.lock:
            self.versions[model] = version

    def after(self, mfc: MFCDef, stats: dict) -> None:
        if mfc.is_train:
            with self.lock:
                self.versions[str(mfc.model_name)] += 1


class ParamReallocHook(MFCHook):
    def __init__(self, spec: ExperimentSpec, call: Call, versions: ParamVersionHook):
        self.spec, self.call, self.versions = spec, call, versions
        self._locks: Dict[str, threading.Lock] = {}
        self._locks_lock = threading.Lock()

    def before(self, mfc: MFCDef) -> dict:
        return self.sync(str(mfc.model_name))

    def sync(self, name: str) -> dict:
        """Bring mirror replica ``name`` the current parameters of its source (nothing when it has them)."""
        m = self.spec.model(name)
        if m.realloc_from is None:
            return {}
        src = self.spec.model(m.realloc_from)
        with self._locks_lock:
            lock = self._locks.setdefault(src.name, threading.Lock())
        with lock:  # one reallocation of a source at a time; a second mirror waits and then checks again
            version = self.versions.version(src.name)
            if self.versions.version(m.name) >= version:
                return {}
            t0 = time.perf_counter()
            if m.gen_servers is not None:
                ranks = sorted(set(src.ranks) | set(m.ranks))
                self.call("publish_weights", {r: {"src": src.name, "dst": m.name, "version": version} for r in ranks})
                dt = time.perf_counter() - t0
                self.versions.set(m.name, version)
                logger.debug(f"published {src.name} version {version} to the {m.gen_servers.backend} servers in {dt:.3f}s")
                return {"weight_sync_time": dt}
            if self.spec.param_realloc == "disk":
                path = os.path.join(self.spec.save_dir, ".realloc", m.name)
                shutil.rmtree(path, ignore_errors=True)
                self.call("realloc_save", {r: {"src": src.name, "path": path} for r in src.ranks})
                self.call("realloc_load", {r: {"dst": m.name, "path": path} for r in m.ranks})
            else:
                ranks = sorted(set(src.ranks) | set(m.ranks))
                self.call("realloc", {r: {"src": src.name, "dst": m.name} for r in ranks})
            dt = time.perf_counter() - t0
            self.versions.set(m.name, version)
            logger.debug(f"reallocated {src.name} ({src.layout}) -> {m.name} ({m.layout}) in {dt:.3f}s")
            return {"realloc_time": dt}


class PublishAfterTrainHook(MFCHook):
    """Asynchronous runs: right after a training MFC, publish the new weights to the generation servers that serve a
    mirror of the trained replica (the rollout workers generate with them while the trainer goes on); the time it
    takes is the training MFC's ``weight_sync_time``. Runs after :class:`ParamVersionHook` has counted the step."""

    def __init__(self, spec: ExperimentSpec, realloc: ParamReallocHook):
        self.spec, self.realloc = spec, realloc

    def after(self, mfc: MFCDef, stats: dict) -> None:
        if not mfc.is_train:
            return
        for m in self.spec.models:
            if m.gen_servers is not None and m.realloc_from == str(mfc.model_name):
                stats.update(self.realloc.sync(m.name))


class OffloadHook(MFCHook):
    def __init__(self, spec: ExperimentSpec, call: Call):
        self.spec, self.call = spec, call

    def after(self, mfc: MFCDef, stats: dict) -> None:
        m = self.spec.model(str(mfc.model_name))
        if m.offload:
            self.call("offload", {r: {"models": [m.name]} for r in m.ranks})
