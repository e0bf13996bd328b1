"""How much memory a rank holds and what a model function call (MFC) adds on top of it, from the model's shape
(``ReaLModelConfig``: read from ``config.json`` alone) and the layout. No torch, no weights: the launcher asks it
before any worker starts, and each worker asks it for the call it runs (``<mfc>/est_mem_gib`` in the stats).

What is counted (bytes of live tensors, as ``torch.cuda.max_memory_allocated`` counts them, and
``realhf.base.mem_peak`` on the CPU):

* **State a rank holds between calls** (:func:`replica_state`): each replica's parameters in their dtype (an
  inference replica with ``offload`` holds them in host memory between its calls); a trained replica also its
  gradient buffer in the same dtype, fp32 master weights and their gradient when its dtype is not fp32, and AdamW's
  two fp32 moments.
* **A training call** (:func:`train_call`): the activations the backward pass keeps, per token and layer of the
  rank's pipeline stage (the block's norms, the attention inputs and output — sequences of unequal lengths are padded
  into buckets of at most 1.25x their tokens — and the MLP), for every micro-batch in flight (1F1B: as many as the
  stage's distance from the last, at most the number of micro-batches); with activation checkpointing only each
  block's input, plus one block recomputed at a time; the gradients a block's backward pass makes; and the output
  head's logits over the loss rows — whole when they fit one chunk of ``chunked_head`` (three fp32 [rows, V/tp]
  buffers at the backward pass's start, seven with the entropy bonus), else one chunk at a time.
* **A forward-only call** (:func:`forward_call`): the largest transient of one block (its MLP or its attention,
  whichever is wider) for one micro-batch, and the head's logits over its rows (whole, or chunked as above).
* **A generation call** (:func:`generate_call`): the KV cache (rows x (prompt + new tokens + 1) x layers x kv heads
  x head dim, keys and values, as the engine allocates it), the prefill's forward pass over the distinct prompts,
  and a decode step's logits and sampling buffers over the rows.
* **Parameter reallocation** (:func:`realloc_call`): the pieces a rank sends and receives, packed.

The per-token coefficients follow the code (which tensors autograd keeps) and were checked against
``realhf.base.mem_peak`` on CPU for the Qwen2, Llama, Qwen3 and GPT-2 blocks in fp32 and bf16 (within 8%); the
tests compare whole calls with their measured peaks.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Iterable, Optional

from realhf.api.core.model_api import ReaLModelConfig, kv_head_partition, stage_layer_range
# the chunk of fp32 logits the output head works in (realhf.impl.model.nn.chunked_head), re-exported
from realhf.base.logits_chunk import CHUNK_BYTES, CHUNK_ENV, chunk_bytes, chunk_rows  # noqa: F401

GiB = 1 << 30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# sequences of unequal lengths are right-padded into buckets of at most this many times their tokens (attention)
PAD = 1.25
# per token and block: index tensors of the padded attention and the norms' fp32 statistics
_SMALL_PER_TOKEN = 64


def dtype_bytes(name: str) -> int:
    if name not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {name!r}; allowed: {sorted(DTYPE_BYTES)}")
    return DTYPE_BYTES[name]


def gib(n: float) -> float:
    return n / GiB


@dataclasses.dataclass
class Estimate:
    """Bytes by part (``params``, ``optimizer``, ``activations``, ``logits``, ``kv_cache`` ...)."""

    parts: Dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def total(self) -> float:
        return float(sum(self.parts.values()))

    def __add__(self, other: "Estimate") -> "Estimate":
        out = dict(self.parts)
        for k, v in other.parts.items():
            out[k] = out.get(k, 0.0) + v
        return Estimate(out)

    def describe(self) -> str:
        """``params 2.88 + optimizer 11.5 + activations 20.1 = 34.5 GiB`` (parts of at least 0.01 GiB)."""
        items = [f"{k} {gib(v):.2f}" for k, v in self.parts.items() if gib(v) >= 0.01]
        return (" + ".join(items) + " = " if len(items) > 1 else "") + f"{gib(self.total):.2f} GiB"


@dataclasses.dataclass(frozen=True)
class Shard:
    """One rank's piece of a model: tensor rank 0 (it takes the remainder of uneven head splits) of pipeline stage
    ``stage`` under ``tp`` x ``pp``, in a dtype of ``bytes`` bytes; ``pad``: padded over real tokens of the attention's
    length buckets (:data:`PAD` at most; 1 for sequences of equal length)."""

    cfg: ReaLModelConfig
    tp: int = 1
    pp: int = 1
    stage: int = 0
    bytes: int = 4
    pad: float = PAD

    @property
    def layers(self) -> int:
        s, e = stage_layer_range(self.cfg.n_layers, self.pp, self.stage)
        return e - s

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.pp - 1

    @property
    def kv_heads(self) -> int:
        return kv_head_partition(self.cfg.n_kv_heads, self.tp)[0][1]

    @property
    def q_dim(self) -> int:
        return self.kv_heads * (self.cfg.n_q_heads // self.cfg.n_kv_heads) * self.cfg.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.cfg.head_dim

    @property
    def mlp_dim(self) -> int:
        return self.cfg.intermediate_dim // self.tp

    @property
    def vocab(self) -> int:
        return self.cfg.vocab_size // self.tp

    def stages(self) -> Iterable["Shard"]:
        """This shard at every pipeline stage (an estimate of a layout takes its largest)."""
        return (dataclasses.replace(self, stage=s) for s in range(self.pp))


def shards(cfg: ReaLModelConfig, tp: int, pp: int, dtype: str) -> Iterable[Shard]:
    return Shard(cfg, tp, pp, 0, dtype_bytes(dtype)).stages()


# ---------------------------------------------------------------------------------------------------- parameters


def params(s: Shard) -> int:
    """Parameters the shard holds (tensor rank 0, which has the most)."""
    c, H = s.cfg, s.cfg.hidden_dim
    norm = H * (2 if c.layer_norm_type == "layer" else 1)
    attn = H * (s.q_dim + 2 * s.kv_dim) + s.q_dim * H
    if c.use_attention_bias:
        attn += s.q_dim + 2 * s.kv_dim
    if c.use_attn_proj_bias:
        attn += H
    if c.qk_layernorm:
        attn += 2 * c.head_dim
    n_mlp = 3 if c.mlp_type == "gated" else 2
    mlp = n_mlp * H * s.mlp_dim + ((n_mlp - 1) * s.mlp_dim + H if c.use_mlp_bias else 0)
    n = s.layers * (2 * norm + attn + mlp)
    if s.is_first:
        n += s.vocab * H + (c.n_positions or 0) * H
    if s.is_last:
        n += norm
        if c.is_critic:
            n += H
        elif not (c.tied_embedding and s.pp == 1):  # a tied head inside one stage shares the embedding
            n += s.vocab * H
    return n


def replica_state(s: Shard, trains: bool, offload: bool = False) -> Estimate:
    """What a replica's shard holds between calls: parameters (none on the device when offloaded), and for a trained
    replica its gradients, fp32 master weights and their gradient (dtype not fp32) and AdamW's two fp32 moments."""
    p = params(s)
    if not trains:
        return Estimate({"params": 0.0 if offload else p * s.bytes})
    out = {"params": p * s.bytes, "grads": p * s.bytes}
    if s.bytes != 4:
        out["master"] = 8.0 * p
    out["optimizer"] = 8.0 * p
    return Estimate(out)


# ---------------------------------------------------------------------------------------------------- activations


def _norm_saved(s: Shard) -> float:
    """Bytes per hidden element a norm keeps for the backward pass: RMSNorm its fp32 input, normalised value and
    output (12 bytes in fp32; 4 + 2 x 2 in bf16, where the fp32 normalised value is not kept); LayerNorm its input
    and output."""
    if s.cfg.layer_norm_type == "layer":
        return 2.0 * s.bytes
    return 12.0 if s.bytes == 4 else 4.0 + 2 * s.bytes


def block_saved_per_token(s: Shard) -> float:
    """Bytes one block keeps per token for its backward pass."""
    c, b = s.cfg, s.bytes
    n = 2 * _norm_saved(s) * c.hidden_dim
    n += b * (s.q_dim + s.pad * (2 * s.q_dim + 2 * s.kv_dim))  # attention output; padded q, k, v and its output
    n += b * (4 if c.mlp_type == "gated" else 2) * s.mlp_dim
    if c.qk_layernorm:  # the q/k/v projection's output and the normalised q and k in fp32
        n += b * (s.q_dim + 2 * s.kv_dim) + (4 + (0 if b == 4 else b)) * (s.q_dim + s.kv_dim)
    return n + _SMALL_PER_TOKEN


def block_forward_peak_per_token(s: Shard) -> float:
    """The largest transient of one block's forward pass without autograd, per token: its MLP (gate and up, the
    activation and the product: four intermediate-wide tensors; two for a plain MLP) or its attention (the q/k/v
    projection, its padded copy, the output and its reordered copy), with a few hidden-wide tensors beside."""
    c, b, H = s.cfg, s.bytes, s.cfg.hidden_dim
    mlp = (4 if c.mlp_type == "gated" else 2) * s.mlp_dim + 6 * H
    attn = (s.q_dim + 2 * s.kv_dim) * (1 + s.pad) + 2 * s.q_dim + 3 * H
    return b * max(mlp, attn) + _SMALL_PER_TOKEN


def _head_factor(s: Shard, train: bool, entropy: bool, temperature: float, whole: bool) -> float:
    """Bytes per (row x local vocabulary entry) the output head holds at its peak."""
    b = s.bytes
    cast = (b + 4) if b != 4 else 0  # logits in the model's dtype, and their fp32 copy
    scaled = 4 if temperature != 1.0 else 0
    if not train:
        return 4 + 4 + cast + scaled - (4 if b != 4 else 0)  # logits (fp32 or cast) and the log-softmax
    if whole:  # torch's log-softmax kept for backward, its gradient and the gather's; entropy: four more buffers
        return (28 if entropy else 12) + cast + scaled
    return 12 + (4 if entropy else 0) + cast  # one chunk: log-probs, their exp, the gradient


def head_call(s: Shard, rows: int, train: bool, entropy: bool = False, temperature: float = 1.0) -> Estimate:
    """The output head over ``rows`` rows on the last stage: logits whole when they fit one chunk, else one chunk at
    a time (plus the weight's gradient, accumulated chunk by chunk)."""
    if not s.is_last or rows <= 0:
        return Estimate()
    c = s.cfg
    if c.is_critic:
        return Estimate({"logits": 4.0 * rows})
    C = chunk_rows(s.vocab)
    whole = rows <= C
    n = rows if whole else C
    out = {"logits": n * s.vocab * _head_factor(s, train, entropy, temperature, whole)}
    if train and not whole:
        out["logits"] += 2.0 * s.vocab * c.hidden_dim * s.bytes  # the weight's gradient, summed over chunks
    out["activations"] = float(rows * c.hidden_dim * (s.bytes + 4))  # the head rows' hidden states and final norm
    return Estimate(out)


def train_call(s: Shard, tokens: int, head_rows: int, n_mbs: int = 1, entropy: bool = False,
               temperature: float = 1.0, checkpointing: bool = False) -> Estimate:
    """A training call whose largest micro-batch has ``tokens`` tokens, ``head_rows`` of them under the loss,
    in ``n_mbs`` micro-batches (pipelines keep several in flight)."""
    H, b = s.cfg.hidden_dim, s.bytes
    in_flight = min(max(1, n_mbs), s.pp - s.stage)
    head = head_call(s, head_rows, True, entropy, temperature)
    grads = tokens * 2 * b * (H + s.mlp_dim)  # a block's backward pass: its input's and its MLP's gradients
    # a parameter's gradient is made whole, then added into the gradient buffer: the largest, the embedding
    grads += max(s.vocab, s.mlp_dim) * H * b
    kept = tokens * H * b * in_flight  # the stage's input (embedding output or the received activations)
    if checkpointing:  # each block's input; then one block at a time is recomputed, after the head's backward pass
        kept += tokens * s.layers * b * H * in_flight
        later = tokens * block_saved_per_token(s) + grads
        return Estimate({"activations": kept + max(0.0, later - head.total)}) + head
    kept += tokens * s.layers * block_saved_per_token(s) * in_flight
    return Estimate({"activations": kept + grads}) + head


def forward_call(s: Shard, tokens: int, head_rows: int, temperature: float = 1.0) -> Estimate:
    """A forward-only call (log-probs, values) over micro-batches of at most ``tokens`` tokens, ``head_rows`` of
    them through the output head."""
    body = tokens * block_forward_peak_per_token(s)  # freed block by block: the head runs after the last
    head = head_call(s, head_rows, False, temperature=temperature)
    if head.total <= body:
        return Estimate({"activations": body})
    return head + Estimate({"activations": tokens * s.cfg.hidden_dim * s.bytes})  # the last block's output beside it


def kv_cache(s: Shard, rows: int, max_len: int, cache_bytes: Optional[int] = None) -> float:
    """Keys and values of ``rows`` sequences of up to ``max_len`` positions over the stage's layers."""
    cb = s.bytes if cache_bytes is None else cache_bytes
    return 2.0 * rows * max_len * s.layers * s.kv_dim * cb


def generate_call(s: Shard, prompts: int, n: int, prompt_len: int, max_new: int,
                  cache_bytes: Optional[int] = None) -> Estimate:
    """One generation micro-batch: ``prompts`` prompts of up to ``prompt_len`` tokens, ``n`` answers each of up to
    ``max_new`` tokens."""
    rows = prompts * n
    kv = kv_cache(s, rows, prompt_len + max_new + 1, cache_bytes)
    prefill = prompts * prompt_len * block_forward_peak_per_token(s)
    decode = rows * s.vocab * (s.bytes + 12) if s.is_last else 0.0  # logits, fp32 copies for sampling
    return Estimate({"kv_cache": kv, "activations": max(prefill, decode)})


def realloc_call(src: Optional[Shard], dst: Optional[Shard]) -> Estimate:
    """Parameter reallocation between two layouts: at most this rank's source shard packed to send and its
    destination shard received."""
    n = (params(src) * src.bytes if src is not None else 0) + (params(dst) * dst.bytes if dst is not None else 0)
    return Estimate({"realloc": float(n)})
