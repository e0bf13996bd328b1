"""Timing helpers shared by the benchmark scripts (imported as ``_timing`` when a script runs)."""
from __future__ import annotations

import json
import statistics
import time
from typing import Optional

import torch


def emit(**kw):
    """Print one JSON line of figures (the benchmarks' output format)."""
    print(json.dumps(kw), flush=True)


def inprocess_copy_seconds(numel: int, repeats: int) -> float:
    """Median time of one in-process ``copy_`` of ``numel`` fp32 elements (after a warm-up copy): the
    plain-copy reference that transfer figures are compared with."""
    src = torch.empty(numel)
    dst = torch.empty_like(src)
    return _median_seconds(lambda: dst.copy_(src), repeats)


def linear_weights(hf_model) -> list:
    """The matrices a forward pass of a ``transformers`` causal LM multiplies activations with, in forward
    order, grouped where one input feeds several (q/k/v; gate/up): a list of lists of weights. The output
    head is included (a tied head is its embedding)."""
    import re

    groups, last_key = [], None
    for name, m in hf_model.named_modules():
        if not isinstance(m, torch.nn.Linear):
            continue
        key = re.sub(r"\.(q_proj|k_proj|v_proj)$", ".qkv", name)
        key = re.sub(r"\.(gate_proj|up_proj)$", ".gate_up", key)
        if key == last_key and key != name:
            groups[-1].append(m.weight.detach())
        else:
            groups.append([m.weight.detach()])
        last_key = key
    return groups


def _tile_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    from realhf.impl.model.nn import decode_ops

    with torch.no_grad():
        y = decode_ops.linear(x, w, None)
    assert y is not None, "the tile kernel does not serve this product"
    return y


def gemm_kernels(rows: Optional[int] = None) -> dict:
    """The CPU GEMM kernels in this PyTorch, as ``name -> (prepare(weight), multiply(x, prepared))``: aten's
    ``F.linear`` (MKL in the x86 wheels) and, where PyTorch has oneDNN, oneDNN's linear on the plain weight
    and on a weight packed once in oneDNN's layout (what generation uses); for products of at most
    ``decode_ops.MAX_ROWS`` ``rows``, realhf's own tile kernel too where it serves (an AVX-512 CPU). A floor takes
    the fastest."""
    import torch.nn.functional as F

    from realhf.impl.model.nn import cpu_gemm, decode_ops

    kernels = {"aten": (lambda w: w, F.linear)}
    if cpu_gemm.onednn_available():
        kernels["onednn"] = (lambda w: w, cpu_gemm._onednn_linear)
        kernels["onednn_packed"] = (lambda w: torch.ops.mkldnn._reorder_linear_weight(w, cpu_gemm.PACK_ROWS),
                                    cpu_gemm._onednn_linear)
    if rows is not None and 0 < rows <= decode_ops.MAX_ROWS:
        with torch.no_grad():
            probe = torch.zeros(rows, 16)
            if decode_ops.linear_kernel(probe, torch.zeros(16, 16), None) is not None:
                kernels["realhf_tile"] = (lambda w: w, _tile_linear)
    return kernels


def matmul_peak_gflops(dtype=torch.float32, n: int = 2048, reps: int = 7) -> dict:
    """GFLOP/s of an ``n x n`` product with each of :func:`gemm_kernels` (median of ``reps``), plus ``best``:
    the machine's measured matmul peak is the fastest kernel's, not only the default BLAS's."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    out = {}
    for name, (prep, mul) in gemm_kernels().items():
        w = prep(b)
        for _ in range(2):
            mul(a, w)
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            mul(a, w)
            ts.append(time.perf_counter() - t0)
        out[name] = round(2 * n**3 / statistics.median(ts) / 1e9, 1)
    out["best"] = max(out.values())
    return out


def _sweeps(groups: list, rows: int, own_kernel: bool):
    """Yields one sweep over every weight of ``linear_weights`` with ``rows`` activation rows, as a callable, for each
    kernel of :func:`gemm_kernels` (``own_kernel=False``: PyTorch's only) and each arrangement (each weight alone;
    each group as one wide GEMM), one at a time (a packed copy of the weights lives only while its sweep is used). The
    process keeps freed host memory from the first sweep on, as realhf's workers do (``realhf.base.host_memory``)."""
    from realhf.base import host_memory

    host_memory.retain_freed_memory()
    plain = [w for g in groups for w in g]
    wide = [torch.cat(g, 0) if len(g) > 1 else g[0] for g in groups]
    for prep, mul in gemm_kernels(rows if own_kernel else None).values():
        for ws in (plain, wide):
            ws = [prep(w) for w in ws]
            xs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=w.dtype) for w in ws}

            def sweep(ws=ws, xs=xs, mul=mul):
                for w in ws:
                    mul(xs[w.shape[1]], w)

            yield sweep


def _median_seconds(fn, repeats: int) -> float:
    """Median time of ``repeats`` calls of ``fn`` after a warm-up call."""
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def gemm_sweep_seconds(groups: list, rows: int, repeats: int = 3, own_kernel: bool = True) -> float:
    """Median time of multiplying ``rows`` activation rows by every weight of ``linear_weights``: the GEMM
    work of one forward pass over ``rows`` tokens and nothing else (no attention, norms or sampling). Run
    with each weight alone and with each group as one wide GEMM, with every kernel of :func:`gemm_kernels`;
    the fastest is kept, so it is a floor for fused and unfused implementations and any of these kernels
    (``own_kernel=False``: PyTorch's kernels only, without realhf's tile kernel). The process keeps freed host memory
    as realhf's workers do (``realhf.base.host_memory``): with glibc's default, each large output is a fresh mapping
    whose pages fault in again, which made the prefill's floor about 7% slower than the products it bounds."""
    return min(_median_seconds(sweep, repeats) for sweep in _sweeps(groups, rows, own_kernel))


def fastest_sweep(groups: list, rows: int, repeats: int = 5):
    """The sweep of :func:`gemm_sweep_seconds` (every kernel and arrangement) that ran fastest here, as a callable
    that runs it once: the floor of a forward pass over ``rows`` tokens, to time right beside that forward pass
    (``bench_model.py``'s ``realhf_paired``)."""
    return min(_sweeps(groups, rows, True), key=lambda sweep: _median_seconds(sweep, repeats))


def realhf_train_step(model, ids: list):
    """A callable running one training step of ``model`` (a ReaLModel) on the sequences ``ids`` (1-D token tensors
    on the model's device), packed: forward, backward of the mean next-token loss, AdamW. What bench_model.py and
    bench_scale.py --compare-transformers time for realhf."""
    from realhf.api.core.data_api import SequenceSample
    from realhf.impl.model.backend.engine import TrainEngine
    from realhf.impl.model.backend.optim import OptimizerConfig
    from realhf.impl.model.utils.functional import packed_logprobs

    eng = TrainEngine(model, OptimizerConfig(lr=1e-6), 100)
    sample = SequenceSample.from_default(ids=list(range(len(ids))), seqlens=[int(t.numel()) for t in ids],
                                         data={"packed_input_ids": torch.cat(ids)})

    def loss_fn(out, mb):
        lp, valid = packed_logprobs(out, mb.data["packed_input_ids"], mb.cu_seqlens())
        return -lp.sum() / valid.sum(), {}

    return lambda: eng.train_batch(sample, loss_fn, lambda mb: mb.total_tokens())
