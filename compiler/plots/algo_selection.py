"""The algorithm-selection chart: per layer, the chosen algorithms' time against the best single algorithm's,
and the totals; estimated times are hatched."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from ..sizes import format_bytes
from .style import PALETTE, new_figure, save, source_label

BASELINE_COLOR, MIXED_COLOR = "#bab0ac", "#9c755f"
ESTIMATED_HATCH = "///"
ROW_HEIGHT = 0.32  # inches per layer


def write_algo_chart(path: Path, doc: Mapping[str, Any], title: str) -> list[Path]:
    """Write path.png and path.svg from reports/algo.json (compiler/algo.report); returns the written paths.

    Per layer: `node`, `op`, `chosen` ({pieces: [[algorithm, micro-batch size]], describe, seconds, source}) and
    `best_single` ({algorithm, seconds, source} or None when no single algorithm fits).
    """
    layers = doc["layers"]
    # Colours by the candidates' algorithms, so one algorithm keeps its colour whatever this model chose.
    algorithms = sorted({name for r in layers for name in r.get("algorithms", ())}
                        | {piece[0] for r in layers for piece in r["chosen"]["pieces"]})
    colors = {name: PALETTE[i % len(PALETTE)] for i, name in enumerate(algorithms)}
    figure = new_figure(figsize=(10, 2.2 + ROW_HEIGHT * max(len(layers), 4)))
    totals, per_layer = figure.subplots(
        2, 1, gridspec_kw={"height_ratios": [1.1, max(len(layers), 4) * ROW_HEIGHT / 0.5]})
    _totals(totals, doc)
    _layers(per_layer, layers, colors)
    profiling = doc["profiling"]
    figure.suptitle(f"{title}\nalgorithm selection ({doc['mode']}, micro-batch sizes: {doc['policy']}): "
                    f"{profiling['measured']} candidates measured, {profiling['estimated']} estimated")
    figure.tight_layout()
    return save(figure, path)


def _source_hatch(source: str) -> str:
    return ESTIMATED_HATCH if source == "estimated" else ""


def _totals(ax, doc: Mapping[str, Any]) -> None:
    """Two bars: the chosen total and the best-single total (when every layer has one), each saying how many of
    its layers' times are estimated."""
    layers = doc["layers"]
    rows = [("chosen", doc["total_seconds"], [r["chosen"]["source"] for r in layers], "#4e79a7")]
    if doc["best_single_total_seconds"] is not None:
        rows.append(("best single algorithm", doc["best_single_total_seconds"],
                     [r["best_single"]["source"] for r in layers], BASELINE_COLOR))
    for y, (name, seconds, sources, color) in enumerate(rows):
        estimated = sources.count("estimated")
        ax.barh(y, seconds * 1e3, color=color, hatch=ESTIMATED_HATCH if estimated else "", edgecolor="white")
        ax.text(seconds * 1e3, y, f" {seconds * 1e3:.2f} ms ({source_label(estimated, len(sources))}"
                f"{' layers' if 0 < estimated < len(sources) else ''})", va="center", fontsize=8)
    ax.set_yticks(range(len(rows)), [name for name, *_ in rows])
    ax.invert_yaxis()
    ax.set_xlim(0, max(seconds for _, seconds, *_ in rows) * 1e3 * 1.4 or 1)
    ax.set_xlabel("sum over the layers (ms)")
    ax.set_title(f"total; weights held {format_bytes(doc['weight_bytes'])} "
                 f"({format_bytes(doc['default_weight_bytes'])} without selection, extra layouts "
                 f"{format_bytes(doc['extra_layout_bytes'])})", loc="left")


def _layers(ax, layers, colors: Mapping[str, str]) -> None:
    """Per layer: the best single algorithm (grey, below) and the choice (its algorithm's colour, above)."""
    from matplotlib.patches import Patch

    height = 0.38
    longest = 0.0
    for y, row in enumerate(layers):
        chosen, base = row["chosen"], row["best_single"]
        algorithms = {piece[0] for piece in chosen["pieces"]}
        color = colors[next(iter(algorithms))] if len(algorithms) == 1 else MIXED_COLOR
        ax.barh(y - height / 2, chosen["seconds"] * 1e3, height, color=color,
                hatch=_source_hatch(chosen["source"]), edgecolor="white")
        end = chosen["seconds"] * 1e3
        if base is not None:
            ax.barh(y + height / 2, base["seconds"] * 1e3, height, color=BASELINE_COLOR,
                    hatch=_source_hatch(base["source"]), edgecolor="white")
            end = max(end, base["seconds"] * 1e3)
        speedup = f", {row['speedup']:.2f}x" if row.get("speedup") else ""
        ax.text(end, y, f" {chosen['describe']}{speedup}", va="center", fontsize=7)
        longest = max(longest, end)
    ax.set_yticks(range(len(layers)), [f"{r['node']} ({r['op']}, batch {r['batch']})" for r in layers], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(0, longest * 1.3 or 1)
    ax.set_xlabel("time per layer (ms)")
    ax.set_title("per layer: chosen (upper bar) vs best single algorithm (lower bar)", loc="left")
    alone = {r["chosen"]["pieces"][0][0] for r in layers if len({p[0] for p in r["chosen"]["pieces"]}) == 1}
    handles = [Patch(color=colors[name], label=name) for name in colors if name in alone]
    if any(len({p[0] for p in r["chosen"]["pieces"]}) > 1 for r in layers):
        handles.append(Patch(color=MIXED_COLOR, label="several algorithms"))
    handles += [Patch(color=BASELINE_COLOR, label="best single algorithm"),
                Patch(facecolor="white", edgecolor="#555555", hatch=ESTIMATED_HATCH, label="estimated (else measured)")]
    ax.legend(handles=handles, loc="lower right", framealpha=0.9)
