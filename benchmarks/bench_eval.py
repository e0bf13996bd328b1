"""Evaluation throughput: realhf's own engine (as used by evaluation/) vs ``transformers`` ``generate``.

Same tiny model, same prompts (the first ``--n-problems`` GSM8K problems in the ``qwen-boxed``
template), ``--new-tokens`` new tokens, greedy, one batch of ``--batch-size`` prompts at a time, each
implementation in its own fresh process with ``--threads`` torch threads. Timed: generation and
decoding (after one warm-up batch); model loading is reported separately. Prints JSON lines:

  {"bench": "eval_gen", "impl": "realhf"|"hf", "problems_per_s": ..., "gen_tokens_per_s": ..., ...}
  {"bench": "eval_gen_ratio", "problems_per_s_ratio": realhf / hf, "tokens_per_s_ratio": ...}

Usage: python benchmarks/bench_eval.py [--n-problems 32] [--new-tokens 64] [--threads 2]
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time

from _timing import emit as _emit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _model_path() -> str:
    from realhf.impl.model.tiny import ensure_tiny_model

    return ensure_tiny_model("llama", hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2)


def _prompts(path: str, n: int):
    import transformers

    sys.path.insert(0, ROOT)
    from realhf.evaluation import data_loader, prompts

    tok = transformers.AutoTokenizer.from_pretrained(path)
    probs = data_loader.load_problems("gsm8k")[:n]
    return [prompts.build_prompt(tok, p.question, "qwen-boxed")[1] for p in probs], tok


def _worker(impl: str, path: str, n: int, new_tokens: int, batch_size: int, threads: int, q):
    import torch

    torch.set_num_threads(threads)
    sys.path.insert(0, ROOT)
    from realhf.evaluation.engine import stop_token_ids

    prompts, tok = _prompts(path, n)
    stops = stop_token_ids(path, tok)
    t0 = time.perf_counter()
    if impl == "hf":
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        pad = tok.pad_token_id if tok.pad_token_id is not None else stops[0]

        def run(batch):
            L = max(len(p) for p in batch)
            ids = torch.tensor([[pad] * (L - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in batch])
            with torch.no_grad():
                out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                                     eos_token_id=stops, pad_token_id=pad)
            texts, n_tok = [], 0
            for row in out[:, L:].tolist():
                k = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
                texts.append(tok.decode(row[:k], skip_special_tokens=True))
                n_tok += k
            return texts, n_tok
    else:
        from realhf.evaluation import engine as E
        from realhf.api.core.generation import SamplingParams

        E._worker_init(path, threads, "float32", "cpu")
        cfg = SamplingParams(n=1, greedy=True, max_new_tokens=new_tokens, stop_token_ids=list(stops)).to_dict()

        def run(batch):
            res = E._worker_generate(batch, [0] * len(batch), cfg)
            return [r[0][0] for r in res], sum(r[0][1] for r in res)

    load_s = time.perf_counter() - t0
    run(prompts[: min(4, len(prompts))])  # warm-up
    t0 = time.perf_counter()
    n_tok = 0
    texts = []
    for i in range(0, len(prompts), batch_size):
        t, k = run(prompts[i : i + batch_size])
        texts += t
        n_tok += k
    dt = time.perf_counter() - t0
    q.put(dict(impl=impl, problems=len(prompts), gen_tokens=n_tok, seconds=round(dt, 3),
               problems_per_s=round(len(prompts) / dt, 3), gen_tokens_per_s=round(n_tok / dt, 1),
               load_s=round(load_s, 2), threads=threads, texts=texts))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n-problems", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    path = _model_path()
    ctx = mp.get_context("spawn")
    res = {}
    for impl in ("realhf", "hf"):
        q = ctx.Queue()
        p = ctx.Process(target=_worker, args=(impl, path, a.n_problems, a.new_tokens, a.batch_size, a.threads, q))
        p.start()
        res[impl] = q.get()
        p.join()
    same = sum(x == y for x, y in zip(res["realhf"].pop("texts"), res["hf"].pop("texts")))
    for impl in ("realhf", "hf"):
        _emit(bench="eval_gen", model="tiny-llama(h256,l4)", new_tokens=a.new_tokens, batch_size=a.batch_size,
              greedy=True, **res[impl])
    _emit(bench="eval_gen_ratio", problems_per_s_ratio=round(res["realhf"]["problems_per_s"] / res["hf"]["problems_per_s"], 3),
          tokens_per_s_ratio=round(res["realhf"]["gen_tokens_per_s"] / res["hf"]["gen_tokens_per_s"], 3),
          identical_greedy_texts=f"{same}/{a.n_problems}")


if __name__ == "__main__":
    main()
