"""compiler/plots/gantt.py on a synthetic placement report."""
from __future__ import annotations

import pytest

from tessel.compiler.plots.gantt import GraphFacts, merged_spans, micro_batch_interval, transfer_windows, write_gantt
from tests.compiler.chart_checks import assert_chart


def _placement(planner="pipeline", microbatches=2, estimated=()):
    """Three nodes on device 0, two on device 1, one tensor sent between them."""
    ops = [("conv1", "Conv", 0), ("relu1", "Relu", 0), ("pool", "MaxPool", 0), ("conv2", "Conv", 1), ("fc", "Gemm", 1)]
    nodes, t = {}, 0.0
    for name, op, device in ops:
        nodes[name] = {"device": device, "op": op, "start_s": t, "finish_s": t + 0.002, "estimated": name in estimated}
        t += 0.002 + (0.0005 if name == "pool" else 0.0)
    return {"planner": planner, "devices": 2, "microbatches": microbatches, "predicted_makespan_s": t + 0.006,
            "link": {"alpha_s": 1e-4, "beta_s_per_byte": 1e-9, "measured": False}, "nodes": nodes,
            "transfers": [{"tensor": "pooled", "from": 0, "to": 1, "bytes": 400_000}]}


def test_gantt_names_lanes_op_kinds_micro_batches_transfers_and_sources(tmp_path):
    facts = GraphFacts({"pooled": "pool"}, {"conv2": "Conv+Add+Relu"})
    paths = write_gantt(tmp_path / "gantt", _placement(estimated={"fc"}), facts, "tiny")
    svg = assert_chart(paths, ["device 0", "device 1", "time (ms, predicted)", "Conv", "Relu", "MaxPool", "Gemm",
                               "Conv+Add+Relu",
                               "micro-batch 0", "micro-batch 1", "mb 1", "transfer (Send/Recv)",
                               "tiny: pipeline placement on 2 devices, 2 micro-batches",
                               "node times 1 of 5 estimated, link costs estimated"])
    assert svg.count("<svg") == 1


def test_an_idle_device_lane_says_it_has_no_nodes(tmp_path):
    placement = _placement(microbatches=1)
    placement["devices"] = 3
    svg = assert_chart(write_gantt(tmp_path / "gantt", placement, GraphFacts({"pooled": "pool"}, {}), "tiny"), ["device 2", "(no nodes)"])
    assert "micro-batch" not in svg


def test_transfers_run_after_their_producer_for_alpha_plus_beta_bytes():
    placement = _placement()
    [window] = transfer_windows(placement, {"pooled": "pool"})
    assert window["kind"] == "Send/Recv"
    assert window["start_s"] == pytest.approx(0.006)
    assert window["finish_s"] - window["start_s"] == pytest.approx(1e-4 + 4e-4)


def test_data_placement_scatters_inputs_and_gathers_results(tmp_path):
    placement = _placement(planner="data", microbatches=1)
    for node in placement["nodes"].values():
        node["device"] = "all"
    placement["transfers"] = [{"tensor": "x", "from": 0, "to": 1, "bytes": 8}, {"tensor": "y", "from": 1, "to": 0, "bytes": 8}]
    assert [w["kind"] for w in transfer_windows(placement, {"y": "fc"})] == ["Scatter", "Gather"]
    svg = assert_chart(write_gantt(tmp_path / "gantt", placement, GraphFacts({"y": "fc"}, {}), "tiny"),
                       ["tiny: data placement on 2 devices", "transfer (Gather, Scatter)"])
    assert "(no nodes)" not in svg  # nodes on "all" devices fill every lane


def test_micro_batches_start_one_bottleneck_interval_apart():
    placement = _placement(microbatches=3)
    first = max(n["finish_s"] for n in placement["nodes"].values())
    assert micro_batch_interval(placement) == pytest.approx((placement["predicted_makespan_s"] - first) / 2)
    assert micro_batch_interval(_placement(microbatches=1)) == 0.0


def test_touching_and_overlapping_spans_merge_for_the_hatch():
    assert merged_spans([(5.0, 1.0), (0.0, 2.0), (2.0, 1.0), (2.5, 0.2), (7.0, 1.0)]) == [(0.0, 3.0), (5.0, 1.0),
                                                                                          (7.0, 1.0)]
    assert merged_spans([]) == []
