"""Evaluation datasets: ``<data_dir>/<name>/test.jsonl`` rows -> problems with their ground truth.

Ground truth, the standard way per dataset (the same rules as ``tests/test_reward_datasets.py``):

* ``math_500`` — the last ``\\boxed{}`` of ``solution``;
* ``gsm8k`` — the number after ``####`` in ``answer``;
* ``aime24``, ``aime25``, ``amc23`` — the ``answer`` field (``27.0`` is written ``27``).

Other folders under ``data_dir`` are accepted with the same rules guessed from their fields
(``solution`` with a box, ``answer`` with ``####``, else ``answer``).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
from typing import List, Optional

from realhf.base import logging
from realhf.reward import gsm8k_answer, last_boxed

logger = logging.getLogger(__name__)

DEFAULT_DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
KNOWN_DATASETS = ("math_500", "aime24", "aime25", "amc23", "gsm8k")


class DatasetError(ValueError):
    """A dataset that does not exist or cannot be read."""


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


def _answer_str(a) -> str:
    if isinstance(a, float) and a.is_integer():
        a = int(a)
    return str(a).strip()


def ground_truth(name: str, row: dict) -> tuple[str, List[str]]:
    """``(answer shown, references for the grader)`` of one row."""
    if name == "math_500" or (name not in KNOWN_DATASETS and "solution" in row and last_boxed(str(row["solution"]))
                              and "answer" not in row):
        box = last_boxed(row["solution"])
        if box is None:
            raise DatasetError(f"{name}: a solution without \\boxed{{}}: {row['solution'][-80:]!r}")
        return box, [row["solution"]]
    if name == "gsm8k" or (isinstance(row.get("answer"), str) and "####" in row["answer"]):
        return gsm8k_answer(row["answer"]), [row["answer"]]
    if "answer" in row:
        a = _answer_str(row["answer"])
        return a, [a]
    if isinstance(row.get("solutions"), list) and row["solutions"]:  # realhf math rows {query_id, prompt, solutions}
        sols = [_answer_str(x) for x in row["solutions"]]
        return sols[0], sols
    if "solution" in row and last_boxed(str(row["solution"])):
        return last_boxed(row["solution"]), [row["solution"]]
    raise DatasetError(f"{name}: cannot find a ground truth in a row with fields {sorted(row)}")


def subset_indices(name: str, n_rows: int, max_problems: Optional[int], seed: int) -> List[int]:
    """All rows, or a fixed seeded subset of ``max_problems`` rows (sorted; same for a given seed)."""
    if not max_problems or max_problems >= n_rows:
        return list(range(n_rows))
    rng = random.Random(f"realhf-eval-subset:{seed}:{name}")
    return sorted(rng.sample(range(n_rows), max_problems))


def load_problems(name: str, data_dir: Optional[str] = None, max_problems: Optional[int] = None,
                  seed: int = 0) -> List[Problem]:
    path = dataset_path(name, data_dir)
    rows = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DatasetError(f"{path}:{lineno}: not JSON ({e})") from None
    out = []
    for i in subset_indices(name, len(rows), max_problems, seed):
        row = rows[i]
        q = row.get("problem", row.get("question", row.get("prompt")))
        if q is None:
            raise DatasetError(f"{path}: row {i} has none of 'problem', 'question', 'prompt'")
        gt, sols = ground_truth(name, row)
        out.append(Problem(idx=i, question=str(q), ground_truth=gt, solutions=sols))
    return out
