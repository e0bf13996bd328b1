"""Master worker: runs the dataflow graph step after step on the model workers.

It is put together from parts, each in its own module:

* :class:`~realhf.system.trainer.buffer.SampleBuffer` — metadata of the samples in flight (owners, shapes, birth);
* :class:`~realhf.system.trainer.executor.DFGExecutor` — runs each MFC as soon as the buffer holds its inputs,
  independent MFCs concurrently;
* hooks around every MFC (:mod:`realhf.system.trainer.hooks`) — parameter versions, reallocation between layouts;
* :class:`~realhf.system.trainer.cadence.Cadence` — when to evaluate, save and write recover checkpoints.

Per step: the data-parallel heads of the dataset's model load the next batch (the master keeps its metadata
only); the executor runs the graph over the batch; before each call the inputs are moved directly between
workers (see ``data_manager``) and outputs stay on the workers that produced them; then stats are logged and
the step's samples leave the buffer.
"""
from __future__ import annotations

import glob
import math
import os
import time
from typing import Dict, List, Optional

from realhf.api.core.dfg import MFCDef, build_graph
from realhf.api.core.system_api import ExperimentSpec
from realhf.base import failpoint, logging
from realhf.base.progress import key_stats, write_progress
from realhf.base.recover import RecoverStore
from realhf.base.stats import StatsLogger
from realhf.base.topology import ProcessTopology
from realhf.system.trainer.buffer import SampleBuffer
from realhf.system.trainer.cadence import Cadence
from realhf.system.trainer.data_manager import plan_transfers
from realhf.system.trainer.dynamic_sampling import fill_batch
from realhf.system.trainer.evaluator import make_evaluator
from realhf.system.trainer.executor import DFGExecutor
from realhf.system.trainer.hooks import OffloadHook, ParamReallocHook, ParamVersionHook, PublishAfterTrainHook
from realhf.system.trainer.model_worker import load_recover_info, worker_name
from realhf.system.transport.notices import Notices
from realhf.system.transport.request_reply_stream import MasterClient, Payload

logger = logging.getLogger(__name__)


# stats every MFC has: logged as <mfc>/<stat>
PER_MFC_STATS = ("time", "compute_time", "realloc_time", "weight_sync_time", "peak_mem_gib", "reserved_mem_gib",
                 "est_mem_gib", "est_increase_gib", "mem_increase_gib", "cpu_threads")


def balanced_dp_split(ids: List[str], tokens: Dict[str, int], dp: int) -> List[List[str]]:
    from realhf.api.core.partition import balanced_partition

    if len(ids) < dp:
        raise ValueError(f"cannot split {len(ids)} samples over {dp} data-parallel ranks")
    parts = balanced_partition([tokens[i] for i in ids], dp)
    return [[ids[j] for j in p] for p in parts]


def mfc_requests(mfc: str, plan, metas: Dict[str, Dict[str, dict]], parts: List[List[str]],
                 dp_of: Dict[int, int], metadata: Dict[str, dict], involved) -> Dict[int, dict]:
    """Each involved worker's ``mfc`` request: its own transfers of ``plan`` (in the plan's order, so that every
    pair of workers posts its sends and receives alike) with the metas of what it receives (``metas``: the buffer's,
    sample id -> key -> meta), and, for a member of the MFC's mesh (``dp_of``: its data-parallel rank), the ids of
    its data-parallel rank with their metadata (``metadata``: the buffer's, sample id -> plain metadata). A
    request holds what its worker uses: the master's encoding work grows with the samples each worker handles, not
    with workers x samples (the whole batch's plan, metas and metadata to every worker took 26 ms a worker for 2,048
    samples on a 2-core host)."""
    own: Dict[int, list] = {r: [] for r in involved}
    recv_metas: Dict[int, Dict[str, Dict[str, dict]]] = {r: {} for r in involved}
    for src, dst, sid, key in plan:
        own[src].append([src, dst, sid, key])
        own[dst].append([src, dst, sid, key])
        recv_metas[dst].setdefault(sid, {})[key] = metas[sid][key]
    out = {}
    for r in sorted(involved):
        req = {"mfc": mfc, "plan": own[r], "metas": recv_metas[r], "ids_by_dp": {}, "metadata": {}}
        if r in dp_of:
            ids = parts[dp_of[r]]
            req["ids_by_dp"] = {str(dp_of[r]): ids}
            req["metadata"] = {sid: metadata.get(sid, {}) for sid in ids}
        out[r] = req
    return out


def _rank(worker: str) -> int:
    return int(worker.rsplit("_", 1)[1])


class MasterWorker:
    def __init__(self, spec: ExperimentSpec, client: MasterClient, resume: bool, identity: Optional[dict] = None,
                 name_resolve=None, secret: Optional[bytes] = None):
        """``identity``: ``{"run_id", "fingerprint", "options"}`` of the run, recorded in its recover checkpoints;
        ``name_resolve`` and ``secret`` reach the rollout manager of an asynchronous run."""
        self.spec = spec
        self.client = client
        self.nr, self.secret = name_resolve, secret
        self.identity = dict(identity or {})
        self.recover_store = RecoverStore(spec.recover_dir)
        self.workers = [worker_name(r) for r in range(spec.n_workers)]
        self.buffer = SampleBuffer()
        if spec.wandb:
            os.makedirs(spec.wandb.get("dir", spec.log_dir), exist_ok=True)
        self.resume_info = load_recover_info(spec) if resume else None
        self.stats = StatsLogger(spec.log_dir, tensorboard_dir=spec.tensorboard_dir, wandb_config=spec.wandb,
                                 resume_step=self.resume_info["global_step"] if self.resume_info is not None else None)
        self.evaluator = make_evaluator(spec, self.stats)  # None unless auto_eval.enabled
        self.versions = ParamVersionHook(spec, resumed=self.resume_info is not None)
        if self.resume_info is not None and spec.rollout is not None:
            # asynchronous runs label generated tokens with versions: a resumed trainer's version is its step count
            for m in spec.models:
                if m.optimizer is not None:
                    self.versions.set(m.name, int(self.resume_info["global_step"]))
        self.realloc = ParamReallocHook(spec, self._call_ranks, self.versions)
        # before-hooks run in this order, after-hooks too
        self.hooks = [self.realloc, self.versions, OffloadHook(spec, self._call_ranks)]
        if spec.rollout is not None:
            self.hooks.append(PublishAfterTrainHook(spec, self.realloc))
        self.holders: List[int] = []
        self.step = 0  # the global step being run (1-based) once the loop starts
        self.notices = Notices()

    # ------------------------------------------------------------------ requests
    def _call(self, handle_name: str, data_by_worker: Dict[str, dict], timeout=None) -> Dict[str, Payload]:
        return self.client.call(handle_name, data_by_worker, timeout=timeout)

    def _call_ranks(self, handle_name: str, data_by_rank: Dict[int, dict]) -> Dict[str, Payload]:
        return self._call(handle_name, {worker_name(r): d for r, d in data_by_rank.items()})

    def _all(self, handle_name: str, data: dict, timeout=None) -> Dict[str, Payload]:
        return self._call(handle_name, {w: data for w in self.workers}, timeout=timeout)

    # ------------------------------------------------------------------ data
    def _fetch(self):
        """The next batch from the dataset holders: (sample ids, epoch info, the dataset's keys)."""
        replies = self._call_ranks("fetch", {r: {} for r in self.holders})
        ids, info, keys = [], None, None
        stats: Dict[str, float] = {}
        for w, rep in replies.items():
            ids += self.buffer.add(rep.data["sample"], _rank(w), step=self.step)
            keys = set(rep.data["sample"]["keys"])
            info = {k: v for k, v in rep.data.items() if k not in ("sample", "stats")}
            for k, v in rep.data.get("stats", {}).items():  # over the heads: the longest wait, the total queue
                stats[k] = max(stats.get(k, v), v) if k.endswith("_time") else stats.get(k, 0.0) + v
        info["stats"] = stats
        return ids, info, keys

    # ------------------------------------------------------------------ one MFC
    def _run_mfc(self, mfc: MFCDef, ids: List[str]) -> dict:
        spec = self.spec
        m = spec.model(str(mfc.model_name))
        out_stats = {}
        for h in self.hooks:
            out_stats.update(h.before(mfc))
        topo = ProcessTopology(m.layout)
        parts = balanced_dp_split(ids, self.buffer.tokens, m.layout.dp)
        dp_of = {m.ranks[g]: topo.get_coord(g).dp for g in range(topo.world_size)}
        needs: Dict[int, List[str]] = {r: parts[d] for r, d in dp_of.items()}
        keys = list(mfc.buffer_input_keys)
        with self.buffer.lock:
            plan = plan_transfers(self.buffer.owners, needs, keys)
            involved = set(m.ranks) | {s for s, _, _, _ in plan} | {d for _, d, _, _ in plan}
            requests = mfc_requests(mfc.name, plan, self.buffer.metas, parts, dp_of, self.buffer.metadata, involved)
        version = self.versions.version(m.name)  # of the parameters that compute this MFC's outputs
        t0 = time.perf_counter()
        replies = self._call_ranks("mfc", requests)
        for w, rep in replies.items():
            if "output" in rep.data:
                self.buffer.add(rep.data["output"], _rank(w), step=self.step, version=version)
            if "stats" in rep.data:
                out_stats.update(rep.data["stats"])
        # over the MFC's workers: the slowest one's own compute time (time - compute_time is messaging, data
        # transfer, scheduling) and the largest peak memory of the call
        for key, stat in (("seconds", "compute_time"), ("peak_mem_gib", "peak_mem_gib"),
                          ("reserved_mem_gib", "reserved_mem_gib"), ("est_mem_gib", "est_mem_gib"),
                          ("est_increase_gib", "est_increase_gib"), ("mem_increase_gib", "mem_increase_gib"),
                          ("cpu_threads", "cpu_threads")):
            vals = [rep.data[key] for rep in replies.values() if key in rep.data]
            if vals:
                out_stats[stat] = max(vals)
        out_stats["time"] = time.perf_counter() - t0
        for h in self.hooks:
            h.after(mfc, out_stats)
        return out_stats

    def _rollout_stats(self) -> Dict[str, float]:
        """The rollout manager's counters (asynchronous runs), logged as ``async/<name>`` with each step."""
        from realhf.base.name_resolve import names
        from realhf.system.transport.manager_client import ManagerError, manager_call

        try:
            addr = self.nr.get(names.rollout_manager(self.spec.experiment_name, self.spec.trial_name))
            st = manager_call(addr, self.secret, "/status", timeout=10)
        except (KeyError, ManagerError) as e:
            logger.warning(f"no rollout statistics this step: {e}")
            return {}
        return {f"async/{k}": float(v) for k, v in st.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}

    # ------------------------------------------------------------------ saving and evaluating
    def _save(self, tag: str, global_step: Optional[int] = None):
        for m in self.spec.models:
            if m.optimizer is None:
                continue
            path = os.path.join(self.spec.save_dir, m.name, tag)
            self._call_ranks("save", {r: {"model": m.name, "path": path} for r in m.ranks})
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
                reps = self._call_ranks("evaluate", {r: {"model": role, "mfc": mfc.name} for r in self.spec.model(role).ranks})
                for rep in reps.values():
                    out.update(rep.data.get("stats", {}))
        return out

    # ------------------------------------------------------------------ main loop
    def _train_batch(self, executor: Optional[DFGExecutor]):
        """Fetch the next batch and run the graph over it: (the executor, the batch's ids, its epoch info, the MFCs'
        stats). A resumed run that fails before its first step names the checkpoint it resumed first."""
        try:
            ids, info, dataset_keys = self._fetch()
            if executor is None:
                graph = build_graph([m for m in self.spec.mfcs if not m.is_evaluate], dataset_keys)
                logger.info("dataflow graph:\n" + graph.describe())
                executor = DFGExecutor(graph, self.buffer, self._run_mfc)
            if self.spec.dynamic_sampling is None:
                return executor, ids, info, executor.run(ids)
            return (executor,) + self._dynamic_batch(executor, ids, info)
        except Exception:
            if self.resume_info is not None and self.step == self.resume_info["global_step"] + 1:
                logger.error(self._resume_context())
            raise

    def _dynamic_batch(self, executor: DFGExecutor, ids: List[str], info: dict):
        """Dynamic sampling (``spec.dynamic_sampling``): the rollout part of the graph over as many batches as it takes
        to hold a full batch of samples whose rewards differ, then the rest of the graph over that batch. Returns
        (every sample id fetched, the epoch info, the MFCs' stats)."""
        ds, graph = self.spec.dynamic_sampling, executor.graph
        producer = graph.producer_of(ds.key)
        if producer is None:
            raise ValueError(f"dynamic sampling reads {ds.key!r}, which no MFC of the graph produces")
        rollout = graph.ancestors(producer) | {producer}
        first = [(ids, info)]

        def fetch():
            return first.pop() if first else self._fetch()[:2]

        got = fill_batch(fetch, lambda i: executor.run(i, only=rollout), lambda i: self._values(i, ds.key),
                         ds.max_rounds)
        mfc_stats = dict(got.mfc_stats)
        mfc_stats.update(executor.run(got.kept, only=set(graph.topological_order()) - rollout))
        info = dict(got.info, stats={**got.info.get("stats", {}), **got.stats})
        return got.all_ids, info, mfc_stats

    def _values(self, ids: List[str], key: str) -> Dict[str, list]:
        """The values of ``key`` (a small per-sample key, e.g. the rewards) of ``ids``, from the workers that hold them."""
        by_rank: Dict[int, List[str]] = {}
        with self.buffer.lock:
            for sid in ids:
                by_rank.setdefault(self.buffer.owners[sid][key], []).append(sid)
        out: Dict[str, list] = {}
        for rep in self._call_ranks("values", {r: {"ids": s, "key": key} for r, s in by_rank.items()}).values():
            out.update(rep.data["values"])
        return out

    def _resume_context(self) -> str:
        """Where a resumed run's state came from: the recover checkpoint and the weight files of its trained models."""
        path, files = self.resume_info["path"], []
        for m in self.spec.models:
            if m.optimizer is not None:
                folder = os.path.join(path, m.name)
                files += sorted(glob.glob(os.path.join(folder, "*.safetensors"))) or [folder]
        return (f"the run resumed from the recover checkpoint {path} (global step {self.resume_info['global_step']}) "
                f"and failed before its first step; the trained weights it resumed: {', '.join(files)}. The cause "
                "follows; if it lies in that checkpoint (e.g. weights that are not finite), start afresh "
                "(recover_mode=disabled)")

    def run(self) -> int:
        spec = self.spec
        infos = self._all("dataset_info", {})
        self.holders = sorted(_rank(w) for w, r in infos.items() if r.data.get("holder"))
        for r in infos.values():  # every holder loads the whole file: one note says it
            if r.data.get("skipped"):
                self.notices.add("data_skipped", r.data["skipped"])
        steps_per_epoch = min(r.data["steps_per_epoch"] for r in infos.values() if r.data.get("holder"))
        total_steps = steps_per_epoch * spec.total_train_epochs
        if spec.benchmark_steps:
            total_steps = min(total_steps, spec.benchmark_steps)
        global_step = 0
        if self.resume_info is not None:
            global_step = self.resume_info["global_step"]
            logger.info(f"resuming after global step {global_step}")
        first_step, epochs = global_step, math.ceil(total_steps / steps_per_epoch)
        logger.info(f"this run does {total_steps} steps ({epochs} epoch(s) of {steps_per_epoch} steps"
                    + (f", stopping at exp_ctrl.benchmark_steps={spec.benchmark_steps}" if spec.benchmark_steps else "")
                    + (f"; resumed after step {first_step})" if first_step else ")"))
        progress = {"total_steps": total_steps, "global_step": global_step, "first_step": first_step, "epoch": 0,
                    "epochs": epochs, "steps_per_epoch": steps_per_epoch, "elapsed": 0.0, "eta": None, "last": {},
                    "notices": self.notices.messages}
        write_progress(spec.log_dir, progress)
        executor = None
        cadence = Cadence(spec)
        if spec.rollout is not None and self.resume_info is not None:
            # the servers started with the initial weights: give them the resumed ones before rollouts begin (their
            # publish runs behind; a failure reaches the first step's requests through the publisher's heartbeats)
            for m in spec.models:
                if m.gen_servers is not None:
                    self.realloc.sync(m.name)
        t_start = time.perf_counter()
        while global_step < total_steps:
            t0 = time.perf_counter()
            self.step = global_step + 1
            failpoint.delay("trainer.step")  # tests: a random delay ($REALHF_DELAYS)
            executor, ids, info, mfc_stats = self._train_batch(executor)
            global_step += 1
            epoch, epoch_step = info["epoch"], info["epoch_step"]
            stats = dict(info["stats"])
            if spec.rollout is not None:
                stats.update(self._rollout_stats())
            for name, st in mfc_stats.items():
                for k, v in st.items():
                    stats[f"{name}/{k}" if k in PER_MFC_STATS else k] = v
            self._all("clear", {"ids": ids})
            self.buffer.drop(ids)
            dt = time.perf_counter() - t0
            elapsed = time.perf_counter() - t_start
            remaining = elapsed / (global_step - first_step) * (total_steps - global_step)
            logger.info(
                f"global step {global_step}/{total_steps} (epoch {epoch + 1}/{epochs}, step {epoch_step + 1}/"
                f"{steps_per_epoch}) done in {dt:.2f}s; estimated remaining time {remaining:.1f}s. "
                + ", ".join(f"{k}={v:.4g}" for k, v in sorted(stats.items()) if isinstance(v, (int, float)))
            )
            epoch_end = info.get("is_epoch_last", False)
            if cadence.evaluate(global_step, epoch, epoch_end):
                ev = self._evaluate()
                stats.update(ev)
                logger.info("evaluation: " + ", ".join(f"{k}={v:.4g}" for k, v in ev.items()))
            self.notices.check(global_step, stats)
            self.stats.log(global_step, {"epoch": epoch + 1, "epoch_step": epoch_step + 1, "step_time": dt,
                                         "total_steps": total_steps, **stats})
            progress.update(global_step=global_step, epoch=epoch + 1, elapsed=elapsed, eta=remaining,
                            last=key_stats({"step_time": dt, **stats}))
            write_progress(spec.log_dir, progress)
            save, ckpt = cadence.save_and_ckpt(global_step, epoch, epoch_end, last=global_step == total_steps)
            if save:
                self._save(f"epoch{epoch + 1}epochstep{epoch_step + 1}globalstep{global_step}", global_step)
            if ckpt:
                self._ckpt({"global_step": global_step, "epoch": epoch, "epoch_step": epoch_step})
        logger.info(f"training finished: {global_step} steps in {time.perf_counter() - t_start:.1f}s")
        self._all("exit", {})
        if self.evaluator is not None:  # the workers are gone; wait for the checkpoint evaluations
            self.evaluator.wait(timeout=spec.auto_eval.final_wait_secs)
        self.stats.close()
        return 0
