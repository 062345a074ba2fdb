"""A multi-worker run's measured times against the placement's predictions: compared for the user, and added to
the artifact's reports/placement.json and .md."""
from __future__ import annotations

import json
import logging

from tessel.runtime.safe_write import FileReadError, FileWriteError, read_text, write_text

from .distribute import placement_markdown

_log = logging.getLogger("tessel.run")


def placement_report(artifact) -> dict | None:
    """reports/placement.json, to compare measured times with its predictions; None, with a note, when unusable."""
    try:
        placement = json.loads(read_text(artifact.directory, "reports/placement.json"))
        float(placement["predicted_makespan_s"]), float(placement["predicted_steady_s"])
    except (FileReadError, ValueError, KeyError, TypeError) as exc:
        _log.info("note: measured times not compared with the placement: reports/placement.json is unusable (%s)", exc)
        return None
    return placement


def stream_lines(measured: dict, placement: dict) -> list[str]:
    """The latency of one run and the time per batch streaming --repeat runs, each against the placement's
    prediction."""
    return [f"{label}: {1e3 * got:.3f} ms; placement predicted {1e3 * predicted:.3f} ms "
            f"(error {100 * (predicted - got) / got:+.1f}%)"
            for label, got, predicted in (
                ("latency of one run", measured["latency_s"], float(placement["predicted_makespan_s"])),
                (f"time per batch over {measured['runs']} streamed runs", measured["seconds_per_batch"],
                 float(placement["predicted_steady_s"])))]


def record_measured(artifact, placement: dict, measured) -> None:
    """Add the measured times to reports/placement.json and .md, atomically and never through a link;
    an artifact that cannot be written (read-only) keeps its reports, with one note line."""
    placement["measured"] = {**measured, "prediction_error": (placement["predicted_steady_s"] - measured["seconds_per_batch"])
                             / measured["seconds_per_batch"],
                             "latency_prediction_error": (placement["predicted_makespan_s"] - measured["latency_s"])
                             / measured["latency_s"]}
    try:
        write_text(artifact.directory, "reports/placement.json", json.dumps(placement, indent=1))
        write_text(artifact.directory, "reports/placement.md", placement_markdown(placement))
    except FileWriteError as exc:
        _log.info("note: measured times not added to the reports: %s", exc)
        return
    _log.info("measured times added to %s", artifact.directory / "reports" / "placement.md")
