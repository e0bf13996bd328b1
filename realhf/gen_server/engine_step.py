"""What one iteration of realhf's generation engine (``realhf_engine.py``) does to the running batch, on its engine
thread: admitting waiting requests (their prompts prefilled in one packed forward, their rows written into the slot
KV cache), one decode step for every running row, recording each sampled token with the weight version that made it,
finishing and compacting rows, and log-prob passes between steps. The engine class mixes this in; the state it works
on (``_rows``, ``_cache``, ``_waiting``, ``_stats``, the model) is the engine's. The prefill, the decode step and the
sampling are the decode core's (``realhf.impl.model.nn.decode_core``), which in-process ``generate`` drives too; this
module keeps the server's own scheduling: rows joining and leaving the slot cache, per-row seeds and stops, weight
versions."""
from __future__ import annotations

import traceback
from typing import Dict, List

import torch

from realhf.api.core.model_api import kv_cache_torch_dtype
from realhf.base import logging
from realhf.gen_server.api import SampleOutput
from realhf.gen_server.engine_batch import Group, Req, Row, SharedSlotCache, SlotCache, sample_groups, sampling_key
from realhf.impl.model.nn.decode_core import Decoder
from realhf.impl.model.nn.kv_cache import KVCache, sharing_pays

logger = logging.getLogger("realhf.gen_server.engine")


class EngineSteps:
    """Admission, decode steps and row bookkeeping of ``RealhfEngine`` (a mixin)."""

    # ------------------------------------------------------------------ rows
    def _finish_row(self, row: Row, reason: str):
        row.done = True
        r = row.req
        r.outputs[row.j] = SampleOutput(output_ids=row.ids, logprobs=row.lps, versions=row.vers, finish_reason=reason)
        r.n_done += 1
        if r.n_done == len(r.outputs):
            self._answer(r)

    def _record(self, rows: List[Row], tl: List[int], ll: List[float]) -> List[int]:
        """Append one sampled token per row; finish the rows that are done; return the positions of the rest."""
        v = self._version
        keep = []
        n_rec = 0
        for i, row in enumerate(rows):
            if row.done:  # its request failed in this step's sampling
                continue
            n_rec += 1
            t = tl[i]
            ids = row.ids
            ids.append(t)
            row.lps.append(ll[i])
            row.vers.append(v)
            n = len(ids)
            if t in row.stop:
                self._finish_row(row, "stop")
            elif n >= row.max_new:
                self._finish_row(row, "length")
            else:
                keep.append(i)
                row.refill_stream()
        self._stats["generated_tokens"] += n_rec
        return keep

    def _regroup(self):
        self._groups = self._groups_of(self._rows)

    def _compact(self, keep: List[int]):
        """Keep only running rows ``keep`` (positions, ascending)."""
        if len(keep) == len(self._rows):
            return
        if not keep:
            self._rows, self._groups, self._tok = [], [], None
            self._cache.remove([])  # keeps its storage for the next rows
        else:
            order = self._cache.remove(keep)
            self._tok = self._tok[torch.tensor(order, dtype=torch.long, device=self.model.device)]
            self._rows = [self._rows[i] for i in order]
            self._regroup()
        self._update_counts()

    def _update_counts(self):
        s = self._stats
        s["batch_size"] = len(self._rows)
        s["max_batch_size"] = max(s["max_batch_size"], len(self._rows))
        s["tokens_in_flight"] = sum(len(r.req.ids) + len(r.ids) for r in self._rows)

    # ------------------------------------------------------------------ sampling
    def _sample(self, logits: torch.Tensor, groups: List[Group]):
        """One token per row; a request whose sampling raises fails alone (its rows are done, ``_record`` skips them)
        while the other rows of the batch go on."""
        tok, lp, failures = sample_groups(logits, groups, self._gen)
        for r, e in failures:
            logger.warning("generation engine: sampling request %s failed, the rest of the batch goes on: %s: %s",
                           r.rid, type(e).__name__, e)
            sp = r.sp
            err = RuntimeError(
                f"sampling the next token of request {r.rid!r} failed ({type(e).__name__}: {e}) with its sampling "
                f"parameters greedy={sp.greedy}, temperature={sp.temperature}, top_k={sp.top_k}, top_p={sp.top_p}, "
                f"min_new_tokens={sp.min_new_tokens} and {len(sp.stop_token_ids)} stop tokens")
            err.__cause__ = e
            self._fail(r, err)
        return tok, lp

    # ------------------------------------------------------------------ admission (prefill)
    def _admit(self):
        if self._broken is not None:  # requests queued before the weights broke
            waiting, self._waiting = self._waiting, []
            for r in waiting:
                self._fail(r, RuntimeError(f"the served weights are incomplete ({self._broken})"))
            return

        room = self.cfg.max_num_seqs - len(self._rows)
        batch: List[Req] = []
        n_tok = 0
        while self._waiting:
            r = self._waiting[0]
            if r.sp.n > room or (batch and n_tok + len(r.ids) > self._max_prefill_tokens):
                break
            self._waiting.pop(0)
            batch.append(r)
            room -= r.sp.n
            n_tok += len(r.ids)
        if not batch:
            return
        model, dev = self.model, self.model.device
        with self._lock:
            for r in batch:
                r.state = "running"
                self._n_waiting -= 1
                self._n_running += 1
        try:
            # each distinct prompt once; every sample of every request copies its row
            distinct: Dict[tuple, int] = {}
            prompts: List[List[int]] = []
            src: List[int] = []  # distinct prompt of each new row
            new_rows: List[Row] = []
            for r in batch:
                k = distinct.setdefault(tuple(r.ids), len(prompts))
                if k == len(prompts):
                    prompts.append(r.ids)
                r.rows = [Row(r, j) for j in range(r.sp.n)]
                new_rows.extend(r.rows)
                src.extend([k] * r.sp.n)
            seqlens = [len(p) for p in prompts]
            max_len = max(len(r.ids) + r.sp.max_new_tokens for r in batch) + 1
            cfg = model.config
            # the prefill's own cache holds the prompts only: its rows are copied into the running batch's slots
            # (room for max_len positions there), so decode positions here would be zeroed memory never used
            cache = KVCache(model.n_local_layers, len(prompts), max(seqlens) + 1, model.n_local_kv_heads,
                            cfg.head_dim, self._cache_dtype(), dev)
            out = self._core().prefill(prompts, cache)
            src_t = torch.tensor(src, dtype=torch.long, device=dev)
            logits = out.float().index_select(0, src_t)
            groups = self._groups_of(new_rows)
            tok, lp = self._sample(logits, groups)
            self._stats["prefills"] += 1
            self._stats["prefill_tokens"] += sum(seqlens)
            keep = self._record(new_rows, tok.tolist(), lp.tolist())
            if keep:
                kt = torch.tensor(keep, dtype=torch.long, device=dev)
                self._cache_for(batch)
                self._cache.add(cache, src_t[kt], max_len)
                self._tok = tok[kt] if self._tok is None else torch.cat([self._tok, tok[kt]])
                self._rows = self._rows + [new_rows[i] for i in keep]
                self._regroup()
            self._update_counts()
        except Exception as e:
            logger.error("generation engine: prefill of %d requests failed: %s", len(batch), traceback.format_exc())
            for r in batch:
                self._fail(r, e)
            # rows of these requests that already joined the batch (the failure came after the append)
            if any(row.done and row.req in batch for row in self._rows):
                self._drop_failed_rows()

    def _cache_dtype(self) -> torch.dtype:
        """The KV caches' dtype: the model's, or fp16 (backend option ``kv_cache_dtype``)."""
        return kv_cache_torch_dtype(self._kv_dtype, self.model.dtype)

    def _cache_for(self, batch: List[Req]):
        """Make sure the running batch has a KV cache for the new rows of ``batch``. A batch that starts empty takes a
        ``SharedSlotCache`` when its requests ask for several samples of prompts long enough for sharing to pay
        (``kv_cache.sharing_pays``; ``share_prefixes`` true: whenever one asks for several, false: never), else a
        ``SlotCache``; rows that join a running batch use its cache, whichever kind."""
        m = self.model
        shared = any(r.sp.n > 1 for r in batch) and self._share is not False and (self._share or sharing_pays(
            [len(r.ids) for r in batch], [r.sp.n for r in batch], m.n_local_kv_heads, m.config.head_dim,
            self._cache_dtype().itemsize))
        kind = SharedSlotCache if shared else SlotCache
        if self._cache is None or (not self._rows and type(self._cache) is not kind):
            self._cache = kind(m.n_local_layers, m.n_local_kv_heads, m.config.head_dim, self._cache_dtype(), m.device,
                               self.cfg.max_num_seqs, self._len_limit[1] + 1)

    def _groups_of(self, rows: List[Row]) -> List[Group]:
        groups: Dict[tuple, tuple] = {}
        for i, row in enumerate(rows):
            g = groups.setdefault(sampling_key(row.req.sp), ([], []))
            g[0].append(row)
            g[1].append(i)
        return [Group(k, rs, idx, len(rows), self.model.device) for k, (rs, idx) in groups.items()]

    def _drop_failed_rows(self):
        try:
            self._compact([i for i, row in enumerate(self._rows) if not row.done])
        except Exception:  # the cache itself is unusable: drop the whole batch
            for r in {id(row.req): row.req for row in self._rows}.values():
                self._fail(r, RuntimeError("the generation engine dropped its batch after an internal error"))
            self._rows, self._groups, self._cache, self._tok = [], [], None, None
            self._update_counts()

    # ------------------------------------------------------------------ one decode step
    def _core(self) -> Decoder:
        """The decode core over the engine's model and its decode step (``_decoder``: the compiled or CUDA-graph step,
        chosen once at start by ``decode_core.fast_step_for``; None: eager). The compiled and graph steps read rows
        with their own caches (``SlotCache``); a ``SharedSlotCache`` decodes eagerly."""
        return Decoder(self.model, self._decoder)

    def _decode_step(self):
        cache = self._cache
        try:
            logits = self._core().step(self._tok, cache)
            tok, lp = self._sample(logits.float(), self._groups)
            keep = self._record(self._rows, tok.tolist(), lp.tolist())
            self._stats["steps"] += 1
            self._tok = tok
            self._compact(keep)
            self._update_counts()
        except Exception as e:  # the batch cannot go on: fail its requests, keep serving the others
            logger.error("generation engine: decode step failed: %s", traceback.format_exc())
            for r in {id(row.req): row.req for row in self._rows}.values():
                self._fail(r, e)
            self._rows, self._groups, self._cache, self._tok = [], [], None, None
            self._update_counts()

    # ------------------------------------------------------------------ between steps: log-probs
    def _logprobs(self, seqs: List[List[int]]) -> List[List[float]]:
        from realhf.impl.model.nn.real_model import make_packed_input
        from realhf.impl.model.utils.functional import packed_logprobs

        self._check_weights()
        dev = self.model.device
        inp = make_packed_input([len(s) for s in seqs], device=dev)
        inp.defer_head = True  # the log-softmax chunk by chunk: no [tokens, vocabulary] logits
        ids = torch.tensor([t for s in seqs for t in s], dtype=torch.long, device=dev)
        lp, _ = packed_logprobs(self.model(ids, inp), ids, inp.cu_seqlens)
        lp = lp.tolist()
        out, off = [], 0
        for s in seqs:
            out.append(lp[off:off + len(s) - 1])
            off += len(s)
        return out
