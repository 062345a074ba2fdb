"""`--input-value NAME=VALUE` at run time and at compile time (inputs that become constants, with -1 dims bound),
the hint for a random input that steers an If into a branch that cannot run, and
`tessel run --check` on small corpus models with the corpus' documented fills."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

from tessel.compiler.api import compile as compile_model
from tessel.compiler.cli import main
from tessel.compiler.input_values import parse_compile_values, parse_input_values, with_input_values
from tessel.ir.types import TensorType
from tessel.runtime.errors import InputError
from tests.conftest import POSITIVE, assert_matches_onnxruntime, run_onnxruntime
from tests.ir.helpers import F, I64, model

TYPES = {"sr": TensorType("int64", ()), "mask": TensorType("bool", (2,)), "x": TensorType("float32", (2, 3))}


def test_values_are_broadcast_to_the_input_shape_and_dtype():
    values = parse_input_values(["sr=16000", "mask=true", "x=0.5"])
    inputs = with_input_values({"x": np.zeros((2, 3), np.float32)}, values, TYPES)
    assert inputs["sr"].dtype == np.int64 and inputs["sr"].shape == () and inputs["sr"] == 16000
    assert inputs["mask"].tolist() == [True, True]
    assert inputs["x"].dtype == np.float32 and np.all(inputs["x"] == 0.5)


@pytest.mark.parametrize("items, message", [
    (["sr"], "expected NAME=VALUE"),
    (["sr=1", "sr=2"], "gives 'sr' twice"),
    (["sr=fast"], "VALUE must be a number"),
])
def test_malformed_items_are_refused(items, message):
    with pytest.raises(InputError, match=message):
        parse_input_values(items)


@pytest.mark.parametrize("item, message", [
    ("sr=1.5", "the input is int64; give an integer"),
    ("mask=2", "the input is bool"),
    ("sr=1e30", "out of the range of int64"),
    ("nosuch=1", "the model has no input 'nosuch'; its inputs are mask, sr, x"),
])
def test_values_the_input_cannot_hold_are_refused(item, message):
    with pytest.raises(InputError, match=message):
        with_input_values({}, parse_input_values([item]), TYPES)


def _corpus(name: str):
    return next(m for m in POSITIVE if m.name == name)


@pytest.fixture(scope="module")
def silero(kernel_cache, tmp_path_factory):
    entry = _corpus("silero_vad")
    artifact = compile_model(entry.path, input_shapes=entry.input_shapes, cache_dir=kernel_cache, keep_model=True)
    return entry, artifact.save(tmp_path_factory.mktemp("art") / "silero")


def test_a_random_control_input_is_named_when_it_sends_the_if_to_a_branch_that_cannot_run(silero, capsys):
    _, artifact = silero
    assert main(["run", str(artifact), "--check"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "LSTM" not in err, err
    assert "random input 'sr' sent the If at node 'If_0' to a branch that cannot run" in err
    assert "--input-value sr=VALUE" in err


def test_silero_checks_with_its_documented_sample_rate(silero, capsys):
    entry, artifact = silero
    kind, rate = entry.inputs["sr"]["fill"]  # the corpus documents ["const", 16000]
    assert kind == "const"
    assert main(["run", str(artifact), "--check", "--input-value", f"sr={rate}"]) == 0
    assert "check: ok" in capsys.readouterr().out


def test_mtcnn_rnet_checks_with_the_corpus_fills(kernel_cache, tmp_path, capsys):
    entry = _corpus("mtcnn_rnet")
    artifact = compile_model(entry.path, input_shapes=entry.input_shapes, cache_dir=kernel_cache, keep_model=True)
    saved = artifact.save(tmp_path / "rnet")
    np.savez(tmp_path / "in.npz", **entry.make_inputs(seed=0))
    assert main(["run", str(saved), "--check", "--inputs", str(tmp_path / "in.npz")]) == 0
    assert "check: ok" in capsys.readouterr().out


def _free_dims_model(path):
    """x[-1,3,-1,-1] → Relu → ReduceSum over `axes` (an input) → Reshape to `shape` (an input), saved at `path`."""
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("ReduceSum", ["r", "axes"], ["s"], keepdims=0),
             helper.make_node("Reshape", ["s", "shape"], ["y"])]
    onnx.save(model(nodes, [("x", F, [-1, 3, -1, -1]), ("axes", I64, [1]), ("shape", I64, [2])], [("y", F, [-1, -1])]),
              path)
    return str(path)


def test_compile_values_are_arrays_one_number_or_a_list():
    values = parse_compile_values(["shape=2,-1", "k=3", "flag=true"])
    assert values["shape"].tolist() == [2, -1] and values["k"].shape == () and values["flag"] == True  # noqa: E712
    with pytest.raises(InputError, match="VALUE must be a number"):
        parse_compile_values(["shape=2,x"])


def test_a_model_with_free_dims_compiles_for_the_bound_shape_and_equals_onnxruntime(tmp_path, kernel_cache, capsys):
    path = _free_dims_model(tmp_path / "free.onnx")
    values = {"axes": np.array([1]), "shape": np.array([2, -1])}
    artifact = compile_model(path, input_shapes={"x": (2, 3, 4, 5)}, input_values=values, cache_dir=kernel_cache,
                             profile=False, keep_model=True)
    assert sorted(artifact.batch_input_types()) == ["x"]
    x = np.random.default_rng(0).standard_normal((2, 3, 4, 5)).astype(np.float32)
    assert_matches_onnxruntime(artifact.run({"x": x}), run_onnxruntime(path, {"x": x, **values}))
    # the kept model is the model as compiled, the values its initializers: --check needs no --input-value
    assert main(["run", str(artifact.save(tmp_path / "art")), "--check"]) == 0
    assert "check: ok" in capsys.readouterr().out


def test_cli_compile_takes_input_values_and_refuses_bad_ones_in_one_line(tmp_path, capsys):
    path = _free_dims_model(tmp_path / "free.onnx")
    args = ["compile", path, "-o", str(tmp_path / "art"), "--input-shape", "x=1x3x2x2", "--no-profile"]
    assert main(args + ["--input-value", "axes=1.5", "--input-value", "shape=1,-1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "input value for 'axes' ([1.5]) does not fit the input's element type int64" in err
    assert main(args + ["--input-value", "axes=1,2,3", "--input-value", "shape=1,-1"]) == 2
    assert "input value for 'axes' has shape 3; the model declares 1" in capsys.readouterr().err


def test_inspect_names_the_inputs_that_decide_shapes(tmp_path, capsys):
    path = _free_dims_model(tmp_path / "free.onnx")
    assert main(["inspect", path, "--input-shape", "x=1x3x2x2"]) == 2
    out, err = capsys.readouterr()
    assert "x: float32[?,3,?,?]" in out
    assert "  axes: ReduceSum '#1' axes\n  shape: Reshape '#2' shape" in out
    assert "'axes' decides its output shape" in err
    assert main(["inspect", path, "--input-shape", "x=1x3x2x2", "--input-value", "axes=1", "--input-value", "shape=1,-1"]) == 0
    assert "y: float32[1,4]" in capsys.readouterr().out
