"""One training step per worker, predicted (compiler/step_timeline.py) or measured (compiler/measured_step.py): a
lane per worker, its kernels coloured by phase (forward, backward, update) and above them its communication
(all-reduce, Send); a wait (a Recv's; in a measured step, an all-reduce's too) sits, grey, in the kernels' row,
over the step it holds up."""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from ..step_timeline import WAIT
from .style import PALETTE, new_figure, save

LANE_HEIGHT = 0.8  # inches per worker lane
COMPUTE, COMM = 0.55, 0.25  # shares of a lane's height
PHASE_COLORS = {"forward": PALETTE[0], "backward": PALETTE[1], "update": PALETTE[2], "all-reduce": PALETTE[3],
                "send/recv": "#222222", WAIT: "#d9d9d9"}


def write_step_gantt(path: Path, timeline, title: str) -> list[Path]:
    """Write path.png and path.svg of `timeline` (a step_timeline.Timeline) titled `title`; returns both paths."""
    from matplotlib.patches import Rectangle

    workers = max(len(timeline.busy_s), 1)
    figure = new_figure(figsize=(10, 1.2 + LANE_HEIGHT * workers))
    axes = figure.subplots()
    scale = 1e3  # milliseconds
    # One collection per (worker, row, phase), not one per bar: a step has thousands of kernels.
    rows: dict[tuple[int, bool, str], list[tuple[float, float]]] = defaultdict(list)
    for bar in timeline.bars:
        rows[bar.worker, bar.comm, bar.phase].append((scale * bar.start_s, scale * (bar.finish_s - bar.start_s)))
    for (worker, comm, phase), spans in rows.items():
        base = worker + (0.05 if comm else 0.05 + COMM + 0.05)
        axes.broken_barh(spans, (base, COMM if comm else COMPUTE), facecolors=PHASE_COLORS[phase],
                         edgecolor="white", linewidth=0.2)
    axes.set_yticks([w + 0.5 for w in range(workers)], [f"worker {w}" for w in range(workers)])
    axes.set_ylim(workers, 0)
    axes.set_xlim(0, scale * timeline.step_s * 1.02 or 1)
    axes.set_xlabel("ms into the step")
    used = {bar.phase for bar in timeline.bars}
    handles = [Rectangle((0, 0), 1, 1, color=color) for phase, color in PHASE_COLORS.items() if phase in used]
    axes.legend(handles, [phase for phase in PHASE_COLORS if phase in used], loc="upper left", bbox_to_anchor=(1, 1))
    axes.set_title(title)
    figure.tight_layout()
    return save(figure, path)
