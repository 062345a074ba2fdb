"""The compile's log: what went wrong in detail, kept out of the reports' notes.

A note is one sentence for a person; the exception behind it (type, message,
traceback, a child process's stderr) goes to reports/compile.log inside the
artifact, and the note names that file. Reports are not hashed (the runtime
reads none of them), so the log needs no entry in plan.json.
"""
from __future__ import annotations

import traceback
from pathlib import Path

LOG_FILE = "reports/compile.log"


class CompileLog:
    """Entries collected during one compile, written into the artifact at the end."""

    def __init__(self) -> None:
        self.entries: list[str] = []
        self.notes: list[str] = []

    def note(self, sentence: str, error: BaseException, details: str = "") -> str:
        """Log `error` (and `details`, e.g. a child's stderr) under `sentence`; return the note: the sentence and
        where the details are."""
        trace = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        entry = f"{sentence}\n{trace.rstrip()}"
        if details:
            entry += f"\n--- details ---\n{details.rstrip()}"
        self.entries.append(entry)
        note = f"{sentence.rstrip('.')}; details in {LOG_FILE}"
        self.notes.append(note)
        return note

    def write(self, root: Path) -> None:
        """Write the log into the artifact directory `root` (nothing when there is nothing to say)."""
        if self.entries:
            (root / LOG_FILE).write_text("\n\n".join(self.entries) + "\n")
