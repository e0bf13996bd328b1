"""Greedy (or sampled) accuracy of a checkpoint on math rows, with realhf's own engine in this process.

Grading is ``realhf.reward`` — the same code as the training reward.
"""
from __future__ import annotations

import dataclasses
import time
from typing import List, Optional

import torch

from realhf.api.core.model_api import GenerationHyperparameters
from realhf.base import logging

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class EvalResult:
    accuracy: float
    n: int
    n_correct: int
    mean_answer_tokens: float
    seconds: float
    rows: List[dict]


def format_prompts(tokenizer, rows: List[dict], prompt_template: str, use_chat_template: bool) -> List[List[int]]:
    out = []
    for r in rows:
        text = prompt_template.replace("{prompt}", r["prompt"])
        if use_chat_template:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        else:
            ids = tokenizer(text)["input_ids"]
        out.append(ids)
    return out


def math_accuracy(model_path: str, rows: List[dict], max_new_tokens: int = 64, prompt_template: str = "{prompt}",
                  use_chat_template: bool = True, allow_last_number: bool = False, batch_size: int = 32,
                  gconfig: Optional[GenerationHyperparameters] = None, threads: Optional[int] = None) -> EvalResult:
    import transformers

    from realhf.base.topology import single_process_grid
    from realhf.impl.model.conversion.hf_io import build_from_hf
    from realhf.impl.model.nn.generation import generate
    from realhf.reward import MathVerifier, extract_answer

    if threads:
        torch.set_num_threads(threads)
    t0 = time.perf_counter()
    tok = transformers.AutoTokenizer.from_pretrained(model_path)
    model = build_from_hf(model_path, grid=single_process_grid())
    g = gconfig or GenerationHyperparameters(max_new_tokens=max_new_tokens, greedy=True)
    prompts = format_prompts(tok, rows, prompt_template, use_chat_template)
    texts, lens = [], []
    for i in range(0, len(prompts), batch_size):
        out = generate(model, prompts[i : i + batch_size], g, eos_token_id=tok.eos_token_id)
        for t in out.tokens:
            texts.append(tok.decode(t, skip_special_tokens=True))
            lens.append(len(t))
    graded = []
    for t in texts:
        if allow_last_number and extract_answer(t) is None:
            a = extract_answer(t, allow_last_number=True)
            graded.append(f"\\boxed{{{a}}}" if a is not None else t)
        else:
            graded.append(t)
    v = MathVerifier(timeout=5.0)
    res = v.verify_batch(graded, [list(map(str, r["solutions"])) for r in rows])
    v.close()
    ok = [bool(x[0]) for x in res]
    detail = [{"query_id": r["query_id"], "prompt": r["prompt"], "completion": t, "correct": c} for r, t, c in zip(rows, texts, ok)]
    return EvalResult(accuracy=sum(ok) / max(1, len(ok)), n=len(ok), n_correct=sum(ok),
                      mean_answer_tokens=sum(lens) / max(1, len(lens)), seconds=time.perf_counter() - t0, rows=detail)
