"""Attention over packed variable-length sequences, rotary embeddings and norms.

Packed layout: ``x`` is [total_tokens, ...] with sequence boundaries ``cu_seqlens`` (int32, [n+1]).
No token attends across a boundary. Two kernels, chosen by the runtime environment
(``RuntimeEnv.attention``): ``flash`` calls flash-attn's ``flash_attn_varlen_func`` on the packed tokens
with ``cu_seqlens`` (CUDA, fp16/bf16; the environment picks it only on CUDA with flash_attn installed);
``sdpa`` right-pads sequences of similar length into one batch per group and attends with
``scaled_dot_product_attention`` under a causal mask, which is exact (see ``varlen_causal_attention``).
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


@functools.lru_cache(maxsize=1)
def flash_attn_varlen():
    """flash-attn's ``flash_attn_varlen_func``, or None where the package does not import."""
    try:
        from flash_attn import flash_attn_varlen_func  # GPU extra, imported lazily

        return flash_attn_varlen_func
    except ImportError:
        return None


def pad_indices(cu_seqlens: torch.Tensor, max_len: int):
    """(batch_idx, pos) of every packed token, for scattering into a padded [n, max_len] layout."""
    seqlens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    n = seqlens.numel()
    batch_idx = torch.repeat_interleave(torch.arange(n, device=seqlens.device), seqlens)
    pos = torch.arange(int(cu_seqlens[-1]), device=seqlens.device) - cu_seqlens[:-1].long().repeat_interleave(seqlens)
    return batch_idx, pos, seqlens


def varlen_causal_attention(q, k, v, cu_seqlens: torch.Tensor, max_seqlen: int, scale: float, kernel: str = "sdpa"):
    """q: [T, hq, d]; k, v: [T, hkv, d] -> [T, hq, d]. ``kernel="flash"``: flash-attn's varlen kernel (GQA
    natively) for fp16/bf16 inputs; fp32 inputs, which it does not take, use the SDPA path."""
    if kernel == "flash" and q.dtype in (torch.float16, torch.bfloat16):
        cu = cu_seqlens.to(torch.int32)
        return flash_attn_varlen()(q, k, v, cu, cu, max_seqlen, max_seqlen, softmax_scale=scale, causal=True)
    n = cu_seqlens.numel() - 1
    T, hq, d = q.shape
    hkv = k.shape[1]
    seqlens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    if all(L == seqlens[0] for L in seqlens):
        # equal lengths: one batched causal call, no mask (the fused CPU kernel applies)
        L = seqlens[0]
        qb, kb, vb = (t.view(n, L, t.shape[1], d).transpose(1, 2) for t in (q, k, v))
        return batched_causal_attention(qb, kb, vb, scale).transpose(1, 2).reshape(T, hq, d)
    # Unequal lengths: sequences of similar length are right-padded into one batch per bucket and attended
    # with a plain causal mask. That is exact: a real query at position t attends to keys 0..t, all real
    # tokens of its own sequence; padded rows come after them and their outputs are dropped.
    return bucketed_attention(q, k, v, cu_seqlens[:-1].long(), seqlens, cu_seqlens[:-1].long(), seqlens, scale)


def bucketed_attention(q, k, v, q_starts: torch.Tensor, q_lens, k_starts: torch.Tensor, k_lens, scale: float):
    """Causal attention of segments, aligned at the bottom right: segment i's ``q_lens[i]`` queries (rows
    ``q_starts[i]..`` of q, [R, hq, d]) attend to its ``k_lens[i] >= q_lens[i]`` keys (rows ``k_starts[i]..`` of k and
    v), query t to keys 0 .. t + k_lens[i] - q_lens[i]. Segments of similar key length are right-padded into one
    batch per bucket (padding repeats a segment's last row; a real query never sees a padded key, and padded
    queries are dropped) -> [R, hq, d], the segments' queries covering q's rows."""
    R, hq, d = q.shape
    dev = q.device
    q_st, k_st = q_starts.to(dev), k_starts.to(dev)
    q_ln = torch.tensor(q_lens, dtype=torch.long, device=dev)
    k_ln = torch.tensor(k_lens, dtype=torch.long, device=dev)
    outs, order = [], []
    for members in length_buckets(k_lens):  # not empty: some segment has keys
        m = torch.tensor(members, dtype=torch.long, device=dev)
        Lq, Lk = max(q_lens[i] for i in members), max(k_lens[i] for i in members)
        tq, tk = torch.arange(Lq, device=dev).unsqueeze(0), torch.arange(Lk, device=dev).unsqueeze(0)
        qs, ql, ks, kl = q_st[m].unsqueeze(1), q_ln[m].unsqueeze(1), k_st[m].unsqueeze(1), k_ln[m].unsqueeze(1)
        qb = q.index_select(0, (qs + torch.minimum(tq, ql - 1)).reshape(-1)).view(len(members), Lq, hq, d)
        kidx = (ks + torch.minimum(tk, kl - 1)).reshape(-1)
        kb, vb = (t.index_select(0, kidx).view(len(members), Lk, t.shape[1], d).transpose(1, 2) for t in (k, v))
        if all(q_lens[i] == k_lens[i] for i in members):  # plain causal (the fused CPU kernel applies)
            ob = batched_causal_attention(qb.transpose(1, 2), kb, vb, scale)
        else:
            ob = masked_attention(qb.transpose(1, 2), kb, vb, tk.unsqueeze(1) <= (tq + (kl - ql)).unsqueeze(2), scale)
        real = (tq < ql).reshape(-1)
        outs.append(ob.transpose(1, 2).reshape(len(members) * Lq, hq, d)[real])
        order.append((qs + tq).reshape(-1)[real])
    inv = torch.empty(R, dtype=torch.long, device=dev)
    inv[torch.cat(order)] = torch.arange(R, device=dev)
    return torch.cat(outs, 0).index_select(0, inv)


# Up to this many positions, causal attention as two batched matmuls and a masked softmax beats the fused
# CPU kernel of scaled_dot_product_attention (forward and backward; measured 1.4x at 36 positions and
# equal at ~50, 2 cores); longer sequences use the fused kernel.
SHORT_ATTENTION_MAX_LEN = 48


def batched_causal_attention(q, k, v, scale: float):
    """Causal attention of equal-length batches: q [n, hq, L, d], k and v [n, hkv, L, d] -> [n, hq, L, d]."""
    n, hq, L, d = q.shape
    hkv = k.shape[1]
    if q.is_cuda or L > SHORT_ATTENTION_MAX_LEN:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=hq != hkv)
    return masked_attention(q, k, v, torch.ones(1, L, L, dtype=torch.bool, device=q.device).tril(), scale)


def masked_attention(q, k, v, mask, scale: float):
    """q [n, hq, Lq, d], k and v [n, hkv, Lk, d], mask [n or 1, Lq, Lk] (True: attend) -> [n, hq, Lq, d]. Up to
    SHORT_ATTENTION_MAX_LEN keys on CPU as two batched matmuls and a masked softmax, else SDPA."""
    n, hq, Lq, d = q.shape
    hkv, Lk = k.shape[1], k.shape[2]
    if q.is_cuda or Lk > SHORT_ATTENTION_MAX_LEN:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1), scale=scale,
                                              enable_gqa=hq != hkv)
    qg = q.view(n, hkv, hq // hkv, Lq, d)  # the query heads of each kv head
    s = torch.matmul(qg, k.unsqueeze(2).transpose(-1, -2)) * scale
    s = s.masked_fill(~mask[:, None, None], float("-inf"))
    return torch.matmul(s.softmax(-1), v.unsqueeze(2)).view(n, hq, Lq, d)


def length_buckets(seqlens, slack: float = 1.25):
    """Group sequence indices (sorted by length) so that padding each group to its longest member costs at
    most ``slack`` times the group's real tokens: few batched attention calls, little padded work.
    Zero-length sequences are left out."""
    idx = sorted((i for i, L in enumerate(seqlens) if L > 0), key=lambda i: seqlens[i], reverse=True)
    buckets, cur, cur_tokens = [], [], 0
    for i in idx:
        L = seqlens[i]
        # the first (longest) member sets the padded length of the group
        if cur and (len(cur) + 1) * seqlens[cur[0]] > slack * (cur_tokens + L):
            buckets.append(cur)
            cur, cur_tokens = [], 0
        cur.append(i)
        cur_tokens += L
    if cur:
        buckets.append(cur)
    return buckets


class RMSNorm(nn.Module):
    def __init__(self, dim, eps, dtype=None, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))

    def forward(self, x):
        # Normalised in fp32, then cast back before the weight is applied (as the HF families do). Written
        # out rather than F.rms_norm: on CPU its kernel measured 3x slower for 1152 x 256 inputs.
        dt = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dt)


class LayerNorm(nn.Module):
    def __init__(self, dim, eps, dtype=None, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(dim, dtype=dtype, device=device))

    def forward(self, x):
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


def make_norm(kind: str, dim: int, eps: float, dtype=None, device=None) -> nn.Module:
    return RMSNorm(dim, eps, dtype, device) if kind == "rms" else LayerNorm(dim, eps, dtype, device)


def activation(name: str):
    name = name.lower()
    if name in ("silu", "swish"):
        return F.silu
    if name == "gelu":
        return F.gelu
    if name in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"):
        return functools.partial(F.gelu, approximate="tanh")
    if name == "relu":
        return F.relu
    raise ValueError(f"unsupported activation function {name!r}; allowed: silu, gelu, gelu_new, gelu_pytorch_tanh, relu")


def rotary_inv_freq(head_dim: int, base: float, scaling: Optional[dict]) -> torch.Tensor:
    """Inverse frequencies of rotary embeddings, with 'linear' and 'llama3' scaling. Computed on the host,
    as the HF families do, so the tables are the same bits on every device."""
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        low_wl, high_wl = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wl, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wl) & (wavelen <= low_wl)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope scaling type {kind!r}; allowed: default, linear, llama3")


class Rotary(nn.Module):
    """cos/sin tables computed on demand for given positions (non-interleaved, rotate-half form).

    ``cos_sin`` returns ``cos`` and a *signed* ``sin`` (``-sin`` on the first half of the head dimension),
    the form ``apply_rotary`` takes.
    """

    def __init__(self, head_dim: int, base: float, scaling: Optional[dict], device=None):
        super().__init__()
        self.register_buffer("inv_freq", rotary_inv_freq(head_dim, base, scaling).to(device), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype):
        freqs = positions.float().unsqueeze(-1) * self.inv_freq.to(positions.device).unsqueeze(0)
        emb = torch.cat([freqs, freqs], dim=-1)
        sin = emb.sin()
        sin[:, : sin.shape[-1] // 2].neg_()
        return emb.cos().to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding. x: [T, h, d]; cos, sin_signed: [T, 1, d] from ``Rotary.cos_sin``.

    ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = [-x2, x1]``: rolling x by half a head gives
    ``[x2, x1]``, and the signed sin supplies the minus sign, so it is three kernels (roll, mul, addcmul)."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin_signed)
