"""Math answer extraction and grading, safe and time-bounded.

One implementation for training rewards and evaluation:

* ``extract_answer(text, allow_last_number=False)`` — last ``\\boxed{}``/``\\fbox{}``, ``#### N``,
  "the answer is ...", optionally the last number;
* ``normalize_answer(s)`` — canonical string form (LaTeX noise, units, formatting);
* ``math_equal(pred, ref, rel_tol=1e-4, timeout=5.0)`` — string / number / structure / sympy
  equality; ``compare_answers`` returns ``(equal, status)``;
* ``verify_math(completion, solutions, timeout=5.0)`` and ``MathVerifier.verify_batch`` for many
  completions with ``(correct, status)`` and status counts;
* ``gsm8k_answer(answer_field)``.

Model text is never passed to ``eval``/``exec``/``sympify``: plain arithmetic is evaluated by a
small safe parser (``arith.py``); everything else is parsed by a LaTeX grammar into sympy inside
isolated worker processes (``safe.py``) that are killed when they overrun their timeout.
What runs in the calling thread (extraction, normalisation, string and number comparisons) is
linear in the text length or checks the deadline, so ``timeout`` bounds a grading call as a whole.
Importing this package does not import sympy.
"""
from realhf.reward.equal import MAX_ANSWER_CHARS, compare_answers, math_equal
from realhf.reward.extract import extract_answer, gsm8k_answer, last_boxed
from realhf.reward.normalize import normalize_answer
from realhf.reward.safe import WorkerPool, get_default_pool
from realhf.reward.verify import MathVerifier, reference_answer, verify_math, verify_math_status

__all__ = [
    "MAX_ANSWER_CHARS",
    "MathVerifier",
    "WorkerPool",
    "compare_answers",
    "extract_answer",
    "get_default_pool",
    "gsm8k_answer",
    "last_boxed",
    "math_equal",
    "normalize_answer",
    "reference_answer",
    "verify_math",
    "verify_math_status",
]
