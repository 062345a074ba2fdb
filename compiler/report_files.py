"""The reports an artifact holds, for `tessel report`: passes, each worker's memory, algorithms and placement.

Files are read through runtime.safe_write (never a file a link points to elsewhere); one that cannot be read
becomes a note, never the end of the report.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Any, Iterator

from tessel.runtime.safe_write import FileReadError, read_text

_log = logging.getLogger("tessel.report")


def _read(directory, name: str) -> str | None:
    """reports/<name>, or None (with a note when it is there but unreadable)."""
    if not os.path.lexists(directory / "reports" / name):
        return None
    try:
        return read_text(directory, f"reports/{name}")
    except FileReadError as exc:
        _log.info("note: %s", exc)
        return None


def _memory_names(devices: int, extension: str) -> Iterator[tuple[int, str]]:
    """(worker, file name) of each worker's memory report: memory.<ext> for worker 0, memory_device<N>.<ext>."""
    for worker in range(devices):
        yield worker, f"memory{'' if worker == 0 else f'_device{worker}'}.{extension}"


def report_markdown(artifact) -> list[str]:
    """The text of every report of `artifact`, each worker's memory report included, in reading order."""
    devices = artifact.devices
    sections = [text for text in [_read(artifact.directory, "passes.md")] if text is not None]
    for worker, name in _memory_names(devices, "md"):
        text = _read(artifact.directory, name)
        if text is not None:
            sections.append(text if devices == 1 else f"# Device {worker}\n\n{text}")
    for name in ("algo.md", "placement.md", "data_parallel.md"):
        text = _read(artifact.directory, name)
        if text is not None:
            sections.append(text)
    return [text.rstrip() for text in sections]


def report_document(artifact) -> dict[str, Any]:
    """Every JSON report of `artifact` in one document: compile, memory (one per worker), algo, placement."""
    document: dict[str, Any] = {"artifact": str(artifact.directory), "compile": artifact.report(), "memory": []}
    for worker, name in _memory_names(artifact.devices, "json"):
        document["memory"].append({"device": worker, **_parsed(artifact.directory, name)})
    for key in ("algo", "placement", "data_parallel"):
        parsed = _parsed(artifact.directory, f"{key}.json")
        if parsed:
            document[key] = parsed
    return document


def _parsed(directory, name: str) -> dict[str, Any]:
    """reports/<name> as JSON; empty (with a note) when missing or not JSON."""
    text = _read(directory, name)
    if text is None:
        return {}
    try:
        return json.loads(text)
    except ValueError:
        _log.info("note: reports/%s is not JSON; left out", name)
        return {}
