import pytest

from realhf.reward import compare_answers, math_equal

EQUAL = [
    (r"\dfrac12", "0.5"),
    (r"\frac{1}{2}", "1/2"),
    (r"50\%", "50"),
    (r"50\%", "0.5"),  # a percent sign on either side allows a factor of 100
    ("(1,2)", "(1, 2)"),
    (r"x\in[-2,7]", "[-2,7]"),
    (r"\frac{\sqrt{3}}{2}", r"\sqrt{3}/2"),
    (r"10\text{ cm}", "10"),
    (r"90^\circ", "90"),
    (r"\$5.00", "5"),
    ("1,000", "1000"),
    ("2x+1", "1+2x"),
    ("x=3", "3"),
    (r"\left(3,\frac{\pi}{2}\right)", r"(3,\frac{\pi}{2})"),
    ("0.333333", r"\frac13"),  # within the default rel_tol=1e-4
    (r"\sqrt{8}", r"2\sqrt{2}"),
    (r"\pi/2", r"\frac{\pi}{2}"),
    ("y=2x+1", "2x+1=y"),
    ("2y=4x+2", "y=2x+1"),  # same equation up to a constant factor
    ("1,-2", "-2, 1"),  # bare lists of solutions are unordered
    (r"\{3, 1\}", r"\{1,3\}"),
    (r"[-2,7)\cup(8,\infty)", r"[-2, 7) \cup (8, \infty)"),
    (r"\text{Evelyn}", "evelyn"),
    ("6-5i", "-5i+6"),
    (r"x^2-1", "(x-1)(x+1)"),
    ("1.5e3", "1500"),
    ("2^{10}", "1024"),
    (r"\begin{pmatrix}1\\2\end{pmatrix}", r"\begin{pmatrix}1\\ 2\end{pmatrix}"),
    (r"\frac{1}{\sqrt{2}}", r"\frac{\sqrt{2}}{2}"),
    (r"\$1,234.50", "1234.5"),
    (r"10\text{ cm}^2", "10"),
    (r"3 \text{ and } 4", "4, 3"),
    ("x = 1 or x = 2", "1, 2"),
    (r"\text{(C)}", "C"),
    (r"\sqrt[3]{27}", "3"),
    (r"2\frac{1}{2}", "2.5"),  # mixed number
]

NOT_EQUAL = [
    ("1/2", "0.6"),
    ("(1,2)", "(2,1)"),
    ("[1,2]", "(1,2)"),
    ("3", "-3"),
    ("x+1", "x-1"),
    ("50", "0.5"),  # no percent sign: no factor of 100
    ("0.33", r"\frac13"),
    ("10000", "10001"),  # integers compare exactly
    ("(1,2)", "1"),
    (r"\text{Evelyn}", "5"),
    ("y=2x+1", "y=2x-1"),
    (r"\sqrt{2}", "1.41"),
    ("", "5"),
]


@pytest.mark.parametrize("pred, ref", EQUAL)
def test_equal(pred, ref):
    assert compare_answers(pred, ref) == (True, "ok")
    assert math_equal(ref, pred)


@pytest.mark.parametrize("pred, ref", NOT_EQUAL)
def test_not_equal(pred, ref):
    assert compare_answers(pred, ref) == (False, "ok")


def test_tolerance_is_configurable():
    assert math_equal("3.14", r"\pi", rel_tol=1e-3)
    assert not math_equal("3.14", r"\pi")
    assert math_equal("0.3333", r"\frac{1}{3}", rel_tol=1e-3)


def test_none_and_too_long():
    assert compare_answers(None, "1") == (False, "ok")
    assert compare_answers("1" * 5000, "1") == (False, "error")
