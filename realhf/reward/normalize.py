"""String normalisation of final answers (LaTeX noise, units, formatting) before comparison.

:func:`normalize_answer` is idempotent on its own output and only rewrites text; it never
evaluates it. It removes what does not change the mathematical value of a competition answer:
math delimiters, ``\\left``/``\\right``, spacing commands, ``\\text{units}``, degree signs,
percent and dollar signs, thousands separators of a lone number, trailing ``.0``, a leading
``x =`` / ``x \\in`` on a single-variable answer, and it canonicalises ``\\dfrac``/``\\tfrac``,
``\\frac12``, ``\\sqrt2``, ``.5`` and ``a/b``.
"""
from __future__ import annotations

import re

from realhf.reward.extract import _groups

# Unit words stripped after a number (plain text or inside \text{}). Single letters and short
# ambiguous words ("m", "in", "s") are only stripped inside \text{...}.
_UNIT_WORDS = [
    "units", "unit", "sq", "square", "cubic",
    "cm", "mm", "km", "meters", "meter", "metres", "metre", "centimeters", "centimeter",
    "millimeters", "kilometers", "kilometer", "inches", "inch", "feet", "foot", "ft", "yards",
    "yard", "yd", "miles", "mile", "mph", "kmh",
    "degrees", "degree", "radians", "radian",
    "dollars", "dollar", "cents", "cent", "euros", "euro", "pounds", "pound", "lbs", "lb",
    "kg", "kilograms", "grams", "gram", "ounces", "ounce", "oz", "liters", "liter", "litres",
    "ml", "gallons", "gallon", "quarts", "cups", "cup",
    "seconds", "second", "sec", "minutes", "minute", "min", "mins", "hours", "hour", "hrs", "hr",
    "days", "day", "weeks", "week", "months", "month", "years", "year",
    "people", "persons", "students", "children", "pages", "marbles", "apples", "books",
    "times", "ways", "points", "percent", "percentage",
]
_TEXT_ONLY_UNITS = ["m", "in", "s", "g", "l", "h", "km^2", "m^2", "cm^2", "cm^3", "m^3"]
_UNIT_SET = {u.lower() for u in _UNIT_WORDS + _TEXT_ONLY_UNITS}
_UNIT_ALT = "|".join(sorted((re.escape(u) for u in _UNIT_WORDS), key=len, reverse=True))
_PLAIN_UNIT_RE = re.compile(
    r"(?<=[\d}\s])\s*\b(?:" + _UNIT_ALT + r")\b(?:\s*\^\s*\{?[23]\}?|\s+squared|\s+cubed)?\.?(?=\s|$|[,;)\]])",
    re.IGNORECASE,
)

_TEXT_CMDS = ("text", "textbf", "textit", "textrm", "mbox", "mathrm", "mathbf", "mathit", "operatorname", "textnormal")
_CMD_ARG_RE = re.compile(r"\\(" + "|".join(_TEXT_CMDS) + r")\s*\{")
_THOUSANDS_RE = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_ASSIGN_RE = re.compile(r"^(?:[a-zA-Z]|\\[a-zA-Z]+)(?:_\{?[a-zA-Z0-9]+\}?)?(?:\([a-zA-Z]\))?=(?!=)")
_IN_RE = re.compile(r"^(?:[a-zA-Z]|\\[a-zA-Z]+)\\in(?![a-zA-Z])")


def _matching_brace(s: str, i: int) -> int:
    """Index of the ``}`` closing the group opened at ``s[i]``, or -1 when it is never closed."""
    return next((close for open_, close in _groups(s, i) if open_ == i), -1)


def _is_unit_phrase(content: str) -> bool:
    words = re.split(r"[\s~]+|\\\s|\\,|\\;", content.strip().lower())
    words = [w.strip(".") for w in words if w.strip(".")]
    return bool(words) and all(w in _UNIT_SET for w in words)


def _unwrap_text_cmds(s: str) -> str:
    """``\\text{ cm}`` -> ``''`` (unit phrase), ``\\text{Evelyn}`` -> ``Evelyn``."""
    for _ in range(50):
        m = _CMD_ARG_RE.search(s)
        if not m:
            break
        open_ = m.end() - 1
        close = _matching_brace(s, open_)
        if close < 0:
            s = s[: m.start()] + s[open_ + 1 :]
            continue
        content = s[open_ + 1 : close]
        keep = "" if (m.group(1) != "operatorname" and _is_unit_phrase(content)) else content
        if m.group(1) == "operatorname":
            keep = "\\" + content.strip()
            keep = keep + " " if re.match(r"\\[a-zA-Z]+$", keep) else keep
        elif keep and m.start() > 0 and re.search(r"\\[a-zA-Z]+$", s[: m.start()]):
            keep = " " + keep  # do not glue the text onto a preceding command name
        rest = s[close + 1 :]
        if not keep:  # a dropped unit takes its exponent along: 10\text{ cm}^2 -> 10
            rest = re.sub(r"^\s*\^\s*(?:\{\s*[23]\s*\}|[23])", "", rest)
        s = s[: m.start()] + keep + rest
    return s


def _strip_delimiters(s: str) -> str:
    s = s.strip()
    for _ in range(3):
        before = s
        if len(s) >= 2 and s.startswith("$") and s.endswith("$"):
            s = s.strip("$").strip()
        for a, b in (("\\(", "\\)"), ("\\[", "\\]")):
            if s.startswith(a) and s.endswith(b):
                s = s[len(a) : -len(b)].strip()
        m = re.match(r"^\\(?:boxed|fbox)\s*\{", s)
        if m and _matching_brace(s, m.end() - 1) == len(s) - 1:
            s = s[m.end() : -1].strip()
        if s == before:
            break
    return s


def strip_assignment(s: str) -> str:
    """``x=3`` -> ``3``, ``x\\in[-2,7]`` -> ``[-2,7]`` (on normalised text; a single variable on
    the left and no other ``=``)."""
    m = _ASSIGN_RE.match(s)
    if m and "=" not in s[m.end() :]:
        rest = s[m.end() :]
        if rest:
            return rest
    m = _IN_RE.match(s)
    if m and s[m.end() :]:
        return s[m.end() :]
    return s


def normalize_answer(s: str, strip_assign: bool = True) -> str:
    """Canonical string form of an answer (see the module docstring)."""
    if s is None:
        return ""
    s = str(s).replace("\n", " ").replace("\r", " ").replace("\t", " ")
    s = _strip_delimiters(s)
    # spacing and sizing commands
    s = re.sub(r"\\(?:displaystyle|textstyle|scriptstyle|limits|bigl|bigr|Bigl|Bigr|big|Big|biggl|biggr)(?![a-zA-Z])", "", s)
    s = re.sub(r"\\(?:left|right)(?![a-zA-Z])\s*\.?", "", s)
    s = re.sub(
        r"\\\\|\\(?:!|,|;|:|>| )|\\(?:qquad|quad)(?![a-zA-Z])|~",
        lambda m: m.group(0) if m.group(0) == "\\\\" else " ",
        s,
    )
    s = re.sub(r"\\[dt]frac(?![a-zA-Z])", r"\\frac", s)
    s = s.replace("{,}", ",")
    s = re.sub(r"\\(?:le)(?![a-zA-Z])", r"\\leq", s)
    s = re.sub(r"\\(?:ge)(?![a-zA-Z])", r"\\geq", s)
    s = s.replace("\\neq", "\\ne ")
    # degrees
    s = re.sub(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ(?![a-zA-Z])|\\circ(?![a-zA-Z])|°|\\degree(?![a-zA-Z])", "", s)
    # text / units
    s = _unwrap_text_cmds(s)
    s = re.sub(r"\s+", " ", s)  # one space per run: _PLAIN_UNIT_RE would retry at each space of a run
    s = _PLAIN_UNIT_RE.sub("", s)
    s = re.sub(r"(?<=\S)\s+(?:and|or)\s+(?=\S)", ",", s)  # "3 and 4" -> "3,4"
    # percent and currency
    s = s.replace("\\%", "").replace("%", "")
    s = s.replace("\\$", "").replace("$", "")
    s = s.strip()
    # a lone number with thousands separators (not a tuple / list "1, 2")
    if _THOUSANDS_RE.match(s):
        s = s.replace(",", "")
    # remove spaces, but keep one between a command name and a following letter (\pi r)
    s = re.sub(r"(\\[a-zA-Z]+)\s+(?=[a-zA-Z])", "\\1\x00", s)
    s = re.sub(r"\s+", "", s).replace("\x00", " ")
    # trailing sentence punctuation
    s = s.rstrip(".")
    if s.endswith("\\"):
        s = s[:-1]
    # \frac12 -> \frac{1}{2}, \frac1{2}, \frac{1}2, \sqrt2 -> \sqrt{2}
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac(\d)(?=\{)", r"\\frac{\1}", s)
    s = re.sub(r"\\frac(\{[^{}]*\})(\d)", r"\\frac\1{\2}", s)
    s = re.sub(r"\\sqrt\s?([0-9a-zA-Z])", r"\\sqrt{\1}", s)
    # numbers: .5 -> 0.5, 2.0 -> 2, 1.50 -> 1.5
    s = re.sub(r"(?<![\d.])\.(\d)", r"0.\1", s)
    s = re.sub(r"(\d)\.0+(?![\d])", r"\1", s)
    s = re.sub(r"(\d\.\d*?[1-9])0+(?![\d])", r"\1", s)
    # multiple choice "(C)" -> "C"
    m = re.match(r"^\(([A-Ea-e])\)$", s)
    if m:
        s = m.group(1).upper()
    if strip_assign:
        s = strip_assignment(s)
    # a/b -> \frac{a}{b} for a lone ratio of integers
    m = re.match(r"^(-?)(\d+)/(\d+)$", s)
    if m:
        s = f"{m.group(1)}\\frac{{{m.group(2)}}}{{{m.group(3)}}}"
    return s
