"""Building blocks of the quickstart config dataclasses: a field with its ``--help`` text, and value checks
whose ``ValueError`` names the key, the value and what is allowed."""
import dataclasses
import math
from typing import Sequence


def option(default=dataclasses.MISSING, help: str = "", factory=dataclasses.MISSING):
    """A dataclass field with ``metadata={"help": help}``; ``factory`` for mutable defaults (sections, lists)."""
    if factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=factory, metadata={"help": help})
    return dataclasses.field(default=default, metadata={"help": help})


def check_choice(key: str, value, allowed: Sequence) -> None:
    if value not in allowed:
        raise ValueError(f"{key}={value!r} is not allowed; choose one of {list(allowed)}")


def check_int(key: str, value, lo: int, optional: bool = False) -> None:
    """An integer >= ``lo`` (``optional``: or None, meaning never)."""
    if optional and value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < lo:
        none = " or null (never)" if optional else ""
        raise ValueError(f"{key}={value!r} is not allowed; expected an integer >= {lo}{none}")


def check_number(key: str, value, lo=None, hi=None, lo_open=False, hi_open=False) -> None:
    """A finite number within the given bounds (open or closed)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and lo is not None:
        ok = value > lo if lo_open else value >= lo
    if ok and hi is not None:
        ok = value < hi if hi_open else value <= hi
    if not ok:
        lo_s = "" if lo is None else f"{'>' if lo_open else '>='} {lo}"
        hi_s = "" if hi is None else f"{'<' if hi_open else '<='} {hi}"
        rng = " and ".join(x for x in (lo_s, hi_s) if x)
        raise ValueError(f"{key}={value!r} is not allowed; expected a finite number {rng}".rstrip())
