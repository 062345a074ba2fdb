"""Every number says where it came from: the compile's summary lines, the profile budget, notes without tracebacks."""
from __future__ import annotations

import time

import pytest
from onnx import TensorProto, helper

from tessel import ir
from tessel.backends.cache import KernelCache
from tessel.backends.target import parse_target
from tessel.compiler import algo
from tessel.compiler.compile_log import LOG_FILE, CompileLog
from tessel.compiler.pipeline import run_pipeline
from tessel.compiler.program import ProgramBuilder
from tessel.compiler.provenance import algo_line, placement_line, share, weight_growth
from tessel.runtime.profile_db import ProfileDB

BUILD_S, RUN_S = 0.15, 0.05


def _matmul_layers(batch=8):
    """A tiny graph with a few MatMul layers (several algorithms, several micro-batch sizes each)."""
    nodes, inits, x = [], [], "x"
    for k in range(3):
        inits.append(helper.make_tensor(f"w{k}", TensorProto.FLOAT, [64, 64], [0.01] * 64 * 64))
        nodes.append(helper.make_node("MatMul", [x, f"w{k}"], [f"h{k}"]))
        x = f"h{k}"
    graph = helper.make_graph(nodes, "mm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 64])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, [batch, 64])], inits)
    graph, _ = run_pipeline(ir.from_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])))
    layers = algo.find_layers(graph, "llvm", "powers-of-two")
    assert len(layers) == 3 and all(len(layer.algorithms) * len(layer.sizes) > 1 for layer in layers)
    return layers


def _slow_build(specs, target, cache, jobs=None, progress=None):
    time.sleep(BUILD_S)


def _slow_time(library, spec, runs, deadline=None):
    """Like runtime/profile.time_kernel: each run takes RUN_S, and the runs stop at the deadline."""
    samples = 0
    for _ in range(runs):
        if deadline is not None and time.perf_counter() >= deadline:
            break
        time.sleep(RUN_S)
        samples += 1
    return 1.0 if samples else None


@pytest.fixture
def slow_kernels(monkeypatch, tmp_path):
    """Kernel builds and timings that take known time and compile nothing; an empty cache and profile database."""
    monkeypatch.setattr(algo, "build_kernels", _slow_build)
    monkeypatch.setattr(algo, "time_kernel", _slow_time)
    monkeypatch.setattr(algo, "BUILD_ROUND_PRIOR_S", BUILD_S)
    return KernelCache(tmp_path / "kernels"), ProfileDB(tmp_path / "profiles.json")


def test_the_profile_budget_is_honoured_and_the_rest_estimated(slow_kernels):
    cache, db = slow_kernels
    layers = _matmul_layers()
    total = sum(len(layer.algorithms) * len(layer.sizes) for layer in layers)
    budget = 1.0  # every candidate would take 0.25 s + its share of the builds: far more than the budget
    started = time.perf_counter()
    timing = algo.time_candidates(layers, ProgramBuilder(parse_target("llvm")), parse_target("llvm"), cache, db,
                                  budget_s=budget, jobs=2)
    measuring = time.perf_counter() - started - timing.enumerate_seconds
    # A candidate's runs stop at the deadline: at most one run of 50 ms past it (the machine is shared: generous).
    assert timing.seconds == pytest.approx(measuring, abs=0.05) and budget <= timing.seconds < budget * 1.1 + 0.2
    assert timing.budget_exhausted and 0 < timing.measured < total and timing.measured + timing.estimated == total
    whole = {(layer.node.name, layer.batch) for layer in layers}
    measured = {(name, c.batch) for name, rows in timing.candidates.items() for c in rows if c.measured}
    assert measured <= whole  # whole-batch candidates are measured first
    selection = algo.select(layers, timing, "dp", None, "none given", "powers-of-two")
    rows = [{"chosen": {"source": "measured" if c.measured else "estimated"}} for c in selection.chosen.values()]
    summary = {"mode": "dp", "total_seconds": 0.2299, "total_source": algo.chosen_source(rows, "chosen"),
               "best_single_total_seconds": None, "default_weight_bytes": 100, "weight_bytes": 100,
               "extra_layout_bytes": 0,
               "profiling": {"measured": timing.measured, "estimated": timing.estimated, "seconds": timing.seconds,
                             "budget_s": budget, "budget_exhausted": True}}
    line = algo_line(summary, "algo.md")
    assert f"{timing.measured} of {total} candidates measured" in line and "of a 1 s budget" in line


def test_no_build_starts_that_would_end_past_the_budget(slow_kernels, monkeypatch):
    monkeypatch.setattr(algo, "BUILD_ROUND_PRIOR_S", 2.0)  # before any build, one is expected to take 2 s
    target = parse_target("llvm")
    started = time.perf_counter()
    timing = algo.time_candidates(_matmul_layers(), ProgramBuilder(target), target, *slow_kernels, budget_s=1.0)
    assert timing.measured == 0 and timing.budget_exhausted and time.perf_counter() - started < 1.0


def test_no_budget_left_measures_nothing(tmp_path):
    layers = _matmul_layers(batch=2)
    target = parse_target("llvm")
    timing = algo.time_candidates(layers, ProgramBuilder(target), target, KernelCache(tmp_path / "kernels"),
                                  ProfileDB(tmp_path / "profiles.json"), budget_s=0, remeasure=True)
    assert timing.measured == 0 and timing.budget_exhausted and not list(tmp_path.glob("kernels/*"))


def test_summary_lines_mark_estimates_and_their_share():
    assert share(9, 219, "candidates") == "9 of 219 candidates measured, 4%"
    algo_summary = {"mode": "dp", "total_seconds": 0.22986, "total_source": "estimated",
                    "best_single_total_seconds": 0.27143, "best_single_source": "estimated",
                    "default_weight_bytes": int(44.6 * 2**20), "weight_bytes": int(150.9 * 2**20),
                    "extra_layout_bytes": 110 << 20,
                    "profiling": {"measured": 9, "estimated": 210, "seconds": 10.04, "budget_s": 10.0,
                                  "budget_exhausted": True}}
    line = algo_line(algo_summary, "r/algo.md")
    assert "229.86 ms estimated (9 of 219 candidates measured, 4%) vs 271.43 ms estimated" in line
    assert "weights 44.6 MiB -> 150.9 MiB (+106.3 MiB; the chosen algorithms' own layouts take 110.0 MiB)" in line and "profiling 10.0 s of a 10 s budget" in line
    assert weight_growth(10, 10, 0) == "weights 10 B (no extra layouts)"
    placed = {"planner": "pipeline", "predicted_makespan_s": 0.05, "predicted_source": "estimated",
              "node_times": {"measured": 58, "total": 60}, "bound_s": 0.04, "transfer_bytes": 1 << 20,
              "link": {"alpha_s": 1e-7, "beta_s_per_byte": 7e-10, "measured": True},
              "alternatives": [{"name": "pipeline", "predicted_ms": 50.0, "source": "estimated"},
                               {"name": "single", "predicted_ms": 80.0, "source": "estimated"}]}
    line = placement_line(placed, 2, "r/placement.md")
    assert "50.00 ms per batch estimated (58 of 60 node times measured, 97%" in line
    assert "link α 0.1 µs, β 0.7 ns/B (measured)" in line
    assert "alternatives: pipeline 50.00 ms estimated; single 80.00 ms estimated" in line


def test_a_note_is_one_sentence_and_the_details_go_to_the_log(tmp_path):
    log = CompileLog()
    try:
        raise RuntimeError('  File "<unknown>", line 0, in 0xffffffffffffffff')
    except RuntimeError as exc:
        note = log.note("The model did not run on random inputs, so node times are estimates.", exc, "stderr text")
    assert note == f"The model did not run on random inputs, so node times are estimates; details in {LOG_FILE}"
    (tmp_path / "reports").mkdir()
    log.write(tmp_path)
    text = (tmp_path / LOG_FILE).read_text()
    assert "RuntimeError" in text and "0xffffffffffffffff" in text and "stderr text" in text and "Traceback" in text



def test_auto_placement_lists_its_alternatives_and_a_failed_profiling_leaves_one_sentence(monkeypatch, tmp_path):
    from tessel.compiler import worker_programs
    from tessel.compiler.distribute import PlacementReport
    from tessel.compiler.options import CompileOptions
    from tessel.compiler.program import build_program
    from tessel.passes.machine import Link, Machine
    from tessel.passes.partition import Transfers
    from tessel.passes.placement import place
    from tessel.runtime.profile import ProfilingFailed

    def fails(*args, **kwargs):
        raise ProfilingFailed("the profiling process exited with status 1",
                              'Traceback (most recent call last):\n  File "<unknown>", line 0, in 0xffffffffffffffff\n')

    monkeypatch.setattr(worker_programs, "profile_steps", fails)
    graph = helper.make_graph([helper.make_node("Exp", ["x"], ["h"]), helper.make_node("Tanh", ["h"], ["y"])], "two",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])])
    graph = ir.from_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]))
    target = parse_target("llvm")
    log = CompileLog()
    # No kernel is compiled: profiling fails before it would run them.
    tasks, notes = worker_programs._tasks(graph, build_program(graph, target), target, KernelCache(tmp_path / "k"),
                                          CompileOptions(devices=2), 2, log)
    assert notes == log.notes and len(notes) == 1
    assert notes[0].endswith(f"details in {LOG_FILE}") and "File" not in notes[0] and "\n" not in notes[0]
    (tmp_path / "reports").mkdir()
    log.write(tmp_path)
    assert "0xffffffffffffffff" in (tmp_path / LOG_FILE).read_text()

    machine = Machine((1 << 30, 1 << 30), Link(5e-5, 1e-9, measured=True))
    plan = place(tasks, machine, "auto", batch=4, io_bytes=(128, 128), cuts={1: 128})
    doc = PlacementReport(plan, Transfers(), machine, tasks, [0, 0], [0, 0]).to_json()
    names = [a["name"] for a in doc["alternatives"]]
    assert names[0] == doc["planner"] and {"single", "pipeline", "list", "data"} <= set(names)
    assert all(set(a) == {"name", "predicted_ms", "source"} and a["source"] == "estimated" for a in doc["alternatives"])
    line = placement_line(doc, 2, "placement.md")
    assert "estimated (0 of 2 node times measured, 0%" in line and "alternatives: " in line
