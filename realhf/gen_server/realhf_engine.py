"""realhf's own generation engine (backend ``gen``): continuous batching over one ``ReaLModel`` replica.

One background thread owns the model and runs the scheduling loop; the async methods (called from the
server's event loop) hand it work through a thread-safe queue and are answered through asyncio futures
(``loop.call_soon_threadsafe``), so the event loop is never blocked by a forward pass. Every iteration of
the loop:

1. takes the commands that arrived (new requests, abort, pause/resume, weight updates, log-prob passes;
   the last two run here, between decode steps, so no forward ever sees weights change);
2. unless paused, *admits* waiting requests (first come, first served) while the running samples stay
   within ``max_num_seqs``: their prompts are prefilled in one packed forward (each distinct prompt once;
   its samples copy its cache row), the first token of every sample is drawn, and the new rows are
   written into free slots of the running batch's KV cache (``SlotCache``: preallocated row slots, so a
   row joining or leaving copies only its own keys/values; ``SharedSlotCache`` where requests ask for several
   samples: the samples of a prompt decode over one copy of its keys/values, read once per step for all);
3. runs ONE decode step for every running row in one forward pass, samples a token per row (rows grouped
   by identical sampling parameters, ``sampling.sample_with_mask``), records it with the current weight
   version, finishes rows that produced a stop token (``"stop"``, the token included) or reached
   ``max_new_tokens`` (``"length"``), and drops them from the batch (the last rows move into their slots);
4. answers the requests whose samples have all finished.

A request submitted while others run joins the batch at the next iteration. Sampling follows
``generation.generate`` exactly: log-probs under ``log_softmax(logits / temperature)`` of the unmodified
distribution, stop tokens banned before ``min_new_tokens``; a request with ``seed`` draws sample ``j`` by
inverse CDF from its own stream seeded by ``sample_seed(seed, j)`` in chunks of ``RowStreams.CHUNK``
numbers, so it gets the samples ``generate(..., seeds=[seed])`` gives, whatever else shares the batch.
Requests without a seed draw from the engine's generator (seeded by ``EngineConfig.seed``).

Errors: sampling parameters that cannot be sampled are refused when a request arrives (``RequestError``, by
``realhf.api.core.sampling_checks``, the rule in-process generation follows too). A request whose sampling still
raises in a step fails alone (``sample_groups`` samples its group again request by request, only after the shared
call raised); its neighbours in the batch go on. A failed prefill forward fails the requests it admitted, a failed
decode forward the running ones; the engine keeps serving. A weight update that fails before touching a parameter
(bad folder, older version, unknown tensor, wrong shape, non-finite value: all checked first) changes nothing; one
that fails after replacing some parameters (the trainer dies mid-broadcast) leaves a mix of weights, so every
request fails and new ones are refused until a complete update succeeds. ``close`` fails whatever is still
pending with ``EngineClosed``.

Backend options (``EngineConfig.extra``): ``compile_decode`` (bool, default False: run the decode forward
as one compiled graph, ``realhf.impl.model.nn.compiled_decode``; a one-off compile cost of seconds),
``cuda_graph`` (bool, default True: on CUDA, each decode step of a batch whose rows have their own caches is
replayed as a CUDA graph, captured once per padded row count, ``graph_decode.PaddedGraphDecoder``; with it,
``share_prefixes`` is off unless set true), ``max_prefill_tokens`` (int, default 16384: prompt tokens prefilled in one iteration at most; one request
is always admitted even if longer), ``share_prefixes`` (bool; unset: where it pays, ``kv_cache.sharing_pays``;
true: a running batch that starts with a request for several samples decodes them over one shared copy of its
prompt's keys/values; false: never; off under ``compile_decode``), ``kv_cache_dtype`` ("auto", the model's dtype, or
"float16": see ``GenerationHyperparameters.kv_cache_dtype``). ``pp_size`` other than 1 is refused, as is
``tp_size`` other than 1: this backend runs one model replica per server.

The pieces: this module (the thread, commands, the async interface), ``engine_step.py`` (admission, decode steps,
rows), ``engine_weights.py`` (weight updates), ``engine_batch.py`` (requests, rows, sampling groups, slot caches).
"""
from __future__ import annotations

import asyncio
import queue
import threading
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from realhf.base import logging
from realhf.gen_server.api import (EngineConfig, GenerateRequest, GenerateResult, GenerationEngine, RequestError,
                                   SampleOutput, TensorMeta, WeightGroupSpec)
from realhf.impl.model.nn import cpu_gemm
from realhf.gen_server.engine_step import EngineSteps
from realhf.gen_server.engine_weights import EngineWeights
from realhf.gen_server.engine_batch import Group, Req, Row
from realhf.api.core.model_api import check_kv_cache_dtype
from realhf.api.core.sampling_checks import SamplingValueError, check_stop_coverage
from realhf.impl.model.nn.kv_cache import decode_kernel

logger = logging.getLogger("realhf.gen_server.engine")

# pp_size is accepted only to be refused with the reason (this backend serves pp = tp = 1)
_EXTRA_KEYS = {"compile_decode": bool, "cuda_graph": bool, "kv_cache_dtype": str, "max_prefill_tokens": int,
               "pp_size": int, "share_prefixes": bool}

class EngineClosed(RuntimeError):
    pass


class RealhfEngine(EngineWeights, EngineSteps, GenerationEngine):
    backend = "gen"
    shared_weights = True

    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        self.model = None
        self._q: "queue.Queue[tuple]" = queue.Queue()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()  # guards the request registry and its counters
        self._live: Dict[str, Req] = {}  # rid -> request not yet answered
        self._n_waiting = 0
        self._n_running = 0
        self._version = 0
        self._closed = False
        self._dead: Optional[BaseException] = None  # the loop itself failed: every call fails with this
        self._weight_group = None
        # engine-thread state
        self._waiting: List[Req] = []
        self._rows: List[Row] = []
        self._groups: List[Group] = []
        self._cache = None
        self._tok: Optional[torch.Tensor] = None  # last sampled token of every running row
        self._paused = False
        self._stop_flag = False
        self._gen: Optional[torch.Generator] = None
        self._answers: List[tuple] = []  # (future, result, exception) to hand back at the end of the iteration
        self._leftover: List[tuple] = []  # commands taken from the queue after "close"
        self._broken: Optional[str] = None  # why the weights are incomplete (a weight update failed midway)
        self._decoder = None
        self._stats = dict(generated_tokens=0, steps=0, prefills=0, prefill_tokens=0, batch_size=0,
                           max_batch_size=0, tokens_in_flight=0, finished_requests=0, aborted_requests=0,
                           failed_requests=0, weight_updates=0)
        extra = dict(cfg.extra or {})
        unknown = sorted(set(extra) - set(_EXTRA_KEYS))
        if unknown:
            raise ValueError(f"unknown options {unknown} for the gen backend; allowed: {sorted(_EXTRA_KEYS)}")
        for k, t in _EXTRA_KEYS.items():
            if k in extra and (not isinstance(extra[k], t) or (t is int and isinstance(extra[k], bool))):
                raise ValueError(f"gen backend option {k} must be {t.__name__}, got {extra[k]!r}")
        self._compile = bool(extra.get("compile_decode", False))
        # on CUDA (not compiled): the decode step replayed as a CUDA graph over the slot cache
        self._graphs = (not self._compile and bool(extra.get("cuda_graph", True))
                        and str(cfg.device).startswith("cuda"))
        # None: where it pays (kv_cache.sharing_pays). The compiled decode step and the CUDA-graph step read
        # whole-sequence caches: with them, samples keep their own copies of the prompt (unless share_prefixes is
        # set true, which decodes shared batches eagerly)
        self._share = False if self._compile else extra.get("share_prefixes")
        if self._graphs and self._share is None:
            self._share = False
        self._kv_dtype = extra.get("kv_cache_dtype", "auto")
        check_kv_cache_dtype(self._kv_dtype, "gen backend option kv_cache_dtype")
        self._max_prefill_tokens = int(extra.get("max_prefill_tokens", 16384))
        if self._max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {self._max_prefill_tokens}")

    # ================================================================== lifecycle
    async def start(self) -> None:
        cfg = self.cfg
        pp = (cfg.extra or {}).get("pp_size", 1)  # EngineConfig has no pipeline field; refuse one asked for here
        if cfg.tp_size != 1 or pp != 1:
            raise ValueError(
                f"the gen backend runs one model replica per server with tp=1 (got tp_size={cfg.tp_size}"
                f"{f', pp_size={pp}' if pp != 1 else ''}); use the vllm backend for tensor parallelism, or more "
                "gen servers (one per data-parallel replica) for more throughput")
        if cfg.max_num_seqs < 1 or cfg.max_model_len < 2:
            raise ValueError(f"max_num_seqs must be >= 1 and max_model_len >= 2, got {cfg.max_num_seqs}, "
                             f"{cfg.max_model_len}")
        if self._thread is not None:
            raise RuntimeError("RealhfEngine.start called twice")
        dtype = None if cfg.dtype in (None, "", "auto") else getattr(torch, str(cfg.dtype), None)
        if cfg.dtype not in (None, "", "auto") and not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown dtype {cfg.dtype!r}; use float32, bfloat16, float16 or auto")
        if cfg.threads:
            torch.set_num_threads(int(cfg.threads))
        # The engine thread builds the model and then runs every tensor operation of this engine: one OpenMP
        # thread team in the process. A second team (a build in another thread) keeps its worker threads,
        # and with more OpenMP threads than CPUs libgomp stops spin-waiting between parallel regions: every
        # small operation then pays a futex wake-up (measured 1.4x slower decode steps on 2 cores).
        loop = asyncio.get_running_loop()
        built = loop.create_future()
        self._thread = threading.Thread(target=self._run, args=(dtype, loop, built), name="realhf-gen-engine",
                                        daemon=True)
        self._thread.start()
        try:
            self.model = await built
        except BaseException:
            await asyncio.to_thread(self._thread.join)
            self._thread = None
            raise
        mc = self.model.config
        self.vocab_size = mc.vocab_size
        limits = [("max_model_len", cfg.max_model_len)]
        pos = mc.n_positions or mc.max_positions
        if pos:
            limits.append(("the model's positions", int(pos)))
        self._len_limit = min(limits, key=lambda kv: kv[1])
        self._gen = torch.Generator(device=self.model.device).manual_seed(int(cfg.seed))
        from realhf.impl.model.nn.decode_core import fast_step_for

        # the decode core's step, chosen once: compiled, a CUDA graph over the slot storage, or None (eager)
        self._decoder = fast_step_for(self.model, compile_decode=self._compile, cuda_graph=self._graphs, padded=True)

    def _build(self, dtype):
        from realhf.base.topology import single_process_grid
        from realhf.impl.model.conversion.hf_io import build_from_hf

        model = build_from_hf(self.cfg.model_path, grid=single_process_grid(), dtype=dtype, device=self.cfg.device)
        model.eval()
        if str(self.cfg.device) == "cpu" and model.dtype == torch.float32:
            decode_kernel()  # built (first use on this machine) or loaded before the server says it is ready
        return model

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            self._q.put(("close",))
            await asyncio.to_thread(self._thread.join)
        self._weight_group = None
        self.model = None

    # ================================================================== the async interface
    def _check_usable(self):
        if self._dead is not None:
            raise RuntimeError(f"the generation engine failed and serves no more requests: "
                               f"{type(self._dead).__name__}: {self._dead}")
        if self._closed:
            raise EngineClosed("the generation engine is closed")
        if self._thread is None:
            raise RuntimeError("the generation engine is not started (call start() first)")

    def _check_weights(self):
        if self._broken is not None:
            raise RuntimeError(f"the served weights are incomplete after a weight update failed midway "
                               f"({self._broken}); load a complete set (update_weights_from_disk or _from_group) "
                               "before generating")

    def _check_ids(self, ids: Sequence[int], what: str):
        V = self.vocab_size
        for i, t in enumerate(ids):
            if not 0 <= t < V:
                raise RequestError(f"{what} holds token id {t} at position {i}, outside the model's vocabulary "
                                   f"[0, {V})")

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        self._check_usable()
        self._check_weights()
        sp = req.sampling.validate()
        ids = list(req.input_ids)
        if not ids:
            raise RequestError("input_ids must not be empty")
        self._check_ids(ids, "input_ids")
        self._check_ids(sp.stop_token_ids, "sampling.stop_token_ids")
        try:
            check_stop_coverage(sp.stop_token_ids, sp.min_new_tokens, self.vocab_size, prefix="sampling.")
        except SamplingValueError as e:
            raise RequestError(str(e)) from None
        name, limit = self._len_limit
        if len(ids) + sp.max_new_tokens > limit:
            raise RequestError(f"prompt of {len(ids)} tokens + max_new_tokens {sp.max_new_tokens} = "
                               f"{len(ids) + sp.max_new_tokens} exceeds {name} ({limit})")
        if sp.n > self.cfg.max_num_seqs:
            raise RequestError(f"sampling.n={sp.n} exceeds the server's max_num_seqs ({self.cfg.max_num_seqs}); "
                               "split the request")
        fut = asyncio.get_running_loop().create_future()
        r = Req(rid=req.rid, ids=ids, sp=sp, fut=fut, outputs=[None] * sp.n)
        with self._lock:
            if req.rid in self._live:
                raise RequestError(f"a request with rid {req.rid!r} is already running on this server")
            self._live[req.rid] = r
            self._n_waiting += 1
        self._submit(("gen", r))
        try:
            return await fut
        except asyncio.CancelledError:  # the caller went away: free its rows
            self._submit(("abort", [r], None))
            raise

    async def _call(self, kind: str, *args):
        self._check_usable()
        fut = asyncio.get_running_loop().create_future()
        self._submit((kind, *args, fut))
        return await fut

    def _submit(self, cmd: tuple):
        self._q.put(cmd)
        if not self._thread.is_alive():  # the loop ended after our check: nobody else will answer it
            self._shutdown(self._dead or EngineClosed("the generation engine was closed"))

    async def _between_steps(self, fn: Callable[[], Any]):
        """Run ``fn()`` on the engine thread between two decode steps; its result or exception is ours."""
        return await self._call("call", fn)

    async def abort(self, rids: Optional[Sequence[str]] = None) -> int:
        return await self._call("abort", None if rids is None else list(rids))

    async def pause(self) -> None:
        await self._call("pause")

    async def resume(self) -> None:
        await self._call("resume")

    async def update_weights_from_disk(self, path: str, version: int) -> None:
        await self._between_steps(lambda: self._load_from_disk(path, version))

    async def init_weight_group(self, spec: WeightGroupSpec) -> None:
        self._check_usable()
        from realhf.gen_server.weight_group import WeightGroup

        # blocking until the trainer joins; decoding goes on meanwhile
        group = await asyncio.to_thread(WeightGroup, spec, spec.rank_offset)
        old, self._weight_group = self._weight_group, group
        if old is not None:
            old.close()

    async def update_weights_from_group(self, tensors: List[TensorMeta], version: int) -> None:
        if self._weight_group is None:
            raise RuntimeError("no weight group: call init_weight_group before update_weights_from_group")
        metas = list(tensors)
        await self._between_steps(lambda: self._load_from_group(metas, version))

    async def update_weights_from_shared(self, parts: List[dict], version: int) -> None:
        parts = list(parts)
        await self._between_steps(lambda: self._load_from_shared(parts, version))

    async def logprobs(self, sequences: List[List[int]]) -> List[List[float]]:
        self._check_usable()
        if not isinstance(sequences, list) or not sequences:
            raise RequestError("sequences must be a non-empty list of token-id lists")
        name, limit = self._len_limit
        for i, s in enumerate(sequences):
            if not isinstance(s, (list, tuple)) or len(s) < 2:
                raise RequestError(f"sequence {i} must be a list of at least 2 token ids")
            if len(s) > limit:
                raise RequestError(f"sequence {i} has {len(s)} tokens, more than {name} ({limit})")
            self._check_ids(s, f"sequence {i}")
        self._check_weights()
        seqs = [list(map(int, s)) for s in sequences]
        return await self._between_steps(lambda: self._logprobs(seqs))

    def metrics(self) -> Dict[str, Any]:
        with self._lock:
            m = dict(running_requests=self._n_running, waiting_requests=self._n_waiting)
        s = dict(self._stats)
        m.update(tokens_in_flight=s.pop("tokens_in_flight"), version=self._version,
                 generated_tokens=s.pop("generated_tokens"), paused=self._paused,
                 max_num_seqs=self.cfg.max_num_seqs, weights_incomplete=self._broken is not None, **s)
        d = self._decoder
        if d is not None and hasattr(d, "replays"):  # the CUDA-graph step: graphs captured, steps replayed
            m.update(graph_captures=d.captures, graph_replays=d.replays, graph_failed=d.failed is not None)
        return m

    @property
    def version(self) -> int:
        return self._version

    # ================================================================== futures (engine thread -> event loop)
    def _resolve(self, fut: Optional[asyncio.Future], result=None, exc: Optional[BaseException] = None):
        """Answer ``fut`` at the end of this iteration (``_flush``), once the metrics are up to date."""
        if fut is not None:
            self._answers.append((fut, result, exc))

    def _flush(self):
        answers, self._answers = self._answers, []
        for fut, result, exc in answers:
            def done(fut=fut, result=result, exc=exc):
                if not fut.done():
                    if exc is not None:
                        fut.set_exception(exc)
                    else:
                        fut.set_result(result)

            try:
                fut.get_loop().call_soon_threadsafe(done)
            except RuntimeError:  # the caller's event loop is closed: nobody waits any more
                pass

    def _unregister(self, r: Req, was: str):
        with self._lock:
            if self._live.get(r.rid) is r:
                del self._live[r.rid]
            if was == "waiting":
                self._n_waiting -= 1
            elif was == "running":
                self._n_running -= 1

    def _answer(self, r: Req):
        """All samples of ``r`` are finished: answer it."""
        was, r.state = r.state, "done"
        self._unregister(r, was)
        self._stats["finished_requests"] += 1
        self._resolve(r.fut, GenerateResult(rid=r.rid, outputs=list(r.outputs)))

    def _fail(self, r: Req, exc: BaseException):
        if r.state == "done":
            return
        was, r.state = r.state, "done"
        for row in r.rows:
            row.done = True
        self._unregister(r, was)
        self._stats["failed_requests"] += 1
        self._resolve(r.fut, exc=exc)

    # ================================================================== the engine thread
    def _run(self, dtype=None, loop=None, built=None):
        def answer(fn, *args):
            loop.call_soon_threadsafe(lambda: None if built.done() else fn(*args))

        if self.cfg.threads:
            torch.set_num_threads(int(self.cfg.threads))
        try:
            model = self._build(dtype)
        except BaseException as e:  # reported by start(); the loop never runs
            answer(built.set_exception, e)
            return
        answer(built.set_result, model)
        try:
            if model.device.type == "cuda" and model.device.index is not None:  # this thread's graphs and streams
                torch.cuda.set_device(model.device)
            # packed weight copies live as long as the loop; every weight update drops them first
            with torch.no_grad(), cpu_gemm.packed_weights():
                while not self._stop_flag:
                    try:
                        self._iteration()
                    finally:
                        self._flush()
        except BaseException as e:  # a bug in the loop itself: fail everything rather than hang callers
            logger.error("generation engine loop died: %s", traceback.format_exc())
            self._dead = e
        finally:
            exc = self._dead if self._dead is not None else EngineClosed("the generation engine was closed")
            self._shutdown(exc)

    def _shutdown(self, exc: BaseException):
        for r in list(self._waiting) + list({id(row.req): row.req for row in self._rows}.values()):
            self._fail(r, exc)
        self._waiting, self._rows, self._groups, self._cache, self._tok = [], [], [], None, None
        cmds, self._leftover = self._leftover, []
        while True:  # commands that will never run
            try:
                cmds.append(self._q.get_nowait())
            except queue.Empty:
                break
        for cmd in cmds:
            if cmd[0] == "gen":
                self._fail(cmd[1], exc)
            elif cmd[0] != "close":
                self._resolve(cmd[-1], exc=exc)
        self._flush()

    def _iteration(self):
        busy = not self._paused and (self._rows or self._waiting)
        cmds = []
        if not busy:
            cmds.append(self._q.get())
        while True:
            try:
                cmds.append(self._q.get_nowait())
            except queue.Empty:
                break
        for i, cmd in enumerate(cmds):
            self._command(cmd)
            if self._stop_flag:
                self._leftover = cmds[i + 1:]  # answered by _shutdown
                return
        # answer the commands now, not after this iteration's prefill and decode step: a resume after a weight
        # update would otherwise wait for the prefill of every resubmitted request (seconds on a CPU core)
        self._flush()
        if self._paused:
            return
        if self._waiting and len(self._rows) < self.cfg.max_num_seqs:
            self._admit()
        if self._rows:
            self._decode_step()

    def _command(self, cmd: tuple):
        kind = cmd[0]
        if kind == "gen":
            self._waiting.append(cmd[1])
        elif kind == "close":
            self._stop_flag = True
        elif kind == "pause":
            self._paused = True
            self._resolve(cmd[1])
        elif kind == "resume":
            self._paused = False
            self._resolve(cmd[1])
        elif kind == "abort":
            try:
                n = self._abort(cmd[1])
            except Exception as e:
                self._resolve(cmd[2], exc=e)
            else:
                self._resolve(cmd[2], n)
        elif kind == "call":
            fn, fut = cmd[1], cmd[2]
            try:
                res = fn()
            except Exception as e:
                logger.warning("generation engine: %s", f"{type(e).__name__}: {e}")
                self._resolve(fut, exc=e)
            else:
                self._resolve(fut, res)
        else:  # pragma: no cover - only this module puts commands
            raise RuntimeError(f"unknown engine command {kind!r}")

    # ------------------------------------------------------------------ abort
    def _abort(self, which) -> int:
        """``which``: None (all), a list of rids, or a list of request objects."""
        if which is None:
            match = lambda r: True  # noqa: E731
        elif which and isinstance(which[0], Req):
            objs = {id(r) for r in which}
            match = lambda r: id(r) in objs  # noqa: E731
        else:
            names = set(which)
            match = lambda r: r.rid in names  # noqa: E731
        count = 0
        keep_waiting = []
        for r in self._waiting:
            if match(r) and r.state == "waiting":
                r.outputs = [SampleOutput([], [], [], "abort") for _ in range(r.sp.n)]
                self._answer(r)
                count += 1
            else:
                keep_waiting.append(r)
        self._waiting = keep_waiting
        hit = {}
        for row in self._rows:
            if match(row.req) and row.req.state == "running":
                hit[id(row.req)] = row.req
        for r in hit.values():
            for row in r.rows:
                if not row.done:
                    self._finish_row(row, "abort")
            count += 1
        if hit:
            self._compact([i for i, row in enumerate(self._rows) if not row.done])
        self._stats["aborted_requests"] += count
        return count
