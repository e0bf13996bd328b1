"""Pipelined vs sequential generation under pipeline parallelism (layout d1m1p2, 2 gloo processes).

Generates ``--n-prompts`` random prompts x ``--new-tokens`` new tokens (greedy, min = max new tokens, so
every row runs to the end) with a random llama (hidden 512, 8 layers, 8 heads / 4 kv heads, fp32):

  * pp=2, ``pipeline_groups=1``: the sequential schedule (the whole batch goes through stage 0, then
    stage 1; one stage idle at any moment), 1 torch thread per process;
  * pp=2, default ``pipeline_groups`` (= pp = 2 row groups in flight), 1 torch thread per process;
  * pp=1 in one process with 2 torch threads, for reference (same total number of cores).

Each figure is the median of ``--repeats`` timed runs after a warm-up (the two pp=2 schedules alternate
within one set of processes). Prints JSON lines: one per configuration (tokens/s), then the ratios, and
whether every configuration produced the same tokens. Timings on a shared machine are noisy: compare
the ratios of one run.

What to expect: with G groups each stage runs G decode steps of B/G rows per round instead of one of B
rows, so the gain over the sequential schedule is at most about pp * T(B) / (G * T(B/G)), i.e. for
G = pp it is bounded by T(B) / T(B/pp), where T(n) is the time of one decode step of n rows. On this
CPU a step of 16 rows costs about 70% of one of 32 rows (small GEMMs are weight-bandwidth bound), so
32 prompts cannot gain much more than ~1.4x; larger batches gain more.

Usage: python benchmarks/bench_pp_generate.py [--n-prompts 32] [--new-tokens 64] [--repeats 3] [--groups 2,4]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from _timing import emit as _emit

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _model_path() -> str:
    from realhf.impl.model.tiny import ensure_tiny_model

    return ensure_tiny_model("llama", hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                             num_attention_heads=8, num_key_value_heads=4)


def _prompts(vocab: int, n: int):
    import torch

    g = torch.Generator().manual_seed(0)
    lens = torch.randint(16, 49, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (k,), generator=g).tolist() for k in lens]


def _worker(path, layout, group_counts, n_prompts, new_tokens, repeats):
    """Time ``generate`` for every entry of ``group_counts`` (round-robin over the repeats); returns
    {G: (median seconds, tokens generated, tokens)} on every rank."""
    import torch.distributed as dist

    from realhf.api.core.model_api import GenerationHyperparameters
    from realhf.base.topology import ParallelDims, ParallelGrid
    from realhf.impl.model.conversion.hf_io import build_from_hf
    from realhf.impl.model.nn.generation import generate

    model = build_from_hf(path, grid=ParallelGrid(ParallelDims(*layout)))
    prompts = _prompts(model.config.vocab_size, n_prompts)
    g = GenerationHyperparameters(max_new_tokens=new_tokens, min_new_tokens=new_tokens, greedy=True)
    generate(model, prompts, GenerationHyperparameters(max_new_tokens=4, greedy=True))  # warm-up
    times = {G: [] for G in group_counts}
    outs = {}
    for _ in range(repeats):
        for G in group_counts:
            dist.barrier()
            t = time.perf_counter()
            out = generate(model, prompts, g, pipeline_groups=G)
            dist.barrier()  # the slowest rank decides
            times[G].append(time.perf_counter() - t)
            outs[G] = out.tokens
    return {G: (statistics.median(times[G]), sum(len(t) for t in outs[G]), outs[G]) for G in group_counts}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n-prompts", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--groups", default="", help="extra pipeline_groups values to time on pp=2, e.g. 4,8")
    a = ap.parse_args()

    from realhf.testing import run_distributed

    path = _model_path()
    extra = [int(x) for x in a.groups.split(",") if x]
    pp_groups = [1, None] + extra
    args = (a.n_prompts, a.new_tokens, a.repeats)
    pp2 = run_distributed(_worker, 2, path, (1, 1, 2), pp_groups, *args, threads=1, timeout=1800)[0]
    pp1 = run_distributed(_worker, 1, path, (1, 1, 1), [None], *args, threads=2, timeout=1800)[0]

    def rate(res):
        sec, n, _ = res
        return n / sec

    common = dict(n_prompts=a.n_prompts, new_tokens=a.new_tokens, repeats=a.repeats)
    rows = [("pp2_sequential", "d1m1p2", 1, 1, pp2[1])]
    rows += [("pp2_pipelined", "d1m1p2", 1, "default (pp)" if G is None else G, pp2[G]) for G in [None] + extra]
    rows += [("pp1", "d1m1p1", 2, None, pp1[None])]
    for name, layout, threads, G, (sec, n, _) in rows:
        _emit(bench=name, layout=layout, pipeline_groups=G, threads_per_process=threads, seconds=round(sec, 3),
              tokens=n, tok_per_s=round(n / sec, 1), **common)
    ref_tokens = pp1[None][2]
    _emit(bench="ratios",
          pipelined_over_sequential=round(rate(pp2[None]) / rate(pp2[1]), 3),
          pipelined_over_pp1=round(rate(pp2[None]) / rate(pp1[None]), 3),
          sequential_over_pp1=round(rate(pp2[1]) / rate(pp1[None]), 3),
          **{f"pipelined_g{G}_over_sequential": round(rate(pp2[G]) / rate(pp2[1]), 3) for G in extra},
          same_tokens=all(r[2] == ref_tokens for r in pp2.values()))


if __name__ == "__main__":
    main()
