"""Greedy (or sampled) accuracy of a checkpoint on math rows, with realhf's own engine in this process.

Grading is ``realhf.reward`` — the same code as the training reward.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Dict, List, Optional, Sequence

import torch

from realhf.api.core.model_api import GenerationHyperparameters
from realhf.base import logging

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class EvalResult:
    """``rows``: per answer ``{query_id, prompt, kind, completion, answer, ended, answer_tokens, correct}``
    (``answer``: the final answer as graded, None when none is stated; ``ended``: a stop token ended it within
    ``max_new_tokens``). ``per_kind``: per row ``"kind"`` (rows without one: ``"-"``) ``{n, n_correct, accuracy,
    eos_rate, mean_answer_tokens}``."""

    accuracy: float
    n: int
    n_correct: int
    mean_answer_tokens: float
    seconds: float
    rows: List[dict]
    eos_rate: float = 0.0  # fraction of the answers that ended (a stop token) before max_new_tokens
    per_kind: Dict[str, Dict[str, float]] = dataclasses.field(default_factory=dict)
    require_eos: bool = False
    allow_last_number: bool = False

    def examples(self, k: int = 6, query_ids: Optional[Sequence[str]] = None) -> List[dict]:
        """A few answers to show: those of ``query_ids`` (e.g. the examples of the run before training, to
        compare), else one per kind in turn (first rows first), ``k`` at most."""
        if query_ids is not None:
            by_id = {str(r["query_id"]): r for r in self.rows}
            return [by_id[str(q)] for q in query_ids if str(q) in by_id][:k]
        queues: Dict[str, List[dict]] = {}
        for r in self.rows:
            queues.setdefault(r["kind"], []).append(r)
        out: List[dict] = []
        while len(out) < min(k, len(self.rows)):
            for q in queues.values():
                if q and len(out) < k:
                    out.append(q.pop(0))
        return out

    def summary(self, n_examples: int = 6, example_ids: Optional[Sequence[str]] = None) -> dict:
        """The figures as a JSON-ready dict, with a few example answers."""
        return {"accuracy": self.accuracy, "n": self.n, "n_correct": self.n_correct, "eos_rate": self.eos_rate,
                "mean_answer_tokens": self.mean_answer_tokens, "per_kind": self.per_kind,
                "grading": {"require_eos": self.require_eos, "allow_last_number": self.allow_last_number},
                "examples": self.examples(n_examples, example_ids)}


def grade_answers(rows: Sequence[dict], texts: Sequence[str], ended: Sequence[bool], lens: Sequence[int],
                  allow_last_number: bool = False, require_eos: bool = False) -> EvalResult:
    """Grade one answer per row (``texts[i]`` answers ``rows[i]``; ``ended[i]``: it ended with a stop token;
    ``lens[i]``: its generated tokens) with ``realhf.reward``, the training reward's code. Strict grading
    (``allow_last_number=False, require_eos=True``): the answer must be stated (``\\boxed{}``, "The answer is
    ...") and must have ended; lenient: the last number of an answer without a stated one counts."""
    from realhf.reward import MathVerifier, extract_answer

    if not (len(rows) == len(texts) == len(ended) == len(lens)):
        raise ValueError(f"{len(rows)} rows, {len(texts)} answers, {len(ended)} ended flags, {len(lens)} lengths")
    answers = [extract_answer(t, allow_last_number=allow_last_number) for t in texts]
    graded = [t if extract_answer(t) is not None or a is None else f"\\boxed{{{a}}}" for t, a in zip(texts, answers)]
    v = MathVerifier(timeout=5.0)
    try:
        res = v.verify_batch(graded, [list(map(str, r["solutions"])) for r in rows])
    finally:
        v.close()
    ok = [bool(x[0]) and (bool(e) or not require_eos) for x, e in zip(res, ended)]
    detail = [{"query_id": r["query_id"], "prompt": r["prompt"], "kind": r.get("kind") or "-", "completion": t,
               "answer": a, "ended": bool(e), "answer_tokens": int(n), "correct": c}
              for r, t, a, e, n, c in zip(rows, texts, answers, ended, lens, ok)]

    def figures(group: List[dict]) -> Dict[str, float]:
        n = len(group)
        k = sum(d["correct"] for d in group)
        return {"n": n, "n_correct": k, "accuracy": k / max(1, n), "eos_rate": sum(d["ended"] for d in group) / max(1, n),
                "mean_answer_tokens": sum(d["answer_tokens"] for d in group) / max(1, n)}

    kinds: Dict[str, List[dict]] = {}
    for d in detail:
        kinds.setdefault(d["kind"], []).append(d)
    total = figures(detail)
    return EvalResult(accuracy=total["accuracy"], n=total["n"], n_correct=total["n_correct"],
                      mean_answer_tokens=total["mean_answer_tokens"], seconds=0.0, rows=detail,
                      eos_rate=total["eos_rate"], per_kind={k: figures(g) for k, g in sorted(kinds.items())},
                      require_eos=require_eos, allow_last_number=allow_last_number)


def format_prompts(tokenizer, rows: List[dict], prompt_template: str, use_chat_template: bool) -> List[List[int]]:
    """Token ids of the rows' prompts in ``prompt_template``, encoded as a run's prompt dataset encodes them."""
    from realhf.impl.dataset.jsonl import encode_prompts

    return encode_prompts(tokenizer, [prompt_template.replace("{prompt}", r["prompt"]) for r in rows], use_chat_template)


def math_accuracy(model_path: str, rows: List[dict], max_new_tokens: int = 64, prompt_template: str = "{prompt}",
                  use_chat_template: bool = True, allow_last_number: bool = False, batch_size: int = 32,
                  gconfig: Optional[GenerationHyperparameters] = None, threads: Optional[int] = None,
                  require_eos: bool = False) -> EvalResult:
    """Accuracy of the model at ``model_path`` on ``rows`` (greedy, ``max_new_tokens``, unless ``gconfig``; with
    ``gconfig.n > 1`` every sample is an answer), graded by :func:`grade_answers` (``require_eos``: an answer cut
    by the token limit is wrong), with the EOS rate, answer lengths and accuracy per row ``"kind"``."""
    from realhf.base.hf_tokenizer import load_tokenizer
    from realhf.base.topology import single_process_grid
    from realhf.impl.model.conversion.hf_io import build_from_hf
    from realhf.impl.model.nn.generation import generate

    if threads:
        torch.set_num_threads(threads)
    t0 = time.perf_counter()
    tok = load_tokenizer(model_path)
    model = build_from_hf(model_path, grid=single_process_grid())
    g = gconfig or GenerationHyperparameters(max_new_tokens=max_new_tokens, greedy=True)
    prompts = format_prompts(tok, rows, prompt_template, use_chat_template)
    texts, lens, ended = [], [], []
    for i in range(0, len(prompts), batch_size):
        out = generate(model, prompts[i : i + batch_size], g, eos_token_id=tok.eos_token_id)
        for t, cut in zip(out.tokens, out.no_eos):
            texts.append(tok.decode(t, skip_special_tokens=True))
            lens.append(len(t))
            ended.append(not cut)
    answered = [r for r in rows for _ in range(g.n)]  # generate puts the n samples of a prompt next to each other
    logger.info(f"math_accuracy: {len(texts)} answers of {len(rows)} problems in {time.perf_counter() - t0:.0f}s")
    res = grade_answers(answered, texts, ended, lens, allow_last_number=allow_last_number, require_eos=require_eos)
    res.seconds = time.perf_counter() - t0
    return res
