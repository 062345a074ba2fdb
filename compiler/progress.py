"""What Tessel tells a person while it works: log lines on stderr at the chosen verbosity, and progress bars.

Everything Tessel reports along the way goes through the `tessel` logger: stage lines and notes at INFO,
details at DEBUG, problems that do not stop the work at WARNING. The command line picks the level
(-q: warnings and errors only, default: INFO, -v: DEBUG); stdout is left to the result.
"""
from __future__ import annotations

import logging
import sys
from contextlib import contextmanager
from typing import Callable, Iterator

LOGGER = logging.getLogger("tessel")

QUIET, NORMAL, VERBOSE = -1, 0, 1
_LEVELS = {QUIET: logging.WARNING, NORMAL: logging.INFO, VERBOSE: logging.DEBUG}


class _StderrFormatter(logging.Formatter):
    """Warnings as 'tessel: warning: ...', errors as 'tessel: error: ...', progress and notes as they are."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.levelno >= logging.ERROR:
            return f"tessel: error: {message}"
        if record.levelno >= logging.WARNING:
            return f"tessel: warning: {message}"
        return message


class _StderrHandler(logging.Handler):
    """Writes to whatever sys.stderr is when a record arrives (tests and callers may replace it)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except (OSError, ValueError):  # stderr closed: nothing left to tell anyone
            pass


@contextmanager
def logging_to_stderr(verbosity: int) -> Iterator[None]:
    """While active, the `tessel` logger's records go to stderr at the level `verbosity` (QUIET, NORMAL or
    VERBOSE) picks; afterwards the logger is as it was (a program that calls the CLI's main keeps its logging)."""
    handler = _StderrHandler()
    handler.setFormatter(_StderrFormatter())
    saved = LOGGER.level, LOGGER.propagate
    LOGGER.addHandler(handler)
    LOGGER.setLevel(_LEVELS[verbosity])
    LOGGER.propagate = False  # the command's own lines, never doubled by a root handler
    try:
        yield
    finally:
        LOGGER.removeHandler(handler)
        LOGGER.setLevel(saved[0])
        LOGGER.propagate = saved[1]


def progress_bar(label: str) -> Callable[[int, int], None] | None:
    """A (done, total) progress bar for a long step, drawn on stderr when it is a terminal; None when progress is
    not wanted (-q). Without a terminal the stage's log line, written when it ends, stands for it."""
    from tessel.backends.builder import ProgressBar

    return ProgressBar(label) if LOGGER.isEnabledFor(logging.INFO) else None
