"""Math prompt datasets: rows ``{query_id, prompt, solutions: [str, ...], task}``, GSM8K conversion.

``solutions`` are reference final answers (e.g. ``["19"]``, or ``["\\frac{1}{2}", "0.5"]``); a
rule-based reward compares a generated answer with them. ``task`` defaults to ``"math"``.
"""
from __future__ import annotations

import json
import os
import re
import tempfile
from typing import Dict, Iterable, List

from realhf.base import logging
from realhf.impl.dataset.jsonl import DatasetError, PromptDataset, TypeSpec, read_jsonl, register_dataset

logger = logging.getLogger(__name__)

TASKS = ("math",)
DEFAULT_PROMPT_TEMPLATE = "{prompt}\nPlease reason step by step, and put your final answer within \\boxed{}."
MATH_REQUIRED: Dict[str, TypeSpec] = {"query_id": (str, int), "prompt": str, "solutions": list}
MATH_OPTIONAL: Dict[str, TypeSpec] = {"task": str}


def check_math_row(where: str, row: dict) -> dict:
    """Validate the math-specific fields of a row; returns ``{"solutions": [...], "task": ...}``."""
    sols = row.get("solutions")
    if not isinstance(sols, list) or not sols or not all(isinstance(s, str) and s.strip() for s in sols):
        raise DatasetError(f"{where}: field 'solutions' must be a non-empty list of non-empty strings, "
                           f"e.g. [\"19\"]; got {json.dumps(sols)[:80]}")
    task = row.get("task") or "math"
    if task not in TASKS:
        raise DatasetError(f"{where}: field 'task' is {task!r}; allowed: {list(TASKS)}")
    return {"solutions": list(sols), "task": task}


class MathPromptDataset(PromptDataset):
    """Math prompts for RL. ``prompt_template`` wraps each prompt (it must contain ``{prompt}``,
    which is replaced literally; other braces are kept) before the chat template. Metadata of a
    collated batch: ``query_id``, ``prompt`` (the raw prompt), ``solutions``, ``task``."""

    REQUIRED = MATH_REQUIRED
    OPTIONAL = MATH_OPTIONAL
    META_KEYS = ("query_id", "prompt", "solutions", "task")

    def __init__(self, path: str, tokenizer, max_prompt_len: int, use_chat_template: bool = True,
                 prompt_template: str = DEFAULT_PROMPT_TEMPLATE):
        if "{prompt}" not in prompt_template:
            raise ValueError(f"prompt_template must contain '{{prompt}}', got {prompt_template!r}")
        self.prompt_template = prompt_template
        super().__init__(path, tokenizer, max_prompt_len, use_chat_template=use_chat_template)

    def _row_extra(self, where: str, row: dict) -> dict:
        return check_math_row(where, row)

    def template(self, text: str) -> str:
        return self.prompt_template.replace("{prompt}", text)


register_dataset("math_prompt", MathPromptDataset)

_GSM8K_FINAL = re.compile(r"####\s*(.+?)\s*$", re.DOTALL)


def gsm8k_final_answer(answer: str) -> str:
    """The number after ``####`` in a GSM8K answer, without thousands separators."""
    m = _GSM8K_FINAL.search(answer)
    if not m:
        raise ValueError("no '#### <number>' line")
    value = m.group(1).strip().replace(",", "").rstrip(".")
    if not value:
        raise ValueError("empty final answer after '####'")
    return value


def load_gsm8k(path: str) -> List[dict]:
    """GSM8K rows ``{question, answer}`` -> math rows; ``query_id`` is ``gsm8k-<file stem>-<row>``."""
    stem = os.path.splitext(os.path.basename(path))[0]
    rows = []
    for i, (line_no, row) in enumerate(read_jsonl(path, {"question": str, "answer": str}, nonempty=("question",))):
        try:
            final = gsm8k_final_answer(row["answer"])
        except ValueError as e:
            raise DatasetError(f"{path}:{line_no}: field 'answer' has {e}; GSM8K answers end with '#### <number>'") from None
        rows.append({"query_id": f"gsm8k-{stem}-{i}", "prompt": row["question"], "solutions": [final], "task": "math"})
    return rows


def write_math_jsonl(rows: Iterable[dict], path: str) -> int:
    """Check and write math rows to ``path`` atomically (a reader never sees half a file); returns
    the number of rows. Query ids must be unique."""
    rows = list(rows)
    if not rows:
        raise DatasetError(f"refusing to write an empty math dataset to {path}")
    seen = set()
    lines = []
    for i, row in enumerate(rows):
        where = f"row {i}"
        if not isinstance(row, dict):
            raise DatasetError(f"{where}: expected a dict, got {type(row).__name__}")
        for key in ("query_id", "prompt", "solutions"):
            if key not in row:
                raise DatasetError(f"{where}: missing field {key!r}")
        if not isinstance(row["prompt"], str) or not row["prompt"].strip():
            raise DatasetError(f"{where}: field 'prompt' must be a non-empty string")
        check_math_row(where, row)
        qid = str(row["query_id"])
        if qid in seen:
            raise DatasetError(f"{where}: query_id {qid!r} is not unique")
        seen.add(qid)
        lines.append(json.dumps({"task": "math", **row}, ensure_ascii=False))
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", dir=d)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return len(lines)
