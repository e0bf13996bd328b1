"""Time of a model's passes on one device under a tensor/pipeline layout: prefill, a decode step, generation,
forward-only and training passes, the optimizer step. Pure arithmetic on the model's shape (``ReaLModelConfig``)
and the device's rates (:class:`realhf.plan.hardware.Hardware`); no torch. Every function returns seconds.

Each product ``[rows, k] x [k, n]`` is a roofline: ``max(2 rows k n / matmul rate(rows), bytes / bandwidth)`` with
the bytes of the weight, input and output; the rate by rows is the profiled curve of this machine (small-row products
run below the peak) or the tabled peak. Attention: ``max(flops / attention rate, bytes / bandwidth)``, causal
prefill ``2 d sum(S^2)`` FLOPs per layer, a decode step ``4 d`` per row and cached position with the keys and values
read once. Beside them each block costs a fixed overhead and an elementwise term per token x hidden element (norms,
rotary, residuals, activation), fitted by the profiler on a whole forward pass (:mod:`realhf.plan.profile`).

Tensor parallelism (``tp``) splits the products (heads by whole key/value groups, as the model does) and adds the
collectives the model runs: per pass two all-reduces of ``tokens x hidden`` per block (after the attention's and the
MLP's row-parallel products) and one after the vocabulary-parallel embedding; at the head two small all-reduces of the
vocabulary-parallel log-probs (max and sums, per row), or, when sampling (a decode step, a generation's prefill), an
all-gather of the fp32 logits and a broadcast of the sampled (token, log-prob) pairs from tensor rank 0; a training
pass's backward adds an all-reduce of ``tokens x hidden`` per column-parallel product's input (query, key, value, and
the MLP's one or two input products) per block and one at the head. Each costs its latency per ring step, which on a
profiled machine is a collective's mean between computation (:mod:`realhf.plan.probes`). Pipeline parallelism
(``pp``) splits the blocks (earlier stages take the remainder; the embedding's collectives are on the first stage,
the head on the last) and runs ``m`` micro-batches as the slowest stage's ``m`` slots plus one slot of each other
stage (the fill and drain: ``m + p - 1`` slots of equal stages, bubble ``(p - 1) / (m + p - 1)``), with a send of the
activations between stages per slot.
Training is the forward pass, a backward pass of twice its work (and, on a profiled machine, a measured cost per
block beyond that: ``Hardware.train_layer_overhead_s``), and a recomputation of the blocks' forward pass under
activation checkpointing; generation under ``pp`` runs ``pp`` row groups through the stages in turn (realhf's
pipelined schedule), so a step costs ``pp`` stage passes over ``rows / pp`` rows.
"""
from __future__ import annotations

import functools
import math
from typing import List, Optional, Sequence, Tuple

from realhf.api.core.model_api import ReaLModelConfig, kv_head_partition, stage_layer_range
from realhf.plan import comm_cost
from realhf.plan.hardware import Hardware, interpolate_rate
from realhf.plan.memory import dtype_bytes

# the output head's log-softmax / log-prob pass over fp32 logits: written, read, written again
HEAD_FP32_PASSES = 3
# sampling over a decode step's fp32 logits (temperature, top-p/top-k, the draw): passes over [rows x vocab]
SAMPLE_FP32_PASSES = 4
# decode steps of a generation evaluated at most (the rest interpolated): the search calls generate() often
GEN_SAMPLES = 17


class CostModel:
    """Times of ``cfg``'s passes on ``hw`` in ``dtype``. Per-layout constants are cached, so repeated calls with the
    same (tp, pp) cost a few microseconds."""

    def __init__(self, cfg: ReaLModelConfig, hw: Hardware, dtype: str = "bfloat16"):
        self.cfg, self.hw, self.dtype = cfg, hw, dtype
        self.b = dtype_bytes(dtype)
        self.peak = hw.matmul_rate(dtype)
        self.attn_rate = hw.attention_flops.get(dtype, self.peak)
        self.bw = hw.memory_bw
        self._rate = functools.lru_cache(maxsize=4096)(self._rate_uncached)
        self.linears = functools.lru_cache(maxsize=64)(self._linears)

    # ------------------------------------------------------------------------------------------ building blocks

    def _rate_uncached(self, rows: int) -> float:
        return interpolate_rate(self.hw.matmul_rows, rows, self.peak)

    def matmul(self, rows: float, k: int, n: int) -> float:
        """One product of ``rows`` x ``k`` by ``k`` x ``n``: the roofline's slower side."""
        if rows <= 0:
            return 0.0
        flops = 2.0 * rows * k * n
        return max(flops / self._rate(max(1, int(rows))), (k * n + rows * (k + n)) * self.b / self.bw)

    def _linears(self, tp: int) -> Tuple[Tuple[int, int], ...]:
        """(k, n) of a block's products on tensor rank 0 (the largest share of uneven head splits)."""
        c = self.cfg
        kvh = kv_head_partition(c.n_kv_heads, tp)[0][1]
        q = kvh * (c.n_q_heads // c.n_kv_heads) * c.head_dim
        kv = kvh * c.head_dim
        mlp = c.intermediate_dim // tp
        up = (c.hidden_dim, 2 * mlp) if c.mlp_type == "gated" else (c.hidden_dim, mlp)
        return ((c.hidden_dim, q + 2 * kv), (q, c.hidden_dim), up, (mlp, c.hidden_dim))

    def _q_kv(self, tp: int) -> Tuple[int, int]:
        (_, qkv), (q, _) = self.linears(tp)[:2]
        return q, (qkv - q) // 2

    def block(self, tokens: float, sum_sq: float, tp: int, comm: bool = True) -> float:
        """One block's forward pass over ``tokens`` packed tokens whose sequences' squared lengths sum to
        ``sum_sq``, including its tensor-parallel all-reduces (unless ``comm`` is False)."""
        t = sum(self.matmul(tokens, k, n) for k, n in self.linears(tp))
        q, kv = self._q_kv(tp)
        t += max(2.0 * q * sum_sq / self.attn_rate, tokens * (2 * q + 2 * kv) * self.b / self.bw)
        t += self.hw.layer_overhead_s + self.hw.elementwise_s * tokens * self.cfg.hidden_dim
        if tp > 1 and comm:
            t += 2 * self.tp_allreduce(tokens, tp)
        return t

    def tp_allreduce(self, tokens: float, tp: int) -> float:
        return comm_cost.allreduce(self.hw, tokens * self.cfg.hidden_dim * self.b, tp,
                                   intra=tp <= self.hw.devices_per_node)

    def head_comm(self, rows: float, tp: int, sampled: bool = False) -> float:
        """The tensor-parallel collectives at the head over ``rows`` rows: the log-probs' two reductions (a row's
        max, then its sum and label logit), or when ``sampled`` the all-gather of the fp32 logits (a ring: half an
        all-reduce of the gathered bytes) and the broadcast of the (token, log-prob) pairs (float64) from rank 0."""
        if tp <= 1 or rows <= 0 or self.cfg.is_critic:
            return 0.0
        intra = tp <= self.hw.devices_per_node
        if not sampled:
            return (comm_cost.allreduce(self.hw, rows * 4.0, tp, intra)
                    + comm_cost.allreduce(self.hw, rows * 8.0, tp, intra))
        gather = 0.5 * comm_cost.allreduce(self.hw, rows * self.cfg.vocab_size * 4.0, tp, intra)
        return gather + math.ceil(math.log2(tp)) * comm_cost.send(self.hw, rows * 16.0, intra)

    def embed_comm(self, tokens: float, tp: int) -> float:
        """The vocabulary-parallel embedding's all-reduce of ``tokens x hidden``."""
        return self.tp_allreduce(tokens, tp) if tp > 1 and tokens > 0 else 0.0

    def backward_comm(self, tokens: float, head_rows: float, tp: int, pp: int) -> float:
        """The slowest stage's tensor-parallel all-reduces of a backward pass: the input gradient of each
        column-parallel product per block (query, key, value, the MLP's input products) and of the head."""
        if tp <= 1:
            return 0.0
        per_block = 3 + (2 if self.cfg.mlp_type == "gated" else 1)
        s, e = stage_layer_range(self.cfg.n_layers, pp, pp - 1)
        last = (e - s) * per_block * self.tp_allreduce(tokens, tp) + self.tp_allreduce(head_rows, tp)
        return max(self.stage_layers(pp) * per_block * self.tp_allreduce(tokens, tp), last)

    def head(self, rows: float, tp: int, train: bool = False) -> float:
        """The output head over ``rows`` rows: its product and the log-softmax over the fp32 logits."""
        c = self.cfg
        if rows <= 0:
            return 0.0
        if c.is_critic:
            return self.matmul(rows, c.hidden_dim, 1)
        v = c.vocab_size // tp
        return self.matmul(rows, c.hidden_dim, v) + HEAD_FP32_PASSES * 4.0 * rows * v / self.bw

    def stage_layers(self, pp: int) -> int:
        """Blocks of the largest pipeline stage (the first)."""
        s, e = stage_layer_range(self.cfg.n_layers, pp, 0)
        return e - s

    def _stages(self, tokens: float, sum_sq: float, head_rows: float, tp: int, pp: int, comm: bool = True,
                sampled: bool = False) -> List[float]:
        """Each pipeline stage's forward pass over one micro-batch (one entry without ``pp``): its blocks, the
        embedding's collectives on the first, the head on the last; with ``comm``, its tensor-parallel collectives
        (the head's as for log-probs, or for sampling when ``sampled``)."""
        blk = self.block(tokens, sum_sq, tp, comm)
        out = []
        for i in range(pp):
            s, e = stage_layer_range(self.cfg.n_layers, pp, i)
            t = (e - s) * blk
            if i == 0 and comm:
                t += self.embed_comm(tokens, tp)
            if i == pp - 1:
                t += self.head(head_rows, tp) + (self.head_comm(head_rows, tp, sampled) if comm else 0.0)
            out.append(t)
        return out

    def _stage(self, tokens: float, sum_sq: float, head_rows: float, tp: int, pp: int, comm: bool = True,
               sampled: bool = False) -> float:
        """The slowest stage's forward pass over one micro-batch (see :meth:`_stages`)."""
        return max(self._stages(tokens, sum_sq, head_rows, tp, pp, comm, sampled))

    @staticmethod
    def _schedule(slots: Sequence[float], mb: int) -> float:
        """``mb`` micro-batches through stages taking ``slots`` each: the slowest stage runs every micro-batch, the
        pipeline's fill and drain pass each other stage once ((mb + pp - 1) slots when the stages are equal)."""
        return (mb - 1) * max(slots) + sum(slots)

    def _send(self, tokens: float, pp: int, tp: int, lat: Optional[float] = None) -> float:
        if pp <= 1:
            return 0.0
        intra = pp * tp <= self.hw.devices_per_node
        return comm_cost.send(self.hw, tokens * self.cfg.hidden_dim * self.b, intra, lat)

    # ------------------------------------------------------------------------------------------ passes

    def forward(self, tokens: float, mb: int = 1, seq_len: Optional[float] = None, head_rows: Optional[float] = None,
                tp: int = 1, pp: int = 1, sampled: bool = False) -> float:
        """A forward-only call (log-probs, values) over ``tokens`` tokens on one data-parallel rank, in ``mb``
        micro-batches, sequences of ``seq_len`` tokens (default: one per micro-batch), ``head_rows`` of the tokens
        through the output head (default all); ``sampled``: the head's rows are sampled (a generation's prefill)."""
        mb = max(1, int(mb))
        t_mb = tokens / mb
        s = t_mb if seq_len is None else min(seq_len, t_mb)
        rows = (tokens if head_rows is None else head_rows) / mb
        extra = self._send(t_mb, pp, tp) + self.hw.pass_overhead_s
        return self._schedule([t + extra for t in self._stages(t_mb, t_mb * s, rows, tp, pp, sampled=sampled)], mb)

    def prefill(self, tokens: float, prompts: int = 1, tp: int = 1, pp: int = 1) -> float:
        """The forward pass over ``prompts`` prompts of ``tokens`` tokens in all, the head at each prompt's last
        position only."""
        return self.forward(tokens, 1, tokens / max(1, prompts), prompts, tp, pp, sampled=True)

    def train(self, tokens: float, mb: int = 1, seq_len: Optional[float] = None, head_rows: Optional[float] = None,
              tp: int = 1, pp: int = 1, checkpointing: bool = False) -> float:
        """A training pass (forward, backward of twice its work, recomputation under activation checkpointing) over
        ``tokens`` tokens on one data-parallel rank in ``mb`` micro-batches (1F1B under ``pp``); the optimizer step
        and the gradient all-reduce are :meth:`optimizer_step` and :func:`comm_cost.grad_allreduce`."""
        mb = max(1, int(mb))
        t_mb = tokens / mb
        s = t_mb if seq_len is None else min(seq_len, t_mb)
        rows = (tokens if head_rows is None else head_rows) / mb
        fwd = self._stages(t_mb, t_mb * s, rows, tp, pp)
        bare = self._stages(t_mb, t_mb * s, rows, tp, pp, comm=False)
        blk = self.block(t_mb, t_mb * s, tp)
        common = self.backward_comm(t_mb, rows, tp, pp) + 3.0 * self.hw.pass_overhead_s + 2 * self._send(t_mb, pp, tp)
        slots = []
        for i in range(pp):
            a, e = stage_layer_range(self.cfg.n_layers, pp, i)
            per_block = (blk if checkpointing else 0.0) + self.hw.train_layer_overhead_s
            slots.append(fwd[i] + 2.0 * bare[i] + common + (e - a) * per_block)
        return self._schedule(slots, mb)

    def optimizer_step(self, params_per_rank: float) -> float:
        """AdamW over a rank's parameters."""
        return self.hw.optimizer_s_per_param * params_per_rank

    def decode_step(self, rows: float, cached: float, tp: int = 1, pp: int = 1) -> float:
        """One decode step of ``rows`` rows whose caches hold ``cached`` positions each: every block's products at
        ``rows`` rows, attention reading each row's keys and values, the head and sampling; under ``pp`` the rows
        go through the stages in ``pp`` groups, each group's samples sent back to the first stage."""
        if rows <= 0:
            return 0.0
        r = rows / pp
        q, kv = self._q_kv(tp)
        blk = sum(self.matmul(r, k, n) for k, n in self.linears(tp))
        blk += max(4.0 * q * r * cached / self.attn_rate, 2.0 * r * cached * kv * self.b / self.bw)
        blk += self.hw.decode_layer_overhead_s + self.hw.decode_elementwise_s * r * self.cfg.hidden_dim
        if tp > 1:
            blk += 2 * self.tp_allreduce(r, tp)
        head = (self.head(r, tp) + SAMPLE_FP32_PASSES * 4.0 * r * (self.cfg.vocab_size // tp) / self.bw
                + self.head_comm(r, tp, sampled=True))
        if tp > 1:
            head += self.hw.tp_decode_step_overhead_s
        if pp == 1:
            return self.cfg.n_layers * blk + self.embed_comm(r, tp) + head + self.hw.decode_step_overhead_s
        s, e = stage_layer_range(self.cfg.n_layers, pp, pp - 1)
        stage = max(self.stage_layers(pp) * blk + self.embed_comm(r, tp), (e - s) * blk + head)
        # each group's slot: its activations to the next stage, and its sampled (token, log-prob) pairs (float64) from
        # the last stage back to the first (each message at the pipelined decode's own latency where measured)
        lat = self.hw.pp_decode_lat
        packet = comm_cost.send(self.hw, r * 16.0, pp * tp <= self.hw.devices_per_node, lat)
        return pp * (stage + self._send(r, pp, tp, lat) + packet) + self.hw.decode_step_overhead_s

    def weights_setup(self, tp: int = 1, pp: int = 1) -> float:
        """What a rank's generation pays for its weights before decoding with them (``Hardware.generate_layer_/
        generate_head_overhead_s``): the largest stage's share of the blocks and the head, split over ``tp``."""
        hw = self.hw
        return (hw.generate_layer_overhead_s * self.stage_layers(pp) + hw.generate_head_overhead_s) / tp

    def generate(self, prompts: int, prompt_len: float, n: int, new_tokens: int, tp: int = 1, pp: int = 1) -> float:
        """Generation of ``n`` answers of ``new_tokens`` tokens to each of ``prompts`` prompts of ``prompt_len``
        tokens: the prefill of the distinct prompts, then ``new_tokens - 1`` decode steps over ``prompts * n`` rows
        (each answer's first token comes from the prefill), beside the call's own setup
        (``Hardware.generate_overhead_s`` and :meth:`weights_setup`)."""
        rows = prompts * n
        t = self.prefill(prompts * prompt_len, prompts, tp, pp) + self.hw.generate_overhead_s
        t += self.weights_setup(tp, pp)
        steps = max(0, int(new_tokens) - 1)
        if steps == 0:
            return t
        if steps <= GEN_SAMPLES:
            return t + sum(self.decode_step(rows, prompt_len + i, tp, pp) for i in range(1, steps + 1))
        # the step's time is piecewise linear in the cached positions: a trapezoid sum over GEN_SAMPLES points
        xs = [1 + (steps - 1) * i / (GEN_SAMPLES - 1) for i in range(GEN_SAMPLES)]
        ys = [self.decode_step(rows, prompt_len + x, tp, pp) for x in xs]
        h = (steps - 1) / (GEN_SAMPLES - 1)
        return t + h * (sum(ys) - 0.5 * (ys[0] + ys[-1])) + 0.5 * (ys[0] + ys[-1])


class PlanDoesNotFit(ValueError):
    """A layout whose memory estimate exceeds the device's capacity."""


def capacity(hw: Hardware) -> float:
    """Bytes a rank's tensors may take on ``hw`` (as the launcher's check counts them, :mod:`realhf.plan.fit`)."""
    from realhf.plan.fit import GPU_RESERVED, GPU_USABLE, HOST_USABLE, PROCESS_BASE

    if hw.device == "cuda":
        return hw.memory_bytes * GPU_USABLE - GPU_RESERVED
    return hw.memory_bytes * HOST_USABLE - PROCESS_BASE


def check_fits(cfg: ReaLModelConfig, hw: Hardware, dtype: str, kind: str, tokens: int, tp: int = 1, pp: int = 1,
               mb: int = 1, seq_len: Optional[int] = None, checkpointing: bool = False,
               trains: Optional[bool] = None):
    """The memory model's estimate (:mod:`realhf.plan.memory`) of the fullest rank of a call of ``kind`` ("train",
    "forward", "generate": ``tokens`` of prompt and answer per row, one row) over ``tokens`` tokens per data-parallel
    rank in ``mb`` micro-batches, on top of what the rank holds (a trained replica's optimizer state when ``trains``,
    default: for "train"). Returns the estimate; raises :class:`PlanDoesNotFit` naming it and the capacity."""
    from realhf.plan import memory

    if kind not in ("train", "forward", "generate"):
        raise ValueError(f"check_fits: kind={kind!r}; allowed: 'train', 'forward', 'generate'")
    cfg.check_layout(tp, pp)
    trains = kind == "train" if trains is None else trains
    cap = capacity(hw)
    worst = None
    for s in memory.shards(cfg, tp, pp, dtype):
        t_mb = max(1, -(-tokens // max(1, mb)))
        if kind == "train":
            call = memory.train_call(s, t_mb, t_mb, mb, checkpointing=checkpointing)
        elif kind == "forward":
            call = memory.forward_call(s, t_mb, t_mb)
        else:
            call = memory.generate_call(s, 1, 1, seq_len or tokens, 0)
        est = memory.replica_state(s, trains) + call
        if worst is None or est.total > worst.total:
            worst = est
    if worst.total > cap:
        raise PlanDoesNotFit(f"{kind} of {cfg.n_layers}-layer model (hidden {cfg.hidden_dim}) over {tokens} tokens "
                             f"with tp={tp} pp={pp} mb={mb} in {dtype} does not fit {hw.name}: estimated "
                             f"{worst.describe()} against {memory.gib(cap):.2f} GiB; more tp/pp or micro-batches would")
    return worst
