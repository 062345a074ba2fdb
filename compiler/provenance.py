"""Where each number of a compile comes from: measured on this machine, or estimated.

A predicted time is "measured" only when every time it adds up was measured
(kernel times from the profile database or this compile's profiling, the link
from `tessel calibrate`); one estimated part makes it "estimated", and the
text says how large the measured share is. Memory sizes are neither: they are
the plans the runtime allocates, exact by construction ("planned").
The compile's summary lines (compiler/cli.py prints them) are made here from
reports/compile.json, so a script reading the JSON sees the same markers.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from .sizes import format_bytes

MEASURED, ESTIMATED, PLANNED = "measured", "estimated", "planned"


def source(all_measured: bool) -> str:
    """"measured" when every part of a number was measured, else "estimated"."""
    return MEASURED if all_measured else ESTIMATED


def share(measured: int, total: int, what: str) -> str:
    """'9 of 219 candidates measured, 4%'."""
    percent = round(100 * measured / total) if total else 100
    return f"{measured} of {total} {what} measured, {percent}%"


def format_seconds_us(seconds: float) -> str:
    """Microseconds with three significant digits: a calibrated 0.1 µs must not print as 0."""
    return f"{1e6 * seconds:.3g} µs"


def link_text(link: Mapping[str, Any]) -> str:
    """'link α 74.2 µs, β 0.7 ns/B (measured)', from the placement report's link entry."""
    how = "measured" if link["measured"] else "default, estimated; run tessel calibrate"
    return (f"link α {format_seconds_us(link['alpha_s'])}, β {1e9 * link['beta_s_per_byte']:.3g} ns/B ({how})")


def weight_growth(before: int, after: int, extra: int) -> str:
    """'weights 44.6 MiB -> 150.9 MiB (+106.3 MiB; the chosen algorithms' own layouts take 110.0 MiB)': the weights
    held at run time without and with algorithm selection, and the bytes of the layouts only the chosen algorithms
    read (some replace a default layout, so the growth can be smaller)."""
    if not extra and after == before:
        return f"weights {format_bytes(after)} (no extra layouts)"
    sign = "+" if after >= before else "-"
    return (f"weights {format_bytes(before)} -> {format_bytes(after)} ({sign}{format_bytes(abs(after - before))}; "
            f"the chosen algorithms' own layouts take {format_bytes(extra)})")


def algo_line(algo: Mapping[str, Any], where: str) -> str:
    """The compile's algorithm-selection line: the layers' total, what it rests on, the baseline, the weight growth."""
    profiling = algo["profiling"]
    candidates = profiling["measured"] + profiling["estimated"]
    total = (f"{1e3 * algo['total_seconds']:.2f} ms {algo['total_source']} "
             f"({share(profiling['measured'], candidates, 'candidates')})")
    versus = (f" vs {1e3 * algo['best_single_total_seconds']:.2f} ms {algo['best_single_source']} with the best "
              "single algorithm" if algo["best_single_total_seconds"] else "")
    return (f"algorithms ({algo['mode']}): conv/matmul layers {total}{versus}; {budget_text(profiling)}; "
            f"{weight_growth(algo['default_weight_bytes'], algo['weight_bytes'], algo['extra_layout_bytes'])}; "
            f"see {where}")


def budget_text(profiling: Mapping[str, Any]) -> str:
    """'profiling 10.1 s of a 10 s budget (budget spent: the rest estimated), after 6.8 s making the candidates'
    kernel specs' (the budget bounds the building and timing, not the specs every selection needs)."""
    text = f"profiling {profiling['seconds']:.1f} s"
    if profiling.get("budget_s") is not None:
        text += f" of a {profiling['budget_s']:g} s budget"
    if profiling["budget_exhausted"]:
        text += " (budget spent: the rest estimated)"
    if profiling.get("enumerate_seconds"):
        text += f", after {profiling['enumerate_seconds']:.1f} s making the candidates' kernel specs"
    return text


def placement_line(placed: Mapping[str, Any], devices: int, where: str) -> str:
    """The compile's placement line: the pick's prediction and what it rests on, the link, every alternative."""
    tasks = placed["node_times"]
    others = "; ".join(f"{a['name']} {a['predicted_ms']:.2f} ms {a['source']}" for a in placed["alternatives"])
    return (f"placement {placed['planner']} on {devices} devices: predicted {1e3 * placed['predicted_makespan_s']:.2f} ms "
            f"per batch {predicted(placed['predicted_source'])} "
            f"({share(tasks['measured'], tasks['total'], 'node times')}; "
            f"{link_text(placed['link'])}), bound {1e3 * placed['bound_s']:.2f} ms, "
            f"{format_bytes(placed['transfer_bytes'])} sent per micro-batch; alternatives: {others}; see {where}")


def predicted(how: str) -> str:
    """How a prediction rests on measurements: 'from measured times' or 'estimated'."""
    return "from measured times" if how == MEASURED else ESTIMATED


def chosen_source(rows: Sequence[Mapping[str, Any]], field: str) -> str:
    """The source of a sum over layers: measured when every layer's entry in `field` was."""
    return source(all(r[field] is not None and r[field]["source"] == MEASURED for r in rows))
