"""The native host program runs artifacts as the python host does: same outputs, same errors."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from tessel.compiler.api import compile
from tessel.runtime.errors import ExecutionError
from tessel.runtime.executor import Executor
from tessel.runtime.instructions import KernelCall, walk
from tests.conftest import POSITIVE, assert_matches_onnxruntime, run_onnxruntime
from tests.ir.helpers import F, model

HOSTS = ["native", "python"]


def _nested_if_model():
    """y = If(c, then: Relu(x) + 1 through a Reshape, else: If(d, Neg(x), Abs(x)))."""
    inner = helper.make_node("If", ["d"], ["er"],
                             then_branch=helper.make_graph([helper.make_node("Neg", ["x"], ["n"])], "neg", [],
                                                           [helper.make_tensor_value_info("n", F, None)]),
                             else_branch=helper.make_graph([helper.make_node("Abs", ["x"], ["a"])], "abs", [],
                                                           [helper.make_tensor_value_info("a", F, None)]))
    then_nodes = [helper.make_node("Relu", ["x"], ["t0"]),
                  helper.make_node("Reshape", ["t0", "flat"], ["t1"]),
                  helper.make_node("Add", ["t1", "one"], ["t2"]),
                  helper.make_node("Reshape", ["t2", "back"], ["tr"])]
    then_branch = helper.make_graph(then_nodes, "then", [], [helper.make_tensor_value_info("tr", F, None)])
    else_branch = helper.make_graph([inner], "else", [], [helper.make_tensor_value_info("er", F, None)])
    nodes = [helper.make_node("If", ["c"], ["y"], then_branch=then_branch, else_branch=else_branch)]
    proto = model(nodes, [("x", F, [2, 3]), ("c", TensorProto.BOOL, []), ("d", TensorProto.BOOL, [])], [("y", F, None)])
    proto.graph.initializer.extend([numpy_helper.from_array(np.array([6], np.int64), "flat"),
                                    numpy_helper.from_array(np.array([2, 3], np.int64), "back"),
                                    numpy_helper.from_array(np.ones(6, np.float32), "one")])
    return proto


@pytest.fixture(scope="module")
def nested_if(kernel_cache):
    original = _nested_if_model()
    return original, compile(original, cache_dir=kernel_cache)


@pytest.mark.parametrize("host", HOSTS)
def test_runtime_ifs_take_the_branch_the_arena_holds(nested_if, host):
    original, artifact = nested_if
    executor = Executor(artifact.directory, host=host)
    assert executor.host == host
    x = np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)
    for c in (True, False):
        for d in (True, False):
            feeds = {"x": x, "c": np.array(c), "d": np.array(d)}
            executor.poison()
            np.testing.assert_array_equal(executor.run(feeds)["y"], run_onnxruntime(original, feeds)[0])


@pytest.mark.parametrize("name", ["silero_vad", "mtcnn_onet", "oww_melspectrogram"])
def test_corpus_models_equal_onnxruntime_on_a_poisoned_arena(name, kernel_cache):
    corpus_model = next(m for m in POSITIVE if m.name == name)
    artifact = compile(corpus_model.path, input_shapes=corpus_model.input_shapes, cache_dir=kernel_cache)
    feeds = corpus_model.make_inputs()
    expected = run_onnxruntime(str(corpus_model.path), feeds)
    # Inputs 16 bytes past a 64-byte boundary are copied into the arena, aligned ones read in place (native host).
    placed = [{name: _at(array, remainder) for name, array in artifact.with_defaults(feeds).items()} for remainder in (16, 0)]
    for host in HOSTS:
        executor = Executor(artifact.directory, host=host)
        assert executor.host == host
        for inputs in placed:  # the second run also starts from what the first left in the arena
            executor.poison()
            assert_matches_onnxruntime(executor.run(inputs), expected)


def test_silero_with_an_unsupported_rate_fails_with_the_same_line_on_both_hosts(kernel_cache):
    silero = next(m for m in POSITIVE if m.name == "silero_vad")
    artifact = compile(silero.path, input_shapes=silero.input_shapes, cache_dir=kernel_cache)
    feeds = artifact.with_defaults({**silero.make_inputs(), "sr": np.array(12345, np.int64)})
    messages = []
    for host in HOSTS:
        with pytest.raises(ExecutionError) as error:
            Executor(artifact.directory, host=host).run(feeds)
        messages.append(str(error.value))
    assert messages[0] == messages[1] and "\n" not in messages[0]


def test_an_index_out_of_range_gives_the_one_line_error_of_the_python_host(kernel_cache):
    weight = np.arange(40, dtype=np.float32).reshape(10, 4)
    graph = helper.make_graph([helper.make_node("Gather", ["w", "i"], ["y"], axis=0, name="Gather_3")], "g",
                              [helper.make_tensor_value_info("i", TensorProto.INT64, [3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 4])],
                              [numpy_helper.from_array(weight, "w")])
    artifact = compile(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), cache_dir=kernel_cache)
    native, python = (Executor(artifact.directory, host=host) for host in HOSTS)
    for bad in (10, -11):
        feeds = {"i": np.array([0, bad, 1], np.int64)}
        errors = []
        for executor in (native, python):
            with pytest.raises(ExecutionError) as error:
                executor.run(feeds)
            errors.append(str(error.value))
        assert errors[0] == errors[1]
        assert errors[0].startswith(f"node 'Gather_3': index {bad} out of range [-10, 9] on axis 0 of 'w'")
    good = {"i": np.array([9, -10, 3], np.int64)}
    np.testing.assert_array_equal(native.run(good)["y"], weight[[9, 0, 3]])


def test_wrong_inputs_get_the_same_error_on_the_native_host(nested_if):
    from tessel.runtime.errors import InputError

    _, artifact = nested_if
    executor = Executor(artifact.directory)
    with pytest.raises(InputError, match="input 'x' is float64"):
        executor.run({"x": np.zeros((2, 3)), "c": np.array(True), "d": np.array(True)})
    with pytest.raises(InputError, match="missing 'd'"):
        executor.run({"x": np.zeros((2, 3), np.float32), "c": np.array(True)})
    lists = {"x": np.zeros((2, 3), np.float32).tolist(), "c": True, "d": False}  # array-likes are taken as before
    with pytest.raises(InputError):
        executor.run(lists)


def test_kernel_times_time_the_kernels_alone(nested_if):
    _, artifact = nested_if
    executor = Executor(artifact.directory)
    feeds = {"x": np.ones((2, 3), np.float32), "c": np.array(True), "d": np.array(True)}
    times = executor.kernel_times(feeds, runs=50)
    assert len(times) == 50 and 0 < np.median(times) < 1e-3
    # The timed program takes the inputs as `run` does: x is read where it lies, never copied into its slot.
    assert executor._timed.in_place == executor._native.in_place == [True, False, False]
    rows = executor.kernel_profile(feeds, runs=5)
    assert {node for node, _, _ in rows} == {"fused_Relu_0", "Neg_0", "Abs_0"} and all(us >= 0 for _, _, us in rows)
    with pytest.raises(Exception, match="native host"):
        Executor(artifact.directory, host="python").kernel_times(feeds)


def test_kernel_site_seconds_time_the_calls_the_run_makes(nested_if):
    _, artifact = nested_if
    executor = Executor(artifact.directory)
    nodes = {i.kernel: i.node for i in walk(executor.run_instructions) if isinstance(i, KernelCall)}
    x = np.ones((2, 3), np.float32)
    for c, d, ran in ((True, True, "fused_Relu_0"), (False, False, "Abs_0")):
        sites = executor.kernel_site_seconds({"x": x, "c": np.array(c), "d": np.array(d)}, runs=3)
        # Only the branch taken runs: the others' kernels are not in the times.
        assert [nodes[kernel] for kernel, _ in sites] == [ran] and sites[0][1] > 0


def test_an_unknown_host_is_refused(nested_if):
    with pytest.raises(ValueError, match="host must be one of native, python"):
        Executor(nested_if[1].directory, host="c")


# ---- inputs read in place ---------------------------------------------------------------------------------------
def _readers_model():
    """x read by a MatMul and, through an Unsqueeze, by two Convs (as oww_melspectrogram reads its input): three
    kernels, two through the view."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]),
             helper.make_node("Unsqueeze", ["x", "one"], ["xv"]),
             helper.make_node("Conv", ["xv", "real"], ["cr"], strides=[16]),
             helper.make_node("Conv", ["xv", "imag"], ["ci"], strides=[16]),
             helper.make_node("Mul", ["cr", "ci"], ["c"]),
             helper.make_node("Reshape", ["c", "flat"], ["cf"]),
             helper.make_node("Add", ["m", "cf"], ["y"])]
    rng = np.random.default_rng(1)
    return model(nodes, [("x", F, [1, 256])], [("y", F, [1, 60])],
                 [("w", rng.standard_normal((256, 60)).astype(np.float32)), ("one", np.array([1], np.int64)),
                  ("real", rng.standard_normal((4, 1, 32)).astype(np.float32)),
                  ("imag", rng.standard_normal((4, 1, 32)).astype(np.float32)), ("flat", np.array([1, 60], np.int64))])


@pytest.fixture(scope="module")
def readers(kernel_cache):
    original = _readers_model()
    return original, compile(original, cache_dir=kernel_cache)


def _at(array: np.ndarray, remainder: int) -> np.ndarray:
    """A copy of `array` whose data lies `remainder` bytes past a 64-byte boundary."""
    raw = np.empty(array.nbytes + 128, np.uint8)
    start = (-raw.ctypes.data) % 64 + remainder
    out = raw[start:start + array.nbytes].view(array.dtype).reshape(array.shape)
    out[...] = array
    return out


def _slot_bytes(executor: Executor, name: str) -> bytes:
    return executor._buffer(name).tobytes()


def test_an_aligned_input_is_read_where_it_lies_by_every_kernel_and_view(readers):
    original, artifact = readers
    executor = Executor(artifact.directory)
    native = executor._native
    assert native.in_place == [True]
    redirects = native._redirects(executor._bound_inputs()[0])
    read_by = {name for call in native._calls for name in call.names if name in ("x", "xv")}
    assert len(redirects) == 3 and read_by == {"x", "xv"}  # three kernels, two through the view
    x = np.random.default_rng(2).standard_normal((1, 256)).astype(np.float32)
    expected = run_onnxruntime(original, {"x": x})[0]
    aligned = _at(x, 0)
    executor.poison()
    poisoned = _slot_bytes(executor, "x")
    np.testing.assert_allclose(executor.run({"x": aligned})["y"], expected, rtol=1e-5, atol=1e-5)
    assert _slot_bytes(executor, "x") == poisoned  # not copied: the kernels read the caller's array
    np.testing.assert_array_equal(aligned, x)  # and nothing wrote it


@pytest.mark.parametrize("remainder", [16, 32, 48])
def test_an_input_as_aligned_as_numpy_makes_it_is_read_in_place(readers, remainder):
    """The kernels reading a model input are compiled assuming 16-byte alignment of it (numpy's own), not 64."""
    original, artifact = readers
    executor = Executor(artifact.directory)
    readers_of_x = {call.kernel for call in executor._native._calls if {"x", "xv"} & set(call.names)}
    assert {key for key, entry in executor.plan["kernels"].items() if "arg_alignment" in entry} == readers_of_x
    x = np.random.default_rng(3).standard_normal((1, 256)).astype(np.float32)
    array = _at(x, remainder)
    for _ in range(2):
        executor.poison()
        poisoned = _slot_bytes(executor, "x")
        np.testing.assert_allclose(executor.run({"x": array})["y"], run_onnxruntime(original, {"x": x})[0],
                                   rtol=1e-5, atol=1e-5)
        assert _slot_bytes(executor, "x") == poisoned
    np.testing.assert_array_equal(array, x)


@pytest.mark.parametrize("remainder", [4, 8, 20])
def test_a_misaligned_input_is_copied_into_its_slot(readers, remainder):
    original, artifact = readers
    executor = Executor(artifact.directory)
    x = np.random.default_rng(3).standard_normal((1, 256)).astype(np.float32)
    misaligned = _at(x, remainder)
    executor.poison()
    np.testing.assert_allclose(executor.run({"x": misaligned})["y"], run_onnxruntime(original, {"x": x})[0],
                               rtol=1e-5, atol=1e-5)
    assert _slot_bytes(executor, "x") == x.tobytes()
    np.testing.assert_array_equal(misaligned, x)


def test_non_contiguous_and_read_only_inputs_run_as_copies_would(readers):
    original, artifact = readers
    executor = Executor(artifact.directory)
    wide = np.random.default_rng(4).standard_normal((1, 512)).astype(np.float32)
    strided = wide[:, ::2]
    read_only = _at(wide[:, 1::2], 0)
    read_only.flags.writeable = False
    for x in (strided, read_only, np.asfortranarray(strided)):
        executor.poison()
        np.testing.assert_allclose(executor.run({"x": x})["y"], run_onnxruntime(original, {"x": np.ascontiguousarray(x)})[0],
                                   rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(strided, wide[:, ::2])


def test_runs_alternating_arrays_each_read_their_own(readers):
    """Each run points the kernels at its own array (or back at the slot): none reads a previous run's."""
    original, artifact = readers
    executor = Executor(artifact.directory)
    rng = np.random.default_rng(5)
    arrays = [_at(rng.standard_normal((1, 256)).astype(np.float32), remainder) for remainder in (0, 0, 32, 0, 4)]
    copies = [a.copy() for a in arrays]
    for _ in range(2):
        for array, copy in zip(arrays, copies):
            executor.poison()
            np.testing.assert_allclose(executor.run({"x": array})["y"], run_onnxruntime(original, {"x": copy})[0],
                                       rtol=1e-5, atol=1e-5)
    for array, copy in zip(arrays, copies):
        np.testing.assert_array_equal(array, copy)
    # The python-side path (start: inputs written into the slots) after an in-place run reads the slots again.
    executor.run({"x": arrays[0]})
    executor.poison()
    np.testing.assert_allclose(executor.start({"x": arrays[2]})()["y"], run_onnxruntime(original, {"x": copies[2]})[0],
                               rtol=1e-5, atol=1e-5)


def test_an_input_lying_in_the_executors_own_arena_is_copied_not_read_in_place(readers):
    """An output taken without a copy and fed back (a recurrent state) lies in the arena the run overwrites."""
    original, artifact = readers
    executor = Executor(artifact.directory)
    x = np.random.default_rng(6).standard_normal((1, 256)).astype(np.float32)
    offset = next(o for name, o in sorted(executor._offsets.items(), key=lambda item: item[1])
                  if name != "x" and o + x.nbytes <= executor.arena_bytes and o % 64 == 0)
    inside = executor._memory.at(offset, x.shape, x.dtype)
    for _ in range(2):
        inside[...] = x
        np.testing.assert_allclose(executor.run({"x": inside})["y"], run_onnxruntime(original, {"x": x})[0],
                                   rtol=1e-5, atol=1e-5)
        assert _slot_bytes(executor, "x") == x.tobytes()


def test_an_output_that_is_an_input_stays_a_fresh_array(kernel_cache):
    proto = model([helper.make_node("Identity", ["x"], ["y"]), helper.make_node("Relu", ["x"], ["r"])],
                  [("x", F, [4, 16])], [("y", F, [4, 16]), ("r", F, [4, 16])])
    artifact = compile(proto, cache_dir=kernel_cache)
    executor = Executor(artifact.directory)
    assert executor._native.in_place == [False]
    x = _at(np.random.default_rng(6).standard_normal((4, 16)).astype(np.float32), 0)
    kept = x.copy()
    outputs = executor.run({"x": x})
    np.testing.assert_array_equal(outputs["y"], kept)
    np.testing.assert_array_equal(outputs["r"], np.maximum(kept, 0))
    assert not np.shares_memory(outputs["y"], x)
    outputs["y"][...] = 7
    np.testing.assert_array_equal(x, kept)


def test_branch_conditions_are_copied_and_branch_kernels_read_in_place(nested_if):
    _, artifact = nested_if
    executor = Executor(artifact.directory)
    assert dict(zip(executor.plan["inputs"], executor._native.in_place)) == {"x": True, "c": False, "d": False}


def _outputs_model():
    """r = Relu(x), an output that a later kernel reads; nv = Reshape(Neg(r)), an output through a view."""
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Neg", ["r"], ["n"]),
             helper.make_node("Reshape", ["n", "flat"], ["nv"])]
    return model(nodes, [("x", F, [4, 64])], [("r", F, [4, 64]), ("nv", F, [256])],
                 [("flat", np.array([256], np.int64))])


@pytest.fixture(scope="module")
def outputs(kernel_cache):
    original = _outputs_model()
    return original, compile(original, cache_dir=kernel_cache)


def test_outputs_are_written_into_fresh_arrays_where_they_lie(outputs):
    """The kernels write each output into the run's own fresh array (numpy's 16-byte alignment is enough): nothing
    is copied out of the arena, no run's result shares memory with another's, and a later kernel reads the output
    there."""
    original, artifact = outputs
    executor = Executor(artifact.directory)
    assert executor._native.written_in_place == [True, True]
    rng = np.random.default_rng(7)
    results = []
    for _ in range(3):
        x = rng.standard_normal((4, 64)).astype(np.float32)
        executor.poison()
        poisoned = {name: _slot_bytes(executor, name) for name in ("r", "nv")}
        got = executor.run({"x": x})
        for name, expected in zip(("r", "nv"), run_onnxruntime(original, {"x": x})):
            np.testing.assert_array_equal(got[name], expected)
            assert got[name].ctypes.data % 16 == 0 and _slot_bytes(executor, name) == poisoned[name]
        results.append((x, got))
    arrays = [array for _, got in results for array in got.values()]
    assert not any(np.shares_memory(a, b) for k, a in enumerate(arrays) for b in arrays[k + 1:])
    for x, got in results:  # later runs left earlier results alone
        np.testing.assert_array_equal(got["r"], np.maximum(x, 0))
    # copy=False: the executor's own buffers, as before.
    x = rng.standard_normal((4, 64)).astype(np.float32)
    views = executor.run({"x": x}, copy=False)
    assert all(np.shares_memory(views[name], executor._buffer(name)) for name in ("r", "nv"))
    np.testing.assert_array_equal(views["nv"], -np.maximum(x, 0).reshape(-1))
    # The python-side path after runs into fresh arrays writes the buffers again.
    np.testing.assert_array_equal(executor.start({"x": x})()["r"], np.maximum(x, 0))


def test_an_output_array_less_aligned_than_its_kernels_assume_is_copied_into(outputs):
    original, artifact = outputs
    executor = Executor(artifact.directory)
    x = np.random.default_rng(8).standard_normal((4, 64)).astype(np.float32)
    r, nv = _at(np.zeros((4, 64), np.float32), 4), _at(np.zeros(256, np.float32), 32)
    executor.poison()
    assert executor._taking_inputs(_at(x, 0), r, nv) == 0
    np.testing.assert_array_equal(r, np.maximum(x, 0))
    np.testing.assert_array_equal(nv, -np.maximum(x, 0).reshape(-1))
    assert _slot_bytes(executor, "r") == r.tobytes()  # written in the arena, then copied
    assert _slot_bytes(executor, "nv") != nv.tobytes()  # aligned enough: written in place


def test_outputs_sharing_a_value_or_not_written_by_a_kernel_are_copied(kernel_cache):
    """Two outputs of one value get two arrays; an output that is an input or a weight is copied out of its buffer."""
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Reshape", ["r", "flat"], ["rv"]),
             helper.make_node("Identity", ["x"], ["y"]), helper.make_node("Identity", ["w"], ["wy"])]
    proto = model(nodes, [("x", F, [4, 16])], [("r", F, [4, 16]), ("rv", F, [64]), ("y", F, [4, 16]), ("wy", F, [3])],
                  [("flat", np.array([64], np.int64)), ("w", np.arange(3, dtype=np.float32))])
    artifact = compile(proto, cache_dir=kernel_cache)
    executor = Executor(artifact.directory)
    assert executor._native.written_in_place == [False] * 4
    x = np.random.default_rng(9).standard_normal((4, 16)).astype(np.float32)
    for _ in range(2):
        executor.poison()
        got = executor.run({"x": x})
        for name, expected in zip(("r", "rv", "y", "wy"), run_onnxruntime(proto, {"x": x})):
            np.testing.assert_array_equal(got[name], expected)
        assert not np.shares_memory(got["r"], got["rv"]) and not np.shares_memory(got["y"], x)


def test_kernel_samples_give_each_kernels_time_per_run_within_the_runs_time(nested_if):
    _, artifact = nested_if
    executor = Executor(artifact.directory)
    feeds = {"x": np.ones((2, 3), np.float32), "c": np.array(False), "d": np.array(True)}
    nodes, per_site, walls = executor.kernel_samples(feeds, runs=8)
    # Every kernel site is there; the else branch's inner then-branch ran, Neg alone: the branches not taken took 0 s.
    assert per_site.shape == (8, len(nodes)) and walls.shape == (8,) and len(nodes) > 1
    ran = [node for node, column in zip(nodes, per_site.T) if column.any()]
    assert ran == ["Neg_0"] and (per_site[:, nodes.index("Neg_0")] > 0).all()
    assert (walls >= per_site.sum(axis=1)).all()
    with pytest.raises(ValueError, match="at least 1 run"):
        executor.kernel_samples(feeds, runs=0)
