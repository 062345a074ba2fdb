"""Every conv and matmul algorithm, whole-batch and per micro-batch, equals onnxruntime; workspaces are as documented."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from tessel import ir
from tessel.backends.cpu.algorithms import algorithms
from tessel.backends.lower import build, workspace_bytes
from tessel.backends.target import parse_target
from tessel.compiler.algo import find_layers
from tessel.compiler.pipeline import run_pipeline, select_passes
from tessel.compiler.program import ProgramBuilder, build_program
from tessel.runtime.memory import aligned_copy
from tests.conftest import run_onnxruntime
from tests.ir.helpers import F, model

LLVM = parse_target("llvm")
BATCH = 4

CONVS = {
    "3x3_pad1": dict(channels=(8, 16), size=12, kernel=3, pads=(1, 1, 1, 1), strides=(1, 1), dilations=(1, 1)),
    "3x3_k18": dict(channels=(5, 18), size=12, kernel=3, pads=(1, 1, 1, 1), strides=(1, 1), dilations=(1, 1)),
    "3x3_odd": dict(channels=(5, 12), size=13, kernel=3, pads=(0, 1, 2, 1), strides=(1, 1), dilations=(1, 1)),
    "3x3_stride2": dict(channels=(8, 16), size=13, kernel=3, pads=(1, 1, 1, 1), strides=(2, 2), dilations=(1, 1)),
    "1x1": dict(channels=(16, 32), size=8, kernel=1, pads=(0, 0, 0, 0), strides=(1, 1), dilations=(1, 1)),
    "7x7_stride2": dict(channels=(3, 16), size=20, kernel=7, pads=(3, 3, 3, 3), strides=(2, 2), dilations=(1, 1)),
    "5x5_dilated": dict(channels=(4, 8), size=16, kernel=5, pads=(2, 1, 2, 1), strides=(1, 1), dilations=(2, 2)),
    # Output rows narrower than NARROW_ROW: 32-channel register tiles (two vectors per pixel).
    "3x3_narrow": dict(channels=(16, 64), size=7, kernel=3, pads=(1, 1, 1, 1), strides=(1, 1), dilations=(1, 1)),
    "3x3_narrow_stride2": dict(channels=(8, 32), size=13, kernel=3, pads=(1, 1, 1, 1), strides=(2, 2),
                               dilations=(1, 1)),
    # Wide rows of 32 output channels: 14-pixel tiles, each NCHW row unpacked as it is made.
    "3x3_wide32": dict(channels=(8, 32), size=14, kernel=3, pads=(1, 1, 1, 1), strides=(1, 1), dilations=(1, 1)),
    # A stem-like conv whose 15-pixel rows need a padded last tile (8-pixel tiles of 32 channels).
    "7x7_stride2_wide32": dict(channels=(3, 32), size=30, kernel=7, pads=(3, 3, 3, 3), strides=(2, 2),
                               dilations=(1, 1)),
}


def conv_relu_model(channels, size, kernel, pads, strides, dilations):
    rng = np.random.default_rng(1)
    cin, cout = channels
    weight = rng.standard_normal((cout, cin, kernel, kernel)).astype(np.float32)
    bias = rng.standard_normal(cout).astype(np.float32)
    conv = helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=list(pads), strides=list(strides), dilations=list(dilations))
    relu = helper.make_node("Relu", ["c"], ["y"])
    return model([conv, relu], [("x", F, [BATCH, cin, size, size])], [("y", F, None)], [("w", weight), ("b", bias)])


def matmul_model():
    rng = np.random.default_rng(2)
    weight = rng.standard_normal((24, 32)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Relu", ["m"], ["y"])]
    return model(nodes, [("x", F, [BATCH, 6, 24])], [("y", F, None)], [("w", weight)])


def run_layer(onnx_model, algorithm: str, size: int, x: np.ndarray) -> np.ndarray:
    """Run the model's one layer with `algorithm` over micro-batches of `size` (kernel by kernel, as the runtime does)."""
    from tessel.backends.tvm_env import tvm

    graph, _ = run_pipeline(ir.from_onnx(onnx_model), select_passes([]))
    (layer,) = find_layers(graph, "llvm", "all")
    builder = ProgramBuilder(LLVM)
    spec, args = builder.candidate(layer.node, algorithm, size)
    fn = build(spec, LLVM)["main"]
    out_type = layer.node.outputs[0].type
    out = aligned_copy(np.zeros(out_type.shape, np.float32))
    tvm_mod = tvm()
    for start in range(0, BATCH, size):
        tensors = []
        for name in args:
            array = x[start:start + size] if name == "x" else builder.weights[name]
            tensors.append(tvm_mod.runtime.from_dlpack(aligned_copy(np.ascontiguousarray(array))))
        result = tvm_mod.runtime.from_dlpack(aligned_copy(np.zeros((size,) + out_type.shape[1:], np.float32)))
        fn(*tensors, result)
        out[start:start + size] = result.numpy()
    return out


# Winograd runs 3x3 stride-1 convs only; direct needs whole 16-channel output blocks (not 18 channels).
CONV_CASES = [(case, a) for case in sorted(CONVS) for a in ("nchwc", "im2col", "direct")
              if (case, a) != ("3x3_k18", "direct")] + [(case, "winograd") for case in ("3x3_pad1", "3x3_odd", "3x3_k18")]


def test_float32_convs_tile_32_output_channels_where_they_divide():
    from tessel.backends.cpu.packing import CONV_BLOCKS, NARROW_ROW, plan_packing
    from tessel.ir.types import TensorType

    def blocks(out_channels: int, width: int, stride: int = 1):
        weight = np.zeros((out_channels, 16, 3, 3), np.float32)
        types = [TensorType("float32", (1, 16, width, width)), TensorType.of(weight)]
        return dict(plan_packing("Conv", {"pads": [1] * 4, "strides": [stride] * 2}, types, [None, weight]).attrs)[
            CONV_BLOCKS]

    assert blocks(64, NARROW_ROW - 1) == (16, 32, 0) and blocks(64, 2 * NARROW_ROW - 2, stride=2)[1] == 32
    assert blocks(64, 56) == (16, 32, 0)  # wide rows too: 14 pixels × 2 vectors
    assert blocks(48, 56)[1] == 16 and blocks(16, 7)[1] == 16  # 48 channels are not 32s; 16 are one vector


@pytest.mark.parametrize("case,algorithm", CONV_CASES)
def test_conv_algorithms_equal_onnxruntime(case, algorithm):
    onnx_model = conv_relu_model(**CONVS[case])
    x = np.random.default_rng(0).standard_normal((BATCH, CONVS[case]["channels"][0], CONVS[case]["size"],
                                                   CONVS[case]["size"])).astype(np.float32)
    (want,) = run_onnxruntime(onnx_model, {"x": x})
    for size in (BATCH, 2, 1):
        np.testing.assert_allclose(run_layer(onnx_model, algorithm, size, x), want, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("algorithm", ["packed", "direct"])
def test_matmul_algorithms_equal_onnxruntime(algorithm):
    onnx_model = matmul_model()
    x = np.random.default_rng(0).standard_normal((BATCH, 6, 24)).astype(np.float32)
    (want,) = run_onnxruntime(onnx_model, {"x": x})
    for size in (BATCH, 1):
        np.testing.assert_allclose(run_layer(onnx_model, algorithm, size, x), want, rtol=1e-3, atol=1e-4)


def test_algorithm_choices_and_workspaces():
    graph, _ = run_pipeline(ir.from_onnx(conv_relu_model(**CONVS["3x3_pad1"])), select_passes([]))
    (layer,) = find_layers(graph, "llvm", "powers-of-two")
    assert layer.algorithms == ("nchwc", "im2col", "direct", "winograd") and layer.sizes == (1, 2, 4)
    builder = ProgramBuilder(LLVM)
    workspace = {a: workspace_bytes(builder.candidate(layer.node, a, BATCH)[0], LLVM) for a in layer.algorithms}
    assert workspace["direct"] == 0
    # im2col: the (N, C·R·S, OH·OW padded to 16) column matrix and the (N, K, ·) product.
    assert workspace["im2col"] == 4 * BATCH * (8 * 9 * 144 + 16 * 144)
    # nchwc: the input packed with its padding, (N, C/8, 14, 14, 8); its 12-pixel rows are wide enough to unpack each
    # from a per-thread row buffer as it is made, so there is no whole NCHWc result.
    assert workspace["nchwc"] == 4 * BATCH * 14 * 14 * 8
    half = {a: workspace_bytes(builder.candidate(layer.node, a, 2)[0], LLVM) for a in layer.algorithms}
    assert half["im2col"] * 2 == workspace["im2col"]
    k18, _ = run_pipeline(ir.from_onnx(conv_relu_model(**CONVS["3x3_k18"])), select_passes([]))
    assert find_layers(k18, "llvm", "all")[0].algorithms == ("nchwc", "im2col", "winograd")
    assert algorithms("Conv", {"group": 2}, [layer.node.inputs[0].type], [None, np.ones(1)], "llvm") == ()
    assert algorithms("Conv", {}, [layer.node.inputs[0].type], [None, np.ones((16, 8, 3, 3), np.float32)], "cuda") == ("gemm", "direct")


def test_convs_on_blocks_run_direct_where_whole_tiles_cover_their_rows():
    from tessel.backends.cpu.algorithms import default_algorithm
    from tessel.backends.kernel import ALGORITHM
    from tessel.ir.types import TensorType

    def choice(case, size=None, channels=None, blocks=True):
        spec = dict(CONVS[case], **({"size": size} if size else {}), **({"channels": channels} if channels else {}))
        cin, cout = spec["channels"]
        attrs = {"pads": spec["pads"], "strides": spec["strides"], "dilations": spec["dilations"], "group": 1}
        weight = np.ones((cout, cin, spec["kernel"], spec["kernel"]), np.float32)
        x = TensorType("float32", (1, cin, spec["size"], spec["size"]))
        return default_algorithm("Conv", attrs, [x, None], [None, weight], "llvm", blocks)

    # Its input blocked, rows a register tile divides: 1 × 1 on rows of 20, 12 and 10 pixels; 3 × 3 (padded) on rows
    # of two tiles or more (20 pixels: two of 10; stride 2 from 40 to 20).
    assert [choice("1x1", size=size) for size in (20, 12, 10)] == ["direct"] * 3
    assert choice("3x3_pad1", size=20) == "direct" and choice("3x3_stride2", size=40) == "direct"
    # Rows no tile of CONV_TILE_CHOICES divides: the widest tile that does (SqueezeNet's 55, 27 and 13 pixels: 11, 9,
    # 13), of at least 7 pixels (not 5 or 17: tiles of 5 or 1).
    assert [choice("1x1", size=size) for size in (55, 27, 13, 5, 17)] == ["direct"] * 3 + [None] * 2
    # Not: an NCHW input; 18 output channels (no whole blocks); a padded row of one tile (14 pixels; 13 pixels; 7 × 7
    # stride 2 from 20 to 10), whose edge checks stay in its tile.
    assert choice("1x1", size=20, blocks=False) is None and choice("1x1", size=20, channels=(16, 18)) is None
    assert choice("3x3_pad1", size=14) is None and choice("7x7_stride2", size=20) is None
    assert choice("3x3_pad1", size=13) is None
    # Fewer output channels than a vector: a 1 × 1 conv runs direct, whatever the input; a 3 × 3 one on NCHW does not.
    assert choice("3x3_pad1", size=20, channels=(8, 10), blocks=False) is None
    assert choice("1x1", size=20, channels=(16, 1), blocks=False) == "direct"
    x = TensorType("float32", (1, 16, 20, 20))
    assert default_algorithm("Conv", {}, [x], [None, np.ones((32, 16, 1, 1), np.float32)], "cuda", True) is None
    # In a program: a 3 × 3 conv of a model input (NCHW) keeps the default, a conv result kept blocked is read direct.
    rng = np.random.default_rng(5)
    nodes = [helper.make_node("Conv", ["x", "w1"], ["a"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["a"], ["r"]), helper.make_node("Conv", ["r", "w2"], ["y"])]
    weights = [(f"w{n}", rng.standard_normal((16, 16, k, k)).astype(np.float32)) for n, k in ((1, 3), (2, 1))]
    graph, _ = run_pipeline(ir.from_onnx(model(nodes, [("x", F, [1, 16, 14, 14])], [("y", F, None)], weights)),
                            select_passes([]))
    program = build_program(graph, LLVM)
    chosen = [dict(m.spec.attrs).get(ALGORITHM) for spec in program.kernels.values() for m in spec.members()
              if m.spec.op_type == "Conv"]
    assert sorted(chosen, key=str) == [None, "direct"]


def _concat_read_by_pointwise_convs():
    """x → 3 × 3 conv → Relu, concatenated with x (NCHW: a model input) and read by two 1 × 1 convs as it is and by a
    third scaled (the Mul fused into its kernel)."""
    rng = np.random.default_rng(7)
    shapes = {"a": (32, 16, 3, 3), "b": (32, 48, 1, 1), "c": (16, 48, 1, 1), "d": (32, 48, 1, 1)}
    weights = [(f"w{n}", (rng.standard_normal(s) / np.sqrt(np.prod(s[1:]))).astype(np.float32))
               for n, s in shapes.items()] + [("two", np.array(2.0, np.float32))]
    nodes = [helper.make_node("Conv", ["x", "wa"], ["a"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["a"], ["ar"]), helper.make_node("Concat", ["ar", "x"], ["cat"], axis=1),
             helper.make_node("Conv", ["cat", "wb"], ["b"]), helper.make_node("Conv", ["cat", "wc"], ["c"]),
             helper.make_node("Mul", ["cat", "two"], ["scaled"]), helper.make_node("Conv", ["scaled", "wd"], ["d"])]
    return model(nodes, [("x", F, [1, 16, 14, 14])], [("b", F, None), ("c", F, None), ("d", F, None)], weights)


def test_pointwise_convs_read_an_nchw_argument_direct():
    from tessel.backends.cpu.algorithms import MAX_DIRECT_NCHW_ROW, default_algorithm
    from tessel.backends.cpu.packing import NARROW_ROW
    from tessel.backends.kernel import ALGORITHM
    from tessel.ir.types import TensorType

    def choice(size, kernel=1, computed=False, out_channels=32):
        x = TensorType("float32", (1, 48, size, size))
        weight = np.ones((out_channels, 48, kernel, kernel), np.float32)
        return default_algorithm("Conv", {"pads": [kernel // 2] * 4, "group": 1}, [x, None], [None, weight], "llvm",
                                 False, input_computed=computed)

    # A 1 × 1 conv of an NCHW kernel argument: direct on rows of NARROW_ROW to MAX_DIRECT_NCHW_ROW pixels (a tile
    # dividing them); not on 7-pixel rows or 40-pixel ones (measured slower), not where a prologue computes its input
    # in the kernel, not a 3 × 3 conv, not 18 output channels (no whole blocks to write).
    assert choice(14) == choice(MAX_DIRECT_NCHW_ROW) == choice(NARROW_ROW) == "direct"
    assert choice(7) is None and choice(13) is None and choice(40) is None and choice(14, computed=True) is None
    assert choice(14, kernel=3) is None and choice(14, out_channels=18) is None
    graph, _ = run_pipeline(ir.from_onnx(_concat_read_by_pointwise_convs()), select_passes([]))
    chosen = sorted((tuple(m.spec.op_type for m in spec.members()), str(dict(m.spec.attrs).get(ALGORITHM)))
                    for spec in build_program(graph, LLVM).kernels.values() for m in spec.members()
                    if m.spec.op_type == "Conv")
    assert chosen == [(("Conv",), "direct"), (("Conv",), "direct"), (("Conv", "Relu"), "None"),
                      (("Mul", "Conv"), "None")]


def test_pointwise_convs_reading_an_nchw_argument_equal_onnxruntime(kernel_cache):
    from tessel.compiler.api import compile
    from tests.conftest import assert_matches_onnxruntime

    convs = _concat_read_by_pointwise_convs()
    x = np.random.default_rng(8).standard_normal((1, 16, 14, 14)).astype(np.float32)
    assert_matches_onnxruntime(compile(convs, cache_dir=kernel_cache).run({"x": x}), run_onnxruntime(convs, {"x": x}))
