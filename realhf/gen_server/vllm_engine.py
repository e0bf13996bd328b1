"""The ``vllm`` generation engine: real vLLM (V1 ``AsyncLLM``) inside the generation server's process.

vLLM is imported only when :meth:`VLLMEngine.start` runs. Its processes: the server process holds the
``AsyncLLM`` front end (request bookkeeping, output streaming); vLLM starts an engine-core process (the
scheduler) and, behind it, one worker process per tensor-parallel rank (the model; on CPU always separate
processes, spawned). Weight updates reach the workers by name through ``collective_rpc`` into
:class:`realhf.gen_server.vllm_worker_ext.RealhfWorkerExtension`, so the weight group is joined in the
worker processes, where the weights are.

What the engine returns (``generate``)
--------------------------------------
* ``output_ids``: the sampled ids; a sample that ends on one of the request's ``stop_token_ids`` keeps that
  token (finish ``"stop"``). Only those ids stop a sample: the model's EOS is not a stop token unless the
  caller lists it (vLLM runs with ``ignore_eos``, no tokenizer and no generation_config defaults).
  ``"length"``: ``max_new_tokens`` reached (or the context, ``max_model_len``). ``"abort"``: aborted
  (``abort``, or ``close`` while it ran).
* ``logprobs``: vLLM with ``logprobs_mode="processed_logprobs"``: the log-prob of the sampled token under
  the distribution vLLM samples from, i.e. ``log_softmax(logits / temperature)`` (temperature 1 for
  greedy) computed in fp32 *after* vLLM's logits processors and *after* top-k/top-p truncation. So:

  - no top-k/top-p (``top_k=0``, ``top_p=1``), past the first ``min_new_tokens`` tokens: exactly realhf's
    quantity (``log_softmax(logits / T)``); at temperature 1 the model's true log-probs.
  - while ``min_new_tokens`` holds, vLLM masks out the request's stop tokens *and* the model's EOS ids (from
    ``generation_config.json``, even when not listed as stop tokens: they cannot be sampled then) before
    both sampling and log-probs, so the value is ``log p(tok) - log(1 - p(masked ids))`` (realhf bans only
    the stop tokens and reports the unmasked ``log p(tok)``). realhf callers list EOS as a stop token, so
    the masked ids are the same.
  - with top-k/top-p, the value is the log-prob under the truncated, renormalised distribution
    (``log p(tok) - log(kept mass)``, >= realhf's value). No vLLM mode gives the pre-truncation value:
    ``raw_logprobs`` is pre-truncation but also pre-temperature. ``cfg.extra["logprobs_mode"]`` may pick
    another vLLM mode (``raw_logprobs``: exact at temperature 1 with any top-k/top-p).
* ``versions``: from vLLM's own per-token weight-version labels (the engine core stamps every step's
  output with the label set by the last update), so a token carries the version whose weights produced it.
* Sampling: sample ``j`` of a request with ``seed`` is a vLLM request of its own with seed
  ``sample_seed(seed, j) mod 2**63`` (per-request generator: the same tokens whatever else runs); without a
  seed vLLM's engine-wide stream (seeded by ``cfg.seed``). vLLM's sampler differs from realhf's (CPU:
  Gumbel-max over per-step seeds), so a seed gives reproducible samples, not realhf's samples.
  vLLM accepts temperatures in ``(0, 2]`` (greedy below 1e-5); larger ones are refused (``RequestError``).

Other behaviour
---------------
* ``pause``: vLLM's ``pause_generation(mode="keep")``: running requests stay in the batch with their KV
  cache, nothing is scheduled, new requests (``logprobs`` too) queue; ``resume`` continues them. ``abort``
  works while paused.
* Weight updates (disk or group) pause the scheduler the same way, load the tensors on every worker with
  vLLM's in-place reload (the model's own ``load_weights``, then its post-load processing), reset the
  prefix cache with the running requests preempted (their KV is recomputed with the new weights when they
  continue: no token after the update attends to old-weight keys/values), set the version label, and resume
  (unless paused by the caller). Requests are never dropped by an update.
* ``logprobs``: vLLM prompt log-probs (one request per sequence, ``max_tokens=1``, prefix cache not read):
  ``log_softmax`` of the raw logits in fp32.
* ``metrics``: counted by this engine: ``running_requests`` (requests with a sample that produced a token
  and is unfinished), ``waiting_requests`` (the rest of the unfinished), the same per sample, and
  ``tokens_in_flight`` (prompt + generated tokens of unfinished samples).

Options: ``cfg.extra`` is passed to ``vllm.AsyncEngineArgs`` (e.g. ``{"enable_prefix_caching": false}``),
except ``kv_cache_space`` (GiB of KV cache on CPU: ``VLLM_CPU_KVCACHE_SPACE``, default 2 unless set in the
environment). On CPU the engine runs eager (no torch.compile) unless ``extra`` says otherwise. Start-up (the
engine's arguments and environment, the checks before vLLM starts) and shutdown are in ``vllm_launch.py``.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import os
import time
from typing import Any, Dict, List, Optional, Sequence

from realhf.base import logging
from realhf.gen_server.api import (
    EngineConfig,
    GenerateRequest,
    GenerateResult,
    GenerationEngine,
    RequestError,
    SampleOutput,
    TensorMeta,
    WeightGroupSpec,
    sample_seed,
)
from realhf.gen_server.vllm_launch import VLLMLaunch

logger = logging.getLogger("realhf.gen_server.vllm_engine")

_SEED_MOD = 2 ** 63
# config.json fields that fix the weights' shapes (an update from disk must agree on them)
_SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "head_dim", "vocab_size", "tie_word_embeddings", "model_type")


@dataclasses.dataclass
class _Sample:
    sub_id: str
    prompt_len: int
    n_out: int = 0
    done: bool = False


@dataclasses.dataclass
class _Request:
    rid: str
    samples: List[_Sample]
    aborted: bool = False

    def unfinished(self) -> List[_Sample]:
        return [s for s in self.samples if not s.done]


class VLLMEngine(VLLMLaunch, GenerationEngine):
    backend = "vllm"
    shared_weights = True

    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        self._engine = None  # vllm AsyncLLM
        self._version = 0
        self._paused = False
        self._requests: Dict[str, _Request] = {}
        self._generated = 0
        self._lock: Optional[asyncio.Lock] = None  # pause/resume/updates, one at a time
        self._ids = itertools.count()
        self._closed = False
        self._vocab: Optional[int] = None
        self.startup_seconds: Optional[float] = None

    def _check(self):
        if self._engine is None:
            raise RuntimeError("vLLM engine is not running (start() not called, or closed)")
        return self._engine

    # ------------------------------------------------------------------ generation

    def _params(self, sp, j: int):
        from vllm import SamplingParams as VSP
        from vllm.sampling_params import RequestOutputKind

        greedy = bool(sp.greedy)
        seed = None
        if sp.seed is not None and not greedy:
            seed = sample_seed(sp.seed, j) % _SEED_MOD
        return VSP(
            n=1,
            temperature=0.0 if greedy else float(sp.temperature),
            top_p=1.0 if greedy else float(sp.top_p),
            top_k=0 if greedy else int(sp.top_k),
            seed=seed,
            min_tokens=int(sp.min_new_tokens),
            max_tokens=int(sp.max_new_tokens),
            stop_token_ids=list(sp.stop_token_ids),
            ignore_eos=True,
            logprobs=0,  # the sampled token's log-prob only
            detokenize=False,
            skip_special_tokens=False,
            output_kind=RequestOutputKind.DELTA,
        )

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        eng = self._check()
        sp = req.sampling.validate()
        if req.rid in self._requests:
            raise RequestError(f"request id {req.rid!r} is already running")
        if not req.input_ids:
            raise RequestError("input_ids must not be empty")
        self._check_ids(req.input_ids, "input_ids")
        try:
            params = [self._params(sp, j) for j in range(sp.n)]
        except Exception as e:
            raise RequestError(f"vLLM refused the sampling parameters: {e}") from e
        n = sp.n
        # vLLM request id of sample j: "<rid>#<j>" (one-to-one: j is read back from the last "#")
        st = _Request(req.rid, [_Sample(f"{req.rid}#{j}", len(req.input_ids)) for j in range(n)])
        self._requests[req.rid] = st
        try:
            outs = await asyncio.gather(*[self._run_sample(eng, st, j, list(req.input_ids), params[j])
                                          for j in range(n)], return_exceptions=True)
        finally:
            self._requests.pop(req.rid, None)
        errs = [o for o in outs if isinstance(o, BaseException)]
        if errs:
            e = errs[0]
            if isinstance(e, RequestError):
                raise e
            if _is_client_error(e):
                raise RequestError(f"vLLM refused the request: {e}") from e
            raise e
        return GenerateResult(rid=req.rid, outputs=list(outs))

    def _check_ids(self, ids: Sequence[int], what: str) -> None:
        """Token ids outside the vocabulary kill vLLM's engine (an embedding index error in the worker; with no
        tokenizer loaded vLLM does not check them): refuse them here."""
        if self._vocab is None:
            try:
                self._vocab = int(self._check().model_config.get_vocab_size())
            except Exception:
                self._vocab = 0
        if self._vocab and ids:
            lo, hi = min(ids), max(ids)
            if lo < 0 or hi >= self._vocab:
                bad = lo if lo < 0 else hi
                raise RequestError(f"{what}: token id {bad} is outside the vocabulary [0, {self._vocab})")

    async def _run_sample(self, eng, st: _Request, j: int, prompt: List[int], params) -> SampleOutput:
        s = st.samples[j]
        toks: List[int] = []
        lps: List[float] = []
        vers: List[int] = []
        finish: Optional[str] = None
        spans = None
        if st.aborted:
            s.done = True
            return SampleOutput([], [], [], "abort")
        abort_sent = False
        try:
            async for out in eng.generate({"prompt_token_ids": prompt}, params, s.sub_id):
                if st.aborted and not abort_sent and not out.finished:
                    # aborted before vLLM knew this sample (abort() found nothing to abort): abort it now
                    abort_sent = True
                    await eng.abort(s.sub_id)
                c = out.outputs[0]
                new = list(c.token_ids)
                if new:
                    lpl = c.logprobs or []
                    for k, t in enumerate(new):
                        d = lpl[k] if k < len(lpl) else None
                        lp = d.get(t) if d is not None else None
                        lps.append(float(lp.logprob) if lp is not None else float("nan"))
                    toks.extend(new)
                    vers.extend([self._version] * len(new))
                    s.n_out += len(new)
                    self._generated += len(new)
                if c.finish_reason is not None:
                    finish = str(c.finish_reason)
                    spans = getattr(c, "weight_versions", None)
        finally:
            s.done = True
        if finish is None:
            finish = "abort"
        if finish not in ("stop", "length", "abort"):
            raise RuntimeError(f"vLLM ended sample {s.sub_id!r} with finish reason {finish!r}")
        if spans:
            labelled = self._versions_from_spans(spans, len(toks))
            if labelled is not None:
                vers = labelled
        return SampleOutput(output_ids=toks, logprobs=lps, versions=vers, finish_reason=finish)

    def _versions_from_spans(self, spans, n: int) -> Optional[List[int]]:
        out: List[int] = []
        for sp in spans:
            try:
                v = int(sp.version)
            except (TypeError, ValueError):
                return None
            out.extend([v] * (int(sp.end) - int(sp.start)))
        return out if len(out) == n else None

    async def abort(self, rids: Optional[Sequence[str]] = None) -> int:
        eng = self._check()
        targets = list(self._requests) if rids is None else [r for r in rids if r in self._requests]
        subs: List[str] = []
        for rid in targets:
            st = self._requests.get(rid)
            if st is None:
                continue
            st.aborted = True
            subs.extend(s.sub_id for s in st.samples if not s.done)
        if subs:
            await eng.abort(subs)
        return len(targets)

    # ------------------------------------------------------------------ pause / weights

    async def pause(self) -> None:
        eng = self._check()
        async with self._lock:
            if not self._paused:
                await eng.pause_generation(mode="keep", clear_cache=False)
                self._paused = True

    async def resume(self) -> None:
        eng = self._check()
        async with self._lock:
            if self._paused:
                await eng.resume_generation()
                self._paused = False

    async def _set_label(self, version: int) -> None:
        eng = self._check()
        if hasattr(eng, "update_weight_version"):
            await eng.update_weight_version(str(int(version)))

    async def _update(self, method: str, args: tuple, version: int) -> List[Any]:
        eng = self._check()
        async with self._lock:
            if not self._paused:
                await eng.pause_generation(mode="keep", clear_cache=False)
            try:
                res = await eng.collective_rpc(method, args=args)
                # Running requests are preempted (their KV is recomputed with the new weights when they resume)
                # and the prefix cache emptied, so no later token reads keys/values of the old weights.
                await eng.reset_prefix_cache(reset_running_requests=True)
                await self._set_label(version)
                self._version = int(version)
            finally:
                if not self._paused:
                    await eng.resume_generation()
        return res

    async def update_weights_from_disk(self, path: str, version: int) -> None:
        self._check()
        if not os.path.isdir(path):
            raise FileNotFoundError(f"vLLM engine: weight folder {path!r} does not exist")
        self._check_compatible(path)
        t0 = time.perf_counter()
        await self._update("realhf_update_from_disk", (os.path.abspath(path),), version)
        logger.info("vLLM weights <- %s (version %d) in %.3fs", path, version, time.perf_counter() - t0)

    def _check_compatible(self, path: str) -> None:
        """Refuse a folder whose model shape differs from the served one: vLLM's loaders narrow a larger tensor to
        the parameter's (tensor-parallel) shard and would load a wider model's weights without an error."""
        try:
            with open(os.path.join(self.cfg.model_path, "config.json")) as f:
                have = json.load(f)
        except (OSError, ValueError):
            return
        try:
            with open(os.path.join(path, "config.json")) as f:
                new = json.load(f)
        except OSError:
            return  # a folder of weights only: nothing to compare
        except ValueError as e:
            raise ValueError(f"vLLM engine: {path}/config.json is not valid JSON: {e}") from e
        have, new = have.get("text_config", have), new.get("text_config", new)
        diff = {k: (have.get(k), new.get(k)) for k in _SHAPE_KEYS
                if have.get(k) is not None and new.get(k) is not None and have.get(k) != new.get(k)}
        if diff:
            raise ValueError(f"vLLM engine: weights in {path} are for another model shape than the served "
                             f"{self.cfg.model_path}: " + ", ".join(f"{k} {a} -> {b}" for k, (a, b) in diff.items()))

    async def init_weight_group(self, spec: WeightGroupSpec) -> None:
        eng = self._check()
        await eng.collective_rpc("realhf_init_weight_group", args=(dataclasses.asdict(spec),))

    async def update_weights_from_group(self, tensors: List[TensorMeta], version: int) -> None:
        self._check()
        metas = [dataclasses.asdict(m) if dataclasses.is_dataclass(m) else dict(m) for m in tensors]
        t0 = time.perf_counter()
        await self._update("realhf_update_from_group", (metas,), version)
        logger.info("vLLM weights <- group, %d tensors (version %d) in %.3fs", len(metas), version,
                    time.perf_counter() - t0)

    async def update_weights_from_shared(self, parts: List[dict], version: int) -> None:
        from realhf.gen_server.weight_share import check_parts

        self._check()
        n = len(check_parts(parts))  # refused here, before any worker maps anything
        t0 = time.perf_counter()
        await self._update("realhf_update_from_shared", (list(parts),), version)
        logger.info("vLLM weights <- shared memory, %d tensors (version %d) in %.3fs", n, version,
                    time.perf_counter() - t0)

    # ------------------------------------------------------------------ log-probs, metrics

    async def _logprobs_one(self, seq: List[int], tag: str) -> List[float]:
        from vllm import SamplingParams as VSP
        from vllm.sampling_params import RequestOutputKind

        eng = self._check()
        if len(seq) < 2:
            return []
        params = VSP(n=1, temperature=0.0, max_tokens=1, prompt_logprobs=0, detokenize=False, ignore_eos=True,
                     output_kind=RequestOutputKind.FINAL_ONLY)
        final = None
        async for out in eng.generate({"prompt_token_ids": list(seq)}, params, f"realhf-lp-{tag}-{next(self._ids)}"):
            final = out
        if final is None or final.prompt_logprobs is None:
            raise RuntimeError("vLLM returned no prompt log-probs")
        res = []
        for i, d in enumerate(final.prompt_logprobs[1:], start=1):
            lp = d.get(seq[i]) if d is not None else None
            if lp is None:
                raise RuntimeError(f"vLLM returned no log-prob for position {i}")
            res.append(float(lp.logprob))
        return res

    async def logprobs(self, sequences: List[List[int]]) -> List[List[float]]:
        self._check()
        for s in sequences:
            if not isinstance(s, (list, tuple)) or not all(isinstance(x, int) for x in s):
                raise RequestError("sequences must be lists of integers")
            self._check_ids(s, "sequences")
        try:
            return list(await asyncio.gather(*[self._logprobs_one(list(s), "q") for s in sequences]))
        except Exception as e:
            if _is_client_error(e):
                raise RequestError(f"vLLM refused the sequences: {e}") from e
            raise

    def metrics(self) -> Dict[str, Any]:
        running = waiting = run_s = wait_s = in_flight = 0
        for st in self._requests.values():
            live = st.unfinished()
            if not live:
                continue
            if any(s.n_out > 0 for s in live):
                running += 1
            else:
                waiting += 1
            for s in live:
                if s.n_out > 0:
                    run_s += 1
                else:
                    wait_s += 1
                in_flight += s.prompt_len + s.n_out
        return {
            "running_requests": running,
            "waiting_requests": waiting,
            "running_samples": run_s,
            "waiting_samples": wait_s,
            "tokens_in_flight": in_flight,
            "version": self._version,
            "generated_tokens": self._generated,
            "paused": self._paused,
            "startup_seconds": self.startup_seconds,
        }

    @property
    def version(self) -> int:
        return self._version


def _is_client_error(e: BaseException) -> bool:
    try:
        from vllm.exceptions import VLLMClientError
    except ImportError:  # pragma: no cover
        return isinstance(e, ValueError)
    cur: Optional[BaseException] = e
    while cur is not None:
        if isinstance(cur, (VLLMClientError, RequestError)):
            return True
        cur = cur.__cause__
    return False
