"""Logging for realhf: one formatter, colored by level when attached to a terminal.

Library code calls ``getLogger(name)`` and never ``print``.
"""
import logging as _logging
import os
import sys

_FMT = "%(asctime)s.%(msecs)03d %(name)s %(levelname)s: %(message)s"
_DATEFMT = "%Y%m%d-%H:%M:%S"
_COLORS = {"DEBUG": "\033[36m", "INFO": "", "WARNING": "\033[33m", "ERROR": "\033[31m", "CRITICAL": "\033[1;31m"}


class _Formatter(_logging.Formatter):
    def __init__(self, color: bool):
        super().__init__(_FMT, _DATEFMT)
        self.color = color

    def format(self, record):
        s = super().format(record)
        if self.color and _COLORS.get(record.levelname):
            s = f"{_COLORS[record.levelname]}{s}\033[0m"
        return s


def getLogger(name: str = "realhf", level: str | None = None) -> _logging.Logger:
    """A logger under the ``realhf`` hierarchy; the root ``realhf`` logger gets one stream handler."""
    root = _logging.getLogger("realhf")
    if not root.handlers:
        h = _logging.StreamHandler(sys.stderr)
        h.setFormatter(_Formatter(color=sys.stderr.isatty()))
        root.addHandler(h)
        root.setLevel(os.environ.get("REALHF_LOG_LEVEL", "INFO").upper())
        root.propagate = False
    full = name if name == "realhf" or name.startswith("realhf.") else f"realhf.{name}"
    logger = _logging.getLogger(full)
    if level is not None:
        logger.setLevel(level.upper())
    return logger
