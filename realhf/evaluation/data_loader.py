"""Evaluation datasets: ``<data_dir>/<name>/test.jsonl`` rows -> problems with their ground truth.

Ground truth, the standard way per dataset (the same rules as ``tests/unit/test_reward_datasets.py``):

* ``math_500`` — the last ``\\boxed{}`` of ``solution``;
* ``gsm8k`` — the number after ``####`` in ``answer``;
* ``aime24``, ``aime25``, ``amc23`` — the ``answer`` field (``27.0`` is written ``27``).

Other folders under ``data_dir`` are accepted with the same rules guessed from their fields
(``solution`` with a box, ``answer`` with ``####``, else ``answer``, else ``solutions``).

Every row is checked before anything else happens, with the reader of the training datasets
(:func:`realhf.impl.dataset.jsonl.read_jsonl`): a problem is a :class:`DatasetError` whose message
starts with ``file:line`` and says what is allowed.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import random
from typing import Any, Dict, List, Optional, Tuple

from realhf.base import logging
from realhf.base.process import source_root
from realhf.impl.dataset.jsonl import DatasetError, TypeSpec, read_jsonl
from realhf.reward import gsm8k_answer, last_boxed

logger = logging.getLogger(__name__)

# the datasets stay in the source tree (evaluation/data), beside the command line users run
DEFAULT_DATA_DIR = os.path.join(source_root(), "evaluation", "data")
KNOWN_DATASETS = ("math_500", "aime24", "aime25", "amc23", "gsm8k")

QUESTION_FIELDS = ("problem", "question", "prompt")  # the first one present is the question
ROW_FIELDS: Dict[str, TypeSpec] = {"problem": str, "question": str, "prompt": str, "answer": (str, float),
                                   "solution": str, "solutions": list}
ROW_SHAPE = ("a question in 'problem', 'question' or 'prompt' (a non-empty string) and its ground truth in 'answer' "
             "(a string or number), 'solution' (a string with a \\boxed{} answer) or 'solutions' (a non-empty list of "
             "strings or numbers)")

__all__ = ["DatasetError", "Problem", "available_datasets", "dataset_path", "file_sha256", "ground_truth",
           "load_problems", "subset_indices"]


@dataclasses.dataclass
class Problem:
    idx: int  # row index in the dataset file (stable across subsets)
    question: str
    ground_truth: str  # the reference answer shown in the outputs
    solutions: List[str]  # what the grader compares against (worked solution or bare answer)


def available_datasets(data_dir: Optional[str] = None) -> List[str]:
    d = data_dir or DEFAULT_DATA_DIR
    if not os.path.isdir(d):
        return []
    return sorted(n for n in os.listdir(d) if os.path.isfile(os.path.join(d, n, "test.jsonl")))


def dataset_path(name: str, data_dir: Optional[str] = None) -> str:
    d = data_dir or DEFAULT_DATA_DIR
    path = os.path.join(d, name, "test.jsonl")
    if not os.path.isfile(path):
        avail = available_datasets(d)
        raise DatasetError(
            f"unknown dataset {name!r}: no {path}. Available datasets in {d}: "
            f"{', '.join(avail) if avail else '(none)'}"
        )
    return path


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _answer_str(a, where: str, field: str) -> str:
    """A number or string answer as text (``27.0`` is ``27``); a blank or non-finite one is a DatasetError."""
    if isinstance(a, float):
        if not math.isfinite(a):
            raise DatasetError(f"{where}: field {field!r} is {a}; an answer must be a finite number or a string")
        if a.is_integer():
            a = int(a)
    text = str(a).strip()
    if not text:
        raise DatasetError(f"{where}: field {field!r} is empty; an answer must be a non-empty string or a number")
    return text


def _boxed(row: dict, where: str, why: str) -> Tuple[str, List[str]]:
    sol = row.get("solution")
    box = last_boxed(sol) if isinstance(sol, str) else None
    if not box or not box.strip():
        got = "no 'solution'" if sol is None else f"a 'solution' without one: ...{sol[-60:]!r}"
        raise DatasetError(f"{where}: {why} the ground truth is the last \\boxed{{}} of 'solution', but the row has "
                           f"{got}")
    return box, [sol]


def _solutions(sols: list, where: str) -> Tuple[str, List[str]]:
    """A realhf math row's ``solutions`` (answers as strings or numbers): the first is the one shown."""
    if not sols:
        raise DatasetError(f"{where}: field 'solutions' is an empty list; it needs at least one answer")
    for i, x in enumerate(sols):
        if isinstance(x, bool) or not isinstance(x, (str, int, float)):
            raise DatasetError(f"{where}: field 'solutions' item {i} is {json.dumps(x)[:40]}; the items must be "
                               "strings or numbers")
    refs = [_answer_str(x, where, "solutions") for x in sols]
    return refs[0], refs


def ground_truth(name: str, row: dict, where: Optional[str] = None) -> Tuple[str, List[str]]:
    """``(answer shown, references for the grader)`` of one row; ``where`` (``file:line``) prefixes errors."""
    where = where or name
    ans, sol, sols = row.get("answer"), row.get("solution"), row.get("solutions")
    if name == "math_500" or (name not in KNOWN_DATASETS and ans is None and isinstance(sol, str) and last_boxed(sol)):
        return _boxed(row, where, f"for {name}")
    if name == "gsm8k" or (isinstance(ans, str) and "####" in ans):
        if not isinstance(ans, str) or "####" not in ans:
            raise DatasetError(f"{where}: for gsm8k the ground truth is the number after '####' in 'answer', but the "
                               f"row has {'no answer' if ans is None else json.dumps(ans)[:60]}")
        final = gsm8k_answer(ans)
        if not final:
            raise DatasetError(f"{where}: nothing after '####' in 'answer'; write the final number after it")
        return final, [ans]
    if ans is not None:
        a = _answer_str(ans, where, "answer")
        return a, [a]
    if sols is not None:  # realhf math rows {query_id, prompt, solutions}
        return _solutions(sols, where)
    if sol is not None:
        return _boxed(row, where, "without 'answer' or 'solutions'")
    raise DatasetError(f"{where}: no ground truth (fields {sorted(row)}); each row needs {ROW_SHAPE}")


def _problem(name: str, where: str, idx: int, row: Dict[str, Any]) -> Problem:
    q = next((row[k] for k in QUESTION_FIELDS if row.get(k) is not None), None)
    if q is None:
        raise DatasetError(f"{where}: no question (fields {sorted(row)}); each row needs {ROW_SHAPE}")
    gt, sols = ground_truth(name, row, where)
    return Problem(idx=idx, question=q, ground_truth=gt, solutions=sols)


def subset_indices(name: str, n_rows: int, max_problems: Optional[int], seed: int) -> List[int]:
    """All rows, or a fixed seeded subset of ``max_problems`` rows (sorted; same for a given seed)."""
    if not max_problems or max_problems >= n_rows:
        return list(range(n_rows))
    rng = random.Random(f"realhf-eval-subset:{seed}:{name}")
    return sorted(rng.sample(range(n_rows), max_problems))


def load_problems(name: str, data_dir: Optional[str] = None, max_problems: Optional[int] = None,
                  seed: int = 0) -> List[Problem]:
    """The problems of dataset ``name`` (a seeded subset of ``max_problems`` of them). Every row is checked
    first, with the checks of the training datasets (``realhf.impl.dataset.jsonl.read_jsonl``): a row that is
    not JSON or not an object, a missing, ill-typed or blank field, text that is not Unicode, an empty file,
    no question or no ground truth is a :class:`DatasetError` naming ``file:line``."""
    path = dataset_path(name, data_dir)
    rows = read_jsonl(path, {}, ROW_FIELDS, nonempty=QUESTION_FIELDS + ("answer", "solution"), describe=ROW_SHAPE)
    problems = [_problem(name, f"{path}:{line_no}", i, row) for i, (line_no, row) in enumerate(rows)]
    return [problems[i] for i in subset_indices(name, len(problems), max_problems, seed)]
