"""KV cache for generation over packed prompts.

Per local layer, keys and values live in [B, h_kv, max_len, d] buffers. Prefill writes the packed
prompt tokens of every sequence at their positions; each decode step writes one token per sequence at
``lens[b]`` and attends to positions ``<= lens[b]``. ``keep(rows)`` drops finished sequences so they
stop costing work.
"""
from __future__ import annotations

from typing import List

import torch
import torch.nn.functional as F


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
        self.k[layer][b, :, pos] = k
        self.v[layer][b, :, pos] = v

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
        rows, L, mask = self._step_mask()
        K, V = self.k[layer], self.v[layer]
        K[rows, :, self.lens] = k
        V[rows, :, self.lens] = v
        if q.is_cpu:
            return gqa_decode_attention(q, K[:, :, :L], V[:, :, :L], mask, scale)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2), K[:, :, :L], V[:, :, :L], attn_mask=mask, scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        return out.squeeze(2)

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
        L = int(self.lens.max()) + 1
        for i in range(len(self.k)):
            # copy only the used prefix to new compact buffers
            nk = torch.zeros((rows.numel(),) + self.k[i].shape[1:], dtype=self.k[i].dtype, device=self.k[i].device)
            nv = torch.zeros_like(nk)
            nk[:, :, :L] = self.k[i][rows, :, :L]
            nv[:, :, :L] = self.v[i][rows, :, :L]
            self.k[i], self.v[i] = nk, nv
        self.lens = self.lens[rows]
        self._mask = None
