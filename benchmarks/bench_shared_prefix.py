"""A training pass over GRPO-shaped micro-batches with each group's prompt computed once against the plain layout.

The model of SmolLM2-135M's shape (``--model smollm2``, its real weights are not needed: random ones) or the tests'
tiny model runs forward and backward over ``--prompts`` prompts of ``--prompt-len`` tokens, each followed by
``--group`` answers of random lengths in ``[--min-answer, --max-answer]``, the output head on the answer rows (as
``actor_train`` runs it), alternating the two layouts for ``--rounds`` rounds after a warm-up of each. Prints one JSON
line per layout (median seconds, the blocks' tokens) and the ratio.

Usage: python benchmarks/bench_shared_prefix.py [--model smollm2|tiny] [--rounds 3] [--device cpu|cuda]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import emit  # noqa: E402


def _config(name: str):
    from realhf.impl.model.conversion.hf_io import config_from_hf_path

    if name == "smollm2":
        from realhf.impl.model.smollm2 import ensure_smollm2

        return config_from_hf_path(ensure_smollm2(dtype="float32"))
    from realhf.impl.model.tiny import ensure_tiny_model

    return config_from_hf_path(ensure_tiny_model("qwen2"))


def _batch(vocab: int, a):
    g = torch.Generator().manual_seed(a.seed)
    seqs, rows, start = [], [], 0
    for _ in range(a.prompts):
        prompt = torch.randint(3, vocab, (a.prompt_len,), generator=g)
        for _ in range(a.group):
            n = int(torch.randint(a.min_answer, a.max_answer + 1, (1,), generator=g))
            seqs.append(torch.cat([prompt, torch.randint(3, vocab, (n,), generator=g)]))
            rows.append(torch.arange(start + a.prompt_len - 1, start + a.prompt_len + n - 1))
            start += a.prompt_len + n
    return torch.cat(seqs), [len(s) for s in seqs], torch.cat(rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=75)
    ap.add_argument("--min-answer", type=int, default=20)
    ap.add_argument("--max-answer", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    from realhf.impl.model.nn.real_model import ReaLModel, packed_model_input

    dev = torch.device(a.device)
    cfg = _config(a.model)
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    model = ReaLModel(cfg, dtype=dtype, device=dev)
    model.init_random(seed=0)
    model.attach_flat_grad()
    ids, lens, rows = _batch(cfg.vocab_size, a)

    def one(share: bool):
        model.flat_grad.zero_()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        x, inp = packed_model_input(ids, lens, dev, share)
        inp.head_rows = rows.to(dev)
        model(x, inp).float().logsumexp(-1).mean().backward()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t, x.numel()

    times = {False: [], True: []}
    body = {}
    for share in (False, True):  # warm-up
        one(share)
    for _ in range(a.rounds):
        for share in (False, True):
            s, n = one(share)
            times[share].append(s)
            body[share] = n
    med = {k: statistics.median(v) for k, v in times.items()}
    for share in (False, True):
        emit(layout="shared" if share else "plain", model=a.model, device=a.device, tokens=len(ids),
             block_tokens=body[share], seconds=round(med[share], 3), all_seconds=[round(x, 3) for x in times[share]])
    emit(speedup=round(med[False] / med[True], 3), block_tokens_ratio=round(body[True] / body[False], 3))


if __name__ == "__main__":
    main()
