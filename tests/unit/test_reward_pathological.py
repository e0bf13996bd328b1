"""Pathological completions are graded within the time bound: caller-side work is linear in the text.

Every test runs under a hang detector (pytest-timeout at 60 s, far above what linear work needs on
a loaded machine; the former extraction was quadratic and took minutes on ``"\\boxed{" * 50000``).
No test asserts a wall-clock time.
"""
import pytest

from realhf.reward import MathVerifier, compare_answers, extract_answer, last_boxed, normalize_answer, verify_math_status

TIMEOUT = 2.0
hang_detector = pytest.mark.timeout(60, method="signal")

# (name, completion, reference, expected (correct, status)). "error": the extracted answer is longer
# than MAX_ANSWER_CHARS, which compare_answers rejects without looking at it.
CASES = [
    ("unclosed_boxes", "\\boxed{" * 50_000, "42", (False, "ok")),
    ("answer_then_unclosed_boxes", "\\boxed{42} " + "\\boxed{" * 25_000, "42", (True, "ok")),
    ("nested_boxes", "\\boxed{" * 20_000 + "7" + "}" * 20_000, "7", (True, "ok")),
    ("nested_boxes_unclosed_outside", "\\boxed{" * 20_000 + "7" + "}" * 10_000, "7", (True, "ok")),
    ("unclosed_braces", "\\boxed{" + "{" * 100_000 + "}", "1", (False, "ok")),
    ("framebox_without_group", "\\framebox[" * 20_000 + "]", "1", (False, "ok")),
    ("bare_boxes", "\\boxed $" * 25_000, "1", (False, "ok")),
    ("escaped_close", "\\boxed{" + "\\" * 100_001 + "}", "1", (False, "ok")),
    ("dollar_run", "The answer is " + "$" * 100_000, "1", (False, "ok")),
    ("paren_run", "The answer is " + "\\(" * 90_000, "1", (False, "error")),
    ("bracket_run", "The answer is " + "\\[" * 90_000, "1", (False, "error")),
    ("answer_is_one_line", "the answer is " * 10_000, "1", (False, "error")),
    ("answer_is_lines", "the answer is 3\n" * 10_000 + "so the answer is 42", "42", (True, "ok")),
    ("trailing_dots", "The answer is 5" + " ." * 90_000, "5", (True, "ok")),
    ("long_digits", "The answer is " + "1" * 150_000, "1", (False, "error")),
    ("long_gsm_number", "#### " + "9" * 150_000, "9", (False, "error")),
]


@hang_detector
@pytest.mark.parametrize("completion, ref, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_pathological_completion(completion, ref, expected):
    assert verify_math_status(completion, [ref], timeout=TIMEOUT) == expected


@hang_detector
def test_pathological_batch():
    with MathVerifier(timeout=TIMEOUT, max_workers=2) as v:
        res = v.verify_batch([c[1] for c in CASES] + [r"so \boxed{\frac{1}{2}}"], [[c[2]] for c in CASES] + [["0.5"]])
        assert res == [c[3] for c in CASES] + [(True, "ok")]
        assert v.stats["total"] == len(CASES) + 1


@hang_detector
def test_extraction_of_unclosed_boxes():
    text = "\\boxed{" * 50_000
    assert last_boxed(text) is None and extract_answer(text, allow_last_number=True) is None
    assert last_boxed(r"\boxed{\frac{1}{2}} " + text) == r"\frac{1}{2}"
    assert last_boxed(text + r"\boxed{3}") == "3"
    assert last_boxed(text + r"\boxed{3} " + "}" * 10) == "3"


@hang_detector
def test_normalize_long_runs():
    assert normalize_answer("1" + "\\!" * 100_000 + "cm") == "1"  # a 100k-space run before a unit...
    assert normalize_answer("1" + "\\!" * 100_000 + "x") == "1x"  # ...and before no unit
    assert normalize_answer("\\text{" * 20_000 + "5") == "\\text{" * 19_950 + "5"  # 50 unwraps at most


def test_nested_item_matching_checks_the_deadline():
    # 32 sets of 14 numbers, in reverse order on the other side: ~10^4 item comparisons in the caller
    def nested(rev):
        order = (lambda r: reversed(r)) if rev else (lambda r: r)
        inner = ["\\{" + ",".join(str(40 * i + j) for j in order(range(14))) + "\\}" for i in order(range(32))]
        return "\\{" + ",".join(inner) + "\\}"

    a, b = nested(False), nested(True)
    assert compare_answers(a, b, timeout=0.0) == (False, "timeout")
    assert compare_answers(r"\{1,\{2,3\}\}", r"\{\{3,2\},1\}", timeout=5.0) == (True, "ok")
