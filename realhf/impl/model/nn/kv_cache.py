"""KV cache for generation over packed prompts.

Per local layer, keys and values live in [B, h_kv, max_len, d] buffers. Prefill writes the packed
prompt tokens of every sequence at their positions; each decode step writes one token per sequence at
``lens[b]`` and attends to positions ``<= lens[b]``. ``keep(rows)`` drops finished sequences so they
stop costing work.

The buffers' dtype may be narrower than the model's (``GenerationHyperparameters.kv_cache_dtype``: an fp16
cache for an fp32 model on CPU halves the bytes each decode step reads); keys and values are rounded when
written and widened to the queries' dtype when read, so the arithmetic keeps the model's precision.
"""
from __future__ import annotations

import os
from typing import List, Optional

import torch
import torch.nn.functional as F

from realhf.base.cpp_ext import CppKernel

# fp32 decode attention on CPU in C++ (csrc/decode_attention): each row reads only its own positions, the new
# keys/values are written in the same call, and no mask or score tensor is built (PyTorch fallback: below)
_KERNEL = CppKernel("realhf_decode_attention", os.path.join("csrc", "decode_attention", "decode_attention.cpp"),
                    "realhf._decode_attention_ext", "decode attention",
                    cflags=("-O3", "-fopenmp", "-fno-trapping-math"))  # at::parallel_for runs on torch's OpenMP threads


def decode_kernel():
    """The C++ decode-attention module (built at first use, cached), or None (no compiler, or REALHF_NO_CPP_EXT=1:
    the PyTorch path runs, after one logged warning)."""
    return _KERNEL.load_or_warn()


def _kernel_for(q: torch.Tensor):
    """The C++ module where it serves this step's queries (fp32 on CPU, outside ``torch.compile``), else None."""
    if q.is_cpu and q.dtype == torch.float32 and not torch.compiler.is_compiling():
        return decode_kernel()
    return None


def as_query_dtype(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Cached keys/values (or a mask made in the cache's dtype) ``x`` in the dtype of the queries ``q`` (a copy only
    where the cache is narrower than the model)."""
    return x if x.dtype == q.dtype else x.to(q.dtype)


def gqa_decode_attention(q, K, V, add_mask, scale: float):
    """One query per row over its cached keys: q [B, hq, d]; K, V [B, hkv, L, d]; ``add_mask`` [B, 1, 1, L] (0 where
    attended, -inf elsewhere) -> [B, hq, d]. The query heads that share a kv head go through one product with it,
    so every key and value is read once. On CPU, over SmolLM2's 30 layers at 32 rows, it measured 1.1x faster than
    scaled_dot_product_attention's fused kernel with a mask at 80 positions and equal at 150, where both are bound by
    reading the cache."""
    B, hq, d = q.shape
    hkv = K.shape[1]
    s = torch.matmul(q.view(B, hkv, hq // hkv, d), K.transpose(-1, -2))  # [B, hkv, group, L]
    s = s.mul_(scale).add_(add_mask)
    return torch.matmul(s.softmax(-1), V).view(B, hq, d)


class KVCache:
    def __init__(self, n_layers: int, batch: int, max_len: int, n_kv_heads: int, head_dim: int, dtype, device):
        shape = (batch, n_kv_heads, max_len, head_dim)
        self.k: List[torch.Tensor] = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v: List[torch.Tensor] = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.lens = torch.zeros(batch, dtype=torch.long, device=device)
        self.max_len = max_len
        self.decoding = False
        self._prefill_idx = None
        self._mask = None

    @property
    def batch(self) -> int:
        return self.lens.numel()

    def begin_prefill(self, seqlens: torch.Tensor):
        """Prepare to store packed tokens of ``seqlens`` (one entry per cache row)."""
        seqlens = seqlens.to(self.lens.device).long()
        if int(seqlens.max()) > self.max_len:
            raise ValueError(f"prompt of {int(seqlens.max())} tokens does not fit the cache of {self.max_len}")
        b = torch.repeat_interleave(torch.arange(seqlens.numel(), device=seqlens.device), seqlens)
        starts = torch.cumsum(seqlens, 0) - seqlens
        pos = torch.arange(int(seqlens.sum()), device=seqlens.device) - starts.repeat_interleave(seqlens)
        self._prefill_idx = (b, pos)
        self.decoding = False
        self._pending = seqlens

    def store_prefill(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        b, pos = self._prefill_idx
        self.k[layer][b, :, pos] = k.to(self.k[layer].dtype)
        self.v[layer][b, :, pos] = v.to(self.v[layer].dtype)

    def end_prefill(self):
        self.lens = self._pending.clone()
        self._mask = None
        self.decoding = True
        self._prefill_idx = None

    def positions(self) -> torch.Tensor:
        """Position of the token each row decodes next."""
        return self.lens

    def _step_mask(self):
        """(row indices, attended length L, [B, 1, 1, L] mask of the positions each row attends to) of this
        decode step, computed once per step and shared by every layer. On CPU the mask is additive (0 or -inf)."""
        if self._mask is None:
            dev = self.lens.device
            L = int(self.lens.max()) + 1
            mask = (torch.arange(L, device=dev).unsqueeze(0) <= self.lens.unsqueeze(1))[:, None, None, :]  # [B,1,1,L]
            if self.lens.is_cpu:
                dt = self.k[0].dtype if self.k else torch.float32
                mask = torch.zeros(mask.shape, dtype=dt, device=dev).masked_fill_(~mask, float("-inf"))
            self._mask = (torch.arange(self.batch, device=dev), L, mask)
        return self._mask

    def decode_attention(self, layer: int, q, k, v, scale: float):
        """q: [B, hq, d]; k, v: [B, hkv, d] of the new token of each row -> [B, hq, d]."""
        K, V = self.k[layer], self.v[layer]
        mod = _kernel_for(q)
        if mod is not None:
            return mod.decode_attention(q, K, V, self.lens, k, v, scale)
        rows, L, mask = self._step_mask()
        K[rows, :, self.lens] = k.to(K.dtype)
        V[rows, :, self.lens] = v.to(V.dtype)
        K, V = as_query_dtype(K[:, :, :L], q), as_query_dtype(V[:, :, :L], q)
        if q.is_cpu:
            return gqa_decode_attention(q, K, V, as_query_dtype(mask, q), scale)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2), K, V, attn_mask=mask, scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        return out.squeeze(2)

    def block_attention(self, layer: int) -> dict:
        """The cache arguments of the C++ ``decode_block`` (decode_ops.cpp) for ``layer``."""
        return dict(K=self.k[layer], V=self.v[layer], lens=self.lens)

    def layers_attention(self) -> dict:
        """The cache arguments of the C++ ``DecodeLayers.run`` (decode_ops.cpp): those of every layer."""
        return dict(K=self.k, V=self.v, lens=self.lens)

    def advance(self):
        """Every row consumed one more position (after all layers ran a decode step)."""
        self.lens += 1
        self._mask = None
        if int(self.lens.max()) >= self.max_len:
            raise RuntimeError("KV cache overflow: max_len too small for the requested new tokens")

    def keep(self, rows: torch.Tensor):
        """Keep only cache rows ``rows``, in that order: the unfinished sequences, or (with repeated indices)
        copies of a prefilled prompt for each of its samples."""
        if torch.equal(rows, torch.arange(self.batch, device=rows.device)):
            return
        self._take_rows(rows, int(self.lens.max()) + 1)
        self.lens = self.lens[rows]
        self._mask = None

    def _take_rows(self, rows: torch.Tensor, used: int):
        """Replace ``k``/``v`` by new compact buffers of rows ``rows``, copying only their first ``used`` positions."""
        for i in range(len(self.k)):
            nk = torch.zeros((rows.numel(),) + self.k[i].shape[1:], dtype=self.k[i].dtype, device=self.k[i].device)
            nv = torch.zeros_like(nk)
            nk[:, :, :used] = self.k[i][rows, :, :used]
            nv[:, :, :used] = self.v[i][rows, :, :used]
            self.k[i], self.v[i] = nk, nv


# Sharing a prompt's keys/values among its samples saves reading them again for every extra sample, and costs a
# fixed number of extra small operations per layer and step. Measured on SmolLM2 (fp32, 2 CPU cores, attention over
# 30 layers): the saving is about 2 us per prompt token not read again, the cost about 3 ms a step, so sharing pays
# from about 1,400 such tokens a step, i.e. about 2 MiB of keys/values per layer (8 prompts x 4 samples x 50 tokens:
# 3% slower; x 150 tokens: 1.3x faster attention; x 400 tokens and 8 samples: 2.2x).
SHARE_MIN_BYTES = 2 * 2**20


def sharing_pays(prompt_lens, samples, n_kv_heads: int, head_dim: int, elem_size: int) -> bool:
    """Whether prompts of ``prompt_lens`` tokens with ``samples`` samples each (per distinct prompt) should decode over
    shared keys/values (``SharedPrefixCache``): the keys/values per layer a step would otherwise read again for the
    extra samples reach ``SHARE_MIN_BYTES``."""
    again = sum((n - 1) * L for L, n in zip(prompt_lens, samples))
    return again * 2 * n_kv_heads * head_dim * elem_size >= SHARE_MIN_BYTES


def _to_slots(x: torch.Tensor, P: int, slots: int, flat: Optional[torch.Tensor]) -> torch.Tensor:
    """Rows [B, h, g, c] -> [P, h, slots * g, c]: row ``b`` goes to slot ``flat[b]`` (= prefix * slots + its index
    among the prefix's rows), other slots are zero; ``flat`` None: the rows already are every slot in order."""
    B, h, g, c = x.shape
    if flat is not None:
        x = x.new_zeros((P * slots, h, g, c)).index_copy_(0, flat, x)
    return x.view(P, slots, h, g, c).transpose(1, 2).reshape(P, h, slots * g, c)


def _from_slots(y: torch.Tensor, slots: int, flat: Optional[torch.Tensor]) -> torch.Tensor:
    """The inverse of ``_to_slots`` for the rows: [P, h, slots * g, c] -> [B, h, g, c]."""
    P, h, sg, c = y.shape
    y = y.view(P, h, slots, sg // slots, c).transpose(1, 2).reshape(P * slots, h, sg // slots, c)
    return y if flat is None else y.index_select(0, flat)


def shared_prefix_attention(q, pk, pv, pre_mask, K, V, own_mask, flat: Optional[torch.Tensor], slots: int,
                            scale: float):
    """One query per row over its prompt's shared keys/values and its own: q [B, hq, d]; ``pk``, ``pv``
    [P, hkv, Lp, d] the prefixes, with the additive ``pre_mask`` [P, 1, 1, Lp] of each prefix's positions; ``K``,
    ``V`` [B, hkv, Lo, d] each row's own positions, with the additive ``own_mask`` [B, 1, 1, Lo] (None: every row
    attends to all ``Lo``) -> [B, hq, d]. Row ``b`` is slot ``flat[b]`` of the ``P * slots`` slots, ``slots`` per
    prefix in prefix order (``flat`` None: B == P * slots rows, in slot order). The queries of a prefix's slots go
    through one product with its keys and one with its values, so each prefix is read once per call, not once per
    row; one softmax normalises each row's scores over both parts."""
    B, hq, d = q.shape
    P, hkv, Lp, _ = pk.shape
    Lo = K.shape[2]
    qg = q.view(B, hkv, hq // hkv, d) * scale
    s_pre = torch.matmul(_to_slots(qg, P, slots, flat), pk.transpose(-1, -2)).add_(pre_mask)  # [P, hkv, slots*g, Lp]
    s_own = torch.matmul(qg, K.transpose(-1, -2))  # [B, hkv, g, Lo]
    if own_mask is not None:
        s_own.add_(own_mask)
    s = torch.cat([_from_slots(s_pre, slots, flat), s_own], -1).softmax(-1)
    p_pre, p_own = s.split([Lp, Lo], -1)
    out = _from_slots(torch.matmul(_to_slots(p_pre, P, slots, flat), pv), slots, flat)
    return torch.matmul(p_own, V).add_(out).view(B, hq, d)


class SharedPrefixCache(KVCache):
    """A decoding cache whose rows share the keys/values of their prompt (a *prefix*) with the other samples of that
    prompt: the prefix is stored once, ``[P, h_kv, Lp, d]`` per layer, and each row keeps only the positions it
    generated, ``[B, h_kv, positions, d]``. A decode step reads every prefix once for all of its rows: the queries
    of a prefix's rows (at most ``slots`` of them) go through one product with its keys and one with its values,
    and each row's scores over its prefix and over its own positions are normalised by one softmax, so the result
    is attention over the whole sequence, as :class:`KVCache` computes it, up to rounding. With ``n`` samples per
    prompt this reads the prompt's keys/values ``n`` times less often, which is what a decode step over long
    prompts spends its time on when the samples of a group (GRPO) decode together.

    Built from a prefilled :class:`KVCache` whose rows are the distinct prompts (:meth:`from_prefill`). Same
    decode interface as ``KVCache``: ``lens`` (every row's next position, prefix included), ``decode_attention``,
    ``advance``, ``keep``. Its ``k``/``v`` hold the rows' own positions only, so the compiled decode step, which
    reads them as whole sequences, does not take this cache."""

    # (row_p, plens, rows listed prompt by prompt, where each prompt's rows begin) of the current rows, or None
    _by_prompt = None

    def __init__(self, pk: List[torch.Tensor], pv: List[torch.Tensor], plens: torch.Tensor, row_p: torch.Tensor,
                 row_j: torch.Tensor, slots: int, max_new: int):
        B = row_p.numel()
        h, d = pk[0].shape[1], pk[0].shape[3]
        dtype, device = pk[0].dtype, pk[0].device
        self.pk, self.pv, self.plens = pk, pv, plens
        self.row_p, self.row_j, self.slots = row_p, row_j, slots
        shape = (B, h, max_new + 1, d)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in pk]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in pk]
        self.own = torch.zeros(B, dtype=torch.long, device=device)  # positions each row generated so far
        self.lens = plens[row_p] + self.own
        self.max_len = max_new + 1  # of the own positions (advance checks against it)
        self.decoding = True
        self._prefill_idx = None
        self._mask = None

    @classmethod
    def from_prefill(cls, cache: KVCache, copies: torch.Tensor, max_new: int) -> "SharedPrefixCache":
        """After the prefill of ``cache`` (one row per distinct prompt) and its ``end_prefill``: a cache with
        ``copies[p]`` rows on prompt ``p`` (adjacent, in prompt order) that will generate up to ``max_new``
        tokens each."""
        plens = cache.lens.clone()
        Lp = int(plens.max())
        pk = [k[:, :, :Lp].contiguous() for k in cache.k]
        pv = [v[:, :, :Lp].contiguous() for v in cache.v]
        P = copies.numel()
        row_p = torch.arange(P, device=copies.device).repeat_interleave(copies)
        starts = torch.cumsum(copies, 0) - copies
        row_j = torch.arange(row_p.numel(), device=copies.device) - starts.repeat_interleave(copies)
        return cls(pk, pv, plens.to(row_p.device), row_p, row_j, int(copies.max()), max_new)

    def _step_mask(self):
        """(additive mask of each prefix's positions [P, 1, 1, Lp], of each row's own positions [B, 1, 1, Lo] or None
        where every row has generated as many, Lo, the rows' slots or None where they are every slot in order) of
        this step, shared by every layer."""
        if self._mask is None:
            dev, dt = self.lens.device, self.k[0].dtype
            Lp = self.pk[0].shape[2]
            Lo = int(self.own.max()) + 1
            pre = torch.arange(Lp, device=dev).unsqueeze(0) < self.plens.unsqueeze(1)
            pre = torch.zeros(pre.shape, dtype=dt, device=dev).masked_fill_(~pre, float("-inf"))[:, None, None]
            own = None
            if int(self.own.min()) + 1 != Lo:
                own = torch.arange(Lo, device=dev).unsqueeze(0) <= self.own.unsqueeze(1)
                own = torch.zeros(own.shape, dtype=dt, device=dev).masked_fill_(~own, float("-inf"))[:, None, None]
            flat = self.row_p * self.slots + self.row_j
            if flat.numel() == self.pk[0].shape[0] * self.slots and bool((flat == torch.arange(flat.numel(), device=dev)).all()):
                flat = None
            self._mask = (pre, own, Lo, flat)
        return self._mask

    def decode_attention(self, layer: int, q, k, v, scale: float):
        """q: [B, hq, d]; k, v: [B, hkv, d] of the new token of each row -> [B, hq, d]."""
        mod = _kernel_for(q)
        if mod is not None:
            order, starts = self._rows_by_prompt()
            return mod.shared_prefix_decode_attention(q, self.pk[layer], self.pv[layer], self.plens, self.k[layer],
                                                      self.v[layer], self.own, k, v, order, starts, scale)
        pre_mask, own_mask, Lo, flat = self._step_mask()
        rows = torch.arange(self.batch, device=self.own.device)
        K, V = self.k[layer], self.v[layer]
        K[rows, :, self.own] = k.to(K.dtype)
        V[rows, :, self.own] = v.to(V.dtype)
        own_mask = None if own_mask is None else as_query_dtype(own_mask, q)
        return shared_prefix_attention(q, as_query_dtype(self.pk[layer], q), as_query_dtype(self.pv[layer], q),
                                       as_query_dtype(pre_mask, q), as_query_dtype(K[:, :, :Lo], q),
                                       as_query_dtype(V[:, :, :Lo], q), own_mask, flat, self.slots, scale)

    def block_attention(self, layer: int) -> dict:
        """The cache arguments of the C++ ``decode_block`` (decode_ops.cpp) for ``layer``: the prompts' shared
        keys/values and each row's own."""
        order, starts = self._rows_by_prompt()
        return dict(K=self.k[layer], V=self.v[layer], lens=self.own, pk=self.pk[layer], pv=self.pv[layer],
                    plens=self.plens, row_order=order, row_starts=starts)

    def layers_attention(self) -> dict:
        """The cache arguments of the C++ ``DecodeLayers.run`` for every layer."""
        order, starts = self._rows_by_prompt()
        return dict(K=self.k, V=self.v, lens=self.own, pk=self.pk, pv=self.pv, plens=self.plens, row_order=order,
                    row_starts=starts)

    def _rows_by_prompt(self):
        """(the rows listed prompt by prompt, where each prompt's rows begin in that list [P + 1]), kept while the
        rows and prompts stay the same tensors (they are replaced, never changed in place, when rows come or go)."""
        c = self._by_prompt
        if c is None or c[0] is not self.row_p or c[1] is not self.plens:
            counts = torch.bincount(self.row_p, minlength=self.plens.numel())
            starts = torch.zeros(counts.numel() + 1, dtype=torch.long, device=counts.device)
            torch.cumsum(counts, 0, out=starts[1:])
            c = (self.row_p, self.plens, torch.argsort(self.row_p, stable=True), starts)
            self._by_prompt = c
        return c[2], c[3]

    def advance(self):
        self.own += 1
        self.lens += 1
        self._mask = None
        if int(self.own.max()) >= self.max_len:
            raise RuntimeError("KV cache overflow: max_len too small for the requested new tokens")

    def keep(self, rows: torch.Tensor):
        """Keep only rows ``rows`` (in that order; no repeats); a prefix no row uses any more is dropped."""
        if torch.equal(rows, torch.arange(self.batch, device=rows.device)):
            return
        self._take_rows(rows, int(self.own.max()) + 1)
        self.own, self.lens = self.own[rows], self.lens[rows]
        row_p = self.row_p[rows]
        used = torch.unique(row_p)  # sorted
        if used.numel() < self.pk[0].shape[0]:
            self.pk = [t[used] for t in self.pk]
            self.pv = [t[used] for t in self.pv]
            self.plens = self.plens[used]
            remap = torch.full((int(used.max()) + 1,), -1, dtype=torch.long, device=used.device)
            remap[used] = torch.arange(used.numel(), device=used.device)
            row_p = remap[row_p]
        self.row_p, self.row_j = row_p, self.row_j[rows]
        self._mask = None
