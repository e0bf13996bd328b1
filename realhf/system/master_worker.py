"""Master worker: runs the dataflow graph step after step on the model workers.

Per step: the data-parallel heads of the dataset's model load the next batch (the master keeps its
metadata only); each MFC runs as soon as the buffer holds its inputs for the step's samples —
independent MFCs concurrently, in threads; before a call the inputs are moved directly between
workers (see ``data_manager``); outputs stay on the workers that produced them. Then stats are logged,
and save / recover-checkpoint / evaluation hooks run at their frequencies.
"""
from __future__ import annotations

import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional

from realhf.api.core.data_api import SequenceSample
from realhf.api.core.dfg import MFCDef, build_graph
from realhf.api.core.system_api import ExperimentSpec
from realhf.base import logging
from realhf.base.recover import RecoverStore
from realhf.base.stats import StatsLogger
from realhf.base.topology import ProcessTopology
from realhf.system.data_manager import plan_transfers
from realhf.system.evaluator import make_evaluator
from realhf.system.model_worker import load_recover_info, worker_name
from realhf.system.request_reply_stream import MasterClient, Payload

logger = logging.getLogger(__name__)


class Buffer:
    """Metadata of the step's samples: per sample id, its plain metadata and, per key, the owner
    worker and the KeyMeta needed to receive it."""

    def __init__(self):
        self.owners: Dict[str, Dict[str, int]] = {}
        self.metas: Dict[str, Dict[str, dict]] = {}
        self.metadata: Dict[str, dict] = {}
        self.tokens: Dict[str, int] = {}
        self.lock = threading.Lock()

    def add(self, header: dict, owner: int):
        s = SequenceSample.from_wire(header, [])
        with self.lock:
            for i, sid in enumerate(s.ids):
                sid = str(sid)
                for k in s.keys:
                    self.owners.setdefault(sid, {})[k] = owner
                    self.metas.setdefault(sid, {})[k] = {
                        "seqlens": list(s.seqlens[k][i]), "trailing_shape": list(s.trailing_shapes[k]),
                        "dtype": str(s.dtypes[k]).replace("torch.", ""),
                    }
                md = self.metadata.setdefault(sid, {})
                for k, v in s.metadata.items():
                    md[k] = v[i]
                # the cost of a sample for data-parallel balancing: its longest-known sequences
                if sid not in self.tokens or "packed_input_ids" in s.keys:
                    self.tokens[sid] = sum(s.seqlens[s.main_key()][i])

    def ids(self) -> List[str]:
        return list(self.owners)

    def clear(self):
        self.owners.clear(), self.metas.clear(), self.metadata.clear(), self.tokens.clear()


def balanced_dp_split(ids: List[str], tokens: Dict[str, int], dp: int) -> List[List[str]]:
    from realhf.api.core.partition import balanced_partition

    if len(ids) < dp:
        raise ValueError(f"cannot split {len(ids)} samples over {dp} data-parallel ranks")
    parts = balanced_partition([tokens[i] for i in ids], dp)
    return [[ids[j] for j in p] for p in parts]


class MasterWorker:
    def __init__(self, spec: ExperimentSpec, client: MasterClient, resume: bool, identity: Optional[dict] = None):
        """``identity``: ``{"run_id", "fingerprint", "options"}`` of the run, recorded in its recover checkpoints."""
        self.spec = spec
        self.identity = dict(identity or {})
        self.recover_store = RecoverStore(spec.recover_dir)
        self.client = client
        self.workers = [worker_name(r) for r in range(spec.n_workers)]
        self.buffer = Buffer()
        if spec.wandb:
            os.makedirs(spec.wandb.get("dir", spec.log_dir), exist_ok=True)
        self.resume_info = load_recover_info(spec) if resume else None
        self.stats = StatsLogger(spec.log_dir, wandb_config=spec.wandb,
                                 resume_step=self.resume_info["global_step"] if self.resume_info is not None else None)
        self.evaluator = make_evaluator(spec, self.stats)  # None unless auto_eval.enabled
        self.dataset_keys: Optional[set] = None
        self.graph = None
        self.holders: List[int] = []
        # parameter versions of every model replica: +1 per training step; a mirror replica is
        # reallocated before it runs whenever it is behind its source
        self.versions: Dict[str, int] = {m.name: 0 for m in spec.models}
        if self.resume_info is not None:  # trained replicas come back from the recover checkpoint
            for m in spec.models:
                if m.optimizer is not None:
                    self.versions[m.name] = 1
        self._version_lock = threading.Lock()
        self._realloc_locks: Dict[str, threading.Lock] = {}

    # ------------------------------------------------------------------ helpers
    def _call(self, handle_name: str, data_by_worker: Dict[str, dict], timeout=None) -> Dict[str, Payload]:
        return self.client.call(handle_name, data_by_worker, timeout=timeout)

    def _all(self, handle_name: str, data: dict, timeout=None) -> Dict[str, Payload]:
        return self._call(handle_name, {w: data for w in self.workers}, timeout=timeout)

    # ------------------------------------------------------------------ data
    def _fetch(self) -> dict:
        replies = self._call("fetch", {worker_name(r): {} for r in self.holders})
        info = None
        for w, rep in replies.items():
            self.buffer.add(rep.data["sample"], int(w.rsplit("_", 1)[1]))
            if self.dataset_keys is None:
                self.dataset_keys = set(rep.data["sample"]["keys"])
            info = {k: v for k, v in rep.data.items() if k != "sample"}
        return info

    # ------------------------------------------------------------------ one MFC
    def _run_mfc(self, mfc: MFCDef, ids: List[str]) -> dict:
        spec = self.spec
        m = spec.model(str(mfc.model_name))
        out_stats = {}
        if m.realloc_from is not None:
            out_stats.update(self._sync_params(m))
        topo = ProcessTopology(m.layout)
        parts = balanced_dp_split(ids, self.buffer.tokens, m.layout.dp)
        needs: Dict[int, List[str]] = {}
        for g in range(topo.world_size):
            c = topo.get_coord(g)
            needs[m.ranks[g]] = parts[c.data]
        keys = list(mfc.buffer_input_keys)
        with self.buffer.lock:
            plan = plan_transfers(self.buffer.owners, needs, keys)
            metas = {}
            for src, dst, sid, k in plan:
                metas.setdefault(sid, {})[k] = self.buffer.metas[sid][k]
            metadata = {sid: self.buffer.metadata.get(sid, {}) for sid in ids}
        involved = set(m.ranks) | {s for s, _, _, _ in plan} | {d for _, d, _, _ in plan}
        base = {"mfc": mfc.name, "plan": [list(p) for p in plan], "metas": metas,
                "ids_by_dp": {str(d): p for d, p in enumerate(parts)}, "metadata": metadata}
        t0 = time.perf_counter()
        replies = self._call("mfc", {worker_name(r): base for r in sorted(involved)})
        if mfc.is_train:
            with self._version_lock:
                self.versions[m.name] += 1
        for w, rep in replies.items():
            if "output" in rep.data:
                self.buffer.add(rep.data["output"], int(w.rsplit("_", 1)[1]))
            if "stats" in rep.data:
                out_stats.update(rep.data["stats"])
        # the slowest worker's own compute time; time - compute_time is messaging, data transfer, scheduling
        secs = [rep.data["seconds"] for rep in replies.values() if "seconds" in rep.data]
        if secs:
            out_stats["compute_time"] = max(secs)
        # received inputs are now owned by consumers too; keep the original owner as the source
        out_stats["time"] = time.perf_counter() - t0
        return out_stats

    def _run_dfg(self, ids: List[str]) -> Dict[str, dict]:
        graph = self.graph
        done: Dict[str, threading.Event] = {n: threading.Event() for n in graph.topological_order()}
        results: Dict[str, dict] = {}
        errors: List[BaseException] = []

        def run(name):
            try:
                for p in graph.parents(name):
                    while not done[p].wait(0.2):
                        if errors:
                            return
                if errors:
                    return
                results[name] = self._run_mfc(graph[name], ids)
            except BaseException as e:  # surfaced below in the master thread
                errors.append(e)
            finally:
                done[name].set()

        order = graph.topological_order()
        with ThreadPoolExecutor(max_workers=len(order)) as ex:
            futs = [ex.submit(run, n) for n in order]
            for f in futs:
                f.result()
        if errors:
            raise errors[0]
        return results

    # ------------------------------------------------------------------ parameter reallocation
    def _sync_params(self, m) -> dict:
        """Before an MFC runs on replica ``m``, bring it the trained parameters of ``m.realloc_from`` if they
        changed since it last got them: in memory, point-to-point between the workers of both layouts,
        or through a checkpoint on disk (``param_realloc=disk``)."""
        src = self.spec.model(m.realloc_from)
        with self._realloc_locks.setdefault(src.name, threading.Lock()):
            with self._version_lock:
                if self.versions[m.name] >= self.versions[src.name]:
                    return {}
                version = self.versions[src.name]
            t0 = time.perf_counter()
            ranks = sorted(set(src.ranks) | set(m.ranks))
            if self.spec.param_realloc == "disk":
                path = os.path.join(self.spec.save_dir, ".realloc", m.name)
                shutil.rmtree(path, ignore_errors=True)
                self._call("realloc_save", {worker_name(r): {"src": src.name, "path": path} for r in src.ranks})
                self._call("realloc_load", {worker_name(r): {"dst": m.name, "path": path} for r in m.ranks})
            else:
                self._call("realloc", {worker_name(r): {"src": src.name, "dst": m.name} for r in ranks})
            dt = time.perf_counter() - t0
            with self._version_lock:
                self.versions[m.name] = version
            logger.debug(f"reallocated {src.name} ({src.layout}) -> {m.name} ({m.layout}) in {dt:.3f}s")
            return {"realloc_time": dt}

    # ------------------------------------------------------------------ hooks
    def _save(self, tag: str, global_step: Optional[int] = None):
        for m in self.spec.models:
            if m.optimizer is None:
                continue
            path = os.path.join(self.spec.save_dir, m.name, tag)
            self._call("save", {worker_name(r): {"model": m.name, "path": path} for r in m.ranks})
            logger.info(f"saved {m.name} to {path}")
        if self.evaluator is not None and global_step is not None:
            self.evaluator.on_save(self.spec, tag, global_step)  # queued; runs in a background process

    def _ckpt(self, info: dict):
        """Write a recover checkpoint into a fresh folder; it replaces the previous one only when complete."""
        path = self.recover_store.begin(info["global_step"])
        self._all("ckpt", {"dir": path})
        self.recover_store.commit(path, {**self.identity, **info})
        logger.info(f"recover checkpoint at global step {info['global_step']} -> {path}")

    def _evaluate(self) -> dict:
        out = {}
        for mfc in self.spec.mfcs:
            if mfc.is_evaluate:
                role = str(mfc.model_name)
                reps = self._call("evaluate", {worker_name(r): {"model": role, "mfc": mfc.name} for r in self.spec.model(role).ranks})
                for rep in reps.values():
                    out.update(rep.data.get("stats", {}))
        return out

    # ------------------------------------------------------------------ main loop
    def run(self) -> int:
        spec = self.spec
        infos = self._all("dataset_info", {})
        self.holders = sorted(int(w.rsplit("_", 1)[1]) for w, r in infos.items() if r.data.get("holder"))
        steps_per_epoch = min(r.data["steps_per_epoch"] for r in infos.values() if r.data.get("holder"))
        total_steps = steps_per_epoch * spec.total_train_epochs
        if spec.benchmark_steps:
            total_steps = min(total_steps, spec.benchmark_steps)
        global_step = 0
        if self.resume_info is not None:
            global_step = self.resume_info["global_step"]
            logger.info(f"resuming after global step {global_step}")
        self.graph = None
        train_mfcs = [m for m in spec.mfcs if not m.is_evaluate]
        t_start = time.perf_counter()
        last_save = last_ckpt = time.monotonic()
        steps_done_here = 0
        while global_step < total_steps:
            t0 = time.perf_counter()
            info = self._fetch()
            if self.graph is None:
                self.graph = build_graph(train_mfcs, self.dataset_keys)
                logger.info("dataflow graph:\n" + self.graph.describe())
            ids = self.buffer.ids()
            mfc_stats = self._run_dfg(ids)
            global_step += 1
            steps_done_here += 1
            epoch, epoch_step = info["epoch"], info["epoch_step"]
            stats = {}
            for name, st in mfc_stats.items():
                for k, v in st.items():
                    stats[f"{name}/{k}" if k in ("time", "compute_time", "realloc_time") else k] = v
            self._all("clear", {"ids": ids})
            self.buffer.clear()
            dt = time.perf_counter() - t0
            elapsed = time.perf_counter() - t_start
            remaining = elapsed / steps_done_here * (total_steps - global_step)
            logger.info(
                f"Epoch {epoch + 1}/{spec.total_train_epochs} step {epoch_step + 1}/{steps_per_epoch} "
                f"(global step {global_step}) finishes. Execution time: {dt:.2f}s. "
                f"Estimated remaining time: {remaining:.1f}s. "
                + ", ".join(f"{k}={v:.4g}" for k, v in sorted(stats.items()) if isinstance(v, (int, float)))
            )
            epoch_end = info.get("is_epoch_last", False)
            if spec.eval_freq_epochs and epoch_end and (epoch + 1) % spec.eval_freq_epochs == 0 or (
                spec.eval_freq_steps and global_step % spec.eval_freq_steps == 0
            ):
                ev = self._evaluate()
                stats.update(ev)
                logger.info("evaluation: " + ", ".join(f"{k}={v:.4g}" for k, v in ev.items()))
            self.stats.log(global_step, {"epoch": epoch + 1, "epoch_step": epoch_step + 1, "step_time": dt, **stats})
            last = global_step == total_steps
            now = time.monotonic()
            if (spec.save_freq_steps and global_step % spec.save_freq_steps == 0) or (
                spec.save_freq_epochs and epoch_end and (epoch + 1) % spec.save_freq_epochs == 0
            ) or (spec.save_freq_secs and now - last_save >= spec.save_freq_secs) or (
                last and (spec.save_freq_steps or spec.save_freq_epochs or spec.save_freq_secs)
            ):
                self._save(f"epoch{epoch + 1}epochstep{epoch_step + 1}globalstep{global_step}", global_step)
                last_save = now
            if not last and ((spec.ckpt_freq_steps and global_step % spec.ckpt_freq_steps == 0) or (
                spec.ckpt_freq_epochs and epoch_end and (epoch + 1) % spec.ckpt_freq_epochs == 0
            ) or (spec.ckpt_freq_secs and now - last_ckpt >= spec.ckpt_freq_secs)):
                self._ckpt({"global_step": global_step, "epoch": epoch, "epoch_step": epoch_step})
                last_ckpt = now
        logger.info(f"training finished: {global_step} steps in {time.perf_counter() - t_start:.1f}s")
        self._all("exit", {})
        if self.evaluator is not None:  # the workers are gone; wait for the checkpoint evaluations
            self.evaluator.wait(timeout=spec.auto_eval.final_wait_secs)
        self.stats.close()
        return 0
