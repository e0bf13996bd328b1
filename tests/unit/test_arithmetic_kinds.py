"""The synthetic arithmetic generator: the "bare" kind, held-out splits and SFT rows (with a sloppy teacher), and
the "mix" kind (one- and two-step word problems) with its split, disjoint in templates and in numbers."""
import collections
import hashlib
import json
import re

import pytest

from realhf.impl.dataset.arithmetic import KINDS, make_arithmetic_problems, make_heldout_split, to_sft_rows, write_sft_jsonl


def _digest(rows):
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16]


def test_existing_kinds_unchanged():
    # pinned before the "bare" kind and the helpers were added: their rows must not move
    assert _digest(make_arithmetic_problems(200, seed=1, kind="add", max_value=20)) == "8f78e4cf68bddb96"
    assert _digest(make_arithmetic_problems(200, seed=1, kind="mixed", max_value=20)) == "91020e8ea1b5bd85"
    assert _digest(make_arithmetic_problems(200, seed=1, kind="easy", max_value=20)) == "0b2a1656010281ea"


def test_bare_kind():
    assert "bare" in KINDS
    rows = make_arithmetic_problems(3000, seed=5, kind="bare", max_value=99)
    assert rows == make_arithmetic_problems(3000, seed=5, kind="bare", max_value=99)
    assert rows != make_arithmetic_problems(3000, seed=6, kind="bare", max_value=99)
    assert len({r["query_id"] for r in rows}) == len(rows)
    bs = set()
    for r in rows:
        m = re.fullmatch(r"(\d+)\+(\d)=", r["prompt"])
        assert m, r["prompt"]
        a, b = int(m.group(1)), int(m.group(2))
        assert 0 <= a <= 99 and r["solutions"] == [str(a + b)] and r["task"] == "math"
        assert r["query_id"].startswith("arith-bare-5-")
        bs.add(b)
    assert bs == set(range(10))
    assert len({r["prompt"] for r in rows}) > 900  # 1,000 distinct problems with max_value=99
    small = make_arithmetic_problems(200, seed=1, kind="bare", max_value=5)
    assert all(int(r["prompt"].split("+")[0]) <= 5 for r in small)


def test_heldout_split_is_disjoint_and_deterministic():
    train, test = make_heldout_split(500, 100, seed=3, kind="bare", max_value=99)
    assert len(train) == 500 and len(test) == 100
    assert len({r["prompt"] for r in test}) == 100
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    assert (train, test) == make_heldout_split(500, 100, seed=3, kind="bare", max_value=99)
    assert len({r["query_id"] for r in train + test}) == 600
    # word problems work too
    tr, te = make_heldout_split(50, 20, seed=1, kind="add", max_value=30)
    assert not {r["prompt"] for r in tr} & {r["prompt"] for r in te}
    with pytest.raises(ValueError, match="too few distinct"):
        make_heldout_split(10, 101, seed=1, kind="easy")  # only 100 single-digit sums exist
    with pytest.raises(ValueError):
        make_heldout_split(0, 10, kind="bare")


def test_sft_rows_and_sloppy_teacher(tmp_path):
    rows = make_arithmetic_problems(4000, seed=2, kind="bare", max_value=99)
    clean = to_sft_rows(rows)
    assert clean[0] == {"id": rows[0]["query_id"], "prompt": rows[0]["prompt"], "answer": rows[0]["solutions"][0]}
    assert all(c["answer"] == r["solutions"][0] for c, r in zip(clean, rows))

    noisy = to_sft_rows(rows, slip=0.85, careful_below=2, seed=1)
    assert noisy == to_sft_rows(rows, slip=0.85, careful_below=2, seed=1)
    assert noisy != to_sft_rows(rows, slip=0.85, careful_below=2, seed=2)
    n_sloppy = n_slipped = 0
    for c, r in zip(noisy, rows):
        b = int(r["prompt"].split("+")[1][:-1])
        d = int(c["answer"]) - int(r["solutions"][0])
        if b < 2:
            assert d == 0  # careful: always right
        else:
            assert d in (0, 1)  # otherwise right, or one too many
            n_sloppy += 1
            n_slipped += d
    assert abs(n_slipped / n_sloppy - 0.85) < 0.03
    # one draw per row: changing careful_below does not reshuffle the other rows' draws
    all_sloppy = to_sft_rows(rows, slip=0.85, careful_below=0, seed=1)
    assert all(a["answer"] == b["answer"] for a, b in zip(noisy, all_sloppy) if int(a["prompt"].split("+")[1][:-1]) >= 2)

    path = write_sft_jsonl(rows[:10], str(tmp_path / "d" / "sft.jsonl"), slip=1.0, careful_below=0)
    got = [json.loads(l) for l in open(path)]
    assert [g["answer"] for g in got] == [str(int(r["solutions"][0]) + 1) for r in rows[:10]]

    from realhf.impl.dataset import PromptAnswerDataset, validate_jsonl

    assert validate_jsonl(path, PromptAnswerDataset.REQUIRED, PromptAnswerDataset.OPTIONAL) == 10

    with pytest.raises(ValueError, match="bare sums"):
        to_sft_rows(make_arithmetic_problems(3, kind="add"), slip=0.5)
    with pytest.raises(ValueError, match="slip"):
        to_sft_rows(rows, slip=1.5)


# ------------------------------------------------------------------------------------------- the "mix" kind
FORMULA = {"add1": lambda a, b: a + b, "sub1": lambda a, b: a - b, "mul1": lambda a, b: a * b,
           "add_sub2": lambda a, b, c: a + b - c, "mul_add2": lambda a, b, c: a * b + c,
           "mul_sub2": lambda a, b, c: a * b - c}
COMMUTATIVE_FIRST_STEP = {"add1", "mul1", "add_sub2", "mul_add2", "mul_sub2"}


def _problem(row, instruction):
    assert row["prompt"].endswith("\n" + instruction), row["prompt"]
    return row["prompt"][: -len(instruction) - 1]


def _numbers(row, instruction):
    return tuple(int(x) for x in re.findall(r"\d+", _problem(row, instruction)))


def _combination(kind, ops):
    """Operands up to the order of a commutative first step (3+4 and 4+3 are one combination)."""
    return (kind,) + (tuple(sorted(ops[:2])) + ops[2:] if kind in COMMUTATIVE_FIRST_STEP else ops)


def _balanced(rows):
    counts = collections.Counter(r["kind"] for r in rows)
    assert set(counts) == set(FORMULA) and max(counts.values()) - min(counts.values()) <= 1, counts


def test_mix_split_answers_balance_and_disjointness():
    from realhf.impl.dataset.arithmetic import DEFAULT_INSTRUCTION, MIX_NAMES, MIX_OBJECTS, make_mix_split

    train, test = make_mix_split(3000, 120, seed=2)
    assert len(train) == 3000 and len(test) == 120
    assert (train, test) == make_mix_split(3000, 120, seed=2)
    assert len({r["query_id"] for r in train + test}) == 3120
    assert len({r["prompt"] for r in test}) == 120
    _balanced(train)
    _balanced(test)
    combos = {}
    for split, rows in (("train", train), ("test", test)):
        for r in rows:
            ops = _numbers(r, DEFAULT_INSTRUCTION)
            kind = r["kind"]
            assert len(ops) == (2 if kind.endswith("1") else 3), r
            want = FORMULA[kind](*ops)  # computed here, from the numbers as the prompt states them
            assert r["solutions"] == [str(want)] and want >= 0 and r["task"] == "math", r
            if kind.startswith("mul"):
                assert 2 <= ops[0] <= 9 and 2 <= ops[1] <= 9 and all(1 <= x <= 20 for x in ops[2:]), r
            else:
                assert all(1 <= x <= 20 for x in ops), r
            combos.setdefault(split, set()).add(_combination(kind, ops))
    # numbers: no operand combination of a held-out problem appears in training (in any order where it commutes)
    assert not combos["train"] & combos["test"]
    assert len(combos["test"]) > 60  # and the held-out problems are not a handful of combinations

    # templates: names, objects and sentence frames of held-out prompts never appear in training
    def words(rows):
        return set().union(*(re.findall(r"[A-Za-z]+", _problem(r, DEFAULT_INSTRUCTION)) for r in rows))

    train_words, test_words = words(train), words(test)
    held = set(MIX_NAMES["test"]) | set(MIX_OBJECTS["test"])
    assert held <= test_words and not held & train_words
    assert not (set(MIX_NAMES["train"]) | set(MIX_OBJECTS["train"])) & test_words
    fill = {w: "N" for fam in MIX_NAMES.values() for w in fam} | {w: "O" for fam in MIX_OBJECTS.values() for w in fam}

    def frame(r):
        return re.sub(r"[A-Za-z]+", lambda m: fill.get(m.group(0), m.group(0)),
                      re.sub(r"\d+", "#", _problem(r, DEFAULT_INSTRUCTION)))

    train_frames, test_frames = {frame(r) for r in train}, {frame(r) for r in test}
    assert len(test_frames) >= 6 and not train_frames & test_frames
    # a frame is also not a near copy: each held-out frame shares no 4-word run with any training frame
    grams = lambda f: {tuple(f.split()[i:i + 4]) for i in range(len(f.split()) - 3)}  # noqa: E731
    train_grams = set().union(*(grams(f) for f in train_frames))
    assert all(not grams(f) & train_grams for f in test_frames), [f for f in test_frames if grams(f) & train_grams]


def test_mix_options_and_entry_points(tmp_path):
    from realhf.impl.dataset import make_arithmetic_problems, validate_jsonl, write_math_jsonl
    from realhf.impl.dataset.arithmetic import (DEFAULT_INSTRUCTION, make_heldout_split, make_mix_problems,
                                                make_mix_split)
    from realhf.impl.dataset.math import MATH_OPTIONAL, MATH_REQUIRED

    assert "mix" in KINDS and "The answer is" in DEFAULT_INSTRUCTION
    # the instruction is an option; "" leaves the bare problem
    said = "End with: The answer is N."
    tr, te = make_mix_split(12, 6, seed=1, instruction=said)
    assert all(r["prompt"].endswith("\n" + said) for r in tr + te)
    bare = make_mix_problems(6, seed=1, instruction="")
    assert all("\n" not in r["prompt"] and r["prompt"].endswith("?") for r in bare)
    # a subset of kinds, balanced
    only = make_mix_problems(40, seed=3, kinds=("add1", "mul_add2"))
    assert collections.Counter(r["kind"] for r in only) == {"add1": 20, "mul_add2": 20}
    # the generic entry points: training-family rows, and the disjoint split
    assert make_arithmetic_problems(30, seed=4, kind="mix") == make_mix_problems(30, seed=4, family="train")
    assert make_heldout_split(30, 12, seed=4, kind="mix") == make_mix_split(30, 12, seed=4)
    # rows (with their "kind") are valid math rows
    path = str(tmp_path / "mix.jsonl")
    write_math_jsonl(te, path)
    assert validate_jsonl(path, MATH_REQUIRED, MATH_OPTIONAL) == 6
    assert [json.loads(l)["kind"] for l in open(path)] == [r["kind"] for r in te]
    for bad in (dict(kinds=("div1",)), dict(kinds=()), dict(family="valid"), dict(max_value=2)):
        with pytest.raises(ValueError):
            make_mix_problems(4, **bad)
