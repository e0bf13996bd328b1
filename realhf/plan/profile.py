"""Profile this machine for the cost model (the command: ``python -m realhf.apps.profile --model smollm2-135m``).

A few seconds of the real kernels at a model's shapes (:mod:`realhf.plan.probes`): the FLOP/s of the model's block
products by number of rows, a copy's bandwidth, the attention kernel's rate, AdamW's step per parameter, writing and
reading a checkpoint, all-reduce, send/recv and the real parameter reallocation between two local processes (gloo;
NCCL between two GPUs); then a whole forward pass and a whole decode step of the model's blocks (1 and 3 of them, or
the model's own depth up to ``FIT_WHOLE_DEPTH``; a 1,024-token vocabulary) timed, and what the products and attention
do not explain fitted as a cost per block, per token x hidden element of a block, and per pass
(:func:`fit_overheads`), a generation call's and a training call's own work on the real PPO interface
(:mod:`realhf.plan.interface_probe`), the latency a collective pays inside a real tensor-parallel decode step over
the two processes (:func:`_decode_latency`), what real data-parallel and pipelined training calls over the two take
beyond their count (:func:`_dp_train`, :func:`_pp_train`) and the latency of a message between the stages of a real
pipelined generation (:func:`_pp_decode_latency`); and, where the caller passes the control plane's probe
(:mod:`realhf.apps.control_probe`, a layer above this one: a few steps of a real run on a tiny model), the fixed cost
of each model function call beside its computation and of each step beside its calls. On CPU, where a
"device" is a worker process, the rates are those of this process's threads (``--threads``).

The profile is cached as JSON under ``$REALHF_CACHE_DIR/plan_profiles/``, keyed by the machine (CPU model or GPU
name), the device, the threads, the torch version, the dtype and the model's shape: a second call reads the file.
:func:`hardware` turns a profile into the :class:`realhf.plan.hardware.Hardware` the cost model takes.
"""
from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import platform
from typing import Callable, Dict, Optional, Sequence, Tuple

from realhf.api.core.model_api import ReaLModelConfig
from realhf.base import logging
from realhf.base.cache_dir import realhf_cache_dir
from realhf.plan.hardware import GB, Hardware
from realhf.plan.shapes import model_config

logger = logging.getLogger("realhf.plan.profile")

PROFILE_VERSION = 12  # 2: collectives' latency as a step pays it, the control plane's and a generation's fixed costs;
# 3: that latency as the median of several rounds' means (one round's mean moved 3x between profiles of one host)
# 4: links' bandwidths past the caches, a two-rank all-reduce's own rate, the real reallocation's cost, a generation
# call's own cost on the real interface, every timing a median (was the least); 5: the collectives' latency from a
# real tensor-parallel decode step, shallow models fitted at their own depth, the rule-based reward's grading,
# a batched point-to-point message's cost; 6: a generation call's cost per block and for the head; 7: the host's
# cores (a CPU machine's processes share them); 8: the tensor-parallel decode step at two depths (a block's latency
# apart from the step's own); 9: a real data-parallel training call; 10: the control plane's costs from a real run
# (were an MFC's bare round trip, and twice that for a step); 11: a call's probes timed after an idle gap, as in a run;
# 12: a real pipelined generation and training call (the stages' message latency in a decode step, a pipelined
# training call's excess)
CPU_ROWS = (1, 4, 16, 64, 256, 1024)
CUDA_ROWS = (1, 16, 128, 1024, 8192)
FIT_VOCAB = 1024
FIT_TOKENS = ((64, 1), (512, 2))  # (tokens, sequences) of the timed forward passes
FIT_ROWS = (1, 16)  # rows of the timed decode steps
FIT_PROMPT, FIT_STEPS = 32, (2, 18)  # prompt length; new tokens of the two timed generations (their difference)
FIT_WHOLE_DEPTH = 8  # models of at most this many blocks are fitted at 1 block and at their own depth


def machine_name(device: str) -> str:
    """The CPU model (``/proc/cpuinfo``) or the GPU's name."""
    if device == "cuda":
        import torch

        return torch.cuda.get_device_name(0)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _shape_key(cfg: ReaLModelConfig) -> Dict:
    return dict(hidden=cfg.hidden_dim, intermediate=cfg.intermediate_dim, heads=cfg.n_q_heads, kv_heads=cfg.n_kv_heads,
                head_dim=cfg.head_dim, vocab=cfg.vocab_size, mlp=cfg.mlp_type, norm=cfg.layer_norm_type,
                qk_norm=cfg.qk_layernorm, attn_bias=cfg.use_attention_bias)


def profile_key(cfg: ReaLModelConfig, dtype: str, device: str, threads: int) -> Dict:
    import torch

    return dict(version=PROFILE_VERSION, machine=machine_name(device), device=device, threads=threads,
                torch=torch.__version__, dtype=dtype, shape=_shape_key(cfg))


def cache_path(key: Dict, cache_dir: Optional[str] = None) -> str:
    """The profile's file: ``<cache_dir>/<hash of the key>.json``, by default under ``$REALHF_CACHE_DIR``."""
    h = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return os.path.join(cache_dir or os.path.join(realhf_cache_dir(), "plan_profiles"), f"{h}.json")


def _write(path: str, data: Dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def _read(path: str, key: Dict) -> Optional[Dict]:
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        logger.warning(f"profile cache {path} is unreadable ({e}); measuring again")
        return None
    return data if data.get("key") == key else None


def _memory_bytes(device: str) -> float:
    if device == "cuda":
        import torch

        return float(torch.cuda.get_device_properties(0).total_memory)
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def hardware(p: Dict) -> Hardware:
    """The cost model's view of a profiled machine: the measured rates, no derating."""
    dt = p["key"]["dtype"]
    link = p.get("comm") or {}
    bw, lat = link.get("bw"), link.get("lat")
    src = f"profiled {p['measured_at']} ({p['key']['machine']}, {p['key']['device']}, {p['key']['threads']} threads)"
    if bw is None:  # one GPU: no link was measured; a copy's rate stands in (stated in sources)
        bw, lat = p["copy_bw"] / 2, 10e-6
    o = p["overheads"]
    realloc = link.get("realloc") or {}
    ctl = p.get("control")
    return Hardware(
        name=f"{p['key']['machine']} ({p['key']['device']}, {p['key']['threads']} threads)",
        matmul_flops={dt: max(r for _, r in p["matmul_rows"])}, memory_bw=p["copy_bw"],
        memory_bytes=p["memory_bytes"], intra_bw=bw, intra_lat=lat, inter_bw=bw, inter_lat=lat,
        devices_per_node=1 << 20 if p["key"]["device"] == "cpu" else 8,
        attention_flops={dt: p["attention_flops"]}, layer_overhead_s=o["layer_s"], elementwise_s=o["elementwise_s"],
        decode_layer_overhead_s=o["decode_layer_s"], decode_elementwise_s=o["decode_elementwise_s"],
        pass_overhead_s=o["pass_s"], decode_step_overhead_s=o["decode_step_s"],
        generate_overhead_s=o.get("generate_s", 0.0), generate_layer_overhead_s=o.get("generate_layer_s", 0.0),
        generate_head_overhead_s=o.get("generate_head_s", 0.0), train_call_overhead_s=o.get("train_call_s", 0.0),
        server_generate_overhead_s=o.get("server_generate_s"), server_update_s=o.get("server_update_s", 0.0),
        train_layer_overhead_s=o.get("train_layer_s", 0.0),
        **({} if ctl is None else dict(call_overhead_s=ctl["call_s"], step_overhead_s=ctl["step_s"])),
        optimizer_s_per_param=p["optimizer_s_per_param"], disk_bw=p["disk_bw"],
        allreduce_bw=link.get("allreduce_bw", 0.0), realloc_fixed_s=realloc.get("fixed_s", 0.0),
        realloc_bw=realloc.get("bw", 0.0), realloc_both_ways=realloc.get("both_ways", 0.0),
        broadcast_lat=(link.get("in_step") or {}).get("broadcast", 0.0),
        tp_decode_step_overhead_s=link.get("tp_decode_step_s", 0.0),
        dp_train_call_overhead_s=link.get("dp_train_call_s", 0.0),
        pp_train_call_overhead_s=link.get("pp_train_call_s", 0.0), pp_decode_lat=link.get("pp_decode_lat"),
        reward_s_per_answer=o.get("reward_s", 0.0), rollout_episode_s=o.get("rollout_episode_s", 0.0),
        host_cores=p.get("host_cores") if p["key"]["device"] == "cpu" else None,
        device_threads=max(1, int(p["key"]["threads"])),
        p2p_msg_s=link.get("p2p_message", 0.0),
        matmul_rows=tuple((int(r), float(v)) for r, v in p["matmul_rows"]), device=p["key"]["device"],
        sources={"all": src, "links": "measured between two local processes" if link else
                 "not measured (one device): half a copy's rate and 10 us assumed",
                 "control plane": "an MFC's and a step's own costs measured on a real run's steps" if ctl is not None
                 else "not measured: the tabled GPUs' figures"},
    )


def _fit_layers(cfg: ReaLModelConfig, dtype: str) -> Tuple[int, int]:
    """The depths of ``cfg``'s proxies the fits time: 1 block and the model's own depth for a shallow model, else 1
    and 3 blocks (2 where 3 would not fit in 1.5 GB of ``dtype`` weights)."""
    from realhf.plan.comm_cost import _units
    from realhf.plan.memory import dtype_bytes

    per_layer = _units(cfg, 1, 0)[0][3]
    bytes_per = dtype_bytes(dtype)
    if 2 <= cfg.n_layers <= FIT_WHOLE_DEPTH and cfg.n_layers * per_layer * bytes_per <= 1.5 * GB:
        return (1, cfg.n_layers)  # a shallow model is timed at its own depth: nothing to extrapolate
    return (1, 3) if 3 * per_layer * bytes_per <= 1.5 * GB else (1, 2)


def _measured_hardware(data: Dict, dtype: str, device: str) -> Hardware:
    """:func:`hardware` of a profile's figures while it is being measured (no cache key yet)."""
    return hardware({**data, "key": dict(dtype=dtype, machine="", device=device, threads=0)})


def _proxy(cfg: ReaLModelConfig, layers: int) -> ReaLModelConfig:
    return dataclasses.replace(cfg, n_layers=layers, vocab_size=FIT_VOCAB, tied_embedding=False, is_critic=False)


def _lstsq(rows: Sequence[Sequence[float]], ys: Sequence[float]) -> Tuple[float, ...]:
    """Non-negative least squares of a few unknowns (clip negatives to 0 and refit the rest)."""
    import numpy as np

    A, y = np.asarray(rows, dtype=float), np.asarray(ys, dtype=float)
    free = list(range(A.shape[1]))
    x = np.zeros(A.shape[1])
    while free:
        sol = np.linalg.lstsq(A[:, free], y, rcond=None)[0]
        if (sol >= 0).all():
            x[free] = sol
            break
        free = [f for f, s in zip(free, sol) if s >= 0]
    return tuple(float(v) for v in x)


def _model(cfg: ReaLModelConfig, dtype, device: str):
    from realhf.base.topology import single_process_grid
    from realhf.impl.model.nn.real_model import ReaLModel

    m = ReaLModel(cfg, grid=single_process_grid(), dtype=dtype, device=device)
    m.init_random(seed=1)
    return m.eval()


def _time_forward(model, tokens: int, seqs: int, device: str) -> float:
    import torch

    from realhf.impl.model.nn.real_model import make_packed_input
    from realhf.plan.probes import timed

    inp = make_packed_input([tokens // seqs] * seqs, device=device)
    inp.head_rows = inp.cu_seqlens[1:].long() - 1
    x = torch.randint(0, FIT_VOCAB, (tokens,), device=device)
    with torch.no_grad():
        return timed(lambda: model(x, inp), device, reps=5, budget_s=1.0)


def _time_decode_step(model, rows: int, device: str) -> float:
    """Seconds of one decode step of ``rows`` rows at about ``FIT_PROMPT + 10`` cached positions: the difference of
    two sampled generations of different lengths, divided by the steps between them."""
    import statistics

    import torch

    from realhf.plan.probes import sampled_generation

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, FIT_VOCAB, (FIT_PROMPT,), generator=g).tolist() for _ in range(rows)]
    sampled_generation(model, prompts, FIT_STEPS[0], device)  # warm-up
    a, b = FIT_STEPS
    short, long = (statistics.median(sampled_generation(model, prompts, k, device) for _ in range(3)) for k in (a, b))
    return max(long - short, 1e-9) / (b - a)


def fit_overheads(cfg: ReaLModelConfig, base: Hardware, dtype: str, device: str) -> Dict:
    """Time whole forward passes and decode steps of 1 and 3 (or 2) blocks of ``cfg``'s shape and fit what the
    products and attention (the cost model on ``base``, overheads zero) do not explain: per block, per token x
    hidden element of a block, per pass; likewise for a decode step."""
    import torch

    from realhf.plan.cost import CostModel

    dt = getattr(torch, dtype)
    H = cfg.hidden_dim
    fwd_rows, fwd_y, dec_rows, dec_y, points = [], [], [], [], []
    for L in _fit_layers(cfg, dtype):
        pc = _proxy(cfg, L)
        cm = CostModel(pc, base, dtype)
        model = _model(pc, dt, device)
        for T, n in FIT_TOKENS:
            meas = _time_forward(model, T, n, device)
            pred = cm.forward(T, 1, T / n, n)
            fwd_rows.append((L, L * T * H, 1.0))
            fwd_y.append(meas - pred)
            points.append(dict(kind="forward", layers=L, tokens=T, measured_s=meas, products_s=pred))
        for R in FIT_ROWS:
            meas = _time_decode_step(model, R, device)
            pred = cm.decode_step(R, FIT_PROMPT + (FIT_STEPS[0] + FIT_STEPS[1]) / 2)
            dec_rows.append((L, L * R * H, 1.0))
            dec_y.append(meas - pred)
            points.append(dict(kind="decode", layers=L, rows=R, measured_s=meas, products_s=pred))
        del model
    a, c, f = _lstsq(fwd_rows, fwd_y)
    ad, cd, fd = _lstsq(dec_rows, dec_y)
    return dict(layer_s=a, elementwise_s=c, pass_s=f, decode_layer_s=ad, decode_elementwise_s=cd, decode_step_s=fd,
                points=points)


def fit_train_overheads(cfg: ReaLModelConfig, hw: Hardware, dtype: str, device: str) -> Dict:
    """Time the PPO actor's real training call on 1 and 3 (or 2) blocks of ``cfg``'s shape
    (:mod:`realhf.plan.interface_probe`) and fit what the cost model's passes on ``hw`` leave: per call (host-side
    work) and per block (a backward's cost beyond twice the forward's)."""
    from realhf.plan.interface_probe import train_call_overhead

    rows, ys, points = [], [], []
    for L in _fit_layers(cfg, dtype):
        left, info = train_call_overhead(_proxy(cfg, L), hw, dtype, device)
        rows.append((1.0, float(L)))
        ys.append(left)
        points.append(dict(kind="train_call", layers=L, **info))
    a, b = _lstsq(rows, ys)
    return dict(train_call_s=a, train_layer_s=b, train_points=points)


def fit_generate_call(cfg: ReaLModelConfig, hw: Hardware, dtype: str, device: str) -> Dict:
    """A generation call's own cost beside its prefill and decode steps: on CPU the decode kernel's layout of every
    weight the call multiplies by, made afresh at each call (:func:`realhf.plan.probes.pack_seconds`: per block and
    for the head of ``cfg``'s vocabulary; ~2 ms a SmolLM2-135M block and 60 ms its head here), and what the PPO
    actor's real ``generate`` (:func:`realhf.plan.interface_probe.generate_call_overhead`: the interface's sampling
    options, answers per prompt and outputs) on 1 and 3 (or 2) blocks of ``cfg``'s shape leaves beyond the fitted
    passes and that layout: the mean, per call."""
    import torch

    from realhf.plan.cost import CostModel
    from realhf.plan.interface_probe import generate_call_overhead
    from realhf.plan.probes import pack_seconds

    dt = getattr(torch, dtype)
    block = pack_seconds(CostModel(cfg, _zero_hw(), dtype).linears(1), dt, device)
    head = pack_seconds(((cfg.hidden_dim, cfg.vocab_size),), dt, device)
    proxy_head = pack_seconds(((cfg.hidden_dim, FIT_VOCAB),), dt, device)
    left, points = [], []
    for L in _fit_layers(cfg, dtype):
        extra, info = generate_call_overhead(_proxy(cfg, L), hw, dtype, device)
        left.append(max(0.0, extra - L * block - proxy_head))
        points.append(dict(kind="generate_call", layers=L, **info))
    return dict(generate_s=sum(left) / len(left), generate_layer_s=block, generate_head_s=head,
                proxy_head_layout_s=proxy_head, generate_points=points)


def _server_probe(data: Dict, cfg: ReaLModelConfig, dtype: str, device: str, probe: Callable) -> None:
    """A generation server's own cost per served generation (``probe``:
    :func:`realhf.gen_server.probe.served_generate_overhead`, on the deepest fitted proxy of ``cfg``'s shape), kept
    as ``overheads["server_generate_s"]``."""
    o = data["overheads"]
    L = max(_fit_layers(cfg, dtype))
    hw = _measured_hardware(data, dtype, device)
    layout = L * o.get("generate_layer_s", 0.0) + o.get("proxy_head_layout_s", 0.0)
    left, info = probe(_proxy(cfg, L), hw, dtype, device, layout_s=layout)
    o["server_generate_s"] = left
    o["server_generate_point"] = dict(kind="server_generate", layers=L, **info)


def _rollout_probe(data: Dict, probe: Callable) -> None:
    """The rollout side's host CPU per episode of the probe's answers (``probe``:
    :func:`realhf.system.rollout.probe.rollout_episode_overhead`), kept as ``overheads["rollout_episode_s"]``, and
    a generation server's weight update beside reading the checkpoint as ``overheads["server_update_s"]``."""
    from realhf.plan.interface_probe import PROBE_ANSWER_LEN, PROBE_GROUP

    logger.info("profile: measuring the rollout side's cost per episode (a server process, a rollout manager)")
    per, info = probe(PROBE_GROUP, PROBE_ANSWER_LEN)
    data["overheads"]["rollout_episode_s"] = per
    # a server's weight update through the manager beside reading the checkpoint (pause, abort, load, resume)
    data["overheads"]["server_update_s"] = max(0.0, info["update_s"] - info["weights_bytes"] / data["disk_bw"])
    data["overheads"]["rollout_episode_point"] = dict(kind="rollout_episode", **info)


def measure(cfg: ReaLModelConfig, dtype: str, device: str, comm: bool = True,
            control_probe: Optional[Callable[[], Dict]] = None) -> Dict:
    """Every figure of a profile (seconds: a few on CPU for a small model; longer for a 7B block); ``control_probe``:
    the control plane's (``{"call_s", "step_s", ...}``: :func:`realhf.apps.control_probe.control_plane_costs`), which
    launches a run from a layer above this one."""
    import torch

    from realhf.plan import probes
    from realhf.plan.cost import CostModel
    from realhf.plan.interface_probe import reward_per_answer

    dt = getattr(torch, dtype)
    lin = CostModel(cfg, _zero_hw(), dtype).linears(1)
    rows = CUDA_ROWS if device == "cuda" else CPU_ROWS
    out = dict(matmul_rows=probes.matmul_rows(lin, rows, dt, device), copy_bw=probes.copy_bandwidth(device),
               attention_flops=probes.attention_rate(cfg.n_q_heads, cfg.n_kv_heads, cfg.head_dim, dt, device),
               optimizer_s_per_param=probes.optimizer_seconds_per_param(dt, device),
               disk_bw=probes.disk_bandwidth(realhf_cache_dir()), memory_bytes=_memory_bytes(device))
    out["comm"] = _measure_comm(cfg, dtype, device) if comm else None
    if control_probe is not None:
        out["control"] = control_probe()
    out["measured_at"] = datetime.datetime.now().isoformat(timespec="seconds")
    out["host_cores"] = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    zero = dict(layer_s=0.0, elementwise_s=0.0, decode_layer_s=0.0, decode_elementwise_s=0.0, pass_s=0.0,
                decode_step_s=0.0)
    base = _measured_hardware({**out, "overheads": zero}, dtype, device)
    out["overheads"] = fit_overheads(cfg, base, dtype, device)
    fitted = _measured_hardware(out, dtype, device)
    out["overheads"].update(fit_train_overheads(cfg, fitted, dtype, device))
    out["overheads"].update(fit_generate_call(cfg, fitted, dtype, device))
    out["overheads"]["reward_s"] = reward_per_answer()[0]
    _fit_link(out, cfg, dtype, device)
    return out


TP_PROBE_ROWS = 16  # the tensor-parallel decode probe's rows


def _measure_comm(cfg: ReaLModelConfig, dtype: str, device: str) -> Optional[Dict]:
    """The link probe between two processes, with real calls of ``cfg``'s deepest fitted proxy over both: a
    data-parallel training call (each rank half the probe's prompts) and, where its blocks split in two stages, a
    pipelined generation and training call (the probe's batch); and a real tensor-parallel decode step at the fits' two
    depths when its heads split in two."""
    from realhf.plan import probes
    from realhf.plan.interface_probe import PROBE_PROMPTS, dp_train_call, pp_generate_call, pp_train_call

    proxies = [_proxy(cfg, L) for L in _fit_layers(cfg, dtype)]
    deepest = dict(cfg=dataclasses.asdict(proxies[-1]), dtype=dtype)
    calls = {"dp_train": (dp_train_call, dict(deepest, prompts=PROBE_PROMPTS // 2))}
    if proxies[-1].fits_layout(1, 2):
        calls["pp_generate"] = (pp_generate_call, deepest)
        calls["pp_train"] = (pp_train_call, dict(deepest, prompts=PROBE_PROMPTS))
    if not proxies[0].fits_layout(2, 1):
        return probes.comm(device, calls=calls)
    tp_model = dict(cfgs=[dataclasses.asdict(p) for p in proxies], dtype=dtype, rows=TP_PROBE_ROWS,
                    prompt=FIT_PROMPT, steps=FIT_STEPS)
    return probes.comm(device, tp_model=tp_model, calls=calls)


def _decode_latency(data: Dict, cfg: ReaLModelConfig, dtype: str, device: str) -> None:
    """The link's latency per collective step as a tensor-parallel decode step pays it, from the real two-process
    decode steps at two depths (``comm["tp_decode"]``): what a block adds beyond its fitted computation, over the
    latencies the cost model counts in a block, is ``comm["lat"]`` (the small all-reduce between computation's figure
    stays as ``lat_in_step``); what the shallower step takes beyond the cost model's at that latency (the head's and
    the embedding's collectives, the ranks' per-step handshakes) is ``comm["tp_decode_step_s"]``, paid once a step.
    Where a block adds no more than its computation (noise), the latency stays as measured between computation."""
    from realhf.plan.cost import CostModel

    link = data.get("comm") or {}
    points = sorted(link.get("tp_decode") or [], key=lambda p: p["layers"])
    if len(points) < 2 or points[0]["layers"] == points[-1]["layers"]:
        return
    (p1, p2), hw = (points[0], points[-1]), _measured_hardware(data, dtype, device)

    def step(layers: int, lat: float) -> float:
        h = dataclasses.replace(hw, intra_lat=lat, inter_lat=lat, broadcast_lat=0.0, tp_decode_step_overhead_s=0.0)
        return CostModel(_proxy(cfg, layers), h, dtype).decode_step(p1["rows"], p1["cached"], tp=2)

    span = p2["layers"] - p1["layers"]
    block = (p2["step_s"] - p1["step_s"]) / span
    blk0, blk1 = ((step(p2["layers"], x) - step(p1["layers"], x)) / span for x in (0.0, 1.0))
    lat = (block - blk0) / (blk1 - blk0) if blk1 > blk0 else 0.0
    link["lat_in_step"] = link.get("lat_in_step", link["lat"])
    if lat <= 0:
        lat = link["lat_in_step"]
    link["lat"] = lat
    link["tp_decode_step_s"] = max(0.0, p1["step_s"] - step(p1["layers"], lat))


def _fit_link(data: Dict, cfg: ReaLModelConfig, dtype: str, device: str) -> None:
    """What the link probe's real calls (``data["comm"]``) give beyond the fitted computation, once the profile's
    overheads are fitted: the collectives' latency in a tensor-parallel decode step, then a data-parallel and a
    pipelined training call's excess (at that latency), and the stages' message latency in a pipelined generation."""
    _decode_latency(data, cfg, dtype, device)
    _dp_train(data, cfg, dtype, device)
    _pp_train(data, cfg, dtype, device)
    _pp_decode_latency(data, cfg, dtype, device)


def _train_excess(data: Dict, cfg: ReaLModelConfig, dtype: str, device: str, probe: str, mesh, field: str) -> None:
    """What the link probe's real training call ``comm[probe]`` (laid out as ``mesh``, its ``prompts`` of the probe's
    prompts on each data-parallel rank) took beyond the simulator's count for the same work with ``field`` at 0: kept
    as ``comm[probe + "_call_s"]`` (at least 0), which the hardware's ``field`` pays once per such call."""
    from realhf.plan.fit import Workload
    from realhf.plan.interface_probe import PROBE_ANSWER_LEN, PROBE_GROUP, PROBE_PROMPT_LEN
    from realhf.plan.simulate import PlanCall, PlanModel, compute_time

    link = data.get("comm") or {}
    point = link.get(probe)
    if point is None:
        return
    hw = dataclasses.replace(_measured_hardware(data, dtype, device), **{field: 0.0})
    work = Workload("train", seqs=mesh.dp * point["prompts"] * PROBE_GROUP, seq_len=PROBE_PROMPT_LEN + PROBE_ANSWER_LEN)
    model = PlanModel("actor", _proxy(cfg, point["layers"]), mesh, dtype, trains=True)
    point["simulated_s"] = compute_time(hw, model, PlanCall("train", "actor", work=work))
    link[probe + "_call_s"] = max(0.0, point["measured_s"] - point["simulated_s"])


def _dp_train(data: Dict, cfg: ReaLModelConfig, dtype: str, device: str) -> None:
    """What a data-parallel training call takes beyond what the simulator counts for it (its passes, the gradients'
    all-reduce, the small ones at the fitted latency, the call's host-side work), from the real two-rank call
    (``comm["dp_train"]``): the ranks wait for each other at every collective, and each pays gloo's own work. Kept as
    ``comm["dp_train_call_s"]``, paid once per training call under data parallelism."""
    from realhf.plan.comm_cost import Mesh

    _train_excess(data, cfg, dtype, device, "dp_train", Mesh(dp=2), "dp_train_call_overhead_s")


def _pp_train(data: Dict, cfg: ReaLModelConfig, dtype: str, device: str) -> None:
    """What a pipelined training call (two stages) takes beyond what the simulator counts for it (the 1F1B schedule
    of its passes, the stages' sends, the call's host-side work), from the real call (``comm["pp_train"]``): kept as
    ``comm["pp_train_call_s"]``, paid once per training call under pipeline parallelism."""
    from realhf.plan.comm_cost import Mesh

    _train_excess(data, cfg, dtype, device, "pp_train", Mesh(pp=2), "pp_train_call_overhead_s")


def _pp_decode_latency(data: Dict, cfg: ReaLModelConfig, dtype: str, device: str) -> None:
    """The latency per message between the stages of a pipelined decode step (its activations forward, its sampled
    tokens back), from the real two-stage generation (``comm["pp_generate"]``): what the call takes beyond the cost
    model's generation without those latencies, over the messages it counts (at least 0). Kept as
    ``comm["pp_decode_lat"]``; a decode step's messages between stages then cost that, not the collectives' latency
    of a tensor-parallel step (``comm["lat"]``), which includes the ranks' waits for each other inside a step."""
    from realhf.plan.cost import CostModel
    from realhf.plan.interface_probe import PROBE_ANSWER_LEN, PROBE_GROUP, PROBE_PROMPT_LEN, PROBE_PROMPTS

    link = data.get("comm") or {}
    point = link.get("pp_generate")
    if point is None:
        return
    hw = _measured_hardware(data, dtype, device)
    proxy = _proxy(cfg, point["layers"])

    def gen(lat: float) -> float:
        return CostModel(proxy, dataclasses.replace(hw, pp_decode_lat=lat), dtype).generate(
            PROBE_PROMPTS, PROBE_PROMPT_LEN, PROBE_GROUP, PROBE_ANSWER_LEN, 1, 2)

    g0, g1 = gen(0.0), gen(1e-3)
    point["simulated_s_at_zero"] = g0
    link["pp_decode_lat"] = max(0.0, (point["measured_s"] - g0) / ((g1 - g0) / 1e-3)) if g1 > g0 else 0.0


def _zero_hw() -> Hardware:
    """Placeholder rates for reading a block's product shapes (no timing)."""
    one = dict(float32=1.0, bfloat16=1.0, float16=1.0)
    return Hardware("shapes", one, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1, one, 0.0, 0.0, 0.0, 0.0, 0.0)


def profile(model="smollm2-135m", dtype: str = "float32", device: Optional[str] = None, comm: bool = True,
            refresh: bool = False, cache_dir: Optional[str] = None,
            control_probe: Optional[Callable[[], Dict]] = None, server_probe: Optional[Callable] = None,
            rollout_probe: Optional[Callable] = None) -> Dict:
    """This machine's profile for ``model`` (a shape name, a model folder, a config.json dict or a
    ``ReaLModelConfig``): read from the cache when there, else measured and cached. ``comm=False`` skips the two-
    process link probe (a cached profile without it is completed when asked with ``comm=True``); ``cache_dir``: where
    profiles are kept (default ``$REALHF_CACHE_DIR/plan_profiles``); ``control_probe``: the control plane's
    (:func:`realhf.apps.control_probe.control_plane_costs`, passed in by the layers above: a run of a few seconds), run
    when given and not cached (without it the control plane's fixed costs are the tabled ones); ``server_probe``: a
    generation server's (:func:`realhf.gen_server.probe.served_generate_overhead`: a server process on this machine, a
    few seconds), run likewise; ``rollout_probe``: the rollout side's cost per episode
    (:func:`realhf.system.rollout.probe.rollout_episode_overhead`, about 10 s), likewise."""
    import torch

    cfg = model_config(model)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    key = profile_key(cfg, dtype, device, torch.get_num_threads())
    path = cache_path(key, cache_dir)
    data = None if refresh else _read(path, key)
    need_comm = comm and (data is None or data.get("comm") is None)
    need_control = control_probe is not None and (data is None or data.get("control") is None)
    need_server = server_probe is not None and (data is None or "server_generate_s" not in data["overheads"])
    need_rollout = rollout_probe is not None and (data is None or "rollout_episode_s" not in data["overheads"])
    if data is not None and not (need_comm or need_control or need_server or need_rollout):
        return data
    if data is None:
        logger.info(f"profiling this machine ({key['machine']}, {device}, {key['threads']} threads, {dtype}) "
                    f"at {json.dumps(key['shape'])}: a few seconds")
        data = dict(measure(cfg, dtype, device, comm, control_probe), key=key)
    else:  # cached without the link probe or the control plane's: add them
        if need_comm:
            logger.info("profile: measuring the links between two local processes")
            data["comm"] = _measure_comm(cfg, dtype, device)
            _fit_link(data, cfg, dtype, device)
        if need_control:
            logger.info("profile: measuring the control plane's costs (a few steps of a tiny run)")
            data["control"] = control_probe()
    if need_server:  # a fresh profile, or a cached one without them: the server's and the rollout side's probes
        logger.info("profile: measuring a generation server's own cost (a server process)")
        _server_probe(data, cfg, dtype, device, server_probe)
    if need_rollout:
        _rollout_probe(data, rollout_probe)
    data["path"] = path
    _write(path, data)
    return json.loads(json.dumps(data))  # as a later call reads it back
