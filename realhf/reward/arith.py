"""A tiny, safe parser for plain arithmetic answers (``3/4``, ``2^10``, ``1.5e3``, ``-7``,
``\\frac{1}{2}``, ``2\\cdot 3``) evaluated exactly with :class:`fractions.Fraction`.

It never calls ``eval``; it only knows numbers, ``+ - * / ^ **``, ``\\cdot``, ``\\times``,
``\\div``, ``\\frac{..}{..}`` and grouping with ``()``/``{}``. Anything else (a letter, a
function, implicit multiplication) makes :func:`parse_number` return None, and the caller falls
back to the symbolic comparison in a worker process. Results that would be too large to compute
quickly (``9^9^9^9``, ``1e999999999``) raise :class:`TooLarge` instead of hanging.
"""
from __future__ import annotations

import re
from fractions import Fraction

MAX_BITS = 100_000  # largest |numerator|/|denominator| bit length we agree to build
MAX_DEPTH = 100  # nesting depth of groups / unary signs

_TOKEN_RE = re.compile(
    r"\s*(?:"
    r"(?P<num>(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)"
    r"|(?P<op>\*\*|[-+*/^(){}])"
    r"|(?P<cmd>\\(?:cdot|times|div|frac|dfrac|tfrac)(?![a-zA-Z]))"
    r")"
)


class TooLarge(ValueError):
    """The expression is arithmetic but its value is too large to compute safely."""


class _NotArithmetic(ValueError):
    pass


def _number(text: str) -> Fraction:
    mant, _, exp = text.lower().partition("e")
    e = int(exp) if exp else 0
    if abs(e) > 1000:
        raise TooLarge(text[:40])
    if mant.startswith("."):
        mant = "0" + mant
    if mant.endswith("."):
        mant = mant[:-1]
    if len(mant) > 5000:
        raise TooLarge("too many digits")
    f = Fraction(mant)
    return f * (Fraction(10) ** e)


def _tokenize(s: str) -> list[tuple[str, str]]:
    out = []
    pos, n = 0, len(s)
    while pos < n:
        m = _TOKEN_RE.match(s, pos)
        if not m or m.end() == pos:
            if s[pos:].strip() == "":
                break
            raise _NotArithmetic(s[pos : pos + 10])
        pos = m.end()
        if m.group("num") is not None:
            out.append(("num", m.group("num")))
        elif m.group("op") is not None:
            op = m.group("op")
            out.append(("op", "^" if op == "**" else op))
        else:
            cmd = m.group("cmd")
            if cmd in ("\\cdot", "\\times"):
                out.append(("op", "*"))
            elif cmd == "\\div":
                out.append(("op", "/"))
            else:
                out.append(("frac", "frac"))
    return out


def _check_size(f: Fraction) -> Fraction:
    if f.numerator.bit_length() > MAX_BITS or f.denominator.bit_length() > MAX_BITS:
        raise TooLarge("value too large")
    return f


def _power(base: Fraction, exp: Fraction) -> Fraction:
    if exp.denominator != 1:
        raise _NotArithmetic("non-integer exponent")
    e = exp.numerator
    if base == 0:
        if e < 0:
            raise _NotArithmetic("division by zero")
        return Fraction(1) if e == 0 else Fraction(0)
    if abs(base) == 1:
        return base ** (e % 2) if base < 0 else Fraction(1)
    bits = max(abs(base.numerator).bit_length(), base.denominator.bit_length())
    if abs(e) > MAX_BITS or bits * abs(e) > MAX_BITS:
        raise TooLarge("power too large")
    return base**e


class _Parser:
    def __init__(self, tokens):
        self.toks = tokens
        self.i = 0
        self.depth = 0

    def peek(self):
        return self.toks[self.i] if self.i < len(self.toks) else (None, None)

    def take(self, kind=None, value=None):
        tok = self.peek()
        if tok[0] is None or (kind and tok[0] != kind) or (value and tok[1] != value):
            raise _NotArithmetic(f"unexpected {tok}")
        self.i += 1
        return tok

    def enter(self):
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise _NotArithmetic("too deep")

    def expr(self) -> Fraction:
        v = self.term()
        while self.peek() in (("op", "+"), ("op", "-")):
            op = self.take()[1]
            rhs = self.term()
            v = _check_size(v + rhs if op == "+" else v - rhs)
        return v

    def term(self) -> Fraction:
        v = self.unary()
        while self.peek() in (("op", "*"), ("op", "/")):
            op = self.take()[1]
            rhs = self.unary()
            if op == "*":
                v = _check_size(v * rhs)
            else:
                if rhs == 0:
                    raise _NotArithmetic("division by zero")
                v = _check_size(v / rhs)
        return v

    def unary(self) -> Fraction:
        if self.peek() in (("op", "+"), ("op", "-")):
            op = self.take()[1]
            self.enter()
            v = self.unary()
            self.depth -= 1
            return -v if op == "-" else v
        return self.power()

    def power(self) -> Fraction:
        base = self.atom()
        if self.peek() == ("op", "^"):
            self.take()
            self.enter()
            exp = self.unary()  # right associative: 2^3^2 = 2^(3^2)
            self.depth -= 1
            return _power(base, exp)
        return base

    def group(self, open_, close) -> Fraction:
        self.take("op", open_)
        self.enter()
        v = self.expr()
        self.depth -= 1
        self.take("op", close)
        return v

    def atom(self) -> Fraction:
        kind, val = self.peek()
        if kind == "num":
            self.take()
            return _number(val)
        if kind == "frac":
            self.take()
            num = self.frac_arg()
            den = self.frac_arg()
            if den == 0:
                raise _NotArithmetic("division by zero")
            return _check_size(num / den)
        if (kind, val) == ("op", "("):
            return self.group("(", ")")
        if (kind, val) == ("op", "{"):
            return self.group("{", "}")
        raise _NotArithmetic(f"unexpected {val}")

    def frac_arg(self) -> Fraction:
        kind, val = self.peek()
        if (kind, val) == ("op", "{"):
            return self.group("{", "}")
        if kind == "num" and val.isdigit():  # \frac12 -> digits one at a time
            self.take()
            if len(val) > 1:
                self.toks.insert(self.i, ("num", val[1:]))
            return Fraction(int(val[0]))
        raise _NotArithmetic("bad \\frac argument")


def parse_number(s: str) -> Fraction | None:
    """Exact value of a plain arithmetic expression, or None if ``s`` is not one.

    Raises :class:`TooLarge` when the value would be too large to compute safely.
    """
    if not s or len(s) > 10_000:
        return None
    try:
        tokens = _tokenize(s)
        if not tokens:
            return None
        p = _Parser(tokens)
        v = p.expr()
        if p.i != len(p.toks):
            return None
        return v
    except _NotArithmetic:
        return None
    except (ZeroDivisionError, OverflowError, RecursionError):
        return None
