"""The steady state of asynchronous RL: generation servers and a trainer under a staleness bound ``eta``.

A small discrete-event model at the grain of training batches (``B`` prompts x ``n`` answers). The answers' lengths
are drawn per batch (seeded) from a capped log-normal of a given mean, so batches differ as real ones do.

* Generation of batch ``b`` may start once the fleet is free and the trainer has finished batch ``b - eta - 1`` (the
  rollout rule of :class:`realhf.api.core.system_api.RolloutSpec`: ``b <= version + eta``).
* With ``eta = 0`` generation and training alternate, and a batch's generation lasts until its longest answer ends:
  the decode steps run over the answers still alive (:meth:`CostModel.decode_step` at those rows). With ``eta >= 1``
  the fleet streams: the next batch's answers fill the rows the finished ones leave, so a batch costs its tokens at
  the fleet's full-rows rate. Either way the servers lay out each batch's new weights once
  (:meth:`CostModel.weights_setup`; on CPU only) and pay a served generation's own cost once per batch
  (``Hardware.server_generate_overhead_s``) and a weight update's own (``Hardware.server_update_s``).
* The rollout side's host work (each episode's allocation, request, grading and report:
  ``Hardware.rollout_episode_s`` and ``reward_s_per_answer``; one event loop per rollout worker) runs beside the
  servers' decoding on a GPU machine (a batch takes the longer of the two), and in turn with it on a CPU machine,
  where the episodes in flight share the servers' decoding steps and then wait for the worker together.
* On a CPU machine (``Hardware.host_cores``) every process shares the host's cores: where generation and training
  overlap (``eta >= 1``) a batch takes at least the CPU time of both sides and of the rollout side over the cores.
* Training batch ``b`` starts when it is generated and the trainer is free; it costs the training MFC
  (:func:`realhf.plan.simulate.compute_time`), the control plane's requests (each MFC's, the step's own and the
  rollout manager's counters) and the weights' publication to the servers, of which a single-process trainer
  writing to disk pays a copy only (the checkpoint is written behind it; the servers pause to load it).

Outputs: trained tokens per second (prompts included; the answers' alone as ``generated_per_s``), the trainer's and the
fleet's idle shares, and the mean staleness (trained versions between an answer's generation start and its training).
"""
from __future__ import annotations

import dataclasses
import math
import random
from typing import Dict, List, Optional

from realhf.api.core.model_api import ReaLModelConfig
from realhf.plan import comm_cost
from realhf.plan.comm_cost import Mesh
from realhf.plan.cost import CostModel
from realhf.plan.fit import Workload, server_rows, shared_body_share
from realhf.plan.hardware import Hardware
from realhf.plan.memory import Shard, dtype_bytes, params
from realhf.plan.simulate import PlanCall, PlanModel, compute_time

DECODE_CHUNK = 64  # decode steps evaluated together in the tail-bound (eta = 0) generation


@dataclasses.dataclass(frozen=True)
class AsyncSetting:
    """An asynchronous run: the model, ``gen_gpus`` GPUs of generation servers of ``gen_tp`` GPUs each,
    ``train_gpus`` trainer GPUs in the layout data x ``train_tp`` x ``train_pp``, ``prompts`` x ``n`` answers per batch
    of ``prompt_len`` + up to ``max_new`` tokens (``mean_new`` on average), ``minibatches`` optimizer steps per batch
    (in micro-batches of at most ``train_max_tokens`` tokens), the trainer's extra forward pass (the proximal policy's
    log-probs of decoupled PPO) when ``recompute_logprobs``, ``rollout_workers`` rollout worker processes."""

    cfg: ReaLModelConfig
    gen_gpus: int
    train_gpus: int
    prompts: int = 64
    n: int = 16
    prompt_len: int = 256
    max_new: int = 8192
    mean_new: float = 4096.0
    minibatches: int = 4
    recompute_logprobs: bool = True
    dtype: str = "bfloat16"
    weight_sync: str = "disk"
    gen_tp: int = 1
    train_tp: int = 1
    train_pp: int = 1
    train_max_tokens: int = 2**31 - 1
    rollout_workers: int = 1

    @property
    def servers(self) -> int:
        return self.gen_gpus // self.gen_tp

    @property
    def weight_params(self) -> float:
        """Parameters of the whole model (what a publication moves)."""
        return params(Shard(self.cfg, 1, 1, 0, dtype_bytes(self.dtype)))

    @property
    def train_mesh(self) -> Mesh:
        return Mesh(self.train_gpus // (self.train_tp * self.train_pp), self.train_tp, self.train_pp, 0)

    def __post_init__(self):
        if self.gen_gpus < 1 or self.train_gpus < 1:
            raise ValueError(f"AsyncSetting: gen_gpus and train_gpus must be >= 1, got {self.gen_gpus}, "
                             f"{self.train_gpus}")
        if self.gen_gpus % self.gen_tp or self.train_gpus % (self.train_tp * self.train_pp):
            raise ValueError(f"AsyncSetting: gen_tp={self.gen_tp} must divide gen_gpus={self.gen_gpus} and "
                             f"train_tp x train_pp={self.train_tp}x{self.train_pp} train_gpus={self.train_gpus}")
        if self.rollout_workers < 1:
            raise ValueError(f"AsyncSetting: rollout_workers must be >= 1, got {self.rollout_workers}")
        if not 0 < self.mean_new <= self.max_new:
            raise ValueError(f"AsyncSetting.mean_new={self.mean_new}: expected in (0, max_new={self.max_new}]")


@dataclasses.dataclass
class SteadyState:
    eta: int
    tokens_per_s: float
    trainer_idle: float
    generation_idle: float
    mean_staleness: float
    train_s: float  # a batch's training, publication included (mean)
    gen_s: float  # a batch's generation (mean)
    generated_per_s: float = 0.0  # the answers' tokens alone, per second


def _lengths(s: AsyncSetting, rng: random.Random) -> List[int]:
    if s.mean_new >= s.max_new:  # capped at its mean: every answer runs to the limit
        return [s.max_new] * (s.prompts * s.n)
    sigma = 0.8
    mu = math.log(s.mean_new) - sigma * sigma / 2
    return [max(1, min(s.max_new, int(rng.lognormvariate(mu, sigma)))) for _ in range(s.prompts * s.n)]


class _Fleet:
    def __init__(self, s: AsyncSetting, hw: Hardware):
        self.s, self.cm = s, CostModel(s.cfg, hw, s.dtype)
        shard = Shard(s.cfg, s.gen_tp, 1, 0, dtype_bytes(s.dtype))
        from realhf.plan.cost import capacity

        # rows a server keeps in flight: what its memory holds at full length
        self.rows = max(1, server_rows(shard, s.prompt_len + s.max_new, capacity(hw), 4096))

    def tail_bound(self, lengths: List[int]) -> float:
        """One batch alone: prefill, then decode steps over the answers still alive (per server), in waves of the
        server's rows."""
        s, per = self.s, math.ceil(len(lengths) / self.s.servers)
        mine = sorted(lengths[::s.servers], reverse=True)[:per]
        t = self.cm.prefill(s.prompt_len * math.ceil(per / s.n), math.ceil(per / s.n), tp=s.gen_tp)
        for w in range(0, len(mine), self.rows):
            wave = sorted(mine[w:w + self.rows])
            alive, k, i = len(wave), 0, 0
            while alive > 0:
                step = min(DECODE_CHUNK, wave[i] - k) if wave[i] > k else 1
                t += step * self.cm.decode_step(alive, s.prompt_len + k + step / 2, tp=s.gen_tp)
                k += step
                while i < len(wave) and wave[i] <= k:
                    i, alive = i + 1, alive - 1
        return t

    def streamed(self, lengths: List[int], rows_cap: int) -> float:
        """A batch's tokens at the fleet's rate with every server's rows full (at most ``rows_cap`` rows in all)."""
        s = self.s
        rows = max(1, min(self.rows, rows_cap // s.servers))
        mean = sum(lengths) / len(lengths)
        step = self.cm.decode_step(rows, s.prompt_len + mean / 2, tp=s.gen_tp)
        prefill = self.cm.prefill(s.prompt_len * s.prompts, s.prompts, tp=s.gen_tp) / s.servers
        return sum(lengths) / (s.servers * rows) * step + prefill


def _train_time(s: AsyncSetting, hw: Hardware, lengths: List[int], cm: Optional[CostModel] = None) -> float:
    seq = s.prompt_len + sum(lengths) / len(lengths)
    body = shared_body_share(s.prompt_len, seq - s.prompt_len, s.n)  # a group's prompt computed once
    m = PlanModel("actor", s.cfg, s.train_mesh, s.dtype, trains=True)
    seqs = len(lengths)
    t = compute_time(hw, m, PlanCall("actor_train", "actor", (),
                                     Workload("train", seqs, int(seq), 1.0 - s.prompt_len / seq, body,
                                              minibatches=s.minibatches, checkpointing=True),
                                     max_tokens=s.train_max_tokens), cm)
    if s.recompute_logprobs:
        t += compute_time(hw, m, PlanCall("actor_inf", "actor", (), Workload("inference", seqs, int(seq), 1.0, body),
                                          max_tokens=s.train_max_tokens), cm)
    # the control plane: each MFC's request, the step's fetch and clear, the rollout manager's counters
    t += (2 if s.recompute_logprobs else 1) * hw.call_overhead_s + hw.step_overhead_s + hw.call_overhead_s
    if _publishes_behind(s):  # the trainer copies its weights; the checkpoint is written and loaded behind it
        return t + s.weight_params * dtype_bytes(s.dtype) / hw.memory_bw
    method = "disk" if s.weight_sync == "disk" else "broadcast"
    return t + comm_cost.publish_weights(hw, s.weight_params, dtype_bytes(s.dtype), s.servers, method,
                                         tensors=comm_cost.hf_tensor_count(s.cfg))


def _publishes_behind(s: AsyncSetting) -> bool:
    """A single-process trainer publishing through disk hands the checkpoint to a background thread
    (:class:`realhf.system.trainer.served.WeightPublisher`): the servers then load it while the trainer goes on."""
    return s.train_gpus == 1 and s.weight_sync == "disk"


def _servers_load(s: AsyncSetting, hw: Hardware) -> float:
    """What the servers spend loading a version written behind the trainer (they pause for it), else 0."""
    if not _publishes_behind(s):
        return 0.0
    return s.servers * s.weight_params * dtype_bytes(s.dtype) / hw.disk_bw  # the servers' reads share the disk


def _rollout_time(s: AsyncSetting, hw: Hardware) -> float:
    """Host CPU seconds of the rollout side per batch (every episode's requests and report, its answers' grading)."""
    return s.prompts * (hw.rollout_episode_s + s.n * hw.reward_s_per_answer)


def _generation(s: AsyncSetting, hw: Hardware, g: float) -> float:
    """A batch's generation with the rollout side's work: beside the servers' ``g`` on a GPU machine (each rollout
    worker's loop runs its share), after it on a CPU machine (at least the CPU time of both over the host's cores)."""
    r = _rollout_time(s, hw)
    if hw.host_cores is None:
        return max(g, r / s.rollout_workers)
    return max(g + r / s.rollout_workers, (g * s.gen_gpus * hw.device_threads + r) / hw.host_cores)


def _host_stretch(s: AsyncSetting, hw: Hardware, server_g: float, g: float, t: float) -> float:
    """On a CPU machine, the factor by which overlapping generation (``g``: the servers' ``server_g`` and the
    rollout side's work) and training (``t``) slow down sharing the host's cores: at least 1."""
    if hw.host_cores is None:
        return 1.0
    busy = (server_g * s.gen_gpus + t * s.train_gpus) * hw.device_threads + _rollout_time(s, hw)
    return max(1.0, busy / hw.host_cores / max(g, t))


def steady_state(s: AsyncSetting, hw: Hardware, eta: int, batches: int = 48, warmup: int = 8,
                 seed: int = 1) -> SteadyState:
    """``batches`` batches under staleness bound ``eta``; the figures over those after ``warmup``."""
    if eta < 0:
        raise ValueError(f"eta={eta}: the staleness bound must be >= 0")
    rng = random.Random(seed)
    fleet = _Fleet(s, hw)
    cm = fleet.cm
    # a batch's requests: what a server's generation costs beyond its passes, where profiled
    served = hw.server_generate_overhead_s if hw.server_generate_overhead_s is not None else hw.generate_overhead_s
    served += _servers_load(s, hw) + hw.server_update_s  # the servers pause for every version
    gen_end: List[float] = []
    train_end: List[float] = []
    gen_busy = train_busy = 0.0
    stale = []
    gen_free = 0.0
    tokens, generated = [], 0
    for b in range(batches):
        lengths = _lengths(s, rng)
        gate = train_end[b - eta - 1] if b - eta - 1 >= 0 else 0.0
        start = max(gen_free, gate)
        g = fleet.tail_bound(lengths) if eta == 0 else fleet.streamed(lengths, (eta + 1) * len(lengths))
        g += cm.weights_setup(tp=s.gen_tp) + served  # each batch's weights are new to the servers
        t = _train_time(s, hw, lengths, cm)
        server_g, g = g, _generation(s, hw, g)
        if eta >= 1:  # generation and training overlap
            f = _host_stretch(s, hw, server_g, g, t)
            g, t = g * f, t * f
        gen_free = start + g
        gen_end.append(gen_free)
        t0 = max(gen_free, train_end[-1] if train_end else 0.0)
        train_end.append(t0 + t)
        if b >= warmup:
            gen_busy += g
            train_busy += t
            tokens.append(sum(lengths) + s.prompt_len * len(lengths))
            generated += sum(lengths)
            stale.append(b - sum(1 for e in train_end[:b] if e <= start))
    span = train_end[-1] - train_end[warmup - 1]
    n_meas = batches - warmup
    return SteadyState(eta, sum(tokens) / span, max(0.0, 1 - train_busy / span), max(0.0, 1 - gen_busy / span),
                       sum(stale) / len(stale), train_busy / n_meas, gen_busy / n_meas, generated / span)


def best_split(s: AsyncSetting, hw: Hardware, gpus: int, eta: int) -> AsyncSetting:
    """The split of ``gpus`` between the fleet and the trainer with the highest throughput under ``eta``."""
    cands = [dataclasses.replace(s, gen_gpus=g, train_gpus=gpus - g) for g in range(1, gpus)]
    return max(cands, key=lambda c: steady_state(c, hw, eta, batches=16, warmup=4).tokens_per_s)


# the AReaL paper's small setting (DeepSeek-R1-Distill-Qwen-1.5B, 8k context, 64 prompts x 16 answers, 8 GPUs of
# the H800 class): effective training throughput in tokens/s by maximum staleness, as quoted for comparison
AREAL_PAPER_TOKENS_PER_S: Dict[int, float] = {0: 27.1e3, 1: 47.8e3, 4: 49.0e3, 16: 52.0e3}


def areal_small_setting(mean_new: float = 4096.0, hw: Optional[Hardware] = None) -> List[Dict]:
    """The model's throughput in AReaL's small setting at each eta the paper reports, beside the paper's figure. The
    answers' mean length (half the 8k context) and the prompt length (256) are assumptions; the split of the 8 GPUs
    is the model's best under eta = 16 (AReaL balances generation and training)."""
    from realhf.plan import hardware
    from realhf.plan.shapes import model_config

    hw = hw or hardware.get("h800")
    base = AsyncSetting(model_config("r1-distill-qwen-1.5b"), 1, 7, 64, 16, 256, 8192, mean_new)
    s = best_split(base, hw, 8, 16)
    out = []
    for eta, paper in AREAL_PAPER_TOKENS_PER_S.items():
        r = steady_state(s, hw, eta)
        out.append(dict(eta=eta, gen_gpus=s.gen_gpus, train_gpus=s.train_gpus, tokens_per_s=round(r.tokens_per_s),
                        paper_tokens_per_s=paper, ratio=round(r.tokens_per_s / paper, 3),
                        trainer_idle=round(r.trainer_idle, 3), generation_idle=round(r.generation_idle, 3),
                        mean_staleness=round(r.mean_staleness, 2), train_s=round(r.train_s, 2),
                        gen_s=round(r.gen_s, 2)))
    return out
