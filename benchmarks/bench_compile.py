"""Compiled against eager, in one process, alternating: the decode step (``compile_decode``) and a training
step (``ReaLModel.compile_blocks``), on the model of ``bench_trl.py`` (tiny Qwen2, hidden 256, 4 layers)
or on SmolLM2-135M (``--model smollm2``; compiling its decode step takes minutes).

Decode: one step of ``--rows`` rows at cache position ``--pos`` (cache length ``2 * pos``). Training: one
``TrainEngine.train_batch`` (forward, the PPO actor loss, backward, clipping, AdamW) on ``--rows`` sequences of
``--seqlen`` tokens. Each variant runs
``--rounds`` times, alternating, and medians are printed (JSON lines), with the one-off compile seconds.

Usage: python benchmarks/bench_compile.py [--model tiny|smollm2] [--rows 32] [--pos 20] [--seqlen 36]
       [--rounds 7] [--skip decode|train]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from _timing import emit

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def model_path(name: str) -> str:
    if name == "smollm2":
        from realhf.impl.model.smollm2 import ensure_smollm2

        return ensure_smollm2(dtype="float32")
    from bench_trl import make_model

    return make_model()


def alternate(fns: dict, rounds: int, reps: int) -> dict:
    res = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            f()
            t = time.perf_counter()
            for _ in range(reps):
                f()
            res[k].append((time.perf_counter() - t) / reps)
    return {k: statistics.median(v) for k, v in res.items()}


def bench_decode(path: str, a):
    from realhf.impl.model.conversion.hf_io import build_from_hf
    from realhf.impl.model.nn.compiled_decode import CompiledDecoder
    from realhf.impl.model.nn.kv_cache import KVCache
    from realhf.impl.model.nn.real_model import PackedInput

    m = build_from_hf(path)
    cfg = m.config
    B = a.rows
    cache = KVCache(cfg.n_layers, B, 2 * a.pos, cfg.n_kv_heads, cfg.head_dim, torch.float32, m.device)
    cache.lens = torch.full((B,), a.pos)
    cache.decoding = True
    ids = torch.randint(3, cfg.vocab_size, (B,), generator=torch.Generator().manual_seed(0))
    dec = CompiledDecoder(m)
    with torch.no_grad():
        t = time.perf_counter()
        dec(ids, cache)
        compile_s = time.perf_counter() - t
        if dec.failed:
            raise RuntimeError(f"compiling failed: {dec.failed}")

        def eager():
            inp = PackedInput(cu_seqlens=torch.arange(B + 1, dtype=torch.int32), max_seqlen=1,
                              position_ids=cache.lens, cache=cache)
            return m(ids, inp)

        med = alternate({"eager": eager, "compiled": lambda: dec(ids, cache)}, a.rounds, 20 if a.model == "tiny" else 3)
    emit(bench="decode_step", model=a.model, rows=B, pos=a.pos, eager_ms=round(med["eager"] * 1e3, 2),
         compiled_ms=round(med["compiled"] * 1e3, 2), speedup=round(med["eager"] / med["compiled"], 2),
         compile_seconds=round(compile_s, 1))


def bench_train(path: str, a):
    from realhf.api.core.config import OptimizerConfig
    from realhf.api.core.data_api import SequenceSample
    from realhf.impl.model.backend.engine import TrainEngine
    from realhf.impl.model.conversion.hf_io import build_from_hf
    from realhf.impl.model.utils import ppo_functional as F
    from realhf.impl.model.utils.functional import packed_logprobs

    m = build_from_hf(path)
    eng = TrainEngine(m, OptimizerConfig(lr=1e-6), 10**6)
    T = a.seqlen * a.rows
    g = torch.Generator().manual_seed(0)
    sample = SequenceSample.from_default(ids=list(range(a.rows)), seqlens=[a.seqlen] * a.rows, data={
        "packed_input_ids": torch.randint(3, m.config.vocab_size, (T,), generator=g),
        "old_logprobs": torch.randn(T, generator=g) * 0.1 - 3, "advantages": torch.randn(T, generator=g)})

    def loss_fn(out, mb):  # the PPO actor's clipped surrogate over the packed log-probs
        lp, valid = packed_logprobs(out, mb.data["packed_input_ids"], mb.cu_seqlens())
        return F.actor_loss(lp, mb.data["old_logprobs"], mb.data["advantages"], 0.2, valid)[0], {}

    def step():
        eng.train_batch(sample, loss_fn, lambda mb: mb.total_tokens())

    def set_compiled(on: bool):
        if on:
            m.compile_blocks()
        else:
            for blk in m.blocks.values():
                blk.compiled = None

    set_compiled(True)
    t = time.perf_counter()
    step()
    step()  # the backward graphs compile on the first backward
    compile_s = time.perf_counter() - t

    def variant(on):
        def run():
            set_compiled(on)
            step()
        return run

    med = alternate({"eager": variant(False), "compiled": variant(True)}, a.rounds, 3)
    emit(bench="train_step", model=a.model, seqs=a.rows, seqlen=a.seqlen, eager_s=round(med["eager"], 3),
         compiled_s=round(med["compiled"], 3), speedup=round(med["eager"] / med["compiled"], 2),
         compile_seconds=round(compile_s, 1))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--pos", type=int, default=20)
    ap.add_argument("--seqlen", type=int, default=36)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--skip", choices=["decode", "train"], default=None)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    path = model_path(a.model)
    if a.skip != "decode":
        bench_decode(path, a)
    if a.skip != "train":
        bench_train(path, a)


if __name__ == "__main__":
    sys.exit(main())
