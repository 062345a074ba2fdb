"""Winograd on NCHW[16]c inputs (backends/cpu/winograd_blocks.py): where it is the default, and equal to
onnxruntime on unit shapes and on ResNet-18.

F(4×4, 3×3) in float32 rounds more than a direct conv (its transforms scale by up to 8 and back): the tolerance
below is the corpus test's (rtol 1e-3, atol 1e-4) on unit-scale activations, and on ResNet-18 the logits' largest
difference from onnxruntime is stated relative to their range.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
from onnx import helper

from tessel import ir
from tessel.backends.cpu.algorithms import default_algorithm
from tessel.backends.cpu.winograd_blocks import product_vectors, row_groups
from tessel.backends.kernel import ALGORITHM
from tessel.backends.target import parse_target
from tessel.compiler.api import compile
from tessel.compiler.pipeline import run_pipeline, select_passes
from tessel.compiler.program import build_program
from tessel.ir.types import TensorType
from tests.conftest import CORPUS, assert_matches_onnxruntime, run_onnxruntime
from tests.ir.helpers import F, model

LLVM = parse_target("llvm")


def _conv(name, x, out, channels_in, channels_out, rng, kernel=3):
    weight = (rng.standard_normal((channels_out, channels_in, kernel, kernel)) / np.sqrt(channels_in * kernel ** 2))
    bias = rng.standard_normal(channels_out).astype(np.float32)
    node = helper.make_node("Conv", [x, f"{name}_w", f"{name}_b"], [out], kernel_shape=[kernel, kernel],
                            pads=[kernel // 2] * 4)
    return node, [(f"{name}_w", weight.astype(np.float32)), (f"{name}_b", bias)]


def block_model(batch: int, size: int, channels: int, out_channels: int):
    """x → a: 1×1 conv + ReLU → b: 3×3 conv + ReLU → c: 3×3 conv + a (residual) + ReLU, as ResNet's basic block,
    then d: a 3×3 conv to 16 channels, the model output (NCHW). b, c and d read blocked inputs."""
    rng = np.random.default_rng(3)
    convs = [_conv("a", "x", "a_conv", 16, channels, rng, kernel=1),
             _conv("b", "a", "b_conv", channels, out_channels, rng),
             _conv("c", "b", "c_conv", out_channels, channels, rng), _conv("d", "c", "d", channels, 16, rng)]
    nodes = [convs[0][0], helper.make_node("Relu", ["a_conv"], ["a"]),
             convs[1][0], helper.make_node("Relu", ["b_conv"], ["b"]),
             convs[2][0], helper.make_node("Add", ["c_conv", "a"], ["c_sum"]),
             helper.make_node("Relu", ["c_sum"], ["c"]),
             convs[3][0]]
    weights = [w for _, pair in convs for w in pair]
    return model(nodes, [("x", F, [batch, 16, size, size])], [("d", F, None)], weights)


def _choice(in_channels: int, out_channels: int, size: int, blocks: bool = True, stride: int = 1,
            argument: bool = True, width: int | None = None) -> str | None:
    """The default algorithm of a 3×3 conv of size × `width` (size × size) pixels, its input blocked (`blocks`),
    and itself the kernel's argument (`argument`; else computed from blocked values in the kernel)."""
    attrs = {"pads": [1] * 4, "strides": [stride] * 2, "dilations": [1, 1], "group": 1}
    weight = np.ones((out_channels, in_channels, 3, 3), np.float32)
    x = TensorType("float32", (1, in_channels, size, width or size))
    return default_algorithm("Conv", attrs, [x, None], [None, weight], "llvm", blocks, blocks and argument)


def test_winograd_is_the_default_only_where_it_measured_faster():
    # ResNet-18's 56² and 28² layers, YOLOv8n's 80² to 20² ones and VGG-19's 56² and 28² ones (up to 512 × 512
    # channels, their rows in groups); not the 14² and 7² layers, 10-pixel rows, an NCHW input, a strided conv,
    # channels that do not fill blocks, or more than 512 channels in or out (unmeasured, even within 512 × 512).
    assert _choice(64, 64, 56) == _choice(128, 128, 28) == _choice(16, 16, 80) == _choice(64, 64, 20) == "winograd"
    assert _choice(128, 256, 56) == _choice(256, 256, 56) == _choice(256, 512, 28) == _choice(512, 512, 28)
    assert _choice(512, 512, 28) == "winograd"
    assert _choice(256, 256, 14) is None and _choice(512, 512, 7) is None and _choice(128, 128, 10) is None
    assert _choice(512, 512, 14) is None
    # Narrower rows of 4 tiles (13-15 pixels) where the tile rows run one a task (up to 128 × 128 channels):
    # SqueezeNet's 13² expand convs; 12-pixel rows (3 tiles) stay direct.
    assert _choice(64, 256, 13) == _choice(48, 192, 13) == "winograd"
    assert _choice(64, 64, 12) is None and _choice(128, 256, 13) is None
    # (A strided one, and more channels on blocked rows of two tiles or more, run direct: algorithms.py.)
    assert _choice(64, 64, 56, blocks=False) is None and _choice(64, 64, 56, stride=2) == "direct"
    assert _choice(64, 18, 56) is None and _choice(1024, 512, 28) == _choice(1024, 128, 28) == "direct"
    # Not over a fused Concat of blocked parts (the blocked kernel reads one blocked argument), nor on rows whose
    # tile count has no divisor to make a register tile of 4 accumulators (mtcnn_pnet's 75-pixel rows: 19 tiles).
    assert _choice(64, 64, 20, argument=False) == "direct"
    assert _choice(16, 32, 57, width=75) != "winograd" and _choice(16, 32, 57, width=80) == "winograd"
    x = TensorType("float32", (1, 64, 56, 56))
    assert default_algorithm("Conv", {}, [x], [None, np.ones((64, 64, 3, 3), np.float32)], "cuda", True) is None
    # SAME padding keeps 16-pixel rows 16 pixels wide; VALID makes them 14: too narrow at 256 × 256 channels, one
    # direct tile.
    x16, weight = TensorType("float32", (1, 256, 16, 16)), np.ones((256, 256, 3, 3), np.float32)
    assert [default_algorithm("Conv", {"auto_pad": pad}, [x16, None], [None, weight], "llvm", True, True)
            for pad in ("SAME_UPPER", "VALID")] == ["winograd", "direct"]
    # In a program: b, c and d read blocked values and run Winograd; the values between them stay blocked (a, a 1 × 1
    # conv of the NCHW model input's 16-pixel rows, reads it in place: direct).
    graph, _ = run_pipeline(ir.from_onnx(block_model(1, 16, 32, 32)), select_passes([]))
    program = build_program(graph, LLVM)
    chosen = sorted(str(dict(m.spec.attrs).get(ALGORITHM)) for spec in program.kernels.values()
                    for m in spec.members() if m.spec.op_type == "Conv")
    assert chosen == ["direct", "winograd", "winograd", "winograd"]
    assert set(program.blocked) == {"a", "b", "c"}


def test_wide_convs_run_their_tile_rows_in_groups():
    # Up to 128 × 128 channels, a row at a time; ResNet-18's 28² layers (7 rows) in halves of the output channels.
    assert row_groups(1, 14, 14, 6, 64, 64) == (1, 1) and row_groups(1, 7, 7, 6, 128, 128) == (1, 2)
    # VGG-19's 56² × 256: two groups of 7 rows (3.6 MB of transformed tiles each); its 28² × 512: one group of all 7
    # rows, in halves (two images: one group each). Rows of 56 tiles at 256 channels (2 MB each): two a group; at 512
    # (4 MB), one.
    assert row_groups(1, 14, 14, 6, 256, 256) == (7, 1) and row_groups(1, 7, 7, 6, 512, 512) == (7, 2)
    assert row_groups(2, 7, 7, 6, 512, 512) == (7, 1) and row_groups(1, 56, 56, 6, 256, 256) == (2, 1)
    assert row_groups(1, 56, 56, 6, 512, 512) == (1, 1)
    # Rows of 7 tiles: 7 × 4 accumulators where the conv is wide and has blocks for them, else 7 × 2.
    assert product_vectors(32, 7, True) == 4 and product_vectors(32, 14, True) == 2
    assert product_vectors(32, 7, False) == product_vectors(12, 7, True) == 2 and product_vectors(3, 7, True) == 1


# (batch, size, channels, out_channels): rows a tile divides, two 16-channel vectors per product tile, an odd number
# of tile rows (5: b runs each as two halves of its output channels); rows of 18 pixels (a partial last tile row and
# column), one input block and three output blocks (one vector per tile), a batch of two.
# 128 → 256 → 128 channels on 16² (one group of its 4 tile rows, 4 vectors per product tile) and on 28² (one group of
# 7 rows in halves of the output channels); 256 channels on 46² rows, a batch of two (groups of 6 tile rows, two per
# image, the last tile row partial).
# 13² rows (4 tile rows and columns, the last of each a single pixel; SqueezeNet's 13² expand convs).
# The first two run in the default suite: Winograd is ResNet-18's and YOLOv8n's default on blocks.
CASES = [(1, 20, 32, 64), (1, 13, 64, 128), pytest.param(2, 18, 16, 48, marks=pytest.mark.slow),
         pytest.param(1, 16, 128, 256, marks=pytest.mark.slow), pytest.param(1, 28, 128, 256, marks=pytest.mark.slow),
         pytest.param(2, 46, 256, 256, marks=pytest.mark.slow)]


@pytest.mark.parametrize("batch,size,channels,out_channels", CASES)
def test_blocked_winograd_equals_onnxruntime(batch, size, channels, out_channels, kernel_cache):
    onnx_model = block_model(batch, size, channels, out_channels)
    feeds = {"x": np.random.default_rng(0).standard_normal((batch, 16, size, size)).astype(np.float32)}
    artifact = compile(onnx_model, cache_dir=kernel_cache)
    for _ in range(2):
        artifact.executor().poison()
        assert_matches_onnxruntime(artifact.run(feeds), run_onnxruntime(onnx_model, feeds))


@pytest.mark.slow
def test_resnet18_with_winograd_equals_onnxruntime(kernel_cache):
    resnet = next(m for m in CORPUS if m.name == "resnet18")
    artifact = compile(resnet.path, input_shapes=resnet.input_shapes, cache_dir=kernel_cache)
    # Its seven 3×3 stride-1 convs on 56² and 28² rows run Winograd: their weights are transformed to 6 × 6 points.
    values = json.loads((artifact.directory / "plan.json").read_text())["workers"][0]["values"]
    assert sum(spec.startswith("float32[6,6,") for spec in values.values()) == 7
    feeds = resnet.make_inputs()
    (want,) = run_onnxruntime(str(resnet.path), feeds)
    (got,) = artifact.run(feeds).values()
    # The logits differ from onnxruntime's by at most 1e-5 of their range (measured: 1.9e-7 of it; with the direct
    # convs, 2.0e-7).
    assert np.abs(got - want).max() <= 1e-5 * (want.max() - want.min())

