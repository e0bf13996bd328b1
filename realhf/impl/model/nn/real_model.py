"""ReaLModel: one decoder-only transformer for the HF families, sharded by tensor and pipeline parallelism.

A ``ReaLModel`` instance holds one pipeline stage's layers (a contiguous range of blocks, plus the
embedding on the first stage and the output head on the last), tensor-parallel slices of every matrix,
and all of its parameters as views into one contiguous flat buffer (``model.flat``).

Parameter names are layout independent (``blocks.7.attn.q_proj.weight``); ``tp_shard_dim(name)`` says
along which dimension a parameter is split across tensor-parallel ranks (None = replicated).
"""
from __future__ import annotations

import dataclasses
import hashlib
import re
import weakref
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.utils.checkpoint
import torch.nn.functional as F

from realhf.api.core.model_api import ReaLModelConfig, even_range, kv_head_partition, stage_layer_range  # noqa: F401 (re-exported)
from realhf.base import cpu_share, runtime_env
from realhf.impl.model.nn.attention import (
    Rotary,
    activation,
    apply_rotary,
    make_norm,
    RMSNorm,
    flash_attn_varlen,
    varlen_causal_attention,
)
from realhf.impl.model.nn import cpu_gemm, decode_ops, kv_cache
from realhf.impl.model.nn.chunked_head import HeadOutput
from realhf.impl.model.nn.compile_util import CompiledOrFallback
from realhf.impl.model.nn.kv_cache import KVCache
from realhf.impl.model.nn.shared_prefix import PrefixTree, share_prefixes, tree_attention
from realhf.impl.model.parallelism.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)

_SHARD_DIM0 = re.compile(
    r"(embed\.wte\.weight|attn\.[qkv]_proj\.(weight|bias)|mlp\.(gate_proj|up_proj|fc_in)\.(weight|bias)|head\.lm_head\.weight)$"
)
_SHARD_DIM1 = re.compile(r"(attn\.o_proj\.weight|mlp\.(down_proj|fc_out)\.weight)$")


def tp_shard_dim(name: str) -> Optional[int]:
    """Dimension along which parameter ``name`` is split across tensor-parallel ranks, or None."""
    if _SHARD_DIM0.search(name):
        return 0
    if _SHARD_DIM1.search(name):
        return 1
    return None


def shard_bounds(cfg: ReaLModelConfig, name: str, tp: int, rank: int) -> Optional[Tuple[int, int]]:
    """[start, end) of tensor rank ``rank``'s slice of parameter ``name`` along ``tp_shard_dim(name)``."""
    d = tp_shard_dim(name)
    if d is None:
        return None
    g = cfg.n_q_heads // cfg.n_kv_heads
    kv_start, kv_n = kv_head_partition(cfg.n_kv_heads, tp)[rank]
    hd = cfg.head_dim
    if ".attn.q_proj." in name or name.endswith("attn.o_proj.weight"):
        return kv_start * g * hd, (kv_start + kv_n) * g * hd
    if ".attn.k_proj." in name or ".attn.v_proj." in name:
        return kv_start * hd, (kv_start + kv_n) * hd
    full = cfg.vocab_size if ("wte" in name or "lm_head" in name) else cfg.intermediate_dim
    n = full // tp
    return rank * n, (rank + 1) * n


def tied_source_name(cfg: ReaLModelConfig, name: str) -> str:
    """The parameter whose values ``name`` holds: the embedding for the output head of a tied model (a last
    stage that is not also the first keeps its own copy of it), else ``name`` itself."""
    if name == "head.lm_head.weight" and cfg.tied_embedding and not cfg.is_critic:
        return "embed.wte.weight"
    return name


@dataclasses.dataclass
class PackedInput:
    """What a stage's forward needs besides its input tensor."""

    cu_seqlens: torch.Tensor  # int32 [n+1]
    max_seqlen: int
    position_ids: torch.Tensor  # int64 [T]
    cache: Optional[KVCache] = None
    # Last stage: apply the output head only to these token rows (e.g. the last token of each prompt).
    head_rows: Optional[torch.Tensor] = None
    # Last stage of a language model: return a ``chunked_head.HeadOutput`` (the final norm's output and the output
    # projection) instead of logits, for log-probs computed chunk by chunk (``chunked_head.head_logprobs``).
    defer_head: bool = False
    # Shared prompts computed once (``shared_prefix``): the input holds the compact layout's rows, the head the
    # original layout's (``head_rows`` index the original layout).
    tree: Optional["PrefixTree"] = None


def packed_positions(cu_seqlens: torch.Tensor) -> torch.Tensor:
    seqlens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    starts = cu_seqlens[:-1].long().repeat_interleave(seqlens)
    return torch.arange(int(cu_seqlens[-1]), device=cu_seqlens.device) - starts


def make_packed_input(seqlens: List[int], device=None) -> PackedInput:
    cu = torch.zeros(len(seqlens) + 1, dtype=torch.int32, device=device)
    cu[1:] = torch.cumsum(torch.tensor(seqlens, dtype=torch.int32, device=device), 0)
    return PackedInput(cu_seqlens=cu, max_seqlen=max(seqlens), position_ids=packed_positions(cu))


def packed_model_input(ids: torch.Tensor, seqlens: List[int], device=None,
                       share: bool = True) -> Tuple[torch.Tensor, PackedInput]:
    """(input ids, PackedInput) of packed sequences for a full forward pass; with ``share``, adjacent sequences
    that begin alike (a prompt's answers) are laid out with their common prefix once (``shared_prefix``)."""
    found = share_prefixes(ids, seqlens, device) if share else None
    if found is None:
        return ids.to(device), make_packed_input(seqlens, device=device)
    compact, pos, tree = found
    return compact, PackedInput(cu_seqlens=tree.q_cu, max_seqlen=tree.max_q, position_ids=pos, tree=tree)


class Attention(nn.Module):
    """Self-attention of one block, in two calls around which ``Block.forward`` splits its work:
    ``project`` (q/k/v) and ``attend``; the block applies ``o_proj`` itself."""

    def __init__(self, cfg: ReaLModelConfig, tp_group, tp: int, tp_rank: int, dtype, device, kernel: str):
        super().__init__()
        self.kernel = kernel  # "sdpa" | "flash" (RuntimeEnv.attention)
        _, self.hkv = kv_head_partition(cfg.n_kv_heads, tp)[tp_rank]
        self.hq = self.hkv * (cfg.n_q_heads // cfg.n_kv_heads)
        self.d = cfg.head_dim
        H = cfg.hidden_dim
        b = cfg.use_attention_bias
        self.q_proj = ColumnParallelLinear(H, cfg.n_q_heads * self.d, b, tp_group, dtype, device, local_out=self.hq * self.d)
        self.k_proj = ColumnParallelLinear(H, cfg.n_kv_heads * self.d, b, tp_group, dtype, device, local_out=self.hkv * self.d)
        self.v_proj = ColumnParallelLinear(H, cfg.n_kv_heads * self.d, b, tp_group, dtype, device, local_out=self.hkv * self.d)
        self.o_proj = RowParallelLinear(cfg.n_q_heads * self.d, H, cfg.use_attn_proj_bias, tp_group, dtype, device,
                                        local_in=self.hq * self.d)
        if cfg.qk_layernorm:
            self.q_norm = RMSNorm(self.d, cfg.layer_norm_epsilon, dtype, device)
            self.k_norm = RMSNorm(self.d, cfg.layer_norm_epsilon, dtype, device)
        else:
            self.q_norm = self.k_norm = None
        self.scale = self.d**-0.5

    def project(self, h, rope: Optional[Tuple[torch.Tensor, torch.Tensor]]):
        """q [T, hq, d], k and v [T, hkv, d] of the normed input ``h`` (with qk-norm and rotary applied)."""
        T = h.shape[0]
        q, k, v = cpu_gemm.linear_group(h, (self.q_proj, self.k_proj, self.v_proj))
        q, k, v = q.reshape(T, self.hq, self.d), k.reshape(T, self.hkv, self.d), v.reshape(T, self.hkv, self.d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        return q, k, v

    def attend(self, q, k, v, inp: PackedInput, layer: int):
        """Attention over the packed sequences (or the KV cache) -> [T, hq * d], before the output projection."""
        cache = inp.cache
        if cache is not None and cache.decoding:
            out = cache.decode_attention(layer, q, k, v, self.scale)
        else:
            if cache is not None:
                cache.store_prefill(layer, k, v)
            if inp.tree is not None:
                out = tree_attention(q, k, v, inp.tree, self.scale, self.kernel)
            else:
                out = varlen_causal_attention(q, k, v, inp.cu_seqlens, inp.max_seqlen, self.scale, self.kernel)
        return out.reshape(q.shape[0], self.hq * self.d)


class MLP(nn.Module):
    def __init__(self, cfg: ReaLModelConfig, tp_group, tp: int, dtype, device):
        super().__init__()
        H, I, b = cfg.hidden_dim, cfg.intermediate_dim, cfg.use_mlp_bias
        self.gated = cfg.mlp_type == "gated"
        self.act = activation(cfg.activation_function)
        li = I // tp
        if self.gated:
            self.gate_proj = ColumnParallelLinear(H, I, b, tp_group, dtype, device, local_out=li)
            self.up_proj = ColumnParallelLinear(H, I, b, tp_group, dtype, device, local_out=li)
            self.down_proj = RowParallelLinear(I, H, b, tp_group, dtype, device, local_in=li)
        else:
            self.fc_in = ColumnParallelLinear(H, I, b, tp_group, dtype, device, local_out=li)
            self.fc_out = RowParallelLinear(I, H, b, tp_group, dtype, device, local_in=li)

    def forward(self, x):
        if self.gated:
            gate, up = cpu_gemm.linear_group(x, (self.gate_proj, self.up_proj))
            return self.down_proj(self.act(gate) * up)
        return self.fc_out(self.act(self.fc_in(x)))


class Block(nn.Module):
    def __init__(self, cfg: ReaLModelConfig, tp_group, tp: int, tp_rank: int, dtype, device, kernel: str):
        super().__init__()
        self.attn_norm = make_norm(cfg.layer_norm_type, cfg.hidden_dim, cfg.layer_norm_epsilon, dtype, device)
        self.attn = Attention(cfg, tp_group, tp, tp_rank, dtype, device, kernel)
        self.mlp_norm = make_norm(cfg.layer_norm_type, cfg.hidden_dim, cfg.layer_norm_epsilon, dtype, device)
        self.mlp = MLP(cfg, tp_group, tp, dtype, device)
        self.compiled = None  # (pre, post) compiled by ReaLModel.compile_blocks, else the eager functions run
        # a decode step's small operations in C++ (decode_ops) serve RMSNorm blocks with a SiLU-gated MLP and no
        # qk-norm (Llama, Qwen2, SmolLM2, Mistral)
        self.decode_fusable = (isinstance(self.attn_norm, RMSNorm) and isinstance(self.mlp_norm, RMSNorm)
                               and self.mlp.gated and self.mlp.act is F.silu and self.attn.q_norm is None)
        self.tp1 = tp == 1  # the whole block in one C++ call (decode_ops' decode_block) needs no tp collectives

    def forward(self, x, inp, rope, layer):
        if torch.compiler.is_compiling():
            pre, post = _BLOCK_EAGER
        elif self.decode_fusable and self.compiled is None and decode_ops.for_rows(x) is not None:
            y = _block_decode_whole(self, x, inp, rope, layer)
            if y is not None:
                return y
            pre, post = _BLOCK_DECODE
        else:
            pre, post = _BLOCK_EAGER if self.compiled is None else self.compiled
        q, k, v = pre(self, x, rope)
        return post(self, x, self.attn.attend(q, k, v, inp, layer))


def _block_pre(blk: "Block", x, rope):
    """The part of a block before attention: its norm, the q/k/v projections, qk-norm and rotary."""
    return blk.attn.project(blk.attn_norm(x), rope)


def _block_post(blk: "Block", x, o):
    """The part of a block after attention: the output projection and residual, the MLP and its residual."""
    x = x + blk.attn.o_proj(o)
    return x + blk.mlp(blk.mlp_norm(x))


_BLOCK_EAGER = (_block_pre, _block_post)


def _block_pre_decode(blk: "Block", x, rope):
    """``_block_pre`` for a decode step's few rows (``Block.decode_fusable``): the norm and rotary in C++."""
    ops, a, norm = decode_ops.for_rows(x), blk.attn, blk.attn_norm
    T = x.shape[0]
    h = ops.rms_norm(x, norm.weight, norm.eps)[0]
    q, k, v = cpu_gemm.linear_group(h, (a.q_proj, a.k_proj, a.v_proj))
    q, k, v = q.reshape(T, a.hq, a.d), k.reshape(T, a.hkv, a.d), v.reshape(T, a.hkv, a.d)
    if rope is not None:
        ops.rotary_(q, k, *_rope_rows(rope))  # in place
    return q, k, v


def _block_post_decode(blk: "Block", x, o):
    """``_block_post`` for a decode step's few rows: the residual add with the MLP's norm, and SiLU(gate) * up, in
    C++."""
    ops, mlp, norm = decode_ops.for_rows(x), blk.mlp, blk.mlp_norm
    h, x = ops.rms_norm(blk.attn.o_proj(o), norm.weight, norm.eps, x)  # h = norm(x + o_proj(o)), and the sum
    gate, up = cpu_gemm.linear_group(h, (mlp.gate_proj, mlp.up_proj))
    return x + mlp.down_proj(ops.silu_mul(gate, up))


_BLOCK_DECODE = (_block_pre_decode, _block_post_decode)


# the caches whose attention the C++ decode kernels read (an fp16 cache: GenerationHyperparameters.kv_cache_dtype)
_CPP_KV_DTYPES = (torch.float32, torch.float16)


def _whole_block_ops(x, cache, attn):
    """The decode_ops module where ``decode_block`` serves a decode step of ``x`` through a block with attention
    ``attn`` over ``cache``: a decoding KV cache whose attention runs in C++, and the tile kernel serving the products
    (``decode_ops.linear_kernel``: fp32 rows on an AVX-512 CPU, outside autograd and torch.compile). Else None."""
    if (not x.is_cpu or cache is None or not cache.decoding or not hasattr(cache, "block_attention")
            or cache.k[0].dtype not in _CPP_KV_DTYPES or kv_cache.decode_kernel() is None):
        return None
    return decode_ops.linear_kernel(x, attn.q_proj.weight, attn.q_proj.bias)


def _block_params(blk: "Block") -> list:
    """A block's parameters in the order decode_block and DecodeLayers take them (csrc/decode_ops): attn_norm, q, its
    bias, k, v, o (each with its bias), mlp_norm, gate, up, down (each with its bias)."""
    a, mlp = blk.attn, blk.mlp
    return [blk.attn_norm.weight, a.q_proj.weight, a.q_proj.bias, a.k_proj.weight, a.k_proj.bias, a.v_proj.weight,
            a.v_proj.bias, a.o_proj.weight, a.o_proj.bias, blk.mlp_norm.weight, mlp.gate_proj.weight,
            mlp.gate_proj.bias, mlp.up_proj.weight, mlp.up_proj.bias, mlp.down_proj.weight, mlp.down_proj.bias]


def _rope_rows(rope):
    """The decode step's rotary tables as (cos, sin) [T, d] (from [T, 1, d]), or (None, None) without rotary."""
    return (rope[0][:, 0], rope[1][:, 0]) if rope is not None else (None, None)


def _block_decode_whole(blk: "Block", x, inp, rope, layer: int):
    """A decode step of the whole block in one C++ call (``decode_block`` of csrc/decode_ops: the functions of
    ``_block_pre_decode``, the cache's C++ attention and ``_block_post_decode``, in the same order, so the same
    result to the bit, without ~15 Python-level calls per layer), where it serves: tp = 1 and
    :func:`_whole_block_ops`. Else None."""
    ops = _whole_block_ops(x, inp.cache, blk.attn) if blk.tp1 else None
    if ops is None:
        return None
    p, a = _block_params(blk), blk.attn
    return ops.decode_block(x if x.stride(1) == 1 else x.contiguous(), p[0], blk.attn_norm.eps, *p[1:9], p[9],
                            blk.mlp_norm.eps, *p[10:], *_rope_rows(rope), scale=a.scale, hq=a.hq, hkv=a.hkv,
                            **inp.cache.block_attention(layer))


# model -> its blocks' C++ DecodeLayers (built at the first decode step that can take it; see _decode_layers_whole)
_DECODE_LAYERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _decode_layers_whole(model: "ReaLModel", x, inp, rope):
    """A decode step of every block of ``model`` in one C++ call (decode_ops' ``DecodeLayers``: each layer as
    :func:`_block_decode_whole` runs it, so the same result to the bit, without a Python-level call and ~30 converted
    arguments per layer: about 4 ms a step for SmolLM2's 30 layers), where it serves: every block takes
    ``decode_block`` (``Block.decode_fusable``, not compiled, tp = 1, :func:`_whole_block_ops`). Else None (the
    blocks run one by one)."""
    if torch.compiler.is_compiling():  # (before any test on the data, which a trace would guard on)
        return None
    blocks = list(model.blocks.values())
    a0 = blocks[0].attn
    ops = _whole_block_ops(x, inp.cache, a0)
    if ops is None or not all(b.decode_fusable and b.tp1 and b.compiled is None for b in blocks):
        return None
    layers = _DECODE_LAYERS.get(model)
    if layers is None or layers[0] is not ops:
        eps = [[b.attn_norm.eps, b.mlp_norm.eps] for b in blocks]
        layers = (ops, ops.DecodeLayers([_block_params(b) for b in blocks], eps, scale=a0.scale, hq=a0.hq,
                                        hkv=a0.hkv))
        _DECODE_LAYERS[model] = layers
    return layers[1].run(x if x.stride(1) == 1 else x.contiguous(), *_rope_rows(rope), **inp.cache.layers_attention())


_COMPILED_BLOCK = None


def compiled_block_fns():
    """The compiled (pre, post) block functions, one pair per process shared by every block of every model:
    Inductor sees blocks' parameters as inputs, so blocks of the same shapes reuse the same code."""
    global _COMPILED_BLOCK
    if _COMPILED_BLOCK is None:
        _COMPILED_BLOCK = (CompiledOrFallback(_block_pre, dynamic=True), CompiledOrFallback(_block_post, dynamic=True))
    return _COMPILED_BLOCK


class Embedding(nn.Module):
    def __init__(self, cfg: ReaLModelConfig, tp_group, tp: int, tp_rank: int, dtype, device):
        super().__init__()
        self.wte = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_dim, tp_group, dtype, device, tp=tp, tp_rank=tp_rank)
        self.wpe = (
            nn.Embedding(cfg.n_positions, cfg.hidden_dim, dtype=dtype, device=device)
            if cfg.n_positions
            else None
        )

    def forward(self, ids, position_ids):
        x = self.wte(ids)
        if self.wpe is not None:
            x = x + self.wpe(position_ids)
        return x


class Head(nn.Module):
    def __init__(self, cfg: ReaLModelConfig, tp_group, tp: int, dtype, device):
        super().__init__()
        self.norm = make_norm(cfg.layer_norm_type, cfg.hidden_dim, cfg.layer_norm_epsilon, dtype, device)
        self.is_critic = cfg.is_critic
        if cfg.is_critic:
            self.value = nn.Linear(cfg.hidden_dim, 1, bias=False, dtype=dtype, device=device)
        else:
            self.lm_head = ColumnParallelLinear(cfg.hidden_dim, cfg.vocab_size, False, tp_group, dtype, device,
                                                local_out=cfg.vocab_size // tp)

    def forward(self, x, defer: bool = False):
        x = self.norm(x)
        if self.is_critic:
            return self.value(x).squeeze(-1).float()
        return HeadOutput(x, self.lm_head) if defer else self.lm_head(x)


class ReaLModel(nn.Module):
    """One pipeline stage of a (tensor-parallel) decoder-only transformer.

    ``forward(x, inp)``: on the first stage ``x`` is token ids [T]; elsewhere hidden states [T, H].
    Returns hidden states [T, H] on non-last stages, and on the last stage logits over this rank's
    vocabulary slice [T, V/tp] (or values [T] for a critic), or with ``inp.defer_head`` a ``HeadOutput`` from which
    ``chunked_head.head_logprobs`` computes log-probs without holding the whole logits.

    ``env`` (``realhf.base.runtime_env.RuntimeEnv``) says where the parameters live, their default dtype and
    the attention kernel; without one, the environment of ``device`` (``for_device``), or the CPU
    environment when no device is given either. ``dtype``/``device`` override the env's (``device="meta"``
    builds shapes only).
    """

    def __init__(self, config: ReaLModelConfig, grid=None, dtype=None, device=None, env=None):
        super().__init__()
        if env is None:
            env = runtime_env.for_device(device) if device is not None else runtime_env.cpu_env()
        self.env = env
        self.device = env.device if device is None else torch.device(device)
        dtype = env.dtype if dtype is None else dtype
        kernel = env.attention
        if kernel == "flash" and flash_attn_varlen() is None:
            raise ValueError(f"attention kernel 'flash' asked for ({env.describe()}), but flash_attn does not "
                             "import here; install the GPU extra or use attention='sdpa'")
        self.config = config
        self.grid = grid
        tp = grid.tp_size if grid is not None else 1
        pp = grid.pp_size if grid is not None else 1
        stage = grid.pp_rank if grid is not None else 0
        config.check_layout(tp, pp)
        self.tp_group = grid.tp_group if grid is not None else None
        self.tp, self.pp, self.stage = tp, pp, stage
        self._tp_rank = grid.tp_rank if grid is not None else 0
        self.dtype = dtype
        self.is_first = stage == 0
        self.is_last = stage == pp - 1
        self.layer_start, self.layer_end = stage_layer_range(config.n_layers, pp, stage)
        device = self.device
        r = self._tp_rank
        self.embed = Embedding(config, self.tp_group, tp, r, dtype, device) if self.is_first else None
        self.blocks = nn.ModuleDict(
            {str(i): Block(config, self.tp_group, tp, r, dtype, device, kernel)
             for i in range(self.layer_start, self.layer_end)}
        )
        self.head = Head(config, self.tp_group, tp, dtype, device) if self.is_last else None
        # Tied embeddings inside one stage share the parameter; across stages the last stage keeps a copy
        # that the train engine keeps in sync by all-reducing its gradient with the first stage's.
        self.shares_tied_weight = config.tied_embedding and not config.is_critic and pp == 1
        if self.shares_tied_weight:
            self.head.lm_head.weight = self.embed.wte.weight
        self.rotary = (Rotary(config.head_dim, config.rotary_base, config.rotary_scaling, device)
                       if config.apply_rotary else None)
        # activation checkpointing: a training pass keeps each block's input only and runs the block again in the
        # backward pass (set by the model worker from ModelSpec.gradient_checkpointing)
        self.checkpointing = False
        self._build_flat()

    # ------------------------------------------------------------------ flat parameter buffer
    def _build_flat(self):
        """Move every parameter into one contiguous buffer; parameters become views of it."""
        named = list(self.named_parameters())  # tied parameters appear once
        total = sum(p.numel() for _, p in named)
        self.flat = torch.zeros(total, dtype=self.dtype, device=self.device)
        self.param_spec: Dict[str, Tuple[int, torch.Size]] = {}
        off = 0
        for name, p in named:
            n = p.numel()
            view = self.flat[off : off + n].view(p.shape)
            view.copy_(p.data)
            p.data = view
            self.param_spec[name] = (off, p.shape)
            off += n

    def rebind_flat(self, flat: torch.Tensor):
        """Make ``flat`` (same size and dtype, any device) the parameter buffer: every parameter becomes a
        view of it. Used to offload parameters to host memory and bring them back."""
        if flat.shape != self.flat.shape or flat.dtype != self.flat.dtype:
            raise ValueError(f"rebind_flat: got {tuple(flat.shape)} {flat.dtype}, need {tuple(self.flat.shape)} {self.flat.dtype}")
        for name, p in self.named_parameters():
            off, shape = self.param_spec[name]
            p.data = flat[off : off + shape.numel()].view(shape)
        self.flat = flat

    def attach_flat_grad(self) -> torch.Tensor:
        """Give every parameter a gradient that is a view of one flat buffer (for one-shot reductions)."""
        if getattr(self, "flat_grad", None) is None:
            self.flat_grad = torch.zeros_like(self.flat)
            for name, p in self.named_parameters():
                off, shape = self.param_spec[name]
                p.grad = self.flat_grad[off : off + p.numel()].view(shape)
        return self.flat_grad

    def local_param(self, name: str) -> torch.Tensor:
        off, shape = self.param_spec[name]
        return self.flat[off : off + shape.numel()].view(shape)

    def init_random(self, seed: int = 0, std: float = 0.02):
        """Layout-independent random init: each full tensor is drawn from a host generator seeded by its name
        (the same values on every device and layout), then this rank's slice is copied to the parameters."""
        for name in self.param_spec:
            full = list(self.full_shape(name))
            key = tied_source_name(self.config, name)  # a tied head's copy starts equal to the embedding
            g = torch.Generator().manual_seed(seed * 1000003 + int(hashlib.md5(key.encode()).hexdigest()[:8], 16))
            if name.endswith("norm.weight"):
                t = torch.ones(full)
            elif name.endswith(".bias") or name.endswith("norm.bias"):
                t = torch.zeros(full)
            else:
                t = torch.randn(full, generator=g) * std
            t = self.local_shard(name, t)
            self.local_param(name).copy_(t)

    @property
    def tp_rank(self) -> int:
        return self._tp_rank

    def shard_bounds(self, name: str, rank: Optional[int] = None) -> Optional[Tuple[int, int]]:
        return shard_bounds(self.config, name, self.tp, self.tp_rank if rank is None else rank)

    def local_shard(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the full tensor of parameter ``name``."""
        b = self.shard_bounds(name)
        if b is None or self.tp == 1:
            return full
        return full.narrow(tp_shard_dim(name), b[0], b[1] - b[0])

    def full_shape(self, name: str) -> torch.Size:
        shape = list(self.param_spec[name][1])
        d = tp_shard_dim(name)
        if d is not None and self.tp > 1:
            shape[d] = sum(e - s for s, e in (self.shard_bounds(name, r) for r in range(self.tp)))
        return torch.Size(shape)

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor, inp: PackedInput) -> torch.Tensor:
        if self.is_first:
            x = self.embed(x, inp.position_ids)
        rope = self.rotary.cos_sin(inp.position_ids, x.dtype) if self.rotary is not None else None
        ticking = cpu_share.active() and not torch.compiler.is_compiling()  # CPU threads that follow idle cores
        y = None
        if not ticking and inp.cache is not None:
            y = _decode_layers_whole(self, x, inp, rope)  # a decode step of every block in one C++ call
        if y is not None:
            x = y
        else:
            recompute = self.checkpointing and inp.cache is None and torch.is_grad_enabled()
            for i, blk in self.blocks.items():
                if ticking:
                    cpu_share.tick()
                if recompute:
                    x = torch.utils.checkpoint.checkpoint(blk, x, inp, rope, int(i) - self.layer_start,
                                                          use_reentrant=False)
                else:
                    x = blk(x, inp, rope, int(i) - self.layer_start)
                if ticking:
                    cpu_share.tick_in_backward(x)
        if self.is_last:
            rows = inp.head_rows
            if inp.tree is not None:
                rows = inp.tree.expand if rows is None else inp.tree.expand[rows]
            x = self.head(x if rows is None else x[rows], inp.defer_head)
        return x

    def compile_blocks(self) -> Optional[str]:
        """Run every block's parts before and after attention (norms, projections, rotary, MLP, residuals) as
        compiled graphs (``torch.compile``, forward and backward); attention stays eager, as its packing
        depends on the data. At small hidden sizes this removes much of the per-operation cost of training
        and inference passes, at a one-off compile cost. Returns why not where unsupported (tensor
        parallelism: the projections contain collectives), else None."""
        if self.tp > 1:
            return f"tensor parallelism (tp={self.tp}); compile_blocks serves tp = 1"
        fns = compiled_block_fns()
        for blk in self.blocks.values():
            blk.compiled = fns
        return None

    @property
    def n_local_kv_heads(self) -> int:
        return kv_head_partition(self.config.n_kv_heads, self.tp)[self.tp_rank][1]

    @property
    def n_local_layers(self) -> int:
        return self.layer_end - self.layer_start

    def num_params(self) -> int:
        return self.flat.numel()
