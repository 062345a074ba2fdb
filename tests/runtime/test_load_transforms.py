"""Weights stored in their own form and transformed at load (runtime/load_transforms.py): a Winograd conv's
artifact holds its 3×3 weight, the loader makes the 6 × 6 points the compiler made, and a damaged entry or stored
array is refused with one line before any kernel runs."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from onnx import helper

from tessel.backends.cpu.winograd import transform_matrices, transform_weight, weight_at_load
from tessel.compiler.api import compile as compile_model
from tessel.compiler.api import load
from tessel.compiler.cli import main
from tessel.compiler.program import PACKED_SUFFIX
from tessel.ir.types import TensorType
from tessel.runtime.artifact_files import PLAN_FILE, SELF_HASH, file_hash, sealed_plan_bytes
from tessel.runtime.load_transforms import entry_problem, transformed
from tests.conftest import assert_matches_onnxruntime, run_onnxruntime
from tests.ir.helpers import F, model

RNG = np.random.default_rng(3)
WEIGHT = (RNG.standard_normal((32, 16, 3, 3)) / 12).astype(np.float32)
TRANSFORMED = TensorType("float32", (6, 6, 16, 32))


def test_the_loaders_transform_is_the_compilers_through_the_plans_json():
    entry = json.loads(json.dumps(weight_at_load(WEIGHT)))
    assert entry_problem(entry, TRANSFORMED) is None
    assert np.array_equal(transformed(entry, WEIGHT), transform_weight(WEIGHT))


def test_the_transform_is_g_times_each_kernel_times_g_transposed():
    g = transform_matrices()[2]
    u = transform_weight(WEIGHT)
    for k, c in [(0, 0), (31, 15), (7, 9)]:
        np.testing.assert_allclose(u[:, :, c, k], g @ WEIGHT[k, c].astype(np.float64) @ g.T, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("change, expected", [
    (lambda e: e.update(transform="im2col"), "the transforms at load are 'winograd'"),
    (lambda e: e["matrix"][0].__setitem__(1, float("nan")), "finite numbers"),
    (lambda e: e["matrix"][0].__setitem__(1, 10 ** 400), "finite numbers"),
    (lambda e: e["matrix"][0].__setitem__(1, True), "finite numbers"),
    (lambda e: e["matrix"][0].pop(), "6 rows of 3"),
    (lambda e: e.update(matrix=[]), "6 rows of 3"),
    (lambda e: e.update(matrix=e["matrix"][:4]), "6 rows of 3"),
    (lambda e: e.update(matrix=e["matrix"] * 3000), "6 rows of 3"),
    (lambda e: e.update(stored="float32[32,16,5,5]"), "not a float32 3×3 conv weight"),
    (lambda e: e.update(stored="float32[32,16"), "not a tensor type"),
    (lambda e: e.update(stored="float32[16,16,3,3]"), "the plan declares float32[6,6,16,32]"),
], ids=["transform", "nan", "huge-integer", "bool", "short-row", "no-rows", "4-points", "18000-points", "not-3x3",
        "bad-type", "other-channels"])
def test_a_damaged_entry_is_named(change, expected):
    entry = weight_at_load(WEIGHT)
    change(entry)
    assert expected in entry_problem(entry, TRANSFORMED)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory, kernel_cache) -> tuple[Path, object]:
    """x → 1×1 conv (its result kept blocked) → 3×3 conv on 16-pixel rows, Winograd by default."""
    weights = [("wa", (RNG.standard_normal((16, 16, 1, 1)) / 4).astype(np.float32)), ("wb", WEIGHT)]
    nodes = [helper.make_node("Conv", ["x", "wa"], ["a"], name="a"),
             helper.make_node("Conv", ["a", "wb"], ["b"], name="b", pads=[1, 1, 1, 1])]
    onnx_model = model(nodes, [("x", F, [1, 16, 16, 16])], [("b", F, None)], weights)
    directory = tmp_path_factory.mktemp("winograd") / "art"
    compile_model(onnx_model, cache_dir=kernel_cache).save(directory)
    return directory, onnx_model


def test_the_artifact_stores_the_3x3_weight_and_runs_the_transformed_one(compiled):
    directory, onnx_model = compiled
    section = json.loads((directory / PLAN_FILE).read_text())["workers"][0]
    (name,) = section["weights"]["at_load"]
    assert name.startswith(f"wb{PACKED_SUFFIX}") and section["values"][name] == TRANSFORMED.spec()
    with np.load(directory / "weights.npz", allow_pickle=False) as stored:
        assert np.array_equal(stored[name], WEIGHT)
    x = RNG.standard_normal((1, 16, 16, 16)).astype(np.float32)
    assert_matches_onnxruntime(load(directory).run({"x": x}), run_onnxruntime(onnx_model, {"x": x}))


def _reseal(directory: Path, change) -> None:
    plan = json.loads((directory / PLAN_FILE).read_text())
    change(plan)
    plan.pop(SELF_HASH)
    (directory / PLAN_FILE).write_bytes(sealed_plan_bytes(plan))


def _at_load(plan: dict) -> dict:
    return next(iter(plan["workers"][0]["weights"]["at_load"].values()))


@pytest.mark.parametrize("damage, expected", [
    ("nan matrix", "weights.at_load"),
    ("stored transformed", "the plan declares float32[32,16,3,3]"),
    ("unknown weight", "not one of the section's weights"),
])
def test_a_damaged_transform_at_load_is_refused_with_one_line(compiled, tmp_path, capsys, damage, expected):
    directory = Path(shutil.copytree(compiled[0], tmp_path / "art"))
    if damage == "nan matrix":
        _reseal(directory, lambda plan: _at_load(plan)["matrix"][2].__setitem__(0, float("nan")))
    elif damage == "unknown weight":
        _reseal(directory, lambda plan: plan["workers"][0]["weights"]["at_load"].update(other=_at_load(plan)))
    else:  # the weights file holds the transformed array where the plan says it holds the 3×3 one
        path = directory / "weights.npz"
        with np.load(path, allow_pickle=False) as original:
            arrays = dict(original)
        (name,) = json.loads((directory / PLAN_FILE).read_text())["workers"][0]["weights"]["at_load"]
        np.savez(path, **{**arrays, name: transform_weight(arrays[name])})
        _reseal(directory, lambda plan: plan["hashes"].update({"weights.npz": file_hash(path)}))
    assert main(["run", str(directory)]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line and not line.startswith("no --inputs")]
    assert len(lines) == 1 and expected in lines[0] and "Traceback" not in lines[0], lines


def test_the_matrix_is_winograd_f4x4s():
    assert np.array_equal(np.asarray(weight_at_load(WEIGHT)["matrix"]), transform_matrices()[2])


@pytest.mark.parametrize("placement", ["pipeline", pytest.param("data", marks=pytest.mark.slow)])
def test_each_worker_makes_its_own_winograd_weights_at_load(placement, tmp_path, kernel_cache):
    # Three blocked Winograd convs after a 1 × 1 one, over two workers: each section lists the weights its own
    # convs transform, its weights file holds them 3 × 3, and the workers' run equals onnxruntime's.
    shapes = {"a": (32, 16, 1, 1), "b": (32, 32, 3, 3), "c": (32, 32, 3, 3), "d": (32, 32, 3, 3)}
    weights = [(f"w{n}", (RNG.standard_normal(s) / np.sqrt(np.prod(s[1:]))).astype(np.float32))
               for n, s in shapes.items()]
    names = list(shapes)
    nodes = [helper.make_node("Conv", [source, f"w{n}"], [n], name=n, pads=[1, 1, 1, 1] if n != "a" else [0] * 4)
             for source, n in zip(["x"] + names, names)]
    onnx_model = model(nodes, [("x", F, [2, 16, 16, 16])], [("d", F, None)], weights)
    directory = compile_model(onnx_model, devices=2, placement=placement, cache_dir=kernel_cache).save(tmp_path / "a")
    plan = json.loads((directory / PLAN_FILE).read_text())
    made = set()
    for section in plan["workers"]:
        at_load = section["weights"].get("at_load", {})
        with np.load(directory / section["weights"]["file"], allow_pickle=False) as stored:
            assert all(stored[name].shape == (32, 32, 3, 3) for name in at_load)
        made |= {name.split(PACKED_SUFFIX)[0] for name in at_load}
    assert made == {"wb", "wc", "wd"}
    x = RNG.standard_normal((2, 16, 16, 16)).astype(np.float32)
    assert_matches_onnxruntime(load(directory).run({"x": x}), run_onnxruntime(onnx_model, {"x": x}))
