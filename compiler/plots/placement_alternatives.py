"""The placement comparison: one bar per placement planner with its predicted time; the pick is outlined,
estimated predictions hatched."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

from .style import ESTIMATED_COLOR, MEASURED_COLOR, new_figure, save

ESTIMATED_HATCH = "///"


def write_placement_chart(path: Path, alternatives: Sequence[Mapping[str, Any]], chosen: str | None,
                          title: str) -> list[Path]:
    """Write path.png and path.svg: a bar per alternative, `alternatives` being
    [{"name": planner, "predicted_ms": float, "source": "measured" | "estimated"}], `chosen` the name picked.
    Returns the written paths."""
    from matplotlib.patches import Patch

    figure = new_figure(figsize=(8, 1.4 + 0.45 * max(len(alternatives), 2)))
    ax = figure.subplots()
    longest = max((a["predicted_ms"] for a in alternatives), default=0.0)
    for y, alt in enumerate(alternatives):
        estimated = alt["source"] == "estimated"
        picked = alt["name"] == chosen
        ax.barh(y, alt["predicted_ms"], 0.6, color=ESTIMATED_COLOR if estimated else MEASURED_COLOR,
                hatch=ESTIMATED_HATCH if estimated else "", edgecolor="black" if picked else "white",
                linewidth=2.0 if picked else 0.5)
        ax.text(alt["predicted_ms"], y, f" {alt['predicted_ms']:.2f} ms ({alt['source']})"
                + ("  ← chosen" if picked else ""), va="center", fontsize=8)
    ax.set_yticks(range(len(alternatives)), [a["name"] for a in alternatives])
    ax.set_ylim(len(alternatives) - 0.5, -0.5)
    ax.set_xlim(0, longest * 1.45 or 1)
    ax.set_xlabel("predicted time per batch (ms)")
    ax.set_ylabel("placement")
    ax.legend(handles=[Patch(facecolor=MEASURED_COLOR, label="from measured node times"),
                       Patch(facecolor=ESTIMATED_COLOR, hatch=ESTIMATED_HATCH, label="from estimated node times"),
                       Patch(facecolor="white", edgecolor="black", linewidth=2.0, label="chosen")],
              loc="lower right", framealpha=0.9)
    ax.set_title(f"{title}: placement alternatives", loc="left")
    figure.tight_layout()
    return save(figure, path)
