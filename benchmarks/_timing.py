"""Timing helpers shared by the benchmark scripts (imported as ``_timing`` when a script runs)."""
from __future__ import annotations

import json
import statistics
import time

import torch


def emit(**kw):
    """Print one JSON line of figures (the benchmarks' output format)."""
    print(json.dumps(kw), flush=True)


def inprocess_copy_seconds(numel: int, repeats: int) -> float:
    """Median time of one in-process ``copy_`` of ``numel`` fp32 elements (after a warm-up copy): the
    plain-copy reference that transfer figures are compared with."""
    src = torch.empty(numel)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


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


def gemm_sweep_seconds(groups: list, rows: int, repeats: int = 3) -> float:
    """Median time of ``F.linear(x, W)`` over every weight of ``linear_weights`` with ``rows`` activation
    rows: the GEMM work of one forward pass over ``rows`` tokens and nothing else (no attention, norms or
    sampling). Run both with each weight alone and with each group as one wide GEMM; the faster is kept,
    so it is a floor for fused and unfused implementations alike."""
    import torch.nn.functional as F

    def sweep(ws):
        xs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=w.dtype) for w in ws}
        times = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            for w in ws:
                F.linear(xs[w.shape[1]], w)
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])

    plain = sweep([w for g in groups for w in g])
    wide = sweep([torch.cat(g, 0) if len(g) > 1 else g[0] for g in groups])
    return min(plain, wide)
