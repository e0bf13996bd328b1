"""A compiled decode step: one new token per cache row through the whole model, as one graph.

At the sizes RL rollouts decode on a CPU (tens of rows, hidden sizes of a few hundred), a decode step in
eager PyTorch is dominated by per-operation costs: each layer runs ~25 small kernels (norms, rotary,
the cache write, masked attention, activations) at 5-50 us each, about as long as its GEMMs. Compiling
the step with ``torch.compile`` (Inductor) fuses the elementwise work into a few generated C++ loops and,
with Inductor's C++ wrapper, calls the kernels without going back to Python between them.

The compiled step attends over the whole cache length with a mask built from ``lens`` inside the graph,
so its shapes do not change from step to step; rows (the batch) and the cache length are marked
dynamic, so dropping finished rows or a new batch with longer prompts reuse the same compiled code.
The step writes the new keys/values into the cache buffers in place, like the eager path. For greedy
decoding and plain sampling with per-sequence random streams (what RL rollouts use), the graph also samples
the next tokens, with the eager sampler's own code (``sampling.sample_with_mask``), so a step is one call;
top-k/top-p sampling runs eagerly on the step's logits.

Used by ``generate`` when ``GenerationHyperparameters.compile_decode`` is set, for a model replica that
is a single stage without tensor parallelism (a compiled graph would have to contain the tp collectives;
other layouts decode eagerly). If compiling fails (e.g. no C++ compiler), generation falls back to the
eager step with a warning. Compiling costs time once per process (Inductor also caches compiled code on
disk across runs): about 5-20 s for a 4-layer model here, minutes for a 30-layer one, so it pays off for
small models and long rollouts. On CUDA the same graph is compiled by Inductor into Triton kernels.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from realhf.base import logging
from realhf.impl.model.nn.compile_util import CompiledOrFallback
from realhf.impl.model.nn.kv_cache import as_query_dtype
from realhf.impl.model.nn.sampling import sample_with_mask

logger = logging.getLogger(__name__)


class _StaticDecodeView:
    """What ``Attention.forward`` needs of a KV cache for one decode step, with static shapes: every row
    writes its new key/value at ``lens[row]`` and attends to positions ``<= lens[row]`` out of the whole
    buffer (masked), so no shape depends on the data."""

    decoding = True

    def __init__(self, ks: List[torch.Tensor], vs: List[torch.Tensor], lens: torch.Tensor, bias: torch.Tensor):
        self.k, self.v, self.lens, self.bias = ks, vs, lens, bias
        self.rows = torch.arange(lens.shape[0], device=lens.device)

    def decode_attention(self, layer: int, q, k, v, scale: float):
        """q: [B, hq, d]; k, v: [B, hkv, d] -> [B, hq, d]."""
        K, V = self.k[layer], self.v[layer]
        K[self.rows, :, self.lens] = k.to(K.dtype)
        V[self.rows, :, self.lens] = v.to(V.dtype)
        B, hq, d = q.shape
        hkv = k.shape[1]
        qg = q.view(B, hkv, hq // hkv, d)  # the query heads of each kv head
        K, V = as_query_dtype(K, q), as_query_dtype(V, q)  # a cache narrower than the model (kv_cache_dtype)
        s = torch.matmul(qg, K.transpose(-1, -2)) * scale + self.bias  # [B, hkv, g, L]
        out = torch.matmul(s.softmax(-1), V)  # [B, hkv, g, d]
        return out.reshape(B, hq, d)


def _supported(model) -> Optional[str]:
    """None if the compiled step can serve ``model``; else why not."""
    if model.tp > 1 or model.pp > 1:
        return f"layout tp={model.tp} pp={model.pp} (the compiled step serves tp = pp = 1)"
    return None


def static_step_fns(model):
    """(step, step_sample): the decode step of ``model`` with static shapes, as plain functions of tensors.

    ``step(ids [B], lens [B], ks, vs)`` -> logits [B, V]: writes each row's new key/value into the buffers ``ks``/
    ``vs`` (one [B, hkv, L, d] per layer) at ``lens[row]`` and attends over the whole length ``L``, masked.
    ``step_sample(ids, lens, ks, vs, ban, row_u, greedy, temperature)`` -> (tokens [B], log-probs [B]) also samples,
    with the eager sampler's code. Both have no data-dependent shapes or host synchronisation, so they can be
    compiled whole (``CompiledDecoder``) or captured as a CUDA graph (``graph_decode.GraphDecoder``)."""
    from realhf.impl.model.nn.real_model import PackedInput as PI

    def step(ids, lens, ks, vs):
        L = ks[0].shape[2]
        pos = torch.arange(L, device=lens.device)
        # additive mask [B, 1, 1, L]: 0 at the positions a row attends to (<= its length), -inf elsewhere
        bias = torch.where(pos.unsqueeze(0) <= lens.unsqueeze(1), 0.0, float("-inf")).to(ks[0].dtype)
        view = _StaticDecodeView(ks, vs, lens, bias[:, None, None, :])
        return model(ids, PI(cu_seqlens=lens, max_seqlen=1, position_ids=lens, cache=view))

    def step_sample(ids, lens, ks, vs, ban, row_u, greedy: bool, temperature: float):
        logits = step(ids, lens, ks, vs).float()
        return sample_with_mask(logits, greedy, temperature, 0, 1.0, None, ban, row_u)

    return step, step_sample


class CompiledDecoder:
    """``step(ids [B], cache)`` -> logits [B, V] of the next token of every cache row; writes each row's
    new key/value into ``cache`` at ``cache.lens`` (the caller advances ``lens`` afterwards)."""

    kind = "compiled"  # (decode_core.Decoder.kind)

    def __init__(self, model):
        self.model = model
        step, step_sample = static_step_fns(model)

        # on failure a step returns None and generate runs the eager step
        kw = dict(fallback=lambda *args: None, dynamic=True, fullgraph=True, options={"cpp_wrapper": True})
        self._step = CompiledOrFallback(step, **kw)
        self._step_sample = CompiledOrFallback(step_sample, **kw)

    @property
    def failed(self) -> Optional[str]:
        return self._step.failed or self._step_sample.failed

    def __call__(self, ids: torch.Tensor, cache) -> Optional[torch.Tensor]:
        """The head output of one decode step, or None if the step cannot be compiled here (the caller then
        runs the eager step; the failure is logged once)."""
        return self._step(ids, cache.lens, cache.k, cache.v)

    def sample(self, ids: torch.Tensor, cache, ban: torch.Tensor, row_u: Optional[torch.Tensor], greedy: bool,
               temperature: float) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """One decode step that also samples the next token of every row inside the graph, with the code of
        the eager sampler (``sample_with_mask``: greedy, or inverse CDF with the per-row uniforms ``row_u``;
        no top-k/top-p): (tokens [B], log-probs [B]). ``ban`` [V] bool marks tokens never sampled (pass an
        all-False mask rather than None, so one graph serves steps with and without a ban). None if the
        step cannot be compiled here."""
        return self._step_sample(ids, cache.lens, cache.k, cache.v, ban, row_u, greedy, temperature)


def compiled_decoder(model) -> Optional[CompiledDecoder]:
    """The model's compiled decode step (built once per model object), or None where unsupported."""
    why = _supported(model)
    if why is not None:
        logger.info(f"compile_decode ignored: {why}")
        return None
    dec = getattr(model, "_compiled_decoder", None)
    if dec is None:
        dec = CompiledDecoder(model)
        model._compiled_decoder = dec
    return dec
