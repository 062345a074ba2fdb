"""compiler/plots/algo_selection.py on a synthetic reports/algo.json."""
from __future__ import annotations

from tessel.compiler.plots.algo_selection import write_algo_chart
from tests.compiler.chart_checks import assert_chart


def _layer(node, chosen, seconds, source, base, base_seconds):
    return {"node": node, "op": "Conv", "batch": 4, "chosen": {"pieces": chosen, "describe": " + ".join(
        f"{a} {b}" for a, b in chosen), "seconds": seconds, "workspace_bytes": 0, "source": source},
            "best_single": {"algorithm": base, "seconds": base_seconds, "workspace_bytes": 0, "source": "measured"},
            "speedup": base_seconds / seconds}


def test_chosen_against_best_single_per_layer_and_in_total(tmp_path):
    doc = {"mode": "dp", "policy": "powers-of-two", "total_seconds": 0.005, "best_single_total_seconds": 0.006,
           "weight_bytes": 3 << 20, "default_weight_bytes": 2 << 20, "extra_layout_bytes": 1 << 20,
           "profiling": {"measured": 5, "estimated": 2, "seconds": 1.5, "budget_exhausted": False},
           "layers": [_layer("conv_a", [["winograd", 4]], 0.003, "measured", "direct", 0.0035),
                      _layer("conv_b", [["im2col", 2], ["direct", 2]], 0.002, "estimated", "direct", 0.0025)]}
    paths = write_algo_chart(tmp_path / "algo_selection", doc, "tiny")
    assert_chart(paths, ["tiny", "algorithm selection (dp, micro-batch sizes: powers-of-two): 5 candidates measured, "
                         "2 estimated", "conv_a (Conv, batch 4)", "conv_b (Conv, batch 4)", "winograd", "im2col",
                         "several algorithms", "best single algorithm", "estimated (else measured)",
                         "5.00 ms (1 of 2 estimated layers)", "6.00 ms (measured)", "time per layer (ms)",
                         "weights held 3.0 MiB"])
