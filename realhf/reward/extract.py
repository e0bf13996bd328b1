"""Final-answer extraction from model completions and reference solutions.

Pure string processing (regular expressions and a brace scanner); nothing here evaluates the
text. Order of preference in :func:`extract_answer`:

1. the last complete ``\\boxed{...}`` / ``\\fbox{...}`` / ``\\framebox{...}`` (nested braces are
   balanced; ``\\boxed 5`` without braces is accepted);
2. the last GSM8K-style ``#### N`` line;
3. the last "final answer is ..." / "the answer is ..." phrase (case-insensitive);
4. only with ``allow_last_number=True``: the last number in the text.
"""
from __future__ import annotations

import re

_BOX_RE = re.compile(r"\\(?:boxed|fbox|framebox)(?![a-zA-Z])")
_GSM_RE = re.compile(r"####[ \t]*([^\n]*)")
_ANSWER_IS_RE = re.compile(
    r"(?:final\s+answer|the\s+answer|answer)\s*(?:is|=|:)\s*:?[ \t]*([^\n]*)",
    re.IGNORECASE,
)
_NUMBER_RE = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_THOUSANDS_RE = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")


def _scan_group(text: str, start: int) -> int | None:
    """``text[start] == '{'``; returns the index of the matching ``}`` (``\\{``/``\\}`` are
    literal braces and do not count), or None when the group is never closed."""
    depth = 0
    i, n = start, len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


def _box_content(text: str, pos: int) -> str | None:
    """Content of the box command whose name ends at ``pos``; None if it is incomplete."""
    n = len(text)
    i = pos
    while i < n and text[i] in " \t":
        i += 1
    if i < n and text[i] == "[":  # \framebox[width]{...}
        j = text.find("]", i)
        if j < 0:
            return None
        i = j + 1
    if i < n and text[i] == "{":
        j = _scan_group(text, i)
        if j is None:
            return None
        return text[i + 1 : j]
    if i == pos:  # "\boxedx": not a box command with a bare argument
        return None
    m = re.match(r"[^\s$]+", text[i:])
    if not m:
        return None
    return m.group(0).rstrip(".,;")


def last_boxed(text: str) -> str | None:
    """Content of the last complete ``\\boxed``/``\\fbox``/``\\framebox`` in ``text``."""
    if not text:
        return None
    for m in reversed(list(_BOX_RE.finditer(text))):
        content = _box_content(text, m.end())
        if content is not None:
            return content.strip()
    return None


def _clean_number(s: str) -> str:
    s = s.strip()
    if _THOUSANDS_RE.match(s):
        s = s.replace(",", "")
    return s


def gsm8k_answer(answer_field: str) -> str:
    """The final number of a GSM8K ``answer`` field (the text after the last ``####``), commas
    removed. Raises ValueError when there is no ``####``."""
    matches = _GSM_RE.findall(answer_field or "")
    if not matches:
        raise ValueError("no '####' in GSM8K answer field")
    s = matches[-1].strip().replace(",", "").rstrip(".").strip()
    return s.strip("$ ")


def _clean_phrase(s: str) -> str | None:
    s = s.strip().strip("*").strip()
    # "$5$ apples" -> "5"; "\(x = 3\)" -> "x = 3"
    m = re.search(r"\$\$?(.+?)\$\$?", s) or re.search(r"\\\((.+?)\\\)", s) or re.search(r"\\\[(.+?)\\\]", s)
    if m:
        s = m.group(1)
    s = s.strip().strip("*").strip()
    s = s.rstrip("$").lstrip("$").strip()
    while s.endswith("."):
        s = s[:-1].rstrip()
    return s or None


def extract_answer(text: str, allow_last_number: bool = False) -> str | None:
    """The final answer in ``text`` (see the module docstring for the order), or None."""
    if not text:
        return None
    boxed = last_boxed(text)
    if boxed:
        return boxed
    gsm = _GSM_RE.findall(text)
    for cand in reversed(gsm):
        cand = cand.strip().rstrip(".").strip().strip("$").strip()
        if cand:
            return _clean_number(cand)
    for m in reversed(list(_ANSWER_IS_RE.finditer(text))):
        ans = _clean_phrase(m.group(1))
        if ans:
            return _clean_number(ans)
    if allow_last_number:
        nums = _NUMBER_RE.findall(text)
        if nums:
            return _clean_number(nums[-1])
    return None
