"""Training with generation servers: the model worker's side.

* :class:`ServedEngine` stands where a ``ReaLModel`` engine stands for a generation MFC: ``generate`` sends one
  request per prompt (its ``n`` samples together, with the prompt's seed) to the servers through the run's
  client and returns a ``GenerationOutput`` with the weight version behind every token. Seeds follow
  ``generate(seeds=...)``, so the ``gen`` backend samples exactly what the colocated engine would.
* :class:`WeightPublisher` brings the trained weights of the source replica to every server after training
  (the master's ``ParamReallocHook`` asks for it before the next generation): ``disk`` — the replica writes a HF
  checkpoint (``save_hf``, atomic) and every server loads it; ``memory`` — on the servers' host, ``gen`` and vLLM
  servers map the stage writers' HF-named tensors by reference (``gen_server.weight_transport=shared``, the
  ``auto`` choice there: CUDA IPC handles on a GPU, a shared-memory file on CPU; ``realhf.gen_server.weight_share``);
  otherwise (``group``) the replica's stage writers and every server rank join one torch.distributed group (gloo on
  CPU or where a server shares the trainer's GPU, NCCL between GPUs) and the writers broadcast the tensors, which
  the servers load as they arrive. In an asynchronous run (``spec.rollout``) the checkpoint (or, ``memory``, the
  shared parts: there is no weight group there) goes to the rollout manager instead, which pauses the servers, has
  them load it and resumes them. There, a single-process replica publishes *behind* training: it copies its
  weights (a fraction of a second; on CPU with ``memory`` into the shared buffer) and a background thread writes
  and announces the checkpoint (or announces the shared copy) while the trainer goes on with the next step; the
  next publish waits for it, so versions arrive in order. A failure is reported at once through ``on_failure``
  (the worker's heartbeats: the master stops the run with it, as no rollout of a later batch may wait for a
  version that never comes) and raised again by the next publish. The staleness bound holds as before: the
  manager admits rollouts by the version the servers hold, which only lags a little longer.
"""
from __future__ import annotations

import dataclasses
import os
import threading
import time
import uuid
from typing import Callable, List, Optional, Sequence

import torch.distributed as dist

from realhf.base import logging, network
from realhf.base.name_resolve import names
from realhf.gen_server.api import GenerateRequest, WeightGroupSpec
from realhf.gen_server.client import SyncGenClient, dialect_options, server_addresses

logger = logging.getLogger(__name__)


def make_client(spec, fleet, secret: bytes, nr) -> SyncGenClient:
    addrs = server_addresses(nr, spec.experiment_name, spec.trial_name, fleet.n_servers)
    return SyncGenClient(addrs, secret, routing=fleet.routing, request_timeout=fleet.request_timeout_secs,
                         **dialect_options(fleet.backend, secret))


class ServedModule:
    """What interfaces read of a served replica's "module": it is one stage that samples."""

    is_first = is_last = True
    tp_group = None
    tp = pp = 1


class ServedEngine:
    """The engine of a served replica: generation goes to the servers. ``client``: a client, or a function making
    one when the first generation needs it (an asynchronous run's trainer never generates: no client is made)."""

    def __init__(self, client):
        self._client, self._make = (None, client) if callable(client) else (client, None)
        self.model = ServedModule()

    @property
    def client(self) -> SyncGenClient:
        if self._client is None:
            self._client = self._make()
        return self._client

    def load(self):
        pass

    def offload(self):
        pass

    def generate(self, prompts: Sequence[Sequence[int]], gconfig, eos_token_id=None, generator=None,
                 seeds: Optional[Sequence[int]] = None):
        from realhf.impl.model.nn.generation import GenerationOutput

        stop = sorted(set(gconfig.stop_token_ids) | ({int(eos_token_id)} if eos_token_id is not None else set()))
        base = uuid.uuid4().hex[:12]
        reqs = []
        for i, p in enumerate(prompts):
            sp = gconfig.sampling(stop_token_ids=stop, seed=None if seeds is None or gconfig.greedy else int(seeds[i]))
            reqs.append(GenerateRequest(rid=f"{base}-{i}", input_ids=[int(t) for t in p], sampling=sp))
        t0 = time.perf_counter()
        results = self.client.generate_many(reqs)
        out = GenerationOutput(tokens=[], logprobs=[], no_eos=[], versions=[])
        for r in results:
            for o in r.outputs:
                out.tokens.append(list(o.output_ids))
                out.logprobs.append(list(o.logprobs))
                out.no_eos.append(o.finish_reason != "stop")
                out.versions.append(list(o.versions))
        n_tok = sum(len(t) for t in out.tokens)
        logger.debug("served generation: %d prompts x %d, %d tokens in %.2f s", len(prompts), gconfig.n, n_tok,
                     time.perf_counter() - t0)
        return out

    def close(self):
        if self._client is not None:
            self._client.close()


class WeightPublisher:
    """Publishes the weights of one trained replica (``src`` on this worker) to the servers of ``fleet``.
    ``on_failure(message)``: called (from the background thread) when a publish behind training fails, e.g. the
    worker's ``HeartbeatSender.report_failure``."""

    def __init__(self, spec, fleet, secret: bytes, nr, env, dst: str,
                 on_failure: Optional[Callable[[str], None]] = None):
        self.spec, self.fleet, self.secret, self.nr, self.env, self.dst = spec, fleet, secret, nr, env, dst
        self.on_failure = on_failure
        self.client: Optional[SyncGenClient] = None
        self.group = None
        self.transport: Optional[str] = None  # param_realloc=memory: "group" | "shared", chosen at the first publish
        self.sharer = None  # the shared-memory writer of the "shared" transport
        self._shared_worked = False  # a shared update has reached the servers (auto no longer falls back)
        self.path = os.path.join(spec.save_dir, ".gen_weights", dst)
        self._behind: Optional[threading.Thread] = None  # the publish running behind training
        self._behind_error: Optional[BaseException] = None
        self._snapshot = None  # HF-named copies of the weights, reused from one publish to the next

    def _client(self) -> SyncGenClient:
        if self.client is None:
            self.client = make_client(self.spec, self.fleet, self.secret, self.nr)
        return self.client

    def publish(self, model, version: int) -> dict:
        t0 = time.perf_counter()
        self.wait()
        behind = self.spec.rollout is not None and model.grid.layout.world_size == 1
        if behind:
            self._publish_behind(model, version)
        elif self.fleet.param_realloc == "disk":
            self._publish_disk(model, version)
        else:
            self._publish_memory(model, version)
        return {"seconds": time.perf_counter() - t0}

    def wait(self) -> None:
        """Until the publish running behind training is done; raises its failure."""
        if self._behind is not None:
            self._behind.join()
            self._behind = None
        err, self._behind_error = self._behind_error, None
        if err is not None:
            raise err

    @staticmethod
    def _is_head(grid) -> bool:
        return grid.dp_rank == 0 and grid.tp_rank == 0 and grid.pp_rank == 0

    def _publish_disk(self, model, version: int):
        from realhf.impl.model.conversion.hf_io import save_hf

        save_hf(model.module, self.path)  # collective over the replica; the folder is complete when it returns
        if self._is_head(model.grid):
            self._announce(version)

    def _publish_behind(self, model, version: int):
        """An asynchronous run's single-process replica: a snapshot of the weights now, and the rest behind training
        (disk: written, then announced; memory: shared, then announced; on CPU the shared buffer is the snapshot)."""
        from realhf.impl.model.conversion.hf_io import stage_hf_state

        hf = stage_hf_state(model.module)
        if self.fleet.param_realloc == "memory":
            if self.transport is None:
                self.transport = self._choose_transport(self._client(), 0, None, model.grid, hf)
            on_cpu = all(v.device.type == "cpu" for v in hf.values())
            part = self._sharer(0).share(hf if on_cpu else self._snap(hf))
            target, args = self._share_behind, ([part], version)
        else:
            target, args = self._write_behind, (self._snap(hf), model.module.config, version)
        self._behind = threading.Thread(target=target, args=args, name=f"publish-{self.dst}", daemon=True)
        self._behind.start()

    def _snap(self, hf):
        """A copy of ``hf`` the trainer does not change, reused from one publish to the next."""
        snap = self._snapshot
        if snap is None or snap.keys() != hf.keys() or any(snap[k].shape != v.shape for k, v in hf.items()):
            snap = self._snapshot = {k: v.detach().clone() for k, v in hf.items()}
        else:
            for k, v in hf.items():
                snap[k].copy_(v)
        return snap

    def _write_behind(self, snap, cfg, version: int):
        from realhf.impl.model.conversion.hf_io import write_hf_state

        def write():
            write_hf_state(snap, cfg, self.path)
            self._announce(version)

        self._behind_do(write, version, f"through {self.path}")

    def _share_behind(self, parts, version: int):
        def share():
            try:
                self._announce_shared(parts, version)
            finally:
                self.sharer.release()

        self._behind_do(share, version, "shared by reference")

    def _behind_do(self, fn, version: int, how: str):
        try:
            t0 = time.perf_counter()
            fn()
            logger.info("published version %d of %s behind training in %.2f s", version, self.dst,
                        time.perf_counter() - t0)
        except BaseException as e:  # reported now (the run stops), raised again by the next publish (or close)
            err = RuntimeError(f"publishing version {version} of the weights of {self.dst} to the generation servers "
                               f"({how}) failed: {type(e).__name__}: {e}")
            err.__cause__ = e
            self._behind_error = err
            if self.on_failure is not None:
                self.on_failure(str(err))

    def _manager_call(self, body: dict):
        from realhf.system.transport.manager_client import manager_call

        addr = self.nr.wait(names.rollout_manager(self.spec.experiment_name, self.spec.trial_name), timeout=600)
        manager_call(addr, self.secret, "/update_weights", body, timeout=self.fleet.startup_timeout_secs)

    def _announce_shared(self, parts: List[dict], version: int):
        """The servers load the shared ``parts`` as ``version`` (asynchronous run: through the rollout manager, which
        pauses, updates and resumes them); the writers keep the parts alive until this returns."""
        if self.spec.rollout is not None:
            self._manager_call({"parts": parts, "version": version})
        else:
            self._client().update_weights_from_shared(parts, version)

    def _announce(self, version: int):
        """The checkpoint at ``self.path`` is complete: have the servers load it as ``version``."""
        if self.spec.rollout is not None:  # asynchronous run: the rollout manager pauses, updates, resumes the servers
            self._manager_call({"path": self.path, "version": version})
        else:
            self._client().update_weights_from_disk(self.path, version)

    def _publish_memory(self, model, version: int):
        from realhf.impl.model.conversion.hf_io import stage_hf_state

        module, grid = model.module, model.grid
        hf = stage_hf_state(module)  # collective over the tp group
        if grid.dp_rank != 0 or grid.tp_rank != 0:
            return
        pp, stage = module.pp, grid.pp_rank
        writers_group = grid.pp_group if pp > 1 else None  # the stage writers: dp 0, tp 0 of every stage
        client = self._client() if stage == 0 else None
        if self.transport is None:
            self.transport = self._choose_transport(client, stage, writers_group, grid, hf)
        if self.transport == "shared":
            self._publish_shared(client, stage, pp, writers_group, grid, hf, version)
        else:
            self._publish_group(client, stage, pp, writers_group, grid, hf, version)

    def _choose_transport(self, client, stage: int, writers_group, grid, hf) -> str:
        """``shared`` or ``group`` (gen_server.weight_transport; ``auto``: shared where every stage writer and every
        server is on one host, the servers take shared weights and see the writers' GPU), the same on every stage
        writer. ``shared`` asked for where it cannot work raises, naming why."""
        from realhf.gen_server import weight_share

        want = self.fleet.weight_transport
        if want == "group":
            return "group"
        dev = next(iter(hf.values())).device if hf else self.env.device
        mine = dict(host=weight_share.host_id(), gpu=weight_share.device_uuid(dev),
                    unsupported=weight_share.supported())
        writers = [mine]
        if writers_group is not None:
            writers = [None] * dist.get_world_size(writers_group)
            dist.all_gather_object(writers, mine, group=writers_group)
        box = [None]
        if stage == 0:
            why = self._cannot_share(writers, client.health())
            if why and self.spec.rollout is not None:  # no weight group in an asynchronous run
                box[0] = (f"error: param_realloc=memory in an asynchronous run shares the weights with the servers, "
                          f"which cannot work here: {why}; use param_realloc=disk")
            elif why and want == "shared":
                box[0] = f"error: gen_server.weight_transport=shared cannot work: {why}; use group or auto"
            else:
                box[0] = "group" if why else "shared"
            how = f"by reference: {'CUDA IPC' if mine['gpu'] else 'a shared-memory file'}" if not why else why
            logger.info("weights of %s to the generation servers: %s (%s)", self.dst, box[0], how)
        if writers_group is not None:
            dist.broadcast_object_list(box, src=grid.global_rank_of(0, 0, 0), group=writers_group)
        if box[0].startswith("error: "):
            raise RuntimeError(box[0][len("error: "):])
        return box[0]

    @staticmethod
    def _cannot_share(writers: List[dict], servers: List[dict]) -> Optional[str]:
        """Why the trainer's stage writers (``host``, ``gpu``, ``unsupported``) cannot share weights with the servers
        (their /health answers); None where they can."""
        for i, w in enumerate(writers):
            if w["unsupported"]:
                return f"stage writer {i}: {w['unsupported']}"
        for i, h in enumerate(servers):
            if not h.get("shared_weights"):
                return f"server {i} ({h.get('backend', '?')}) does not take shared weights"
            for j, w in enumerate(writers):
                if h.get("host") != w["host"]:
                    return f"server {i} runs on {h.get('host')!r}, stage writer {j} on {w['host']!r}"
                if w["gpu"] is not None and w["gpu"] not in (h.get("gpus") or []):
                    return f"server {i} does not see stage writer {j}'s GPU {w['gpu']}"
        return None

    def _publish_shared(self, client, stage: int, pp: int, writers_group, grid, hf, version: int):
        """Every stage writer shares its tensors; stage 0 has the servers load all the parts. Until one such update
        has worked, ``auto`` falls back to the weight group when it fails (e.g. a container that forbids CUDA IPC),
        with a warning naming the cause; the group's complete update also repairs a server left half-updated."""
        try:
            part = self._sharer(stage).share(hf)
        except Exception as e:
            if not self._may_fall_back():
                raise
            part = f"stage writer {stage} cannot share: {type(e).__name__}: {e}"
        parts = [part]
        if writers_group is not None:
            parts = [None] * pp
            dist.all_gather_object(parts, part, group=writers_group)
        failed = [None]
        try:
            if stage == 0:
                failed[0] = next((p for p in parts if isinstance(p, str)), None)
                if failed[0] is None:
                    try:
                        self._announce_shared(parts, version)
                    except Exception as e:
                        if not self._may_fall_back():
                            raise
                        failed[0] = f"the servers could not load them: {type(e).__name__}: {e}"
        finally:
            if writers_group is not None:  # every writer keeps its tensors until the servers have read them
                dist.barrier(group=writers_group)
            self.sharer.release()
        if writers_group is not None:
            dist.broadcast_object_list(failed, src=grid.global_rank_of(0, 0, 0), group=writers_group)
        if failed[0] is None:
            self._shared_worked = True
            return
        logger.warning("weights of %s: sharing them with the generation servers failed (%s); falling back to the "
                       "weight group for this run (gen_server.weight_transport=group skips the attempt)", self.dst,
                       failed[0])
        self.transport = "group"
        self.sharer.close()
        self.sharer = None
        self._publish_group(client, stage, pp, writers_group, grid, hf, version)

    def _sharer(self, stage: int):
        """This stage writer's shared-memory writer (one for the run: its CPU buffer is reused)."""
        if self.sharer is None:
            from realhf.gen_server.weight_share import SharedWriter

            self.sharer = SharedWriter(f"{self.dst}-stage{stage}")
        return self.sharer

    def _may_fall_back(self) -> bool:
        """Whether a failed shared update may fall back to the weight group: ``auto``, a synchronous run (an
        asynchronous one has no group), and no shared update has worked yet (after one, a failure is the run's)."""
        return (self.fleet.weight_transport == "auto" and self.spec.rollout is None
                and not self._shared_worked)

    def _publish_group(self, client, stage: int, pp: int, writers_group, grid, hf, version: int):
        from realhf.gen_server.weight_group import metas_of, send

        metas = metas_of(hf, src=stage)
        if writers_group is not None:
            everyone: List = [None] * pp
            dist.all_gather_object(everyone, metas, group=writers_group)
            metas = [m for part in everyone for m in part]
        if self.group is None:
            self._join(client, stage, pp, writers_group, grid)
        pending = None
        if stage == 0:  # the servers receive while the writers send
            pending = client.submit(lambda: client.client.update_weights_from_group(metas, version))
        send(self.group, hf, metas)
        if pending is not None:
            pending.result()

    def _join(self, client, stage: int, pp: int, writers_group, grid):
        from realhf.gen_server.weight_group import WeightGroup

        f = self.fleet
        if stage == 0:
            host = network.worker_host()
            addr = [host, network.find_free_port(host)]
        else:
            addr = [None, None]
        if writers_group is not None:
            dist.broadcast_object_list(addr, src=grid.global_rank_of(0, 0, 0), group=writers_group)
        backend = "nccl" if self.env.device.type == "cuda" and not f.shares_gpus else "gloo"
        world = pp + f.n_servers * f.tp
        name = f"{self.dst}-{uuid.uuid4().hex[:8]}" if stage == 0 else None
        if writers_group is not None:
            box = [name]
            dist.broadcast_object_list(box, src=grid.global_rank_of(0, 0, 0), group=writers_group)
            name = box[0]
        base = WeightGroupSpec(master_addr=addr[0], master_port=int(addr[1]), rank_offset=0, world_size=world,
                               group_name=name, backend=backend)
        pending = None
        if stage == 0:
            specs = [dataclasses.replace(base, rank_offset=pp + i * f.tp) for i in range(f.n_servers)]
            pending = client.submit(lambda: client.client.init_weight_group(specs))
        self.group = WeightGroup(base, rank=stage)
        if pending is not None:
            pending.result()
        logger.info("joined the weight group %s of %d ranks (%s) as rank %d", name, world, backend, stage)

    def close(self):
        try:
            self.wait()
        except RuntimeError as e:
            logger.warning("%s", e)
        if self.sharer is not None:
            self.sharer.close()
        if self.client is not None:
            self.client.close()
