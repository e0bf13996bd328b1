"""A logging handler that keeps the messages it receives, for tests that assert what a component logged."""
import logging


class LogLines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())
