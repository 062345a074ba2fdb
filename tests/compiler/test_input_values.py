"""`--input-value NAME=VALUE`, the hint for a random input that steers an If into a branch that cannot run, and
`tessel run --check` on small corpus models with the corpus' documented fills."""
from __future__ import annotations

import numpy as np
import pytest

from tessel.compiler.api import compile as compile_model
from tessel.compiler.cli import main
from tessel.compiler.input_values import parse_input_values, with_input_values
from tessel.ir.types import TensorType
from tessel.runtime.errors import InputError
from tests.conftest import POSITIVE

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
