"""bench/layer_compare.py: Tessel's kernels joined to OpenVINO's layers by ONNX node; bad input is one line."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

from layer_compare import side_by_side  # noqa: E402


def test_kernels_join_the_layer_of_their_onnx_node_and_unmatched_layers_come_last():
    tessel = [{"node": "fused_node_Conv_298", "op": "Fused", "ms": 0.5, "gflop": 0.23, "algorithm": ""},
              {"node": "node_max_pool2d", "op": "MaxPool", "ms": 0.07, "gflop": 0.002, "algorithm": ""}]
    openvino = [{"node": "node_Conv_298", "exec_type": "brgconv_avx512_f32", "ms": 0.7},
                {"node": "reorder_in", "exec_type": "reorder", "ms": 0.1},
                {"node": "skipped", "exec_type": "reorder", "ms": 0.0}]
    rows = side_by_side(tessel, openvino)
    assert [(r["node"], r["tessel_ms"], r["openvino_ms"]) for r in rows] == [
        ("fused_node_Conv_298", 0.5, 0.7), ("node_max_pool2d", 0.07, None), ("reorder_in", None, 0.1)]
    assert rows[0]["exec_type"] == "brgconv_avx512_f32"


def test_bad_arguments_are_one_line():
    for args in (["no_such_model"], ["resnet18", "--runs", "0"]):
        done = subprocess.run([sys.executable, "bench/layer_compare.py", *args], cwd=REPO, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr


def test_an_engine_that_fails_is_one_line(monkeypatch, capsys):
    import layer_compare

    def failing(kind, name, runs, algo_select, precision="fp32"):
        raise RuntimeError(f"{kind}: No module named 'openvino'")

    monkeypatch.setattr(layer_compare, "_isolated", failing)
    assert layer_compare.main(["resnet18"]) == 2
    assert capsys.readouterr().err == "layer_compare: tessel: No module named 'openvino'\n"
