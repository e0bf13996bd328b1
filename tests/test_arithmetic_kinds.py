"""The synthetic arithmetic generator: the "bare" kind, held-out splits and SFT rows (with a sloppy teacher)."""
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
