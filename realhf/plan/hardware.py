"""The rates of a device, for the cost model: from a vendor datasheet (a table for machines that are not here) or
measured on this machine by :mod:`realhf.plan.profile`.

A :class:`Hardware` gives **achievable** rates. For a tabled GPU they are the datasheet's peak times a derating
factor, stated separately per rate with its own source; a profiled machine's rates are measured, so its factors are 1.

Table sources:

* H100 SXM5: NVIDIA H100 Tensor Core GPU datasheet (dense BF16/FP16 989 TFLOP/s, TF32 495, FP32 67; HBM3 3.35 TB/s;
  80 GB; NVLink 900 GB/s, i.e. 450 GB/s each way).
* H800 SXM5: NVIDIA H800 Tensor Core GPU datasheet (compute and memory as H100 SXM5; NVLink 400 GB/s, 200 each way).
* H200 SXM: NVIDIA H200 Tensor Core GPU datasheet (compute as H100 SXM5; HBM3e 4.8 TB/s; 141 GB; NVLink 900 GB/s).
* Inter-node: one 400 Gb/s NDR InfiniBand / RoCE NIC per GPU (NVIDIA DGX H100/H200 datasheet: 8x ConnectX-7) =
  50 GB/s each way.
* Derating (achievable over peak): dense bf16 matmul 788 / 989 = 0.80 and device copy 4.2 / 4.8 TB/s = 0.875, both
  measured on an H200 on 2026-11-27 (a copy counts bytes read plus written); used for all three Hopper parts, which
  share the SM design. NVLink and network 0.80: an assumption from typical NCCL bus bandwidths, not measured here.
* Latencies (per message / collective step): 10 us over NVLink and 20 us over the network, typical of NCCL's small
  messages; a kernel launch 5 us. Assumptions, not datasheet figures.
* Fixed costs of the control plane (the same for every tabled GPU: they run on the host CPUs): an MFC's request and
  reply between the master and its workers 5 ms, a step's own bookkeeping (fetching and clearing the batch, the
  stats) 30 ms. From CPU hosts: on a 2-core AMD EPYC host a real run's MFC takes 1.5-2 ms beside its worker's
  computation and its step 3-5 ms beside its MFCs (one and two workers, :mod:`realhf.apps.control_probe`,
  2026-11-29), where a bare round trip over the request/reply stream with the whole batch's metadata in every request
  took 3.5-4.3 ms (2026-11-28); rounded up for a cluster's TCP between nodes and its many workers; the step's figure,
  measured on that host before the master's requests were trimmed, is kept as an upper bound; a training call's
  host-side work beside its passes 5 ms (the PPO actor's, :mod:`realhf.plan.interface_probe`, fitted 5-9 ms on that
  host; the same Python drives a GPU's kernels: its low end) and no backward cost per block beyond twice the
  forward's, and no generation setup beside the prefill and steps (on a GPU the kernels' launches are in the per-block
  costs; these two are measured where profiled).
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

TB = 1e12
GB = 1e9
# achievable over peak on Hopper, measured on an H200 on 2026-11-27: bf16 matmul 788 TFLOP/s, device copy 4.2 TB/s
HOPPER_MATMUL_DERATE = 788.0 / 989.4
HOPPER_MEMORY_DERATE = 4.2 / 4.8
LINK_DERATE = 0.80  # assumed: NCCL bus bandwidth over the link's peak
KERNEL_LAUNCH_S = 5e-6  # assumed: a CUDA kernel launch
# the kernels of one transformer block's pass (norms, projections, rotary, attention, activation, residuals)
KERNELS_PER_LAYER = 14
# passes over [tokens x hidden] of a block's elementwise work (two norms, rotary, residuals, activation's share),
# each read and written
ELEMENTWISE_PASSES = 12
# the control plane's fixed costs on a tabled GPU's host (see the module docstring)
CALL_OVERHEAD_S = 0.005
STEP_OVERHEAD_S = 0.03
GENERATE_OVERHEAD_S = 0.0
TRAIN_CALL_OVERHEAD_S = 0.005


@dataclasses.dataclass(frozen=True)
class Hardware:
    """Achievable rates of one device (a GPU, or on CPU one worker process with its threads).

    ``matmul_flops``: dense matmul FLOP/s per dtype at large shapes; ``matmul_rows``: for a profiled machine, the
    FLOP/s of its layers' products by number of rows (small rows run below the peak), as ((rows, FLOP/s), ...) in
    increasing rows; ``memory_bw``: bytes/s of a copy (read + written) — a kernel reading ``b`` bytes is taken at this
    rate; ``attention_flops``: the attention kernel's FLOP/s; ``layer_overhead_s`` and ``elementwise_s``: what a
    block's pass costs beside its products and attention (per block, and per token x hidden element), for forward
    passes and, ``decode_*``, for a decode step; ``pass_overhead_s`` / ``decode_step_overhead_s``: per pass or step
    (launching it, the host's bookkeeping, sampling's fixed cost); ``generate_overhead_s``: a generation call's own
    setup and output (caches, the packed prompts, the answers' lists) beside its prefill and steps;
    ``generate_layer_overhead_s`` / ``generate_head_overhead_s``: what a generation call pays once per block and
    once for the head beyond that, on a rank holding them whole (a CPU rank lays its weights out for the decode
    kernel at every call, or at every weight update on a server); ``server_generate_overhead_s``: a generation
    served by a generation server's own cost in place of ``generate_overhead_s`` (the requests, the server's
    scheduling; None: the same); ``server_update_s``: a generation server's weight update from disk beside reading
    the checkpoint (pausing, aborting and resuming its requests, loading the tensors), where measured;
    ``train_call_overhead_s``: a training call's host-side work beside its passes (advantages, the loss's weights, the
    statistics); ``train_layer_overhead_s``: what a training pass's backward costs per block beyond twice the
    forward's; ``call_overhead_s``: an MFC's fixed cost outside its computation (the master's request and the workers'
    reply); ``step_overhead_s``: a step's own (fetching and clearing the batch); ``optimizer_s_per_param``: AdamW's
    step per parameter;
    ``intra_*``/``inter_*``: links inside a node and between nodes (bytes/s each way, seconds per message);
    ``devices_per_node``; ``disk_bw``: bytes/s of writing, and reading back, a checkpoint; ``memory_bytes``: capacity
    of one device; ``allreduce_bw``: bytes/s a ring all-reduce's data moves at inside a node where it was measured
    (0: the link's); ``realloc_fixed_s``, ``realloc_bw``, ``realloc_both_ways``: a parameter reallocation as measured
    (its fixed cost, bytes/s of the busiest rank's larger direction, the share of the lesser direction's bytes that
    adds to the time; ``realloc_bw`` 0: the link's rate and a latency per message); ``broadcast_lat``: seconds of
    a small broadcast between two processes where measured (0: the link's latency); ``tp_decode_step_overhead_s``: what
    a tensor-parallel decode step pays once beside its blocks' and head's collectives, where measured;
    ``dp_train_call_overhead_s``: what a data-parallel training call takes beyond its passes, collectives and
    host-side work as counted (the ranks waiting for each other at every collective), where measured (0: not counted);
    ``pp_train_call_overhead_s``: the same for a pipelined training call (the stages waiting for each other's
    activations and gradients beyond the schedule as counted), where measured (0: not counted); ``pp_decode_lat``:
    seconds per message between the stages of a pipelined decode step (its activations, its sampled tokens back),
    where measured (None: the link's latency);
    ``reward_s_per_answer``: the rule-based reward's grading of one answer on the host where measured (0: not
    counted); ``p2p_msg_s``: seconds per
    small message of a batch of point-to-point messages where measured (0: the link's latency);
    ``rollout_episode_s``: host CPU seconds an asynchronous run's rollout worker and manager spend on one episode
    beside its generation and grading, where measured (0: not counted); ``host_cores``: on a CPU machine, the cores
    that every process of a run shares (its devices, servers and rollout processes alike), with ``device_threads``
    threads per device (None: the devices are accelerators, the host's CPUs are not theirs); ``sources``: where
    each figure came from."""

    name: str
    matmul_flops: Dict[str, float]
    memory_bw: float
    memory_bytes: float
    intra_bw: float
    intra_lat: float
    inter_bw: float
    inter_lat: float
    devices_per_node: int
    attention_flops: Dict[str, float]
    layer_overhead_s: float
    elementwise_s: float
    decode_layer_overhead_s: float
    decode_elementwise_s: float
    optimizer_s_per_param: float
    pass_overhead_s: float = 0.0
    decode_step_overhead_s: float = 0.0
    generate_overhead_s: float = GENERATE_OVERHEAD_S
    generate_layer_overhead_s: float = 0.0
    generate_head_overhead_s: float = 0.0
    server_generate_overhead_s: Optional[float] = None
    server_update_s: float = 0.0
    call_overhead_s: float = CALL_OVERHEAD_S
    train_call_overhead_s: float = TRAIN_CALL_OVERHEAD_S
    train_layer_overhead_s: float = 0.0
    step_overhead_s: float = STEP_OVERHEAD_S
    matmul_rows: Tuple[Tuple[int, float], ...] = ()
    disk_bw: float = 2 * GB
    allreduce_bw: float = 0.0
    realloc_fixed_s: float = 0.0
    realloc_bw: float = 0.0
    realloc_both_ways: float = 0.0
    broadcast_lat: float = 0.0
    tp_decode_step_overhead_s: float = 0.0
    dp_train_call_overhead_s: float = 0.0
    pp_train_call_overhead_s: float = 0.0
    pp_decode_lat: Optional[float] = None
    reward_s_per_answer: float = 0.0
    p2p_msg_s: float = 0.0
    rollout_episode_s: float = 0.0
    host_cores: Optional[int] = None
    device_threads: int = 1
    device: str = "cuda"
    sources: Dict[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        for k in ("memory_bw", "memory_bytes", "intra_bw", "inter_bw"):
            v = getattr(self, k)
            if not v > 0:
                raise ValueError(f"Hardware {self.name!r}: {k} must be positive, got {v!r}")
        if not self.matmul_flops or any(not v > 0 for v in self.matmul_flops.values()):
            raise ValueError(f"Hardware {self.name!r}: matmul_flops needs a positive rate per dtype, "
                             f"got {self.matmul_flops!r}")
        for k in ("generate_overhead_s", "call_overhead_s", "step_overhead_s", "train_call_overhead_s",
                  "train_layer_overhead_s", "generate_layer_overhead_s", "generate_head_overhead_s",
                  "tp_decode_step_overhead_s", "dp_train_call_overhead_s", "pp_train_call_overhead_s"):
            if not getattr(self, k) >= 0:
                raise ValueError(f"Hardware {self.name!r}: {k} must be >= 0 seconds, got {getattr(self, k)!r}")
        if self.pp_decode_lat is not None and not self.pp_decode_lat >= 0:
            raise ValueError(f"Hardware {self.name!r}: pp_decode_lat must be >= 0 seconds or None, "
                             f"got {self.pp_decode_lat!r}")
        if self.devices_per_node < 1:
            raise ValueError(f"Hardware {self.name!r}: devices_per_node must be >= 1, got {self.devices_per_node}")

    def matmul_rate(self, dtype: str) -> float:
        if dtype not in self.matmul_flops:
            raise ValueError(f"Hardware {self.name!r} has no matmul rate for dtype {dtype!r}; it has "
                             f"{sorted(self.matmul_flops)}")
        return self.matmul_flops[dtype]

    def link(self, intra: bool) -> Tuple[float, float]:
        """(bytes/s each way, seconds per message) of a link inside a node or between nodes."""
        return (self.intra_bw, self.intra_lat) if intra else (self.inter_bw, self.inter_lat)


def _hopper(name: str, hbm_tbs: float, mem_gb: float, nvlink_each_way_gbs: float, source: str,
            bf16_tflops: float = 989.4) -> Hardware:
    bw = hbm_tbs * TB * HOPPER_MEMORY_DERATE
    mm = bf16_tflops * 1e12 * HOPPER_MATMUL_DERATE
    measured = "measured on an H200, 2026-11-27"
    return Hardware(
        name=name,
        matmul_flops={"bfloat16": mm, "float16": mm, "float32": 494.7e12 * HOPPER_MATMUL_DERATE},  # fp32 as TF32
        memory_bw=bw,
        memory_bytes=mem_gb * GB,
        intra_bw=nvlink_each_way_gbs * GB * LINK_DERATE,
        intra_lat=10e-6,
        inter_bw=50 * GB * LINK_DERATE,
        inter_lat=20e-6,
        devices_per_node=8,
        # flash attention's forward reaches about the matmul rate's 0.6 on Hopper (assumed; the FlashAttention-2
        # paper reports 50-73% of peak on A100)
        attention_flops={"bfloat16": 0.6 * mm, "float16": 0.6 * mm, "float32": 0.6 * mm},
        layer_overhead_s=KERNELS_PER_LAYER * KERNEL_LAUNCH_S,
        elementwise_s=ELEMENTWISE_PASSES * 2 / bw,  # per element of 2 bytes, read and written: a copy's rate
        decode_layer_overhead_s=KERNELS_PER_LAYER * KERNEL_LAUNCH_S,
        decode_elementwise_s=ELEMENTWISE_PASSES * 2 / bw,
        optimizer_s_per_param=28.0 / bw,  # AdamW reads grad, master, two moments; writes master, moments, param
        device="cuda",
        sources={
            "matmul_flops": f"{source}: dense bf16 {bf16_tflops} TFLOP/s (TF32 494.7 for fp32) x derate "
                            f"{HOPPER_MATMUL_DERATE:.3f} ({measured}: 788 TFLOP/s)",
            "memory_bw": f"{source}: {hbm_tbs} TB/s x derate {HOPPER_MEMORY_DERATE:.3f} ({measured}: 4.2 TB/s copy)",
            "memory_bytes": f"{source}: {mem_gb} GB",
            "intra_bw": f"{source}: NVLink {2 * nvlink_each_way_gbs:.0f} GB/s total, {nvlink_each_way_gbs:.0f} each "
                        f"way x {LINK_DERATE} (assumed NCCL efficiency)",
            "inter_bw": "NVIDIA DGX H100/H200 datasheet: 8x ConnectX-7 400 Gb/s per node (50 GB/s per GPU) x "
                        f"{LINK_DERATE} (assumed)",
            "disk_bw": "assumed: 2 GB/s to and from the shared file system a checkpoint is published through",
            "latencies": "assumed: NCCL small-message latency 10 us (NVLink) / 20 us (network); kernel launch 5 us",
            "control plane": f"MFC {CALL_OVERHEAD_S * 1e3:.0f} ms, step {STEP_OVERHEAD_S * 1e3:.0f} ms, a training "
                             f"call's host-side work {TRAIN_CALL_OVERHEAD_S * 1e3:.0f} ms: from a CPU host (module "
                             "docstring)",
        },
    )


def table() -> Dict[str, Hardware]:
    """Tabled devices by name: ``h100`` (SXM5), ``h800`` (SXM5), ``h200`` (SXM)."""
    return {
        "h100": _hopper("H100 SXM5 80GB", 3.35, 80, 450, "NVIDIA H100 Tensor Core GPU datasheet"),
        "h800": _hopper("H800 SXM5 80GB", 3.35, 80, 200, "NVIDIA H800 Tensor Core GPU datasheet"),
        "h200": _hopper("H200 SXM 141GB", 4.8, 141, 450, "NVIDIA H200 Tensor Core GPU datasheet"),
    }


def get(name: str) -> Hardware:
    t = table()
    key = name.lower().replace(" ", "").replace("-", "")
    for k, hw in t.items():
        if key.startswith(k):
            return hw
    raise ValueError(f"unknown hardware {name!r}; tabled: {sorted(t)} (or profile this machine: "
                     "python -m realhf.apps.profile)")


def interpolate_rate(points: Tuple[Tuple[int, float], ...], rows: float, default: float) -> float:
    """The rate at ``rows`` from ((rows, rate), ...) measured in increasing rows: linear in log(rows) between two
    points, the nearest point's rate outside them; ``default`` when there are none."""
    import math

    if not points:
        return default
    if rows <= points[0][0]:
        return points[0][1]
    for (r0, v0), (r1, v1) in zip(points, points[1:]):
        if rows <= r1:
            f = (math.log(rows) - math.log(r0)) / (math.log(r1) - math.log(r0))
            return v0 + f * (v1 - v0)
    return points[-1][1]


def describe(hw: Hardware, dtype: Optional[str] = None) -> Dict[str, object]:
    """A JSON-able summary (TFLOP/s, TB/s, GB/s, us, GB), with the fixed costs a call or a step pays in ms
    (``fixed_ms``: the control plane's per MFC and per step, a training call's host-side work, and what
    tensor-parallel decode steps and data-parallel and pipelined training calls pay beyond their count; a pipelined
    decode step's message latency in us where measured)."""
    dt = dtype or next(iter(hw.matmul_flops))
    ms = {k: round(getattr(hw, k + "_overhead_s") * 1e3, 3)
          for k in ("call", "step", "train_call", "tp_decode_step", "dp_train_call", "pp_train_call")}
    out = dict(name=hw.name, dtype=dt, matmul_tflops=round(hw.matmul_rate(dt) / 1e12, 4),
               memory_tbs=round(hw.memory_bw / TB, 4), intra_gbs=round(hw.intra_bw / GB, 3),
               intra_lat_us=round(hw.intra_lat * 1e6, 1), inter_gbs=round(hw.inter_bw / GB, 3),
               inter_lat_us=round(hw.inter_lat * 1e6, 1), memory_gb=round(hw.memory_bytes / GB, 1), fixed_ms=ms)
    if hw.pp_decode_lat is not None:
        out["pp_decode_lat_us"] = round(hw.pp_decode_lat * 1e6, 1)
    return out
