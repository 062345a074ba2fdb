"""The executor: input checks, If on a runtime condition, reused buffers, corrupted artifacts."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from tessel.compiler.api import compile, load
from tessel.runtime.errors import ArtifactError, InputError
from tessel.runtime.memory import ALIGNMENT, aligned_empty
from tests.conftest import run_onnxruntime
from tests.ir.helpers import F, model


def _if_model():
    then_branch = helper.make_graph([helper.make_node("Relu", ["x"], ["t"])], "then", [], [helper.make_tensor_value_info("t", F, None)])
    else_branch = helper.make_graph([helper.make_node("Neg", ["x"], ["e"])], "else", [], [helper.make_tensor_value_info("e", F, None)])
    nodes = [helper.make_node("If", ["c"], ["y"], then_branch=then_branch, else_branch=else_branch)]
    return model(nodes, [("x", F, [2, 3]), ("c", 9, [])], [("y", F, None)])


def test_if_with_runtime_condition_runs_the_chosen_branch(kernel_cache):
    original = _if_model()
    artifact = compile(original, cache_dir=kernel_cache)
    x = np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)
    for flag in (True, False):
        feeds = {"x": x, "c": np.array(flag)}
        np.testing.assert_array_equal(artifact.run(feeds)["y"], run_onnxruntime(original, feeds)[0])


@pytest.mark.parametrize("feeds,match", [
    ({"x": np.zeros((2, 3), np.float32)}, "missing 'c'"),
    ({"x": np.zeros((2, 4), np.float32), "c": np.array(True)}, "input 'x' is float32\\[2,4\\]"),
    ({"x": np.zeros((2, 3), np.float64), "c": np.array(True)}, "input 'x' is float64"),
    ({"x": np.zeros((2, 3), np.float32), "c": np.array(True), "z": np.zeros(1)}, "unknown 'z'"),
])
def test_wrong_inputs_are_refused_with_one_clear_line(feeds, match, kernel_cache):
    artifact = compile(_if_model(), cache_dir=kernel_cache)
    with pytest.raises(InputError, match=match) as info:
        artifact.run(feeds)
    assert "\n" not in str(info.value)


def test_outputs_are_fresh_arrays_and_runs_are_repeatable(kernel_cache):
    artifact = compile(_if_model(), cache_dir=kernel_cache)
    feeds = {"x": np.ones((2, 3), np.float32), "c": np.array(False)}
    first = artifact.run(feeds)["y"]
    second = artifact.run({"x": np.full((2, 3), 2, np.float32), "c": np.array(False)})["y"]
    assert first[0, 0] == -1 and second[0, 0] == -2


@pytest.mark.parametrize("damage", ["delete kernel", "edit weights", "truncate plan"])
def test_damaged_artifacts_are_refused(damage, tmp_path, kernel_cache):
    saved = compile(_if_model(), cache_dir=kernel_cache).save(tmp_path / "artifact")
    if damage == "delete kernel":
        next((saved / "kernels").glob("*.so")).unlink()
    elif damage == "edit weights":
        with open(saved / "weights.npz", "ab") as f:
            f.write(b"junk")
    else:
        (saved / "plan.json").write_text((saved / "plan.json").read_text()[:50])
    with pytest.raises(ArtifactError):
        load(saved).run({"x": np.zeros((2, 3), np.float32), "c": np.array(True)})


def test_aligned_buffers():
    for shape in [(1,), (3, 5), (7, 1, 3)]:
        assert aligned_empty(shape, np.float32).ctypes.data % ALIGNMENT == 0


def test_profile_times_every_step(kernel_cache):
    from tessel.runtime.executor import Executor

    artifact = compile(_if_model(), cache_dir=kernel_cache)
    rows = Executor(artifact.directory).profile({"x": np.ones((2, 3), np.float32), "c": np.array(True)}, runs=3)
    assert [(node, op) for node, op, _ in rows] == [(s["node"], s["op"]) for s in artifact.plan["workers"][0]["instructions"]]
    assert all(ms >= 0 for _, _, ms in rows)


def test_profile_reduces_each_step_s_samples_with_the_statistic(kernel_cache):
    """The placement's node times take each step's fastest sample (runtime/profile.py): the statistic sees all runs."""
    from tessel.runtime.executor import Executor

    artifact = compile(_if_model(), cache_dir=kernel_cache)
    rows = Executor(artifact.directory).profile({"x": np.ones((2, 3), np.float32), "c": np.array(True)}, runs=4,
                                                statistic=len)
    assert rows and {ms for _, _, ms in rows} == {4.0}


def test_profile_starts_every_pass_from_the_inputs(kernel_cache):
    """silero_vad's sample rate decides its If; the arena reuses the rate's bytes later in the run, so a profile
    pass that did not write the inputs again took the branch that cannot run."""
    from tessel.runtime.executor import Executor
    from tests.conftest import POSITIVE

    silero = next(m for m in POSITIVE if m.name == "silero_vad")
    artifact = compile(silero.path, input_shapes=silero.input_shapes, cache_dir=kernel_cache)
    rows = Executor(artifact.directory).profile(silero.make_inputs(), runs=2)
    assert len(rows) == len(artifact.plan["workers"][0]["instructions"]) and all(ms >= 0 for _, _, ms in rows)


def test_the_native_host_cuts_a_segment_at_each_first_reader_of_an_all_reduce_result():
    from tessel.runtime.executor import reduction_readers
    from tessel.runtime.instructions import AllReduce, KernelCall

    def call(node, inputs):
        return KernelCall(node=node, op="Relu", kernel="k", inputs=tuple(inputs), outputs=(f"{node}_out",))

    program = [AllReduce("r1", "AllReduce", tensor="g1", reduction="mean"),
               AllReduce("r2", "AllReduce", tensor="g2", reduction="mean", output="m2"),
               call("backward", ["x"]), call("update1", ["g1", "w1"]), call("update1b", ["g1"]),
               call("update2", ["m2", "w2"])]
    # Bucket 1's update waits for bucket 1 only; bucket 2's first reader starts a segment of its own.
    assert reduction_readers(program) == {3, 5}


def test_an_all_reduce_the_next_instruction_reads_runs_at_once():
    from tessel.runtime.executor import reductions_read_next
    from tessel.runtime.instructions import AllReduce, KernelCall, View

    def call(node, inputs):
        return KernelCall(node=node, op="Relu", kernel="k", inputs=tuple(inputs), outputs=(f"{node}_out",))

    program = [AllReduce("first", "AllReduce", tensor="f", reduction="mean"),
               call("backward", ["x"]),
               AllReduce("loss", "AllReduce", tensor="l", reduction="mean"),
               AllReduce("bucket", "AllReduce", tensor="g", reduction="mean", output="m"),
               View("flat", "Reshape", input="m", output="m2"),
               call("update", ["m2", "w"]),
               AllReduce("last", "AllReduce", tensor="h", reduction="mean"),
               call("other", ["w"]), call("update2", ["h", "f"])]
    # The first bucket overlaps backward and the last reduction overlaps "other": they stay in the background. The
    # bucket's update reads it (through a view) right after it, and the loss comes right before the bucket.
    assert reductions_read_next(program) == {2, 3}
