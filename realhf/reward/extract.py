"""Final-answer extraction from model completions and reference solutions.

Pure string processing (regular expressions and a brace scanner); nothing here evaluates the
text, and every function is linear in the length of its input, whatever the input (deep or
unclosed nesting, long runs of delimiters). Order of preference in :func:`extract_answer`:

1. the last complete ``\\boxed{...}`` / ``\\fbox{...}`` / ``\\framebox{...}`` (nested braces are
   balanced; ``\\boxed 5`` without braces is accepted);
2. the last GSM8K-style ``#### N`` line;
3. the last "final answer is ..." / "the answer is ..." phrase (case-insensitive);
4. only with ``allow_last_number=True``: the last number in the text.
"""
from __future__ import annotations

import re

_BOX_RE = re.compile(r"\\(?:boxed|fbox|framebox)(?![a-zA-Z])")
_BRACE_TOKEN_RE = re.compile(r"\\[\\{}]|[{}]")  # a brace, or an escape that matters: \{ \} literal, \\ (\\{ opens)
_BLANKS_RE = re.compile(r"[ \t]*")
_BARE_ARG_RE = re.compile(r"[^\s$]+")
_GSM_RE = re.compile(r"####[ \t]*([^\n]*)")
_ANSWER_IS_RE = re.compile(
    r"(?:final\s+answer|the\s+answer|answer)\s*(?:is|=|:)\s*:?[ \t]*([^\n]*)",
    re.IGNORECASE,
)
_DOLLARS_RE = re.compile(r"\$\$?(.+?)\$\$?")  # linear: only a "$" with no "$" after it fails
_DOTS_BLANKS_RE = re.compile(r"[.\s]*")
_NUMBER_RE = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_THOUSANDS_RE = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")


def _groups(text: str, start: int = 0):
    """``(index of a "{", index of its matching "}")`` for each group in ``text[start:]``, in the
    order they close, in one pass (``\\{``/``\\}`` are literal braces and do not count; a stray
    ``}`` is ignored, a group never closed is never yielded)."""
    opened = []
    for m in _BRACE_TOKEN_RE.finditer(text, start):
        if m.group() == "{":
            opened.append(m.start())
        elif m.group() == "}" and opened:
            yield opened.pop(), m.start()


def last_boxed(text: str) -> str | None:
    """Content of the last complete ``\\boxed``/``\\fbox``/``\\framebox`` in ``text``.

    Linear in ``len(text)``: the braces are matched in one pass, then the boxes are tried from the
    last one back; each search for the ``]`` of a ``\\framebox[width]`` stops where the previous
    one began.
    """
    boxes = list(_BOX_RE.finditer(text or ""))
    if not boxes:
        return None
    ends = dict(_groups(text, boxes[0].start()))
    n = len(text)
    searched, bracket = n, -1  # the first "]" at or after text[searched] is text[bracket] (-1: none)
    for m in reversed(boxes):
        i = _BLANKS_RE.match(text, m.end()).end()
        if i < n and text[i] == "[":  # \framebox[width]{...}
            j = text.find("]", i, searched)
            searched, bracket = i, (j if j >= 0 else bracket)
            if bracket < 0:
                continue
            i = bracket + 1
        if i < n and text[i] == "{":
            if i in ends:
                return text[i + 1 : ends[i]].strip()
            continue
        if i == m.end():  # "\boxedx": not a box command with a bare argument
            continue
        arg = _BARE_ARG_RE.match(text, i)
        if arg:
            return arg.group(0).rstrip(".,;").strip()
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


def _between(s: str, open_: str, close: str) -> str | None:
    """The text from the first ``open_`` to the first ``close`` at least one character later: what
    ``re.search(open_ + "(.+?)" + close)`` finds in one line, without its retry at every ``open_``."""
    i = s.find(open_)
    j = s.find(close, i + len(open_) + 1) if i >= 0 else -1
    return s[i + len(open_) : j] if j >= 0 else None


def _clean_phrase(s: str) -> str | None:
    s = s.strip().strip("*").strip()
    # "$5$ apples" -> "5"; "\(x = 3\)" -> "x = 3"
    m = _DOLLARS_RE.search(s)
    inner = m.group(1) if m else _between(s, "\\(", "\\)") or _between(s, "\\[", "\\]")
    if inner is not None:
        s = inner
    s = s.strip().strip("*").strip()
    s = s.rstrip("$").lstrip("$").strip()
    return s[: len(s) - _DOTS_BLANKS_RE.match(s[::-1]).end()] or None  # "5 . ." -> "5"


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
