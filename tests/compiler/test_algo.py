"""Algorithm and micro-batch selection through the compiler: outputs equal onnxruntime, reports, limits, errors."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from tessel.compiler.api import CompileError, compile
from tessel.ir.onnx_import import with_batch
from tessel.ir.types import TensorType
from tessel.runtime.executor import Executor
from tests.conftest import POSITIVE, assert_matches_onnxruntime, run_onnxruntime

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 2 << 20


@pytest.fixture(autouse=True)
def _isolated_profiles(tessel_cache, monkeypatch):
    # The profile database goes into the session's cache root, not into ~/.cache.
    monkeypatch.setenv("TESSEL_CACHE_DIR", str(tessel_cache))


def _model(name):
    return next(m for m in POSITIVE if m.name == name)


# YOLOv8n takes about a minute on two cores: `pytest -m slow` runs it; ResNet-18 covers the same path here.
@pytest.mark.parametrize("name", ["resnet18", pytest.param("yolov8n_320", marks=pytest.mark.slow)])
def test_micro_batched_models_at_batch_8_equal_onnxruntime(name, kernel_cache):
    model = _model(name)
    # No profiling (a budget of 0 s): estimated times keep this test fast; the kernels run for real.
    artifact = compile(model.path, batch=8, input_shapes=model.input_shapes, algo_select="dp", workspace_limit=LIMIT,
                       profile_budget=0, cache_dir=kernel_cache)
    doc = json.loads((artifact.directory / "reports" / "algo.json").read_text())
    split = [row for row in doc["layers"] if len(row["chosen"]["pieces"]) > 1]
    assert split, "a 2 MiB limit at batch 8 should make some layer run in micro-batches"
    assert all(row["chosen"]["workspace_bytes"] <= LIMIT for row in doc["layers"])
    assert all(sum(size for _, size in row["chosen"]["pieces"]) == 8 for row in doc["layers"])
    plan = json.loads((artifact.directory / "plan.json").read_text())
    assert any("pieces" in step for step in plan["workers"][0]["instructions"])
    (name_, shape), = model.input_shapes.items()
    feeds = {name_: np.random.default_rng(0).random((8,) + tuple(shape[1:])).astype(np.float32)}
    reference = run_onnxruntime(with_batch(onnx.load(str(model.path)), 8), feeds)
    # Host numpy memory, and TVM-allocated memory as on a GPU (pieces are views at offsets there too).
    for executor in (artifact.executor(), Executor(artifact.directory, memory_device="cpu")):
        executor.poison()
        assert_matches_onnxruntime(executor.run(feeds), reference)
    assert (artifact.directory / "reports" / "algo.md").read_text().startswith("# Algorithm and micro-batch selection")


def test_report_says_what_each_extra_weight_layout_adds(kernel_cache):
    model = _model("mtcnn_onet")
    # Estimated times (no profiling) choose Winograd for a 3x3 conv: its transformed kernel is an extra layout.
    artifact = compile(model.path, batch=4, input_shapes=model.input_shapes, algo_select="dp", workspace_limit="1MiB",
                       profile_budget=0, cache_dir=kernel_cache)
    doc = json.loads((artifact.directory / "reports" / "algo.json").read_text())
    # The bytes the loaded weights hold (a Winograd weight is stored 3×3 and held transformed: load_transforms.py).
    section = json.loads((artifact.directory / "plan.json").read_text())["workers"][0]
    stored = {name: TensorType.parse(section["values"][name]).nbytes for name in section["weights"]["names"]}
    extra = [layout for row in doc["layers"] for layout in row["weights"]["layouts"] if layout["extra"]]
    assert extra and all(stored[layout["name"]] == layout["bytes"] and layout["algorithms"] for layout in extra)
    assert doc["extra_layout_bytes"] == sum(layout["bytes"] for layout in extra)
    assert doc["weight_bytes"] == sum(stored.values()) and doc["default_weight_bytes"] < doc["weight_bytes"]
    for row in doc["layers"]:
        assert row["weights"]["weight_bytes"] == sum(layout["bytes"] for layout in row["weights"]["layouts"])
    summary = artifact.report()["algo"]
    assert {k: summary[k] for k in ("weight_bytes", "default_weight_bytes", "extra_layout_bytes")} == \
        {k: doc[k] for k in ("weight_bytes", "default_weight_bytes", "extra_layout_bytes")}
    markdown = (artifact.directory / "reports" / "algo.md").read_text()
    assert "the chosen algorithms' own layouts take" in markdown and "winograd" in markdown


def test_ilp_divides_the_budget_and_reports_its_bound(kernel_cache):
    model = _model("mtcnn_onet")
    artifact = compile(model.path, batch=4, input_shapes=model.input_shapes, algo_select="ilp", workspace_limit="1MiB",
                       profile_budget=0, cache_dir=kernel_cache)
    doc = json.loads((artifact.directory / "reports" / "algo.json").read_text())
    assert doc["mode"] == "ilp" and doc["layers"]
    assert sum(row["chosen"]["workspace_bytes"] for row in doc["layers"]) <= 1 << 20
    assert doc["ilp"]["lp_bound_s"] <= doc["ilp"]["objective_s"] + 1e-12
    (name_, shape), = model.input_shapes.items()
    feeds = {name_: np.random.default_rng(0).random((4,) + tuple(shape[1:])).astype(np.float32)}
    assert_matches_onnxruntime(artifact.run(feeds), run_onnxruntime(with_batch(onnx.load(str(model.path)), 4), feeds))


@pytest.mark.parametrize("options,message", [
    ({"algo_select": "greedy"}, "--algo-select greedy"),
    ({"algo_select": "dp", "batch_policy": "halves"}, "--batch-policy halves"),
    ({"algo_select": "ilp"}, "give --workspace-limit or --device-memory"),
    ({"algo_select": "dp", "devices": 2}, "one device"),
    ({"algo_select": "dp", "workspace_limit": "lots"}, "--workspace-limit"),
    ({"workspace_limit": "8MiB"}, "add --algo-select"),
])
def test_bad_selection_options_fail_clearly(options, message, kernel_cache):
    with pytest.raises(CompileError, match=message):
        compile(_model("mtcnn_onet").path, batch=2, cache_dir=kernel_cache, **{"profile_budget": 0, **options})


def test_cli_selects_and_reports(kernel_cache, tmp_path):
    out = tmp_path / "art"
    done = subprocess.run([sys.executable, "-m", "tessel.compiler.cli", "compile", str(_model("mtcnn_onet").path), "-o", str(out),
                           "--batch", "4", "--algo-select", "dp", "--workspace-limit", "64KiB", "--profile-budget", "0"],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "algorithms (dp)" in done.stdout and (out / "reports" / "algo.md").is_file()
    # A budget of 0 s measures nothing: the line says the total is an estimate, and on how little it rests.
    assert "ms estimated (0 of " in done.stdout and "candidates measured, 0%" in done.stdout
    assert "of a 0 s budget" in done.stdout and "weights " in done.stdout
    report = subprocess.run([sys.executable, "-m", "tessel.compiler.cli", "report", str(out)], capture_output=True, text=True,
                            cwd=ROOT)
    assert "# Algorithm and micro-batch selection (dp" in report.stdout
    bad = subprocess.run([sys.executable, "-m", "tessel.compiler.cli", "compile", str(_model("mtcnn_onet").path), "-o",
                          str(tmp_path / "bad"), "--algo-select", "ilp", "-q"], capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and not (tmp_path / "bad").exists()
