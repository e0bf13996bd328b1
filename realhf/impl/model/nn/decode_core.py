"""The decode core: prefill, one decode step and sampling over a decoder chosen once, driven alike by in-process
``generate`` (``generation.py``) and by the generation server's continuous batcher (``gen_server/engine_step.py``),
so every speed-up of the step serves both.

What the two drivers share (this module)
----------------------------------------
* **Prefill** (``Decoder.prefill``): distinct prompts packed without padding into a fresh ``KVCache`` (one row per
  prompt), the head run on each prompt's last token only (``prefill_input``).
* **One decode step** (``Decoder.step``): one token per cache row through the model, its key/value written at the
  row's length, then the lengths advanced, by the decoder chosen once per model and cache kind (``fast_step_for``):

  - ``compiled``: ``compiled_decode.CompiledDecoder`` (``compile_decode``; tp = pp = 1);
  - ``graph``: the step replayed as a CUDA graph (on CUDA; tp = pp = 1): ``graph_decode.GraphDecoder`` over
    ``generate``'s per-call cache, ``graph_decode.PaddedGraphDecoder`` over the server's slot storage;
  - ``eager``: the model's forward. On a CPU it runs a decode step's blocks in C++ (``decode_ops``' ``decode_block``
    / ``DecodeLayers``) where they serve (fp32 rows, at most ``decode_ops.MAX_ROWS`` of them, fusable blocks,
    tp = 1, a cache with C++ attention): the model makes that choice at every step, from the step's rows.

  The compiled and graph steps read whole-sequence caches, so a cache whose samples share their prompt
  (``SharedPrefixCache``, the server's ``SharedSlotCache``) decodes eagerly; so does a step they cannot run (a
  compile or capture that failed, logged once by the decoder).
* **Sampling** (``sample_step``, from ``sampling.py``): one token per row and its log-prob under
  ``log_softmax(logits / temperature)`` of the unmodified distribution, stop tokens banned before
  ``min_new_tokens``, rows with per-sequence uniforms (seeded samples) drawn by inverse CDF, so a seeded sequence
  gets the same tokens on either path. A compiled or graph step can also sample inside its graph
  (``Decoder.step_sample``: greedy, or plain sampling with per-row uniforms), with the same ``sample_with_mask``.

Where they differ (each driver keeps its own)
---------------------------------------------
* **KV cache layout**: ``generate`` decodes a packed per-call ``KVCache`` (or a ``SharedPrefixCache`` for the n
  samples of a prompt); the server a slot cache (``SlotCache`` / ``SharedSlotCache``) that rows join at the end and
  leave by compaction.
* **Which rows run**: ``generate`` a fixed batch (the n samples of a prompt are adjacent rows and share one
  prefill); finished rows are dropped from the cache, or, under a CUDA graph, kept until at most half still run.
  The server admits requests between steps and drops finished rows every step; the last rows move into the holes.
* **Seeds**: ``generate`` draws a seeded row's uniforms from ``RowStreams`` (per-row generators), the server from
  each row's own chunk of the same stream (``sample_seed``); unseeded rows draw from one generator (``generate``'s
  ``generator`` / ``gconfig.seed``; the engine's ``EngineConfig.seed``).
* **Sampling parameters and stops**: ``generate`` has one ``SamplingKey`` and one list of banned ids (stop tokens and
  EOS) for the batch; the server groups rows by key, bans per row (a ``[rows, V]`` mask), and isolates a request
  whose sampling raises. ``generate`` records tokens per sequence; the server also each token's weight version and
  each sample's finish reason.
* **Layouts**: ``generate`` runs under tensor and pipeline parallelism: the head output is gathered over the tensor
  ranks and the samples shared by broadcast, and a pipeline stage receives its input and sends its output around the
  forward (the ``forward`` a ``Decoder`` is given). The pipelined schedule (pp > 1, several row groups in flight)
  keeps its own loop, with ``prefill_input``, ``decode_input`` and ``sample_step`` from here.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import torch

from realhf.impl.model.nn.kv_cache import KVCache, SharedPrefixCache
from realhf.impl.model.nn.real_model import PackedInput, make_packed_input
from realhf.impl.model.nn.sampling import SamplingKey, sample_step

__all__ = ["Decoder", "SamplingKey", "decode_input", "fast_step_for", "prefill_input", "sample_step"]


def prefill_input(prompts: Sequence[Sequence[int]], cache: KVCache, device) -> Tuple[PackedInput, torch.Tensor]:
    """The packed input and token ids of the prefill of ``prompts`` (one cache row each) into ``cache``; the head runs
    on each prompt's last token only."""
    seqlens = [len(p) for p in prompts]
    inp = make_packed_input(seqlens, device=device)
    inp.cache = cache
    inp.head_rows = (inp.cu_seqlens[1:] - 1).long()
    cache.begin_prefill(torch.tensor(seqlens, device=device))
    ids = torch.tensor([t for p in prompts for t in p], dtype=torch.long, device=device)
    return inp, ids


def decode_input(cache: KVCache, device) -> PackedInput:
    """The input of one decode step: one token for every row of ``cache``."""
    n = cache.batch
    return PackedInput(cu_seqlens=torch.arange(n + 1, dtype=torch.int32, device=device), max_seqlen=1,
                       position_ids=cache.positions().clone(), cache=cache)


def fast_step_for(model, compile_decode: bool, cuda_graph: bool, padded: bool = False):
    """The decode step that replaces the eager forward for ``model``, chosen once: the compiled step
    (``compile_decode``), else the CUDA-graph step (``cuda_graph``; ``padded``: the one over a slot storage), or None
    (eager; also where the choice does not serve the model: tensor or pipeline parallelism, a graph off CUDA)."""
    if compile_decode:
        from realhf.impl.model.nn.compiled_decode import compiled_decoder

        return compiled_decoder(model)
    if cuda_graph:
        from realhf.impl.model.nn import graph_decode

        return graph_decode.padded_decoder_for(model) if padded else graph_decode.decoder_for(model)
    return None


class Decoder:
    """Prefill and decode steps of ``model``: by ``fast`` (a compiled or CUDA-graph step, from ``fast_step_for``; None:
    eager) where it serves the cache, else by the eager forward. ``forward(x, inp, n_tokens)`` is this rank's eager
    forward (default: ``model(x, inp)``; a pipeline stage receives its input of ``n_tokens`` rows and sends its output
    around it). Cheap to make: the choice is ``fast``, made once per model and cache kind."""

    __slots__ = ("model", "fast", "_forward")

    def __init__(self, model, fast=None, forward: Optional[Callable] = None):
        self.model, self.fast, self._forward = model, fast, forward

    @classmethod
    def choose(cls, model, compile_decode: bool, cuda_graph: bool, padded: bool = False,
               forward: Optional[Callable] = None) -> "Decoder":
        return cls(model, fast_step_for(model, compile_decode, cuda_graph, padded), forward)

    @property
    def kind(self) -> str:
        """``eager``, ``compiled`` or ``graph`` (a CUDA graph; see the module docstring)."""
        return "eager" if self.fast is None else self.fast.kind

    @property
    def keeps_finished_rows(self) -> bool:
        """Whether finished rows should stay in the batch while more than half still run (a graph per row count)."""
        return bool(getattr(self.fast, "keeps_finished_rows", False))

    def can_sample(self, key: SamplingKey, seeded: bool) -> bool:
        """Whether ``step_sample`` may serve rows sampled by ``key`` (greedy, or plain sampling with per-row
        uniforms: ``seeded``)."""
        return (self.fast is not None and hasattr(self.fast, "sample") and not key.top_k and key.top_p >= 1.0
                and (key.greedy or seeded))

    def _eager(self, x, inp: PackedInput, n_tokens: int):
        return self.model(x, inp) if self._forward is None else self._forward(x, inp, n_tokens)

    def prefill(self, prompts: List[List[int]], cache: KVCache) -> Optional[torch.Tensor]:
        """Prefill ``prompts`` (one row each of the fresh ``cache``), which then decodes: the head output at each
        prompt's last token (on the last pipeline stage; other stages' outputs are their activations)."""
        inp, ids = prefill_input(prompts, cache, self.model.device)
        out = self._eager(ids, inp, ids.numel())
        cache.end_prefill()
        return out

    def step(self, tok: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """One decode step of every row of ``cache`` (its last tokens ``tok``); advances the cache. The head output."""
        out = None
        if self.fast is not None and not isinstance(cache, SharedPrefixCache):
            out = self.fast(tok, cache)
        if out is None:
            out = self._eager(tok, decode_input(cache, self.model.device), cache.batch)
        cache.advance()
        return out

    def step_sample(self, tok: torch.Tensor, cache: KVCache, key: SamplingKey, ban: torch.Tensor,
                    row_u: Optional[torch.Tensor]) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """One decode step that also samples inside the fast step's graph (``can_sample``; ``ban`` [V] bool, all
        False for no ban): (tokens, log-probs), the cache advanced; or None, the cache untouched (the step could not
        run: decode with ``step`` and sample with ``sample_step``)."""
        r = self.fast.sample(tok, cache, ban, row_u, key.greedy, key.temperature)
        if r is not None:
            cache.advance()
        return r
