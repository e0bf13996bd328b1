"""Model worker: holds the shards of every (model, layout) it takes part in and serves the master.

One process per device slot. Its runtime environment (``realhf.base.runtime_env.RuntimeEnv``: device,
distributed backend, default dtype, attention kernel), made at its process entry, decides where its models,
engines and stored tensors live and which backend every process group uses. It joins the model workers'
torch.distributed world, builds the grid of every model (collectively, in spec order), loads its shards,
and then answers requests from the
master over an authenticated ZMQ socket: ``fetch`` (next dataset batch, kept here), ``mfc`` (move the
inputs the plan says, then run the interface method), ``evaluate``, ``save``, ``ckpt``, ``clear``,
``exit``. A request that raises is answered with the traceback, after which the worker exits: its
collective state can no longer be trusted. A worker whose master stops sending heartbeats (stopped, hung
or gone) ends itself (``realhf.system.transport.heartbeat.exit_when_silent``).

The torch.distributed rendezvous store listens only on the address the worker binds its sockets to
(loopback for a run on one machine; the node's address under a cluster launcher). Recover checkpoints are
read with ``torch.load(weights_only=True)`` (``realhf.base.recover.load_state_file``): a file planted in the run folder
cannot run code.
"""
from __future__ import annotations

import os
import random
import socket
import time
import traceback
from typing import Dict, Optional

import numpy as np
import torch
import torch.distributed as dist

from realhf.api.core.data_api import SequenceSample
from realhf.api.core.dfg import MicroBatchSpec
from realhf.api.core.model_api import Model, make_interface
from realhf.api.core.system_api import ExperimentSpec, ModelSpec
import realhf.impl.model.interface  # noqa: F401 (registers the interfaces)
from realhf.base import cpu_share, logging, network
from realhf.base.name_resolve import names
from realhf.base.recover import RecoverStore, load_state_file
from realhf.base.runtime_env import RuntimeEnv
from realhf.base.topology import ParallelGrid
from realhf.system.trainer import mfc_memory
from realhf.system.trainer.data_manager import DataManager
from realhf.system.transport.heartbeat import HeartbeatMonitor, HeartbeatSender, exit_when_silent
from realhf.system.transport.request_reply_stream import Payload, WorkerServer

logger = logging.getLogger(__name__)


def worker_name(rank: int) -> str:
    return f"model_worker_{rank}"


def owner_rank(grid: ParallelGrid, dp_rank: int) -> int:
    """The worker that keeps the outputs of data-parallel rank ``dp_rank``: last stage, tensor rank 0."""
    return grid.global_rank_of(grid.pp_size - 1, dp_rank, 0)


def load_recover_info(spec: ExperimentSpec) -> Optional[dict]:
    """The current recover checkpoint's info (its folder under ``"path"``), or None (see realhf.base.recover)."""
    return RecoverStore(spec.recover_dir).latest()


def _np_state_plain(state) -> list:
    name, keys, pos, has_gauss, cached = state
    return [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)]


def _np_state_from_plain(state) -> tuple:
    name, keys, pos, has_gauss, cached = state
    return name, keys.numpy().astype(np.uint32), pos, has_gauss, cached


def _init_distributed(spec: ExperimentSpec, rank: int, nr, backend: str) -> Optional[socket.socket]:
    """Join the model workers' world with ``backend`` (the runtime environment's). Rank 0 serves the
    rendezvous store on a socket it binds itself on this worker's host (so it listens there only, not on
    every interface) and publishes the address; gloo's and NCCL's own connections use the loopback interface
    when the run is on one machine. Returns the store's socket (it must stay open)."""
    import datetime

    host = network.worker_host()
    key = names.distributed_init(spec.experiment_name, spec.trial_name)
    timeout = datetime.timedelta(seconds=1800)
    if network.is_loopback(host) and "lo" in {n for _, n in socket.if_nameindex()}:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    lsock = None
    if rank == 0:
        lsock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        lsock.bind((host.strip("[]"), 0))
        lsock.listen(max(128, spec.n_workers))
        port = lsock.getsockname()[1]
        store = dist.TCPStore(host.strip("[]"), port, spec.n_workers, is_master=True, timeout=timeout,
                              wait_for_workers=False, master_listen_fd=lsock.fileno())
        nr.add(key, f"tcp://{host}:{port}", replace=True)
    else:
        addr = nr.wait(key, timeout=120)
        h, _, port = addr[len("tcp://"):].rpartition(":")
        store = dist.TCPStore(h.strip("[]"), int(port), spec.n_workers, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=spec.n_workers, timeout=timeout)
    return lsock


def make_interfaces(mfcs) -> Dict[str, object]:
    """One interface object per MFC, shared by the MFCs of one model replica with the same implementation
    and equal arguments (e.g. critic_inf and critic_train share the value normaliser that training updates and
    inference uses). The arguments are the experiment's config objects (dataclasses), compared by ``repr``."""
    shared, out = {}, {}
    for m in mfcs:
        key = (str(m.model_name), m.interface_impl, repr(sorted(m.interface_args.items())))
        if key not in shared:
            shared[key] = make_interface(m.interface_impl, **m.interface_args)
        out[m.name] = shared[key]
    return out


class ModelWorker:
    def __init__(self, spec: ExperimentSpec, rank: int, secret: bytes, nr, resume: bool, env: RuntimeEnv):
        self.spec, self.rank, self.secret, self.nr, self.env = spec, rank, secret, nr, env
        self.name = worker_name(rank)
        self.resume_info = load_recover_info(spec) if resume else None
        self.data = DataManager(rank, env.device)
        self.models: Dict[str, Model] = {}
        self.grids: Dict[str, ParallelGrid] = {}
        self.interfaces = make_interfaces(spec.mfcs)
        self.data_iter = None
        self.valid_batches = None
        self._realloc_plans = {}
        self._publishers = {}  # served replica name -> WeightPublisher (realhf.system.trainer.served)

    # ------------------------------------------------------------------ setup
    def setup(self):
        spec = self.spec
        torch.set_num_threads(spec.cpus_per_worker)
        if not self.env.is_cuda and spec.cpus_per_worker_max > spec.cpus_per_worker:
            cpu_share.install(spec.cpus_per_worker, spec.cpus_per_worker_max)
        seed = spec.seed * 1000 + self.rank
        random.seed(seed)
        np.random.seed(seed % (2**32))
        torch.manual_seed(seed)
        env = self.env
        env.activate()
        logger.info(f"{self.name} runtime environment: {env.describe()}")
        self._store_sock = _init_distributed(spec, self.rank, self.nr, env.backend)
        self._build_models()
        self._setup_data()
        # let interfaces start what their first call would (e.g. grading processes); once per interface
        # object, as MFCs of one replica may share it (make_interfaces)
        warmed = set()
        for mfc in spec.mfcs:
            iface = self.interfaces[mfc.name]
            if str(mfc.model_name) in self.models and id(iface) not in warmed:
                warmed.add(id(iface))
                iface.warmup(self.models[str(mfc.model_name)])
        if self.resume_info is not None:
            self._load_ckpt()
        exp, trial = spec.experiment_name, spec.trial_name
        # the master's heartbeats: it connects once every worker is up (it waits up to 600 s for their addresses)
        self.master_beats = HeartbeatMonitor(self.secret, host=network.worker_host(), name_resolve=self.nr,
                                             key=names.worker_heartbeat(exp, trial, self.name))
        self._master_watch = exit_when_silent(self.master_beats, "master", spec.worker_timeout_secs,
                                              first_timeout_s=660.0, what=self.name)
        self.server = WorkerServer(self.name, self.secret, host=network.worker_host(), name_resolve=self.nr,
                                   key=names.worker_address(exp, trial, self.name))
        hb_addr = self.nr.wait(names.master_heartbeat(exp, trial), timeout=120)
        self.heartbeat = HeartbeatSender(self.name, self.secret, hb_addr)
        self.heartbeat.start()
        logger.info(f"{self.name} ready: models {sorted(self.models)}")

    def _build_models(self):
        """The grid of every model (collective: every worker builds every grid in the same order, each group
        with the environment's backend) and this worker's shards of the models it takes part in."""
        for m in self.spec.models:
            self.grids[m.name] = ParallelGrid(m.layout, ranks=m.ranks, backend=self.env.backend)
        for m in self.spec.models:
            if self.grids[m.name].is_member:
                self.models[m.name] = self._load_model(m)

    def _load_model(self, m: ModelSpec) -> Model:
        from realhf.impl.model.backend.engine import InferenceEngine, TrainEngine
        from realhf.impl.model.conversion.hf_io import build_from_hf

        if m.gen_servers is not None:  # served by generation servers: a client and the tokenizer
            from realhf.base.hf_tokenizer import load_tokenizer
            from realhf.system.trainer.served import ServedEngine, make_client

            tok = load_tokenizer(m.tokenizer_path or m.path)
            engine = ServedEngine(lambda: make_client(self.spec, m.gen_servers, self.secret, self.nr))
            return Model(name=m.name, engine=engine, tokenizer=tok, grid=self.grids[m.name], path=m.path)
        if not m.path:  # a model without weights (e.g. a rule-based reward): only the tokenizer
            from realhf.base.hf_tokenizer import load_tokenizer

            tok = load_tokenizer(m.tokenizer_path)
            return Model(name=m.name, engine=None, tokenizer=tok, grid=self.grids[m.name], path="")
        path = m.path
        if self.resume_info is not None and m.optimizer is not None:
            path = os.path.join(self.resume_info["path"], m.name)
        # the model's own dtype, or the environment's default (bf16 on GPU, fp32 on CPU) where it names none
        dtype = getattr(torch, m.dtype) if m.dtype not in (None, "auto") else self.env.dtype
        module = build_from_hf(path, grid=self.grids[m.name], dtype=dtype, is_critic=m.is_critic, env=self.env)
        module.checkpointing = m.gradient_checkpointing
        if m.compile:
            why = module.compile_blocks()
            if why is not None:
                logger.info(f"model {m.name}: compile ignored: {why}")
        engine = TrainEngine(module, m.optimizer, m.total_train_steps) if m.optimizer is not None else InferenceEngine(module)
        from realhf.base.hf_tokenizer import load_tokenizer

        src = m.tokenizer_path or m.path
        try:
            tok = load_tokenizer(src)
        except (OSError, ValueError) as e:  # checked at build time already; a folder changed since then
            raise RuntimeError(f"model {m.name}: cannot load the tokenizer of {src}: {e}") from e
        return Model(name=m.name, engine=engine, tokenizer=tok, grid=self.grids[m.name], path=m.path)

    def _is_data_holder(self, model_name: str) -> Optional[ParallelGrid]:
        g = self.grids[model_name]
        if g.is_member and g.tp_rank == 0 and g.pp_rank == 0:
            return g
        return None

    def _setup_data(self):
        from realhf.impl.dataset import EpochIterator, make_dataset

        ds = self.spec.dataset
        g = self._is_data_holder(ds.holder_model)
        if g is not None and ds.kind == "trajectory_stream":  # asynchronous RL: finished trajectories, pulled
            from realhf.system.transport.trajectory_stream import TrajectoryStreamSource

            self.dataset = range(ds.args["n_prompts"])
            self.data_iter = TrajectoryStreamSource(
                self.secret, self.nr, self.spec.experiment_name, self.spec.trial_name, g.dp_rank, g.dp_size,
                ds.batch_size, ds.args["steps_per_epoch"], ds.args["n_prompts"], host=network.worker_host(),
                device=self.env.device)
        elif g is not None:
            tok = self.models[ds.holder_model].tokenizer
            self.dataset = make_dataset(ds.kind, tokenizer=tok, **ds.args)
            self.data_iter = EpochIterator(self.dataset, ds.batch_size, seed=self.spec.seed, dp_rank=g.dp_rank,
                                           dp_size=g.dp_size, shuffle=ds.shuffle)
        vs = self.spec.valid_dataset
        if vs is not None and self.grids[vs.holder_model].is_member:
            g = self.grids[vs.holder_model]
            tok = self.models[vs.holder_model].tokenizer
            vds = make_dataset(vs.kind, tokenizer=tok, **vs.args)
            it = EpochIterator(vds, vs.batch_size, seed=0, dp_rank=g.dp_rank, dp_size=g.dp_size, shuffle=False,
                               drop_last=False)
            batches = [vds.collate([vds[i] for i in it.rank_share(it.global_batch_indices(0, s))])
                       for s in range(it.steps_per_epoch)]
            for b in batches:  # on this worker's device, like every input the data manager hands an MFC
                b.data = {k: v.to(self.env.device) for k, v in b.data.items()}
            self.valid_batches = lambda: batches

    # ------------------------------------------------------------------ serving
    def run(self) -> int:
        while True:
            got = self.server.poll(timeout=0.5)
            if got is None:
                continue
            peer, req = got
            self.heartbeat.set_status(req.handle_name)
            try:
                data, tensors = self.handle(req)
                self.server.reply(peer, Payload(handler="master", handle_name=req.handle_name,
                                                request_id=req.request_id, data=data or {}, tensors=tensors or []))
            except Exception:  # report any failure to the master, then stop: collectives may be broken
                tb = traceback.format_exc()
                logger.error(f"{self.name} failed on {req.handle_name}:\n{tb}")
                self.server.reply(peer, Payload(handler="master", handle_name=req.handle_name,
                                                request_id=req.request_id, error=tb))
                time.sleep(0.5)
                return 1
            finally:
                self.heartbeat.set_status("idle")
            if req.handle_name == "exit":
                return 0

    def handle(self, req: Payload):
        h = getattr(self, f"_h_{req.handle_name}", None)
        if h is None:
            raise ValueError(f"unknown request {req.handle_name!r}")
        return h(req.data)

    def _h_exit(self, data):
        return {}, []

    def _h_dataset_info(self, data):
        if self.data_iter is None:
            return {"holder": False}, []
        return {"holder": True, "steps_per_epoch": self.data_iter.steps_per_epoch, "n_samples": len(self.dataset),
                "dp_rank": self.grids[self.spec.dataset.holder_model].dp_rank,
                "skipped": getattr(self.dataset, "skipped", None)}, []

    def _h_fetch(self, data):
        it = self.data_iter
        info = {"epoch": it.epoch, "epoch_step": it.position, "is_epoch_last": it.position == it.steps_per_epoch - 1}
        batch = it.next_batch()
        self.data.put(batch)
        header, _ = batch.meta().to_wire()
        return {"sample": header, **info, "stats": dict(getattr(it, "last_stats", {}))}, []

    def _h_mfc(self, data):
        mfc = next(m for m in self.spec.mfcs if m.name == data["mfc"])
        self.env.reset_peak_memory()  # the reply's peak covers received inputs and the call
        self.data.execute([tuple(x) for x in data["plan"]], data["metas"])
        role = str(mfc.model_name)
        grid = self.grids[role]
        if not grid.is_member:
            return {}, []
        ids = data["ids_by_dp"][str(grid.dp_rank)]
        meta = data.get("metadata", {})
        md = {k: [meta[str(i)].get(k) for i in ids] for k in (meta[str(ids[0])] if ids and meta else {})}
        inp = self.data.get(ids, list(mfc.buffer_input_keys), metadata=md)
        inp = inp.remap_keys(mfc.input_buffer_to_interface())
        model = self.models[role]
        iface = self.interfaces[mfc.name]
        mb_spec = MicroBatchSpec(**data.get("mb_spec", {})) if data.get("mb_spec") else mfc.mb_spec
        t0 = time.perf_counter()
        self._load_params(role)
        t_est = time.perf_counter()  # the memory model's estimate is bookkeeping, not the call's compute
        held = mfc_memory.held(self.models, self.env.device)
        est, mb_info = mfc_memory.call(mfc, iface, model, inp, mb_spec)
        t0 += time.perf_counter() - t_est
        mb_key = f"{mfc.name}.mb_spec" if mfc.name != "trainDefault" else "mb_spec"
        with mfc_memory.reported_out_of_memory(mfc.name, self.rank, mb_info, held, est,
                                               lambda: self.env.memory_stats()["peak_mem_gib"], mb_key), \
                mfc_memory.measured(self.env.device) as peak:
            if mfc.is_train:
                res = iface.train_step(model, inp, mb_spec)
                model.version += 1
            elif mfc.is_generate:
                res = iface.generate(model, inp, mb_spec)
            elif mfc.is_inference:
                res = iface.inference(model, inp, mb_spec)
            else:
                raise ValueError(f"MFC {mfc.name}: {mfc.interface_type} is not run through 'mfc' requests")
        # this worker's compute time and peak memory of the call (realhf.base.runtime_env: peak_mem_gib, and
        # reserved_mem_gib on CUDA), beside the memory model's estimate (realhf.system.trainer.mfc_memory)
        reply = {"seconds": time.perf_counter() - t0, **self.env.memory_stats(), **mfc_memory.stats(held, est, peak)}
        if cpu_share.active():  # cpus_per_worker_max: the threads this call ran with on average
            reply["cpu_threads"] = cpu_share.mean_threads()
        is_owner = self.rank == owner_rank(grid, grid.dp_rank)
        if isinstance(res, SequenceSample):
            if is_owner:
                out = res.remap_keys(mfc.output_interface_to_buffer())
                self.data.put(out)
                reply["output"] = out.meta().to_wire()[0]
        elif isinstance(res, dict) and is_owner and grid.dp_rank == 0:
            reply["stats"] = {k: float(v) for k, v in res.items()}
        return reply, []

    def _h_evaluate(self, data):
        role = data["model"]
        if role not in self.models or self.valid_batches is None:
            return {}, []
        mfc = next(m for m in self.spec.mfcs if m.name == data["mfc"])
        stats = self.interfaces[mfc.name].evaluate(self.models[role], self.valid_batches())
        g = self.grids[role]
        return ({"stats": stats} if g.dp_rank == 0 and self.rank == owner_rank(g, 0) else {}), []

    def _h_save(self, data):
        from realhf.impl.model.conversion.hf_io import save_hf

        role = data["model"]
        if role in self.models:
            m = self.models[role]
            save_hf(m.module, data["path"], tokenizer_src=self.spec.model(role).tokenizer_path or m.path)
        return {}, []

    def _h_ckpt(self, data):
        """Recover checkpoint of everything this worker holds (models, optimizer, data position, RNG)."""
        from realhf.impl.model.conversion.hf_io import save_hf

        d = data["dir"]
        for name, m in self.models.items():
            spec = self.spec.model(name)
            if spec.optimizer is None:
                continue
            save_hf(m.module, os.path.join(d, name), tokenizer_src=spec.tokenizer_path or spec.path)
            torch.save({**m.engine.state_dict(), "version": m.version}, os.path.join(d, name, f"engine_rank{self.rank}.pt"))
        st = {"rng": torch.get_rng_state(), "py": random.getstate(), "np": _np_state_plain(np.random.get_state()),
              "interfaces": {n: i.state_dict() for n, i in self.interfaces.items()}}
        if self.data_iter is not None:
            st["data_iter"] = self.data_iter.state_dict()
        torch.save(st, os.path.join(d, f"worker_rank{self.rank}.pt"))
        dist.barrier()
        return {}, []

    def _load_ckpt(self):
        d = self.resume_info["path"]
        for name, m in self.models.items():
            spec = self.spec.model(name)
            if spec.optimizer is None:
                continue
            st = load_state_file(os.path.join(d, name, f"engine_rank{self.rank}.pt"), keys=("version",))
            m.engine.load_state_dict(st)
            m.version = st["version"]
        st = load_state_file(os.path.join(d, f"worker_rank{self.rank}.pt"), keys=("rng", "py", "np"))
        torch.set_rng_state(st["rng"])
        random.setstate(st["py"])
        np.random.set_state(_np_state_from_plain(st["np"]))
        if self.data_iter is not None:
            self.data_iter.load_state_dict(st["data_iter"])
        for mfc in self.spec.mfcs:
            name = str(mfc.model_name)
            if name in self.models and st.get("interfaces", {}).get(mfc.name):
                self.interfaces[mfc.name].load_state_dict(st["interfaces"][mfc.name], self.models[name])
        logger.info(f"{self.name} resumed from {d}")

    # ------------------------------------------------------------------ parameter reallocation
    def _h_realloc(self, data):
        """Move the parameters of model ``src`` onto model ``dst`` (another layout of the same role),
        point-to-point between the workers of both (collective over them)."""
        from realhf.impl.model.parallelism.realloc import PlacedLayout, execute_plan, make_plan

        src, dst = data["src"], data["dst"]
        key = (src, dst)
        if key not in self._realloc_plans:
            s, d = self.spec.model(src), self.spec.model(dst)
            cfg = (self.models.get(src) or self.models[dst]).module.config
            self._realloc_plans[key] = make_plan(cfg, PlacedLayout.of(s.layout, s.ranks),
                                                 PlacedLayout.of(d.layout, d.ranks))
        plan = self._realloc_plans[key]
        t0 = time.perf_counter()
        self._load_params(dst)
        n = execute_plan(plan, self.rank, self.models[src].module.flat if src in self.models else None,
                         self.models[dst].module.flat if dst in self.models else None)
        if src in self.models and dst in self.models:
            self.models[dst].version = self.models[src].version
        return {"seconds": time.perf_counter() - t0, **n}, []

    def _h_publish_weights(self, data):
        """Bring the parameters of trained replica ``src`` to the generation servers that serve replica ``dst``
        (collective over ``src``'s workers); ``dst``'s worker only records the version it now generates with."""
        from realhf.system.trainer.served import WeightPublisher

        src, dst, version = data["src"], data["dst"], int(data["version"])
        out = {}
        if src in self.models:
            if dst not in self._publishers:
                self._publishers[dst] = WeightPublisher(self.spec, self.spec.model(dst).gen_servers, self.secret,
                                                        self.nr, self.env, dst, on_failure=self.heartbeat.report_failure)
            out = self._publishers[dst].publish(self.models[src], version)
        if dst in self.models:
            self.models[dst].version = version
        return out, []

    def _h_realloc_save(self, data):
        """Disk path, first half: the source layout writes its parameters as a HF checkpoint."""
        from realhf.impl.model.conversion.hf_io import save_hf

        if data["src"] in self.models:
            save_hf(self.models[data["src"]].module, data["path"])
        return {}, []

    def _h_realloc_load(self, data):
        """Disk path, second half: the destination layout reads its shards of that checkpoint."""
        from realhf.impl.model.conversion.hf_io import load_hf_into

        if data["dst"] in self.models:
            self._load_params(data["dst"])
            load_hf_into(self.models[data["dst"]].module, data["path"])
        return {}, []

    def _load_params(self, name: str):
        m = self.models.get(name)
        if m is not None and m.engine is not None:
            m.engine.load()

    def _h_offload(self, data):
        """Move the parameters of ``data["models"]`` (inference-only replicas) to host memory; the next request that
        uses one brings it back (``_load_params``). Sent by the master's OffloadHook after their MFCs."""
        for name in data["models"]:
            m = self.models.get(name)
            if m is not None and m.engine is not None:
                m.engine.offload()
        return {}, []

    def _h_values(self, data):
        """The values of a small per-sample key (e.g. one reward per answer) of samples this worker holds, for the
        master's decisions over the data (dynamic sampling)."""
        key = data["key"]
        return {"values": {str(i): self.data.get([i], [key]).data[key].flatten().tolist() for i in data["ids"]}}, []

    def _h_clear(self, data):
        self.data.drop(data["ids"])
        return {}, []

    def close(self):
        if hasattr(self, "_master_watch"):
            self._master_watch.set()
            self.master_beats.close()
        if hasattr(self, "heartbeat"):
            self.heartbeat.stop()
        if hasattr(self, "server"):
            self.server.close()
        for p in self._publishers.values():
            p.close()
        for m in self.models.values():
            if hasattr(m.engine, "close"):
                m.engine.close()
        if hasattr(self.data_iter, "close"):
            self.data_iter.close()
        if dist.is_initialized():
            dist.destroy_process_group()
