"""Mathematical equality of two final answers, fast paths first, sympy in a worker last.

Decision procedure of :func:`compare_answers` (``pred`` is the model's answer, ``ref`` the
ground truth):

1. Inputs longer than ``MAX_ANSWER_CHARS`` are rejected (False, ``"error"``).
2. Normalised strings equal (``normalize.py``) -> True. Pure words compare case-insensitively.
3. Both are equations ``l = r`` -> same equation (sides swapped, or ``l - r`` proportional).
   Otherwise a single-variable prefix is dropped (``x = 3`` -> ``3``, ``x \\in [a,b]``).
4. Structures: intervals and tuples ``(..)``/``[..]`` compare element-wise in order and the
   bracket kinds must match (``[1,2]`` != ``(1,2)``); sets ``\\{..\\}`` and bare lists ``1, 2``
   compare as multisets; unions ``A \\cup B`` piece by piece. A structure never equals a scalar.
5. Plain numbers (``arith.py``, exact fractions, no process round trip): two integers must be
   equal; otherwise relative tolerance ``rel_tol`` (default 1e-4, so ``0.333333`` ==
   ``\\frac13`` but ``0.33`` != ``\\frac13``). Percent: when either raw answer contains ``%``,
   ``pred`` may equal ``ref``, ``ref/100`` or ``ref*100`` (``50\\%`` == ``50`` == ``0.5``);
   without a ``%`` sign ``50`` != ``0.5``. A number too large to build (``9^{9^{9^9}}``)
   gives False with status ``"error"``.
6. Anything else goes to sympy (``symbolic.py``) in a worker process of the pool, bounded by
   ``timeout`` seconds for the whole comparison; overrunning gives False, ``"timeout"``.

Steps 1-5 run in the calling thread. Each is linear in the (capped) answer length, except the
item matching of structures (quadratic in at most ``MAX_ITEMS`` items per level), whose nested
comparisons check the deadline and give up with ``"timeout"`` like a worker would.

Status ``"ok"`` means the comparison was decided (True or False, including answers that do not
parse); ``"timeout"``/``"error"`` mean the grader gave up and scored False.
"""
from __future__ import annotations

import re
import time
from fractions import Fraction

from realhf.reward.arith import TooLarge, parse_number
from realhf.reward.normalize import normalize_answer, strip_assignment
from realhf.reward.safe import WorkerPool, get_default_pool

MAX_ANSWER_CHARS = 2000
MAX_ITEMS = 32

_OPEN = {"(": ")", "[": "]"}


class _Ctx:
    def __init__(self, rel_tol: float, timeout: float, pool: WorkerPool | None, pct: bool):
        self.rel_tol = rel_tol
        self.deadline = time.monotonic() + timeout
        self.pool = pool
        self.pct = pct
        self.status = "ok"

    def fail(self, status: str) -> bool:
        if self.status == "ok" or status == "timeout":
            self.status = status
        return False

    def symbolic(self, kind: str, a, b) -> bool:
        if self.status == "timeout":
            return False
        left = self.deadline - time.monotonic()
        if left <= 0:
            return self.fail("timeout")
        pool = self.pool or get_default_pool()
        status, value = pool.run("compare", [kind, a, b, self.rel_tol, self.pct], left)
        if status != "ok":
            return self.fail(status)
        return bool(value)


def _split_top(s: str, sep: str) -> list[str]:
    """Split on ``sep`` outside of (), [], {} and ``\\{ \\}``."""
    out, depth, start, i, n = [], 0, 0, 0, len(s)
    while i < n:
        c = s[i]
        if c == "\\" and i + 1 < n:
            if s[i + 1] == "{":
                depth += 1
            elif s[i + 1] == "}":
                depth -= 1
            elif depth == 0 and s.startswith(sep, i):
                out.append(s[start:i])
                start = i + len(sep)
                i = start
                continue
            i += 2
            continue
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif depth == 0 and s.startswith(sep, i):
            out.append(s[start:i])
            start = i + len(sep)
            i = start
            continue
        i += 1
    out.append(s[start:])
    return out


def _outer_close(s: str) -> int:
    """Index where the bracket opened at ``s[0]`` closes (any of ``)]``), or -1."""
    depth = 0
    for i, c in enumerate(s):
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return i
    return -1


def _structure(s: str):
    """``(kind, brackets, items)`` for unions, tuples/intervals, sets and bare lists, else None."""
    parts = _split_top(s, "\\cup")
    if len(parts) > 1:
        return "union", "", parts
    if s.startswith("\\{") and s.endswith("\\}"):
        return "set", "", _split_top(s[2:-2], ",")
    if s[:1] in _OPEN and s[-1:] in ")]" and _outer_close(s) == len(s) - 1:
        items = _split_top(s[1:-1], ",")
        if len(items) > 1:
            return "seq", s[0] + s[-1], items
        return None
    items = _split_top(s, ",")
    if len(items) > 1:
        return "set", "", items
    return None


def _is_word(s: str) -> bool:
    return bool(re.fullmatch(r"[A-Za-z][A-Za-z']*", s))


def _top_level_eq(s: str) -> list[str] | None:
    parts = _split_top(s, "=")
    if len(parts) != 2 or not parts[0] or not parts[1]:
        return None
    if parts[0][-1:] in "<>!" or parts[1][:1] == "=":
        return None
    return parts


def _numbers_close(a: Fraction, b: Fraction, ctx: _Ctx) -> bool:
    cands = [b, b / 100, b * 100] if ctx.pct else [b]
    for c in cands:
        if a == c:
            return True
        if a.denominator == 1 and c.denominator == 1:
            continue  # two integers: exact
        if abs(a - c) <= Fraction(ctx.rel_tol) * max(abs(a), abs(c)):
            return True
    return False


def _eq(a_raw: str, b_raw: str, ctx: _Ctx, depth: int = 0) -> bool:
    if depth > 4:
        return False
    if depth and time.monotonic() > ctx.deadline:
        return ctx.fail("timeout")  # matching many nested items in this thread must respect the bound too
    a = normalize_answer(a_raw, strip_assign=False)
    b = normalize_answer(b_raw, strip_assign=False)
    if a == b:
        return True
    if not a or not b:
        return False
    ea, eb = _top_level_eq(a), _top_level_eq(b)
    if ea and eb:
        if ea == eb or ea == eb[::-1]:
            return True
        return ctx.symbolic("eq", ea, eb)
    a, b = strip_assignment(a), strip_assignment(b)
    if a == b:
        return True
    if _is_word(a) and _is_word(b):
        return a.lower() == b.lower()
    sa, sb = _structure(a), _structure(b)
    if sa or sb:
        if not (sa and sb) or sa[0] != sb[0] or sa[1] != sb[1] or len(sa[2]) != len(sb[2]):
            return False
        if len(sa[2]) > MAX_ITEMS:
            return ctx.fail("error")
        if sa[0] in ("seq", "union"):
            return all(_eq(x, y, ctx, depth + 1) for x, y in zip(sa[2], sb[2]))
        used = [False] * len(sb[2])
        for x in sa[2]:
            for j, y in enumerate(sb[2]):
                if not used[j] and _eq(x, y, ctx, depth + 1):
                    used[j] = True
                    break
            else:
                return False
        return True
    try:
        na, nb = parse_number(a), parse_number(b)
    except TooLarge:
        return ctx.fail("error")
    if na is not None and nb is not None:
        return _numbers_close(na, nb, ctx)
    if (_is_word(a) and len(a) > 2) or (_is_word(b) and len(b) > 2):
        return False  # a name ("Evelyn") never equals a non-word; skip the round trip
    return ctx.symbolic("expr", a, b)


def compare_answers(
    pred: str | None,
    ref: str | None,
    rel_tol: float = 1e-4,
    timeout: float = 5.0,
    pool: WorkerPool | None = None,
) -> tuple[bool, str]:
    """``(equal, status)`` for two extracted answers; see the module docstring."""
    if pred is None or ref is None:
        return False, "ok"
    pred, ref = str(pred), str(ref)
    if len(pred) > MAX_ANSWER_CHARS or len(ref) > MAX_ANSWER_CHARS:
        return False, "error"
    ctx = _Ctx(rel_tol, timeout, pool, pct=("%" in pred or "%" in ref))
    try:
        result = _eq(pred, ref, ctx)
    except RecursionError:
        return False, "error"
    return (True, "ok") if result else (False, ctx.status)


def math_equal(pred: str, ref: str, rel_tol: float = 1e-4, timeout: float = 5.0) -> bool:
    """Whether ``pred`` and ``ref`` are the same mathematical answer (see module docstring)."""
    return compare_answers(pred, ref, rel_tol=rel_tol, timeout=timeout)[0]
