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
  (the fast GRPO learning test, ``scripts/tiny_arith_learning.py``, uses it);
* ``"mix"``: one- and two-step word problems of the kinds :data:`MIX_KINDS` (each row's ``"kind"``),
  ending with an instruction that states the answer format; :func:`make_mix_split` gives training and
  held-out rows whose templates and numbers are disjoint (see there). ``make_arithmetic_problems(kind=
  "mix")`` gives rows of the training family.

The same ``(n, seed, kind, max_value)`` always gives the same rows; ``query_id`` is unique
(``arith-<kind>-<seed>-<i>``).

Helpers for learning tests: :func:`make_heldout_split` gives training and held-out rows with disjoint
prompts (for "mix": disjoint templates and numbers, :func:`make_mix_split`); :func:`to_sft_rows` / :func:`write_sft_jsonl` turn math rows into SFT ``{id, prompt, answer}``
rows (the answer is the first solution, or a sloppy teacher's answer).
"""
from __future__ import annotations

import random
import re
import zlib
from typing import Iterable, List, Optional, Sequence, Tuple

NAMES = ("Tom", "Anna", "Ravi", "Mei", "Lucas", "Sara", "Omar", "Ines", "Kofi", "Yuki")
OBJECTS = ("apples", "pencils", "marbles", "stickers", "books", "coins", "cookies", "shells")
KINDS = ("add", "mixed", "easy", "bare", "mix")


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
    if kind == "mix":
        return make_mix_problems(n, seed=seed, family="train", max_value=max_value)
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
    if kind == "mix":  # held out by template and by numbers, not only by prompt
        return make_mix_split(n_train, n_test, seed=seed, max_value=max_value, test_seed=test_seed)
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


# ---------------------------------------------------------------------------------------------- the "mix" kind
MIX_KINDS = ("add1", "sub1", "mul1", "add_sub2", "mul_add2", "mul_sub2")
# SmolLM2-135M-Instruct copies a placeholder such as "\boxed{N}" (or an example calculation) literally; this one it
# follows: on 48 held-out problems (greedy, 128 tokens) 12.5% strictly right with every answer ended, against 0%
# for 'End your answer with "The answer is" and the number.', which it mostly answers without a calculation
DEFAULT_INSTRUCTION = 'Write the calculation with the numbers, then end with "The answer is" and the number.'
# Two template families: the training rows use only "train", the held-out rows only "test" (names, objects and
# sentence frames all differ). Every frame states the operands in the order of the formula of its kind:
# add1 a+b, sub1 a-b, mul1 a*b, add_sub2 a+b-c, mul_add2 a*b+c, mul_sub2 a*b-c.
MIX_NAMES = {"train": ("Tom", "Anna", "Ravi", "Mei", "Lucas", "Sara", "Omar", "Ines"),
             "test": ("Kofi", "Yuki", "Elena", "Marco", "Priya", "Jonas")}
MIX_OBJECTS = {"train": ("apples", "pencils", "marbles", "stickers", "books", "coins"),
               "test": ("cookies", "shells", "cards", "stamps", "beads", "buttons")}
MIX_FRAMES = {
    "train": {
        "add1": ("{n} has {a} {o} and buys {b} more. How many {o} does {n} have now?",
                 "{n} had {a} {o}. A friend gave {n} {b} more {o}. How many {o} does {n} have now?",
                 "A jar contains {a} {o}. {n} drops {b} more {o} into the jar. How many {o} are in the jar?",
                 "{n} picked {a} {o} in the morning and {b} {o} in the afternoon. How many {o} did {n} pick "
                 "altogether?"),
        "sub1": ("{n} has {a} {o} and gives away {b}. How many {o} does {n} have left?",
                 "{n} had {a} {o} and lost {b} of them. How many {o} does {n} have now?",
                 "A bag contains {a} {o}. {n} removes {b} {o} from the bag. How many {o} remain in the bag?",
                 "{n} made {a} {o} and sold {b} of them. How many {o} are not sold?"),
        "mul1": ("{n} buys {a} bags with {b} {o} in each bag. How many {o} does {n} buy in all?",
                 "A classroom has {a} tables, and each table has {b} {o}. How many {o} are there in total?",
                 "{n} stacks {a} piles of {o} with {b} {o} in every pile. How many {o} are in the piles?",
                 "There are {a} plates with {b} {o} on each plate. How many {o} are on the plates?"),
        "add_sub2": ("{n} has {a} {o}, buys {b} more, then gives away {c}. How many {o} does {n} have left?",
                     "A jar contains {a} {o}. {n} drops in {b} more {o} and then takes {c} {o} out. How many {o} "
                     "are in the jar?",
                     "{n} had {a} {o}, found {b} more and lost {c}. How many {o} does {n} have now?"),
        "mul_add2": ("{n} buys {a} bags with {b} {o} in each bag and already had {c} {o}. How many {o} does {n} "
                     "have now?",
                     "{n} has {a} piles of {o} with {b} {o} in every pile, plus {c} loose {o}. How many {o} does "
                     "{n} have in all?",
                     "There are {a} plates with {b} {o} on each plate and {c} extra {o} beside them. How many {o} are "
                     "there altogether?"),
        "mul_sub2": ("{n} buys {a} bags with {b} {o} in each bag, then gives away {c} {o}. How many {o} does {n} "
                     "have left?",
                     "{n} has {a} piles of {o} with {b} {o} in every pile and sells {c} of them. How many {o} are "
                     "not sold?",
                     "There are {a} plates with {b} {o} on each plate. {n} takes {c} {o} away. How many {o} are "
                     "still on the plates?"),
    },
    "test": {  # three frames a kind: how a run reads one frame moves a third of a kind's problems, not all of them
        "add1": ("There are {a} {o} in a box. {n} puts in {b} more {o}. What is the number of {o} in the box now?",
                 "{n} collects {a} {o} on Monday and {b} {o} on Tuesday. What is the number of {o} collected over "
                 "the two days?",
                 "{n} owns {a} {o} and gets {b} more as a gift. What is the number of {o} {n} owns now?"),
        "sub1": ("A basket holds {a} {o}. {n} takes out {b} {o}. What is the number of {o} still in the basket?",
                 "{n} owns {a} {o} and hands {b} of them to a friend. What is the number of {o} {n} still owns?",
                 "There were {a} {o} on the desk. {n} used {b} of them. What is the number of {o} left on the desk?"),
        "mul1": ("{n} lays out {a} rows of {o}, {b} {o} per row. What is the total number of {o}?",
                 "{n} keeps {a} packs of {o}, and every pack holds {b} {o}. What is the number of {o} in the packs?",
                 "Each of {a} shelves holds {b} {o}. What is the total number of {o} on the shelves?"),
        "add_sub2": ("A shelf has {a} {o}. {n} adds {b} {o} and later removes {c} {o}. What is the number of {o} on "
                     "the shelf at the end?",
                     "{n} starts with {a} {o}, gets {b} more, and then hands {c} to a friend. What is the number of "
                     "{o} {n} owns at the end?",
                     "A drawer holds {a} {o}. {n} puts {b} more {o} in and later pulls {c} {o} out. What is the "
                     "number of {o} in the drawer now?"),
        "mul_add2": ("{n} fills {a} jars, {b} {o} per jar, and {c} more {o} lie on the table. What is the total "
                     "number of {o}?",
                     "{n} keeps {a} packs of {o}, every pack holding {b} {o}, and {c} single {o}. What is the "
                     "number of {o} {n} keeps in total?",
                     "Each of {a} shelves holds {b} {o}, and {c} more {o} sit on the floor. What is the total "
                     "number of {o}?"),
        "mul_sub2": ("{n} packs {a} boxes, {b} {o} per box, then hands out {c} {o}. What is the number of {o} still "
                     "packed?",
                     "{n} keeps {a} packs of {o}, every pack holding {b} {o}, and uses up {c} {o}. What is the "
                     "number of {o} left?",
                     "Each of {a} shelves holds {b} {o}. {n} clears {c} {o} off the shelves. What is the number of "
                     "{o} still on the shelves?"),
    },
}
MIX_FAMILIES = ("train", "test")
MUL_MAX = 9  # factors of the multiplications are in [2, MUL_MAX]
HELDOUT_EVERY = 4  # one operand combination in HELDOUT_EVERY (by hash) belongs to the held-out family


def mix_answer(kind: str, ops: Tuple[int, ...]) -> int:
    """The answer of a ``kind`` problem with operands ``ops`` (in the order the prompt states them)."""
    a, b, *c = ops
    return {"add1": lambda: a + b, "sub1": lambda: a - b, "mul1": lambda: a * b, "add_sub2": lambda: a + b - c[0],
            "mul_add2": lambda: a * b + c[0], "mul_sub2": lambda: a * b - c[0]}[kind]()


def operand_key(kind: str, ops: Tuple[int, ...]) -> Tuple[int, ...]:
    """The operand combination of a problem, with the operands of the commutative first step sorted
    (``3+4`` and ``4+3``, ``2*5`` and ``5*2`` are one combination; the subtrahend keeps its place)."""
    if kind == "sub1":
        return tuple(ops)
    return tuple(sorted(ops[:2])) + tuple(ops[2:])


def operand_family(kind: str, ops: Tuple[int, ...]) -> str:
    """``"test"`` for the operand combinations held out (a fixed hash of ``(kind, operand_key)``: about one
    combination in ``HELDOUT_EVERY``), else ``"train"``; so the two families never share a combination."""
    h = zlib.crc32(f"{kind}:{','.join(map(str, operand_key(kind, ops)))}".encode())
    return "test" if h % HELDOUT_EVERY == 0 else "train"


def _draw_operands(rng: random.Random, kind: str, max_value: int) -> Tuple[int, ...]:
    hi = max(3, max_value)
    if kind == "add1":
        return rng.randint(2, hi), rng.randint(2, hi)
    if kind == "sub1":
        a = rng.randint(3, hi)
        return a, rng.randint(1, a - 1)
    if kind == "mul1":
        return rng.randint(2, MUL_MAX), rng.randint(2, MUL_MAX)
    if kind == "add_sub2":
        a, b = rng.randint(2, hi), rng.randint(2, hi)
        return a, b, rng.randint(1, min(hi, a + b - 1))
    if kind == "mul_add2":
        return rng.randint(2, MUL_MAX), rng.randint(2, MUL_MAX), rng.randint(1, hi)
    if kind == "mul_sub2":
        a, b = rng.randint(2, MUL_MAX), rng.randint(2, MUL_MAX)
        return a, b, rng.randint(1, min(hi, a * b - 1))
    raise ValueError(f"unknown mix kind {kind!r}; choose from {list(MIX_KINDS)}")


def make_mix_problems(n: int, seed: int = 1, family: str = "train", max_value: int = 20,
                      kinds: Sequence[str] = MIX_KINDS, instruction: str = DEFAULT_INSTRUCTION) -> List[dict]:
    """``n`` math rows ``{query_id, prompt, solutions, task, kind}`` of the template ``family`` ("train" or "test"),
    whose operand combinations all belong to that family (:func:`operand_family`). Kinds are balanced: each
    block of ``len(kinds)`` rows holds every kind once, in a random order. Additions and subtractions use numbers
    in ``[1, max_value]`` (results never negative), multiplications factors in ``[2, MUL_MAX]``
    (the number added to or taken from a product is in ``[1, max_value]``). ``instruction``
    (e.g. how to state the final answer) ends every prompt, on a line of its own ("" = none)."""
    if family not in MIX_FAMILIES:
        raise ValueError(f"family={family!r} is not allowed; choose one of {list(MIX_FAMILIES)}")
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive integer, got {n!r}")
    if not isinstance(max_value, int) or max_value < 3:
        raise ValueError(f"max_value must be an integer >= 3 for the mix kind, got {max_value!r}")
    kinds = tuple(kinds)
    bad = [k for k in kinds if k not in MIX_KINDS]
    if not kinds or bad:
        raise ValueError(f"kinds must be a non-empty subset of {list(MIX_KINDS)}, got {list(kinds)}")
    rng = random.Random(f"arith-mix-{family}-{seed}-{max_value}-{','.join(kinds)}")
    rows: List[dict] = []
    order: List[str] = []
    for i in range(n):
        if not order:
            order = list(kinds)
            rng.shuffle(order)
        kind = order.pop()
        ops = _draw_operands(rng, kind, max_value)
        while operand_family(kind, ops) != family:
            ops = _draw_operands(rng, kind, max_value)
        frame = rng.choice(MIX_FRAMES[family][kind])
        text = frame.format(n=rng.choice(MIX_NAMES[family]), o=rng.choice(MIX_OBJECTS[family]), a=ops[0], b=ops[1],
                            c=ops[2] if len(ops) > 2 else "")
        prompt = f"{text}\n{instruction}" if instruction else text
        rows.append({"query_id": f"arith-mix-{family}-{seed}-{i}", "prompt": prompt,
                     "solutions": [str(mix_answer(kind, ops))], "task": "math", "kind": kind})
    return rows


def make_mix_split(n_train: int, n_test: int, seed: int = 1, max_value: int = 20, kinds: Sequence[str] = MIX_KINDS,
                   instruction: str = DEFAULT_INSTRUCTION, test_seed: Optional[int] = None
                   ) -> Tuple[List[dict], List[dict]]:
    """``(train, test)`` rows of the "mix" kind, held out twice over: ``test`` uses only the "test" template
    family (names, objects and sentence frames that no training prompt uses) and only operand combinations that
    :func:`operand_family` reserves for it (so no training problem has the same numbers in the same roles, up to
    the order of a commutative first step). ``test`` prompts are distinct (drawn with ``test_seed``, default
    ``seed + 1000``); ``train`` prompts may repeat. Both are balanced over ``kinds``."""
    if not isinstance(n_test, int) or n_test < 1:
        raise ValueError(f"n_test must be a positive integer, got {n_test!r}")
    tseed = seed + 1000 if test_seed is None else test_seed
    kinds = tuple(kinds)
    quota = {k: n_test // len(kinds) + (i < n_test % len(kinds)) for i, k in enumerate(kinds)}  # balanced
    test, seen = [], set()
    for r in make_mix_problems(8 * n_test, seed=tseed, family="test", max_value=max_value, kinds=kinds,
                               instruction=instruction):
        if r["prompt"] not in seen and quota[r["kind"]] > 0:
            seen.add(r["prompt"])
            quota[r["kind"]] -= 1
            test.append(r)
    if len(test) < n_test:
        raise ValueError(f"the mix kind (max_value={max_value}) has too few distinct problems for n_test={n_test}")
    train = make_mix_problems(n_train, seed=seed, family="train", max_value=max_value, kinds=kinds,
                              instruction=instruction)
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
