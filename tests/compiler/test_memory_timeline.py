"""compiler/plots/memory_timeline.py on synthetic memory reports."""
from __future__ import annotations

from tessel.compiler.plots.memory_timeline import write_memory_timeline
from tests.compiler.chart_checks import assert_chart

MIB = 1 << 20


def _report(timeline, peak_node="conv2"):
    peak = max(range(len(timeline)), key=timeline.__getitem__)
    return {"timeline": timeline, "arena_bytes": int(max(timeline) * 1.1), "bound_bytes": max(timeline),
            "peak": {"step": peak, "node": peak_node, "op": "Conv"}}


def test_one_panel_per_worker_with_arena_bound_and_peak(tmp_path):
    workers = [_report([MIB, 3 * MIB, 2 * MIB, MIB]), _report([2 * MIB, MIB], peak_node="fc")]
    paths = write_memory_timeline(tmp_path / "memory_timeline", workers, "tiny: planned activation memory per step")
    assert_chart(paths, ["device 0", "device 1", "live bytes (MiB)", "step (instruction in execution order)",
                         "arena 3.30 MiB", "lower bound 3.00 MiB", "peak 3.00 MiB at step 1", "conv2 (Conv)",
                         "fc (Conv)", "tiny: planned activation memory per step"], min_height=400)


def test_small_graphs_are_drawn_in_kib(tmp_path):
    paths = write_memory_timeline(tmp_path / "m", [_report([512, 2048, 1024])], "tiny")
    svg = assert_chart(paths, ["live bytes (KiB)", "lower bound 2.00 KiB", "peak 2.00 KiB at step 1"])
    assert "device 0" not in svg  # one worker: no panel name


def test_a_worker_without_steps_gets_an_empty_panel(tmp_path):
    empty = {"timeline": [], "arena_bytes": 0, "bound_bytes": 0, "peak": {"step": 0, "node": None, "op": None}}
    paths = write_memory_timeline(tmp_path / "m", [_report([MIB, 2 * MIB]), empty], "tiny")
    assert_chart(paths, ["device 1", "no steps on this worker"], min_height=400)
