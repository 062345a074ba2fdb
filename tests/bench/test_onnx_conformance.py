"""The conformance sweep runs and classifies node tests."""
from __future__ import annotations

from onnx.backend.test.case.node import collect_testcases

from bench.onnx_conformance import main, run_case

CASES = {c.name: c for c in collect_testcases()}


def test_supported_ops_pass_through_import_export_and_onnxruntime():
    for name in ("test_relu", "test_conv_with_strides_padding", "test_lstm_defaults", "test_gru_defaults",
                 "test_softmax_axis_0", "test_maxpool_2d_pads", "test_gather_0"):
        assert run_case(CASES[name]) == ("pass", ""), name


def test_sequence_and_data_dependent_cases_are_classified():
    assert run_case(CASES["test_sequence_insert_at_back"])[0] == "unsupported"
    outcome, detail = run_case(CASES["test_nonmaxsuppression_center_point_box_format"])
    assert outcome == "import" and "static shape" in detail


def test_sweep_prints_totals(capsys):
    assert main(["--filter", "test_add"]) == 0
    out = capsys.readouterr().out
    assert "node tests over" in out and "passed" in out
