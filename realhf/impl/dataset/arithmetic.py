"""Deterministic synthetic arithmetic problems (math rows) for tiny CPU runs.

``kind``:

* ``"add"``: word problems with one addition ("Tom has 12 apples and buys 7 more. How many apples
  does Tom have now?" -> ``["19"]``);
* ``"mixed"``: word problems with addition, subtraction (never negative) or multiplication;
* ``"easy"``: bare single-digit sums such as ``"3+4="`` -> ``["7"]``, learnable by a tiny model
  trained from scratch (``max_value`` is ignored);
* ``"bare"``: bare sums of a number in ``[0, max_value]`` and a single digit, such as ``"47+5="`` ->
  ``["52"]``: with ``max_value=99`` there are 1,000 distinct problems, too many to memorise from a
  few hundred examples, so a tiny model trained from scratch has to learn the rule (the units digit
  and the carry), and its accuracy on held-out problems tracks its accuracy on training problems
  (the fast GRPO learning test, ``scripts/tiny_arith_learning.py``, uses it).

The same ``(n, seed, kind, max_value)`` always gives the same rows; ``query_id`` is unique
(``arith-<kind>-<seed>-<i>``).

Helpers for learning tests: :func:`make_heldout_split` gives training and held-out rows with disjoint
prompts; :func:`to_sft_rows` / :func:`write_sft_jsonl` turn math rows into SFT ``{id, prompt, answer}``
rows (the answer is the first solution, or a sloppy teacher's answer).
"""
from __future__ import annotations

import random
import re
from typing import Iterable, List, Optional, Tuple

NAMES = ("Tom", "Anna", "Ravi", "Mei", "Lucas", "Sara", "Omar", "Ines", "Kofi", "Yuki")
OBJECTS = ("apples", "pencils", "marbles", "stickers", "books", "coins", "cookies", "shells")
KINDS = ("add", "mixed", "easy", "bare")


def _word_problem(rng: random.Random, op: str, max_value: int):
    name, obj = rng.choice(NAMES), rng.choice(OBJECTS)
    if op == "add":
        a, b = rng.randint(1, max_value), rng.randint(1, max_value)
        return (f"{name} has {a} {obj} and buys {b} more. How many {obj} does {name} have now?", a + b)
    if op == "sub":
        a = rng.randint(1, max_value)
        b = rng.randint(0, a)
        return (f"{name} has {a} {obj} and gives away {b}. How many {obj} does {name} have left?", a - b)
    if op == "mul":
        a, b = rng.randint(1, min(max_value, 12)), rng.randint(1, min(max_value, 12))
        return (f"{name} buys {a} bags with {b} {obj} in each bag. How many {obj} does {name} buy in all?", a * b)
    raise ValueError(f"unknown operation {op!r}")


def make_arithmetic_problems(n: int, seed: int = 1, kind: str = "add", max_value: int = 20) -> List[dict]:
    """``n`` math rows ``{query_id, prompt, solutions, task}`` (see the module docstring)."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} is not allowed; choose one of {list(KINDS)}")
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive integer, got {n!r}")
    if not isinstance(max_value, int) or max_value < 1:
        raise ValueError(f"max_value must be a positive integer, got {max_value!r}")
    rng = random.Random(f"arith-{kind}-{seed}")
    rows = []
    for i in range(n):
        if kind == "easy":
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            prompt, answer = f"{a}+{b}=", a + b
        elif kind == "bare":
            a, b = rng.randint(0, max_value), rng.randint(0, 9)
            prompt, answer = f"{a}+{b}=", a + b
        else:
            op = "add" if kind == "add" else rng.choice(("add", "sub", "mul"))
            prompt, answer = _word_problem(rng, op, max_value)
        rows.append({"query_id": f"arith-{kind}-{seed}-{i}", "prompt": prompt, "solutions": [str(answer)], "task": "math"})
    return rows


def make_heldout_split(n_train: int, n_test: int, seed: int = 1, kind: str = "add", max_value: int = 20,
                       test_seed: Optional[int] = None) -> Tuple[List[dict], List[dict]]:
    """``(train, test)`` math rows of ``kind`` whose prompts are disjoint.

    ``test`` holds ``n_test`` rows with distinct prompts (from ``make_arithmetic_problems(.., seed=
    test_seed)``, default ``seed + 1000``); ``train`` holds ``n_train`` rows (prompts may repeat, as
    in the generator) from ``seed``, with every prompt of ``test`` left out. Raises ``ValueError``
    when the kind has too few distinct problems for the sizes asked.
    """
    if not isinstance(n_test, int) or n_test < 1:
        raise ValueError(f"n_test must be a positive integer, got {n_test!r}")
    if not isinstance(n_train, int) or n_train < 1:
        raise ValueError(f"n_train must be a positive integer, got {n_train!r}")
    tseed = seed + 1000 if test_seed is None else test_seed
    test, seen = [], set()
    pool_n = 4 * n_test
    for _ in range(6):
        test, seen = [], set()
        for r in make_arithmetic_problems(pool_n, seed=tseed, kind=kind, max_value=max_value):
            if r["prompt"] not in seen:
                seen.add(r["prompt"])
                test.append(r)
                if len(test) == n_test:
                    break
        if len(test) == n_test:
            break
        pool_n *= 4
    if len(test) < n_test:
        raise ValueError(f"kind={kind!r} (max_value={max_value}) has too few distinct problems for n_test={n_test}")
    train: List[dict] = []
    pool_n = 2 * n_train + 16
    for _ in range(6):
        train = [r for r in make_arithmetic_problems(pool_n, seed=seed, kind=kind, max_value=max_value)
                 if r["prompt"] not in seen][:n_train]
        if len(train) == n_train:
            break
        pool_n *= 4
    if len(train) < n_train:
        raise ValueError(f"kind={kind!r} (max_value={max_value}) has no problems left outside the {n_test} held-out ones")
    return train, test


_BARE_SUM = re.compile(r"(\d+)\+(\d+)=")


def to_sft_rows(rows: Iterable[dict], slip: float = 0.0, careful_below: int = 0, seed: int = 1) -> List[dict]:
    """Math rows -> SFT rows ``{id, prompt, answer}`` (``answer`` = the first solution, ``id`` = ``query_id``).

    ``slip > 0`` makes the answers those of a *sloppy teacher* for bare sums ``"a+b="`` (kinds
    ``"easy"`` and ``"bare"``): when ``b >= careful_below`` it answers one too many (``a + b + 1``) with
    probability ``slip``; when ``b < careful_below`` it is always right. Draws are deterministic in
    ``seed``. A model that imitates the teacher (``slip > 0.5``) answers the careful problems right and
    the others one too many; a verifier reward can tell it which of its two likely answers is right —
    the fast RL learning test (``scripts/tiny_arith_learning.py``) is built on this.
    """
    if not 0.0 <= slip <= 1.0:
        raise ValueError(f"slip must be in [0, 1], got {slip!r}")
    rng = random.Random(f"sft-slip-{seed}")
    out = []
    for r in rows:
        answer = str(r["solutions"][0])
        if slip > 0:
            m = _BARE_SUM.fullmatch(r["prompt"])
            if m is None:
                raise ValueError(f"slip needs bare sums 'a+b=' (kinds 'easy', 'bare'); row {r['query_id']!r} has "
                                 f"prompt {r['prompt']!r}")
            u = rng.random()  # one draw per row, careful or not, so rows do not shift each other's draws
            if int(m.group(2)) >= careful_below and u < slip:
                answer = str(int(answer) + 1)
        out.append({"id": str(r["query_id"]), "prompt": r["prompt"], "answer": answer})
    return out


def write_sft_jsonl(rows: Iterable[dict], path: str, slip: float = 0.0, careful_below: int = 0, seed: int = 1) -> str:
    """Write math rows as SFT JSONL (see :func:`to_sft_rows`) to ``path``; returns ``path``."""
    import json
    import os

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        for r in to_sft_rows(rows, slip=slip, careful_below=careful_below, seed=seed):
            f.write(json.dumps(r) + "\n")
    return path
