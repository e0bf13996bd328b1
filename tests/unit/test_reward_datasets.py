"""Reference solutions of the shipped evaluation sets must grade as correct (>= 99%)."""
import json
import os
import time
from decimal import Decimal

import pytest

from realhf.base.process import source_root
from realhf.reward import MathVerifier, gsm8k_answer, last_boxed

DATA = os.path.join(source_root(), "evaluation", "data")
MIN_PASS = 0.99


def _rows(name, split="test"):
    path = os.path.join(DATA, name, f"{split}.jsonl")
    if not os.path.exists(path):
        pytest.skip(f"{path} not available")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="module")
def verifier():
    v = MathVerifier(timeout=10.0, max_workers=2)
    v.pool.warmup()
    yield v
    v.close()


def _check(verifier, name, completions, solutions):
    t0 = time.time()
    verifier.reset_stats()
    results = verifier.verify_batch(completions, solutions, max_workers=4)
    failures = [(i, c[-120:], s if isinstance(s, str) else s[0][-120:], st)
                for i, ((ok, st), c, s) in enumerate(zip(results, completions, solutions)) if not ok]
    rate = 1 - len(failures) / len(results)
    print(f"\n{name}: {rate:.2%} of {len(results)} in {time.time() - t0:.1f}s, stats {verifier.stats}")
    for f in failures:
        print("  FAIL", f)
    assert rate >= MIN_PASS, f"{name}: pass rate {rate:.2%} ({len(failures)} failures)"
    return rate


def test_math500_solution_self(verifier):
    rows = _rows("math_500")
    _check(verifier, "math_500 solution vs solution", [r["solution"] for r in rows], [[r["solution"]] for r in rows])


def test_math500_answer_field_vs_solution(verifier):
    rows = _rows("math_500")
    comps = [f"So the final answer is $\\boxed{{{r['answer']}}}$." for r in rows]
    _check(verifier, "math_500 answer field vs solution", comps, [[r["solution"]] for r in rows])


def test_math500_boxed_is_extracted():
    rows = _rows("math_500")
    assert all(last_boxed(r["solution"]) for r in rows)


def test_gsm8k(verifier):
    rows = _rows("gsm8k")
    _check(verifier, "gsm8k answer vs answer", [r["answer"] for r in rows], [[r["answer"]] for r in rows])
    comps = [f"The answer is \\boxed{{{gsm8k_answer(r['answer'])}}}" for r in rows]
    _check(verifier, "gsm8k boxed number vs answer", comps, [[r["answer"]] for r in rows])


@pytest.mark.parametrize("name", ["aime24", "aime25", "amc23"])
def test_competition_answers(verifier, name):
    rows = _rows(name)
    comps = [f"Therefore the answer is $\\boxed{{{r['answer']}}}$" for r in rows]
    _check(verifier, f"{name} boxed answer", comps, [[str(r["answer"])] for r in rows])
    comps = [f"The final answer is {r['answer']}." for r in rows]
    _check(verifier, f"{name} plain answer", comps, [[str(r["answer"])] for r in rows])


def test_math500_wrong_answers_rejected(verifier):
    """Another problem's answer must not grade as correct (checks the grader is not lenient)."""
    rows = _rows("math_500")
    comps, sols, keep = [], [], []
    for i, r in enumerate(rows):
        other = rows[(i + 1) % len(rows)]["answer"]
        if other.strip() == r["answer"].strip():
            continue
        comps.append(f"The final answer is $\\boxed{{{other}}}$.")
        sols.append([r["solution"]])
    verifier.reset_stats()
    t0 = time.time()
    results = verifier.verify_batch(comps, sols, max_workers=4)
    wrong = [(c, s[0][-80:]) for (ok, _), c, s in zip(results, comps, sols) if ok]
    print(f"\nmath_500 wrong answers: {len(wrong)} of {len(comps)} accepted in {time.time() - t0:.1f}s, stats {verifier.stats}")
    for w in wrong:
        print("  ACCEPTED", w)
    assert len(wrong) <= 0.01 * len(comps)


def test_gsm8k_wrong_numbers_rejected(verifier):
    rows = _rows("gsm8k")
    comps = [f"#### {Decimal(gsm8k_answer(r['answer'])) + 1}" for r in rows]
    results = verifier.verify_batch(comps, [[r["answer"]] for r in rows], max_workers=4)
    assert not any(ok for ok, _ in results)
