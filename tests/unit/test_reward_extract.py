import pytest

from realhf.reward import extract_answer, gsm8k_answer, last_boxed, normalize_answer


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"so $\boxed{\frac{1}{2}}$.", r"\frac{1}{2}"),
        (r"first \boxed{3}, then finally \boxed{4}", "4"),
        (r"\boxed{\left\{ 1, 2 \right\}}", r"\left\{ 1, 2 \right\}"),
        (r"\boxed{\{a\}}", r"\{a\}"),
        (r"answer: \fbox{7}", "7"),
        (r"$\framebox{204}$ minutes", "204"),
        (r"thus \boxed 5.", "5"),
        (r"\boxed{2} and a truncated \boxed{\frac{1}{", "2"),
        ("The answer is 5.", "5"),
        ("so the final answer is $\\frac{3}{4}$.", r"\frac{3}{4}"),
        ("THE ANSWER IS: 12", "12"),
        ("Final Answer: The final answer is $x = 3$. I hope it is correct.", "x = 3"),
        ("blah\n#### 1,234", "1234"),
        ("#### 72\n", "72"),
        ("no answer here, only 3 and 4", None),
        ("", None),
    ],
)
def test_extract(text, expected):
    assert extract_answer(text) == expected


def test_last_number_only_when_asked():
    text = "We get 3 apples and then 1,250 pears, costing 2.5 dollars"
    assert extract_answer(text) is None
    assert extract_answer(text, allow_last_number=True) == "2.5"
    assert extract_answer("total is -7 here", allow_last_number=True) == "-7"
    assert extract_answer("x = 1,250", allow_last_number=True) == "1250"
    # a boxed answer wins over the last number
    assert extract_answer(r"\boxed{9} and then 10", allow_last_number=True) == "9"


def test_last_boxed_nested():
    assert last_boxed(r"\boxed{\frac{\sqrt{3}}{2}}") == r"\frac{\sqrt{3}}{2}"
    assert last_boxed("nothing") is None


def test_gsm8k_answer():
    assert gsm8k_answer("She has 2*3=<<2*3=6>>6\n#### 1,234") == "1234"
    assert gsm8k_answer("#### -5") == "-5"
    with pytest.raises(ValueError):
        gsm8k_answer("no marker")


@pytest.mark.parametrize(
    "raw, expected",
    [
        (r"\dfrac12", r"\frac{1}{2}"),
        (r"\tfrac{3}{4}", r"\frac{3}{4}"),
        (r"\left( 3, \frac{\pi}{2} \right)", r"(3,\frac{\pi}{2})"),
        (r"10\text{ cm}", "10"),
        (r"12 \mbox{ square units}", "12"),
        ("5 dollars", "5"),
        (r"90^\circ", "90"),
        (r"90^{\circ}", "90"),
        (r"50\%", "50"),
        (r"\$5.00", "5"),
        ("1,000", "1000"),
        ("(1,000, 2)", "(1,000,2)"),
        ("x = 3", "3"),
        ("k = 5", "5"),
        (r"x \in [-2, 7]", "[-2,7]"),
        ("3/4", r"\frac{3}{4}"),
        (r"\sqrt2", r"\sqrt{2}"),
        (r"\frac12", r"\frac{1}{2}"),
        (".5", "0.5"),
        ("2.50", "2.5"),
        (r"1\!000", "1000"),
        (r"\text{(C)}", "C"),
        (r"\text{Evelyn}", "Evelyn"),
        (r"\pi r^2", r"\pi r^2"),
    ],
)
def test_normalize(raw, expected):
    assert normalize_answer(raw) == expected
    assert normalize_answer(normalize_answer(raw)) == expected  # idempotent
