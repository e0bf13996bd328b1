"""Hardware floors of an RL step's model function calls (MFCs), from ceilings measured on the device that runs them.

A floor is the time no implementation can beat on that device at that work, given two measured ceilings:

* ``matmul``: FLOP/s of a large matrix product in the run's compute dtype (CUDA: bf16 8192^3; CPU: fp32 2048^2 with
  the fastest of PyTorch's CPU kernels, ``_timing.matmul_peak_gflops``);
* ``copy``: bytes/s of a device copy, counting bytes read plus bytes written (CUDA: 1 GiB; CPU: 256 MiB, beyond the
  caches). It stands for the memory bandwidth; a kernel that only reads may run up to ~10% faster than a copy, so a
  time within 10% of a memory-bound floor is at the floor.

With ``N_body`` the parameters of the blocks (and the final norm), ``N_head = V * H`` the output head's (the input
embedding is a lookup, no product), ``L`` layers, ``d`` the query width (heads x head dim) and ``b`` bytes per value:

* **forward-only** (``ref_inf``, ``actor_inf``; the ``critic_inf`` head is ``H`` wide) over ``T`` tokens of ``n``
  sequences, ``R`` of which feed the head (the answer tokens: no log-prob is needed elsewhere)::

      F_fwd = 2 * N_body * T + 2 * N_head * R + 2 * L * d * sum_i S_i^2        (causal attention: QK^T and AV, halved)
      floor = max(F_fwd / matmul, weight bytes / copy)

  ``sum_i S_i^2`` is taken as ``T^2 / n``, its least value for ``n`` sequences of ``T`` tokens (the stats give totals).
* **training** (``actor_train``, ``critic_train``): the forward pass and a backward pass of twice its products::

      floor = 3 * F_fwd / matmul

  (no activation recomputation, no optimizer update: AdamW's passes over the parameters, ~1% of the step at 1.5B, are
  left out so that the floor stays a floor).
* **generation** (``actor_gen``; the ``gen`` experiment's ``gen``) of ``P`` prompts of ``p_total`` tokens in all,
  ``G`` answers each (``rows = P * G``), every answer exactly ``A`` tokens: the prefill of each distinct prompt once,
  its head only at the last position, then ``A - 1`` decode steps, each bound by reading the weights and the KV cache
  (a group's prompt keys/values once, each row's own answer keys/values) or by its products, whichever is slower::

      prefill  = max((2 * N_body * p_total + 2 * N_head * P + 2 * L * d * p_total^2 / P) / matmul, weight bytes / copy)
      step t   = max((weight bytes + kv * (p_total + rows * t)) / copy,
                     (2 * (N_body + N_head) * rows + 4 * L * d * (G * p_total + rows * t)) / matmul)
      floor    = prefill + sum over t = 1 .. A-1 of step t

  with ``kv = 2 * L * kv_heads * head_dim * b`` bytes per token. Answers here are fixed-length (min = max new tokens),
  so no row finishes early; with early finishes the sum would run over the rows still decoding.

The floor of a step is the sum of its MFCs' floors where they share one device (colocated; a server beside the
trainer on the same GPU or CPU cores), and where an asynchronous run's generation has devices of its own, the larger
of the generation floor and the sum of the trainer's floors.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Dict, Optional

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
FORWARD, TRAIN, GENERATE = "forward", "train", "generate"
# which floor each MFC has (rew_inf grades text on the CPU: no device floor)
MFC_KIND = {"actor_gen": GENERATE, "gen": GENERATE, "ref_inf": FORWARD, "actor_inf": FORWARD,
            "critic_inf": FORWARD, "actor_train": TRAIN, "critic_train": TRAIN}


@dataclasses.dataclass(frozen=True)
class Ceilings:
    """Measured on the device that runs the work: FLOP/s of a matrix product, bytes/s (read + written) of a copy."""

    matmul_flops: float
    copy_bytes: float
    dtype: str
    device: str

    def __post_init__(self):
        if not (self.matmul_flops > 0 and self.copy_bytes > 0):
            raise ValueError(f"ceilings must be positive: matmul_flops={self.matmul_flops}, "
                             f"copy_bytes={self.copy_bytes}")


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What the floors need of a model: parameters of the blocks and of the head, layers, query width, KV bytes per
    token and weight bytes, in the compute dtype."""

    body_params: int
    head_params: int
    layers: int
    q_dim: int
    kv_bytes_per_token: int
    dtype_bytes: int

    @property
    def weight_bytes(self) -> int:
        return (self.body_params + self.head_params) * self.dtype_bytes

    @classmethod
    def from_path(cls, path: str, dtype: str, critic: bool = False) -> "ModelShape":
        """From a Hugging Face folder's config.json (torch-free: realhf's own parameter count, ``realhf.plan``)."""
        from realhf.impl.model.conversion.hf_files import config_from_hf_path
        from realhf.plan.memory import Shard, params

        if dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype={dtype!r}; allowed: {sorted(DTYPE_BYTES)}")
        b = DTYPE_BYTES[dtype]
        cfg = config_from_hf_path(path)
        s = Shard(cfg, bytes=b)
        n, emb = params(s), cfg.vocab_size * cfg.hidden_dim
        tables = emb * (1 if cfg.tied_embedding else 2) + (cfg.n_positions or 0) * cfg.hidden_dim
        head = cfg.hidden_dim if critic else emb
        return cls(body_params=n - tables, head_params=head, layers=cfg.n_layers, q_dim=s.q_dim,
                   kv_bytes_per_token=2 * cfg.n_layers * s.kv_dim * b, dtype_bytes=b)


def forward_flops(m: ModelShape, tokens: float, head_rows: float, n_seqs: float) -> float:
    return 2.0 * m.body_params * tokens + 2.0 * m.head_params * head_rows + 2.0 * m.layers * m.q_dim * tokens ** 2 / n_seqs


def forward_floor(m: ModelShape, c: Ceilings, tokens: float, head_rows: float, n_seqs: float) -> float:
    return max(forward_flops(m, tokens, head_rows, n_seqs) / c.matmul_flops, m.weight_bytes / c.copy_bytes)


def train_floor(m: ModelShape, c: Ceilings, tokens: float, head_rows: float, n_seqs: float) -> float:
    return 3.0 * forward_flops(m, tokens, head_rows, n_seqs) / c.matmul_flops


def generate_floor(m: ModelShape, c: Ceilings, prompts: int, group: int, prompt_tokens: float, answer: int) -> float:
    """``prompt_tokens``: the distinct prompts' tokens in all (each prompt once, not once per answer)."""
    rows = prompts * group
    t = max((2.0 * m.body_params * prompt_tokens + 2.0 * m.head_params * prompts
             + 2.0 * m.layers * m.q_dim * prompt_tokens ** 2 / prompts) / c.matmul_flops,
            m.weight_bytes / c.copy_bytes)
    flops_per_row = 2.0 * (m.body_params + m.head_params)
    for step in range(1, answer):
        read = m.weight_bytes + m.kv_bytes_per_token * (prompt_tokens + rows * step)
        flops = flops_per_row * rows + 4.0 * m.layers * m.q_dim * (group * prompt_tokens + rows * step)
        t += max(read / c.copy_bytes, flops / c.matmul_flops)
    return t


def mfc_floor(mfc: str, m: ModelShape, c: Ceilings, stats: dict, group: int,
              critic: Optional[ModelShape] = None) -> Optional[float]:
    """The floor of ``mfc`` at the work one step's ``stats`` (a row of stats.jsonl) record: ``n_seqs``,
    ``n_tokens`` (prompt + answer tokens of every sequence), ``n_valid_tokens`` (answer tokens), ``avg_prompt_len``.
    None for an MFC without a device floor or a row without these figures."""
    kind = MFC_KIND.get(mfc)
    need = ("n_seqs", "n_tokens", "n_valid_tokens", "avg_prompt_len")
    if kind is None or not all(isinstance(stats.get(k), (int, float)) and stats[k] > 0 for k in need):
        return None
    shape = critic if mfc.startswith("critic") and critic is not None else m
    n, tokens, answers = stats["n_seqs"], stats["n_tokens"], stats["n_valid_tokens"]
    if kind == GENERATE:
        prompts = max(1, round(n / group))
        return generate_floor(shape, c, prompts, group, stats["avg_prompt_len"] * n / group, round(answers / n))
    fn = forward_floor if kind == FORWARD else train_floor
    return fn(shape, c, tokens, answers, n)


# ------------------------------------------------------------------------------------------------ measured ceilings


def measure_ceilings(device: str, matmul_n: int = 0, reps: int = 5) -> Ceilings:
    """The two ceilings on ``device`` ("cuda" or "cpu"), in its compute dtype (bf16 on CUDA, fp32 on the CPU)."""
    import torch

    if device == "cuda":
        return _cuda_ceilings(matmul_n or 8192, reps)
    from _timing import matmul_peak_gflops

    flops = matmul_peak_gflops(torch.float32, n=matmul_n or 2048, reps=reps)["best"] * 1e9
    x = torch.randn(64 << 20)  # 256 MiB of fp32: beyond the caches
    y = torch.empty_like(x)
    ts = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        y.copy_(x)
        ts.append(time.perf_counter() - t0)
    return Ceilings(flops, 2 * x.numel() * 4 / statistics.median(ts[1:]), "float32", "cpu")


def _cuda_ceilings(n: int, reps: int) -> Ceilings:
    import torch

    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    torch.cuda.synchronize()
    flops = 2 * n ** 3 * reps / (time.perf_counter() - t0)
    x = torch.randn(2 ** 30 // 4, device="cuda")  # 1 GiB of fp32
    y = torch.empty_like(x)
    y.copy_(x)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        y.copy_(x)
    torch.cuda.synchronize()
    bw = 2 * x.numel() * 4 * reps / (time.perf_counter() - t0)
    del a, b, x, y
    torch.cuda.empty_cache()
    return Ceilings(flops, bw, "bfloat16", "cuda")


def describe(c: Ceilings) -> Dict[str, float]:
    return {"matmul_tflops": round(c.matmul_flops / 1e12, 4), "copy_gb_per_s": round(c.copy_bytes / 1e9, 2),
            "dtype": c.dtype, "device": c.device}
