"""Pipeline-parallel training schedules: in which order each stage runs its micro-batches' forwards and backwards.

K stages, M micro-batches; each stage runs F(m) (its part of micro-batch m's forward) and B(m) (its part of the
backward) once per micro-batch, then updates its parameters once (not part of the order here).

- GPipe (Huang et al. 2019): every forward, then every backward. A stage keeps all M micro-batches' activations
  until their backwards run.
- 1F1B (PipeDream-Flush, Narayanan et al. 2021): stage s first runs K - s - 1 warm-up forwards, then alternates
  one forward and one backward, then drains the remaining backwards (cool-down). A stage keeps at most K - s
  micro-batches' activations (forwarded, not yet backwarded) at once: at most K.

Both have the same bubble: with equal stage times, each stage idles (K - 1) of the M + K - 1 slots of a step.
"""
from __future__ import annotations

GPIPE, ONE_F_ONE_B = "gpipe", "1f1b"
SCHEDULES = (GPIPE, ONE_F_ONE_B)
FORWARD, BACKWARD = "F", "B"


def stage_order(schedule: str, stages: int, micro_batches: int, stage: int) -> list[tuple[str, int]]:
    """Stage `stage`'s (phase, micro-batch) sequence under `schedule` ("gpipe" or "1f1b")."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule '{schedule}'; choose from {', '.join(SCHEDULES)}")
    if not 0 <= stage < stages:
        raise ValueError(f"stage {stage} of {stages}")
    if schedule == GPIPE:
        return [(FORWARD, m) for m in range(micro_batches)] + [(BACKWARD, m) for m in range(micro_batches)]
    warmup = min(stages - stage - 1, micro_batches)
    order = [(FORWARD, m) for m in range(warmup)]
    for m in range(warmup, micro_batches):
        order += [(FORWARD, m), (BACKWARD, m - warmup)]
    order += [(BACKWARD, m) for m in range(micro_batches - warmup, micro_batches)]
    return order


def most_in_flight(order: list[tuple[str, int]]) -> int:
    """The most micro-batches whose forward ran and whose backward did not yet, at any point of `order`: how many
    micro-batches' activations the stage holds at its peak."""
    held = peak = 0
    for phase, _ in order:
        held += 1 if phase == FORWARD else -1
        peak = max(peak, held)
    return peak


def bubble_fraction(stages: int, micro_batches: int) -> float:
    """The share of a step each stage idles with equal stage times: (K - 1) / (M + K - 1)."""
    return (stages - 1) / (micro_batches + stages - 1)


def balanced_cut(costs: list[float], parts: int, nonempty: list[bool] | None = None) -> list[int]:
    """Cut positions 0 = b0 < b1 < ... < b_parts = len(costs) splitting `costs` into `parts` contiguous stages with
    the least largest stage sum (dynamic programming, exact); with `nonempty`, every stage holds an item marked
    True. ValueError when no such cut exists."""
    n = len(costs)
    marked = nonempty if nonempty is not None else [True] * n
    prefix, count = [0.0], [0]
    for cost, mark in zip(costs, marked):
        prefix.append(prefix[-1] + cost)
        count.append(count[-1] + bool(mark))
    if count[-1] < parts:
        raise ValueError(f"{count[-1]} item(s) cannot fill {parts} stages")
    inf = float("inf")
    # best[k][j]: the least bottleneck of items[:j] in k stages; back[k][j]: where the last of them starts.
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    back = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for j in range(1, n + 1):
            for i in range(j):
                if best[k - 1][i] == inf or count[j] == count[i]:
                    continue
                value = max(best[k - 1][i], prefix[j] - prefix[i])
                if value < best[k][j]:
                    best[k][j], back[k][j] = value, i
    bounds = [n]
    for k in range(parts, 0, -1):
        bounds.append(back[k][bounds[-1]])
    return bounds[::-1]
