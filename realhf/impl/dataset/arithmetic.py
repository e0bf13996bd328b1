"""Deterministic synthetic arithmetic problems (math rows) for tiny CPU runs.

``kind``:

* ``"add"``: word problems with one addition ("Tom has 12 apples and buys 7 more. How many apples
  does Tom have now?" -> ``["19"]``);
* ``"mixed"``: word problems with addition, subtraction (never negative) or multiplication;
* ``"easy"``: bare single-digit sums such as ``"3+4="`` -> ``["7"]``, learnable by a tiny model
  trained from scratch (``max_value`` is ignored).

The same ``(n, seed, kind, max_value)`` always gives the same rows; ``query_id`` is unique
(``arith-<kind>-<seed>-<i>``).
"""
from __future__ import annotations

import random
from typing import List

NAMES = ("Tom", "Anna", "Ravi", "Mei", "Lucas", "Sara", "Omar", "Ines", "Kofi", "Yuki")
OBJECTS = ("apples", "pencils", "marbles", "stickers", "books", "coins", "cookies", "shells")
KINDS = ("add", "mixed", "easy")


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
        else:
            op = "add" if kind == "add" else rng.choice(("add", "sub", "mul"))
            prompt, answer = _word_problem(rng, op, max_value)
        rows.append({"query_id": f"arith-{kind}-{seed}-{i}", "prompt": prompt, "solutions": [str(answer)], "task": "math"})
    return rows
