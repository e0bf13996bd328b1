"""Symbolic comparison with sympy; runs inside the isolated worker process (see ``safe.py``).

Text is turned into sympy objects only by the LaTeX parser of ``latex2sympy2_extended`` (an
ANTLR grammar that builds sympy objects directly); ``sympify``/``parse_expr``, which evaluate
Python, are never called on answer text. Equality of two expressions is decided by

* numbers (no free symbols): numeric values within ``rel_tol`` (exact for two integers);
* expressions with symbols: agreement at several random points, then ``simplify(a - b) == 0``
  when the points are inconclusive;
* equations: ``lhs - rhs`` of one is a non-zero constant multiple of the other's;
* sets, intervals, tuples and matrices: element-wise.

Nothing here is time-bounded by itself; the caller kills the process when it takes too long.
"""
from __future__ import annotations

import random

import sympy
from latex2sympy2_extended import NormalizationConfig, latex2sympy
from latex2sympy2_extended.latex2sympy2 import ConversionConfig

_NORM = NormalizationConfig(basic_latex=True, units=True, malformed_operators=True, nits=True, boxed="all", equations=False)
_CONV = ConversionConfig(lowercase_symbols=False)
_N_POINTS = 6


def parse_latex(s: str):
    """sympy object for a LaTeX string, or None if it does not parse."""
    try:
        return latex2sympy(s, normalization_config=_NORM, conversion_config=_CONV)
    except Exception:
        return None


def _num(expr) -> complex | None:
    try:
        v = complex(sympy.N(expr, 30))
    except Exception:
        return None
    if v != v or abs(v) == float("inf"):
        return None
    return v


def _close(x: complex, y: complex, rel_tol: float) -> bool:
    scale = max(abs(x), abs(y))
    return abs(x - y) <= rel_tol * scale or abs(x - y) <= 1e-12


def _numbers_equal(a, b, rel_tol: float, pct: bool) -> bool:
    if isinstance(a, sympy.Integer) and isinstance(b, sympy.Integer):
        if a == b:
            return True
        if not pct:
            return False
    va, vb = _num(a), _num(b)
    if va is None or vb is None:
        try:
            return bool(sympy.simplify(a - b) == 0)
        except Exception:
            return False
    cands = [vb, vb / 100, vb * 100] if pct else [vb]
    return any(_close(va, c, rel_tol) for c in cands)


def _random_points(symbols, rng):
    return [{s: sympy.Float(rng.uniform(0.3, 2.7), 20) for s in symbols} for _ in range(_N_POINTS)]


def _exprs_equal(a, b, rel_tol: float) -> bool:
    diff = a - b
    symbols = sorted(diff.free_symbols | a.free_symbols | b.free_symbols, key=str)
    rng = random.Random(1234)
    checked = 0
    for pt in _random_points(symbols, rng):
        va, vb = _num(a.subs(pt)), _num(b.subs(pt))
        if va is None or vb is None:
            continue
        if not _close(va, vb, max(rel_tol * 1e-2, 1e-8)):
            return False
        checked += 1
    if checked >= 3:
        return True
    try:
        return bool(sympy.simplify(diff) == 0)
    except Exception:
        return False


def expr_equal(a, b, rel_tol: float = 1e-4, pct: bool = False) -> bool:
    """Equality of two parsed sympy objects (see the module docstring)."""
    if a is None or b is None:
        return False
    try:
        if a == b:
            return True
    except Exception:
        pass
    if isinstance(a, sympy.MatrixBase) or isinstance(b, sympy.MatrixBase):
        if not (isinstance(a, sympy.MatrixBase) and isinstance(b, sympy.MatrixBase)) or a.shape != b.shape:
            return False
        return all(expr_equal(x, y, rel_tol) for x, y in zip(a, b))
    if isinstance(a, sympy.Interval) and isinstance(b, sympy.Interval):
        return (
            a.left_open == b.left_open
            and a.right_open == b.right_open
            and expr_equal(a.start, b.start, rel_tol)
            and expr_equal(a.end, b.end, rel_tol)
        )
    if isinstance(a, sympy.FiniteSet) and isinstance(b, sympy.FiniteSet):
        xs, ys = list(a), list(b)
        if len(xs) != len(ys):
            return False
        used = [False] * len(ys)
        for x in xs:
            for j, y in enumerate(ys):
                if not used[j] and expr_equal(x, y, rel_tol):
                    used[j] = True
                    break
            else:
                return False
        return True
    if isinstance(a, sympy.Tuple) and isinstance(b, sympy.Tuple):
        return len(a) == len(b) and all(expr_equal(x, y, rel_tol) for x, y in zip(a, b))
    if isinstance(a, sympy.Eq) and isinstance(b, sympy.Eq):
        return equations_equal(a.lhs - a.rhs, b.lhs - b.rhs, rel_tol)
    if not (isinstance(a, sympy.Expr) and isinstance(b, sympy.Expr)):
        return False
    if not a.free_symbols and not b.free_symbols:
        return _numbers_equal(a, b, rel_tol, pct)
    return _exprs_equal(a, b, rel_tol)


def equations_equal(da, db, rel_tol: float = 1e-4) -> bool:
    """Whether ``da = 0`` and ``db = 0`` are the same equation (``da = c * db``, ``c != 0``)."""
    symbols = sorted(da.free_symbols | db.free_symbols, key=str)
    if not symbols:
        return _exprs_equal(da, db, rel_tol)
    ratios = []
    for pt in _random_points(symbols, random.Random(4321)):
        va, vb = _num(da.subs(pt)), _num(db.subs(pt))
        if va is None or vb is None:
            continue
        if abs(vb) < 1e-12:
            if abs(va) > 1e-9:
                return False
            continue
        ratios.append(va / vb)
    if len(ratios) >= 3:
        r0 = ratios[0]
        return abs(r0) > 1e-12 and all(_close(r, r0, 1e-6) for r in ratios[1:])
    try:
        return bool(sympy.simplify(da - db) == 0 or sympy.simplify(da + db) == 0)
    except Exception:
        return False


def compare(kind: str, a, b, rel_tol: float = 1e-4, pct: bool = False) -> bool:
    """Entry point for the worker. ``kind == "expr"``: ``a``, ``b`` are LaTeX strings;
    ``kind == "eq"``: ``a``, ``b`` are ``[lhs, rhs]`` LaTeX pairs of two equations."""
    if kind == "eq":
        la, ra = (parse_latex(x) for x in a)
        lb, rb = (parse_latex(x) for x in b)
        if any(not isinstance(x, sympy.Expr) for x in (la, ra, lb, rb)):
            return False
        return equations_equal(la - ra, lb - rb, rel_tol)
    if kind == "expr":
        return expr_equal(parse_latex(a), parse_latex(b), rel_tol, pct)
    raise ValueError(f"unknown comparison kind {kind!r}")
