"""The measurements behind a profile of this machine (:mod:`realhf.plan.profile`): each runs the real kernels for a
fraction of a second and returns plain numbers. The code path is chosen at run time: CPU (realhf's CPU GEMM kernel,
its attention, gloo between two local processes) or CUDA (cuBLAS, SDPA / flash attention, NCCL between two GPUs).
Only the CPU path has been run on the machine this was written on; the CUDA path follows the same steps with
``torch.cuda.synchronize`` around each timing.
"""
from __future__ import annotations

import math
import os
import tempfile
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from realhf.base import logging

logger = logging.getLogger("realhf.plan.probes")


def _sync(device: str):
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], device: str, reps: int = 5, budget_s: float = 0.5, gap_s: float = 0.0) -> float:
    """Median seconds of ``fn`` after two warm-up calls (the first calls pay one-off costs), over at most ``reps``
    calls and about ``budget_s``, each timed call after ``gap_s`` idle. The median, not the least: a run pays the
    typical call, and on a 2-core host the least figure of the passes put SmolLM2-135M's training and generation
    20-40% below what the same passes took inside a run (the median: within 10% for training)."""
    for _ in range(2):
        fn()
    _sync(device)
    ts: List[float] = []
    start = time.perf_counter()
    while len(ts) < reps and (len(ts) < 2 or time.perf_counter() - start < budget_s):
        if gap_s > 0:
            time.sleep(gap_s)
        t = time.perf_counter()
        fn()
        _sync(device)
        ts.append(time.perf_counter() - t)
    import statistics

    return statistics.median(ts)


def _linear_fn(device: str):
    if device == "cpu":
        from realhf.impl.model.nn import cpu_gemm

        return cpu_gemm.linear  # the kernel every linear layer of ReaLModel runs on this CPU
    return torch.nn.functional.linear


def matmul_rows(shapes: Sequence[Tuple[int, int]], rows: Sequence[int], dtype: torch.dtype,
                device: str) -> List[Tuple[int, float]]:
    """FLOP/s of a sweep over the products ``[r, k] x [k, n]`` of ``shapes`` (a block's layers), for each ``r`` of
    ``rows``: small-row products are bound by reading the weights, large ones by the arithmetic."""
    lin = _linear_fn(device)
    ws = [torch.randn(n, k, dtype=dtype, device=device) * 0.02 for k, n in shapes]
    out = []
    with torch.no_grad():
        for r in rows:
            xs = {k: torch.randn(r, k, dtype=dtype, device=device) for k, _ in shapes}
            s = timed(lambda: [lin(xs[w.shape[1]], w) for w in ws], device, reps=5, budget_s=0.4)
            out.append((int(r), 2.0 * r * sum(k * n for k, n in shapes) / s))
    return out


def pack_seconds(shapes: Sequence[Tuple[int, int]], dtype: torch.dtype, device: str, reps: int = 3) -> float:
    """Seconds to lay out weights of the products ``shapes`` ((in, out) each) for the CPU decode kernel, as a
    generation does once per call for every weight it multiplies by (:func:`realhf.impl.model.nn.cpu_gemm.pack`);
    0 where generation lays out nothing (a GPU, the aten kernel, a dtype oneDNN does not serve here)."""
    if device != "cpu":
        return 0.0
    from realhf.impl.model.nn import cpu_gemm

    if cpu_gemm.kernel() != "onednn" or not cpu_gemm.onednn_serves(dtype):
        return 0.0
    ws = [torch.randn(n, k).to(dtype) for k, n in shapes]
    return timed(lambda: [cpu_gemm.pack(w) for w in ws], device, reps=reps, budget_s=math.inf)


def copy_bandwidth(device: str, nbytes: int = 256 << 20) -> float:
    """Bytes/s of a device copy, counting bytes read plus bytes written."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    return 2.0 * nbytes / timed(lambda: dst.copy_(src), device, reps=5, budget_s=0.5)


def attention_rate(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: str,
                   seq: int = 512, n_seqs: int = 2) -> float:
    """FLOP/s of realhf's causal attention over ``n_seqs`` packed sequences of ``seq`` tokens (``2 d S^2`` per
    sequence and query width ``d``: QK^T and AV, halved by the causal mask)."""
    from realhf.base.runtime_env import for_device
    from realhf.impl.model.nn.attention import varlen_causal_attention

    kernel = for_device(device).attention
    T = seq * n_seqs
    q = torch.randn(T, heads, head_dim, dtype=dtype, device=device)
    k = torch.randn(T, kv_heads, head_dim, dtype=dtype, device=device)
    v = torch.randn(T, kv_heads, head_dim, dtype=dtype, device=device)
    cu = torch.arange(0, T + 1, seq, dtype=torch.int32, device=device)
    with torch.no_grad():
        s = timed(lambda: varlen_causal_attention(q, k, v, cu, seq, head_dim**-0.5, kernel), device, reps=5)
    return 2.0 * heads * head_dim * seq * seq * n_seqs / s


def optimizer_seconds_per_param(dtype: torch.dtype, device: str, n: int = 4 << 20) -> float:
    """Seconds per parameter of realhf's AdamW step (fp32 master weights and moments, as the train engine keeps)."""
    from realhf.impl.model.backend.optim import OptimizerConfig, build_adamw

    p = torch.nn.Parameter(torch.zeros(n, dtype=torch.float32, device=device))
    p.grad = torch.full_like(p, 1e-3)
    opt = build_adamw([("w", p)], OptimizerConfig(lr=1e-6))
    return timed(opt.step, device, reps=5, budget_s=0.5) / n


def disk_bandwidth(folder: str, nbytes: int = 64 << 20) -> float:
    """Bytes/s of writing a checkpoint-sized file (flushed to disk) and reading it back, each counted once."""
    data = os.urandom(1 << 20) * (nbytes >> 20)
    fd, path = tempfile.mkstemp(dir=folder, prefix=".disk-probe-")
    try:
        t = time.perf_counter()
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        with open(path, "rb") as f:
            while f.read(16 << 20):
                pass
        return 2.0 * len(data) / (time.perf_counter() - t)
    finally:
        os.unlink(path)


# ------------------------------------------------------------------------------------------------ communication


def _comm_worker(rank: int, world: int, store_path: str, backend: str, sizes: Sequence[int], q,
                 tp_model: Optional[Dict] = None, calls: Optional[Dict[str, Tuple[Callable, Dict]]] = None) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    device = "cuda" if backend == "nccl" else "cpu"
    if device == "cuda":
        torch.cuda.set_device(rank)
    try:
        dist.init_process_group(backend, store=dist.FileStore(store_path, world), rank=rank, world_size=world)
        res: Dict[str, List[Tuple[int, float]]] = {"allreduce": [], "sendrecv": []}
        for n in sizes:
            t = torch.ones(max(1, n // 4), dtype=torch.float32, device=device)
            res["allreduce"].append((n, timed(lambda: dist.all_reduce(t), device, reps=7, budget_s=0.5)))

            def pingpong():
                if rank == 0:
                    dist.send(t, 1)
                    dist.recv(t, 1)
                else:
                    dist.recv(t, 0)
                    dist.send(t, 0)

            res["sendrecv"].append((n, timed(pingpong, device, reps=7, budget_s=0.5) / 2))
        res["in_step"] = _collectives_in_step(dist, device)
        res["realloc"] = _realloc_probe(dist, device)
        res["p2p_message"] = _p2p_message(dist, device)
        if tp_model is not None:  # one point per depth of the model (``cfgs``)
            kw = dict(tp_model)
            res["tp_decode"] = [dict(_tp_decode_probe(device, c, **kw), layers=c["n_layers"]) for c in kw.pop("cfgs")]
        for name, (fn, kw) in (calls or {}).items():  # real calls over both ranks, in turn
            res[name] = fn(device, **kw)
        dist.destroy_process_group()
        q.put((rank, res, None))
    except Exception as e:  # reported to the parent, which decides
        q.put((rank, None, f"{type(e).__name__}: {e}"))


def _collectives_in_step(dist, device: str, reps: int = 40, rounds: int = 9, small: int = 4 << 10,
                         products: int = 8) -> Dict[str, float]:
    """Mean seconds of a small all-reduce, all-gather and broadcast as they run in a model's step: each after a
    short stretch of computation on both ranks (``products`` 128x128 products, a decode layer's order), not back to
    back. Between processes that share a few cores, a collective pays for waking its peer; its least time over
    back-to-back calls (what :func:`timed` reports) was 4-6x below its mean in a decode step on a 2-core host, and a
    step pays the mean of each of its collectives. That mean is itself noisy there (one round of 40 calls gave 0.5 to
    1.8 ms on one idle host a minute apart): the figure is the median over ``rounds`` rounds of each round's mean."""
    import statistics

    t = torch.ones(small // 4, dtype=torch.float32, device=device)
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    a = torch.randn(128, 128, device=device)
    ops = {"allreduce": lambda: dist.all_reduce(t), "allgather": lambda: dist.all_gather(parts, t),
           "broadcast": lambda: dist.broadcast(t, 0)}
    means: Dict[str, list] = {name: [] for name in ops}
    for _ in range(rounds):
        for name, op in ops.items():  # the ops take turns, so a slow spell of the host touches each alike
            ts = []
            for i in range(reps + 3):
                for _ in range(products):
                    a @ a
                _sync(device)
                s = time.perf_counter()
                op()
                _sync(device)
                if i >= 3:
                    ts.append(time.perf_counter() - s)
            means[name].append(statistics.mean(ts))
    return {name: statistics.median(v) for name, v in means.items()}


# two synthetic shapes for the reallocation probe: a small one (its fixed cost) and one of ~120 MB in fp32 (its rate)
REALLOC_PROBE_SHAPES = (dict(n_layers=2, n_q_heads=2, n_kv_heads=2, head_dim=32, hidden_dim=64, intermediate_dim=128,
                             vocab_size=1024),
                        dict(n_layers=4, n_q_heads=8, n_kv_heads=8, head_dim=64, hidden_dim=512, intermediate_dim=1536,
                             vocab_size=32768))
# (source, destination) layouts over the two ranks: one way (rank 0's whole model to both) and both ways (each rank
# trades its tensor-parallel half for the other's)
REALLOC_PROBE_PAIRS = (("d1m1p1", "d2m1p1"), ("d1m2p1", "d2m1p1"))


def _realloc_probe(dist, device: str, reps: int = 3) -> List[Dict]:
    """The real parameter reallocation (:func:`realhf.impl.model.parallelism.realloc.execute_plan`) between the two
    ranks, for each shape of ``REALLOC_PROBE_SHAPES`` and pair of ``REALLOC_PROBE_PAIRS``: the median seconds of
    ``reps`` runs after a warm-up, and the busiest rank's elements sent and received."""
    import statistics

    from realhf.api.core.model_api import ReaLModelConfig
    from realhf.base.topology import ParallelDims, ParallelGrid
    from realhf.impl.model.nn.real_model import ReaLModel
    from realhf.impl.model.parallelism.realloc import PlacedLayout, execute_plan, make_plan

    rank, out = dist.get_rank(), []
    for shape in REALLOC_PROBE_SHAPES:
        cfg = ReaLModelConfig(**shape, n_positions=None, tied_embedding=True, family="llama")
        for a, b in REALLOC_PROBE_PAIRS:
            da, db = ParallelDims.parse(a), ParallelDims.parse(b)
            ra, rb = list(range(da.world_size)), list(range(db.world_size))
            ga, gb = ParallelGrid(da, ranks=ra), ParallelGrid(db, ranks=rb)
            src = ReaLModel(cfg, grid=ga, device=device) if ga.is_member else None
            dst = ReaLModel(cfg, grid=gb, device=device) if gb.is_member else None
            plan = make_plan(cfg, PlacedLayout.of(da, ra), PlacedLayout.of(db, rb))
            ts, moved = [], {}
            for i in range(reps + 1):
                dist.barrier()
                _sync(device)
                t = time.perf_counter()
                moved = execute_plan(plan, rank, src.flat if src else None, dst.flat if dst else None)
                _sync(device)
                dist.barrier()
                if i:
                    ts.append(time.perf_counter() - t)
            traffic = torch.tensor([moved["sent"], moved["received"]], dtype=torch.float64)
            gathered = [torch.zeros_like(traffic) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, traffic)
            busiest = max(gathered, key=lambda x: float(x.max()))
            out.append(dict(pair=f"{a}:{b}", layers=cfg.n_layers, hidden=cfg.hidden_dim, seconds=statistics.median(ts),
                            sent=float(busiest[0]), received=float(busiest[1]),
                            bytes_per=src.flat.element_size() if src is not None else 4))
            del src, dst
    return out


def _p2p_message(dist, device: str, n: int = 64, nbytes: int = 256, reps: int = 7) -> float:
    """Seconds per message of a batch of ``n`` small point-to-point messages from rank 0 to rank 1, sent as the
    data manager moves an MFC's inputs (``batch_isend_irecv``, one message per sample and key): the median of
    ``reps`` batches after two, over ``n``."""
    import statistics

    rank = dist.get_rank()
    bufs = [torch.ones(max(1, nbytes // 4), device=device) for _ in range(n)]
    ts = []
    for i in range(reps + 2):
        dist.barrier()
        t = time.perf_counter()
        ops = [dist.P2POp(dist.isend if rank == 0 else dist.irecv, b, 1 - rank) for b in bufs]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        _sync(device)
        if i >= 2:
            ts.append(time.perf_counter() - t)
    return statistics.median(ts) / n


def _tp_decode_probe(device: str, cfg: Dict, dtype: str, rows: int, prompt: int, steps: Tuple[int, int],
                     reps: int = 5) -> Dict:
    """A real decode step of model ``cfg`` split over the two ranks (d1m2p1): sampled generations of ``steps[0]`` and
    ``steps[1]`` new tokens over ``rows`` prompts of ``prompt`` tokens, the median of ``reps`` each; their difference
    per step. What a tensor-parallel decode step pays for its collectives, between its own computation."""
    import statistics

    from realhf.api.core.model_api import ReaLModelConfig
    from realhf.base.topology import ParallelDims, ParallelGrid
    from realhf.impl.model.nn.real_model import ReaLModel

    grid = ParallelGrid(ParallelDims.parse("d1m2p1"), ranks=[0, 1])
    m = ReaLModel(ReaLModelConfig(**cfg), grid=grid, dtype=getattr(torch, dtype), device=device)
    m.init_random(seed=1)
    m.eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, cfg["vocab_size"], (prompt,), generator=g).tolist() for _ in range(rows)]

    sampled_generation(m, prompts, steps[0], device)  # warm-up
    a, b = (statistics.median(sampled_generation(m, prompts, k, device) for _ in range(reps)) for k in steps)
    return dict(rows=rows, cached=prompt + (steps[0] + steps[1]) / 2, step_s=max(b - a, 1e-9) / (steps[1] - steps[0]))


def sampled_generation(model, prompts: List[List[int]], k: int, device: str) -> float:
    """Seconds of a generation of exactly ``k`` new tokens for each prompt, sampled as an RL run samples
    (temperature 1, a random stream per answer)."""
    from realhf.api.core.model_api import GenerationHyperparameters
    from realhf.impl.model.nn.generation import generate

    gc = GenerationHyperparameters(max_new_tokens=k, min_new_tokens=k, temperature=1.0)
    _sync(device)
    t = time.perf_counter()
    generate(model, prompts, gc, seeds=list(range(len(prompts))))
    _sync(device)
    return time.perf_counter() - t


def realloc_rates(points: Sequence[Dict]) -> Dict[str, float]:
    """The reallocation's cost from :func:`_realloc_probe`'s points: ``fixed_s`` (the small shape's one-way
    reallocation), ``bw`` (bytes/s of the busiest rank's larger direction, from the two shapes' one-way
    reallocations) and ``both_ways`` (the share of the lesser direction's bytes that adds to the time: 0 where a
    rank sends and receives at once at full rate, 1 where the two directions take turns; from the large shape's
    two-way reallocation). On a 2-core host the two-way reallocation alone ran 2-8x slower than taking turns in three
    probes a minute apart (both processes' gloo threads on two cores), while the same exchange inside a training run
    took what turns would: the share is held at 1 at most."""
    one = sorted((p for p in points if p["received"] == 0 or p["sent"] == 0), key=lambda p: p["hidden"])
    two = max((p for p in points if p["received"] > 0 and p["sent"] > 0), key=lambda p: p["hidden"])

    def nbytes(p, f=max):
        return f(p["sent"], p["received"]) * p["bytes_per"]

    small, large = one[0], one[-1]
    fixed = small["seconds"]
    bw = (nbytes(large) - nbytes(small)) / max(large["seconds"] - small["seconds"], 1e-9)
    both = ((two["seconds"] - fixed) * bw - nbytes(two)) / max(nbytes(two, min), 1.0)
    return dict(fixed_s=fixed, bw=bw, both_ways=min(1.0, max(0.0, both)))


def comm(device: str, sizes: Sequence[int] = (4 << 10, 4 << 20, 64 << 20), timeout: float = 180.0,
         tp_model: Optional[Dict] = None, calls: Optional[Dict[str, Tuple[Callable, Dict]]] = None) -> Optional[Dict]:
    """All-reduce and send/recv times between two local processes (gloo; NCCL between two GPUs) at ``sizes``
    bytes, small collectives as they run between computation (``in_step``, :func:`_collectives_in_step`), and the
    fitted link: bandwidth from the two largest sends' difference in size (``bw``; ``allreduce_bw`` likewise from the
    all-reduces), latency per collective step from the mean small all-reduce between computation (at least the least
    one-way send), and the real parameter reallocation's cost (``realloc``: :func:`realloc_rates`); with
    ``tp_model`` (``cfgs``: a model's configs at a few depths, and :func:`_tp_decode_probe`'s other arguments) a real
    tensor-parallel decode step at each depth (``tp_decode``: a list, each with its ``layers``); with ``calls``
    (by name, a function of the device and its keyword arguments, run on both ranks: a data-parallel training call,
    :func:`realhf.plan.interface_probe.dp_train_call`, a pipelined one or a pipelined generation) each one's figures
    under its name, the slower rank's (by ``measured_s``). None where two devices are not here (one GPU)."""
    import multiprocessing as mp

    backend = "gloo"
    if device == "cuda":
        if torch.cuda.device_count() < 2:
            return None
        backend = "nccl"
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="realhf-comm-probe-") as d:
        store = os.path.join(d, "store")
        procs = [ctx.Process(target=_comm_worker, args=(r, 2, store, backend, list(sizes), q, tp_model, calls),
                             daemon=True)
                 for r in range(2)]
        for p in procs:
            p.start()
        got = {}
        try:
            for _ in range(2):
                rank, res, err = q.get(timeout=timeout)
                if err is not None:
                    raise RuntimeError(f"communication probe ({backend}, rank {rank}) failed: {err}")
                got[rank] = res
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
    res = got[0]
    out = dict(backend=backend, allreduce=res["allreduce"], sendrecv=res["sendrecv"])
    # bandwidths from the two largest sizes (a message past the caches moves slower than one inside them): a send's,
    # and a two-rank all-reduce's (gloo reduces on the CPU: it ran at a third of a send's rate on a 2-core host)
    (_, s0), (n1, s1), (n2, s2) = res["sendrecv"][0], res["sendrecv"][-2], res["sendrecv"][-1]
    out["bw"] = (n2 - n1) / max(s2 - s1, 1e-9)
    (_, a1), (_, a2) = res["allreduce"][-2], res["allreduce"][-1]
    out["allreduce_bw"] = (n2 - n1) / max(a2 - a1, 1e-9)
    out["realloc"] = dict(points=res["realloc"], **realloc_rates(res["realloc"]))
    out["p2p_message"] = max(r["p2p_message"] for r in got.values())
    if "tp_decode" in res:  # per depth, the slower rank's
        out["tp_decode"] = [max((r["tp_decode"][i] for r in got.values()), key=lambda d: d["step_s"])
                            for i in range(len(res["tp_decode"]))]
    for name in calls or {}:  # the slower rank's
        out[name] = max((r[name] for r in got.values()), key=lambda d: d["measured_s"])
    # the latency per step of a collective (a ring all-reduce of n ranks takes 2 (n - 1) steps) as a model's step pays
    # it: from the mean small all-reduce between computation, over both ranks (each waits for the later one)
    in_step = {k: max(r["in_step"][k] for r in got.values()) for k in got[0]["in_step"]}
    out["in_step"] = in_step
    out["lat"] = max(s0, in_step["allreduce"] / 2.0)
    return out
