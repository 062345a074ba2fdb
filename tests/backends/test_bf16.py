"""bf16 convs (`precision="bf16"`): bf16 rounding and weight packing, the vdpbf16ps conv kernel against onnxruntime
run on bf16-rounded inputs (equal up to the order of the float32 sums), and ResNet-18 against float32."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from onnx import helper

from tessel.backends.cpu.bf16 import cpu_has_bf16, from_bf16_bits, round_to_bf16, to_bf16_bits
from tessel.backends.cpu.packing import NARROW_ROW, BF16_WINDOW_PAIRS, CONV_BLOCKS, plan_packing
from tessel.backends.kernel import BF16, PRECISION
from tessel.backends.target import parse_target
from tessel.compiler.api import compile as compile_model
from tessel.compiler.program import build_program
from tessel.compiler.reference_check import BF16_SCALED_TOL
from tessel.ir import from_onnx
from tessel.ir.types import TensorType
from tests.conftest import CORPUS, run_onnxruntime
from tests.ir.helpers import F, model

needs_bf16 = pytest.mark.skipif(not cpu_has_bf16(), reason="the CPU lacks avx512_bf16")
RNG = np.random.default_rng(17)


def test_rounding_to_bf16_is_to_nearest_even_as_torch_rounds_and_keeps_nan():
    nan_low_payload = np.array([0x7F800001], np.uint32).view(np.float32)[0]  # rounding its bits up would give inf
    values = np.concatenate([
        np.array([1.0, 1 + 2 ** -8, 1 + 3 * 2 ** -8, 1 + 2 ** -8 + 2 ** -20, -2.5, 3e38, np.inf, -np.inf, 1e-40],
                 np.float32),
        RNG.standard_normal(1000).astype(np.float32) * 10.0 ** RNG.integers(-20, 20, 1000)])
    bits = to_bf16_bits(values)
    expected = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(bits, expected)
    assert list(bits[:4]) == [0x3F80, 0x3F80, 0x3F82, 0x3F81]  # ties go to the even neighbour
    assert np.isnan(from_bf16_bits(to_bf16_bits(np.array([np.nan, nan_low_payload], np.float32)))).all()
    np.testing.assert_array_equal(round_to_bf16(values[:3]), [1.0, 1.0, 1 + 2 ** -6])


def _conv_packing(out_channels: int, in_channels: int, width: int, precision: str, stride: int = 1):
    weight = RNG.standard_normal((out_channels, in_channels, 3, 3)).astype(np.float32)
    types = [TensorType("float32", (1, in_channels, width, width)), TensorType.of(weight)]
    return weight, plan_packing("Conv", {"pads": [1] * 4, "strides": [stride] * 2}, types, [None, weight], precision)


def test_bf16_packing_pairs_input_channels_of_16_output_channel_tiles():
    weight, packing = _conv_packing(40, 24, 28, "bf16")
    attrs = dict(packing.attrs)
    assert attrs[PRECISION] == BF16 and attrs[CONV_BLOCKS] == (16, 16, 0)
    packed = packing.arrays[1]
    assert packed.dtype == np.uint16 and packed.shape == (3, 2, 3, 3, 8, 16, 2)  # K and C padded to whole blocks
    k, c, kh, kw = 37, 21, 2, 1  # output channel 37 = tile 2, lane 5; input channel 21 = block 1, pair 2, element 1
    assert packed[2, 1, kh, kw, 2, 5, 1] == to_bf16_bits(weight[k, c, kh, kw])
    assert not packed[2, :, :, :, :, 8:].any() and not packed[:, 1, :, :, 4:].any()  # the padding is zero


def test_bf16_packing_tiles_32_channels_where_they_come_in_32s_and_leaves_small_convs_float32():
    _, narrow = _conv_packing(64, 64, NARROW_ROW - 1, "bf16")
    assert dict(narrow.attrs)[CONV_BLOCKS] == (16, 32, 0) and narrow.arrays[1].shape[-2:] == (32, 2)
    _, strided = _conv_packing(64, 64, 2 * NARROW_ROW - 2, "bf16", stride=2)  # narrow after its stride
    assert dict(strided.attrs)[CONV_BLOCKS][1] == 32
    _, wide = _conv_packing(64, 64, 56, "bf16")  # 32-channel tiles on wide rows too, where channels come in 32s
    assert dict(wide.attrs)[CONV_BLOCKS] == (16, 32, 0)
    _, rgb64 = _conv_packing(64, 3, 56, "bf16")  # a conv pairing kernel columns keeps 16-channel tiles
    assert dict(rgb64.attrs)[CONV_BLOCKS] == (1, 16, 0)
    rgb, odd = _conv_packing(16, 3, 32, "bf16")  # three input channels: pairs of kernel columns, one zero column
    assert dict(odd.attrs)[CONV_BLOCKS] == (1, 16, 0) and dict(odd.attrs)[BF16_WINDOW_PAIRS] == 1
    assert odd.arrays[1].shape == (1, 3, 3, 2, 16, 2) and odd.arrays[1][0, 2, 1, 1, 7, 0] == to_bf16_bits(rgb[7, 2, 1, 2])
    assert not odd.arrays[1][:, :, :, 1, :, 1].any()  # the fourth column pads the third's pair
    _, six = _conv_packing(16, 6, 32, "bf16")  # more channels than BF16_WINDOW_MAX_CHANNELS: channel pairs
    assert dict(six.attrs)[CONV_BLOCKS] == (6, 16, 0) and BF16_WINDOW_PAIRS not in dict(six.attrs)
    _, few = _conv_packing(8, 16, 32, "bf16")  # fewer output channels than a vector: float32
    _, f32 = _conv_packing(8, 16, 32, "fp32")
    assert PRECISION not in dict(few.attrs) and few.attrs == f32.attrs and few.arrays[1].dtype == np.float32


def _conv_relu(cin: int, cout: int, kernel: int, stride: int, pad: int, height: int, width: int, weight=None):
    weight = RNG.standard_normal((cout, cin, kernel, kernel)).astype(np.float32) if weight is None else weight
    bias = RNG.standard_normal(cout).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[pad] * 4, strides=[stride] * 2),
             helper.make_node("Relu", ["c"], ["y"])]
    return model(nodes, [("x", F, [1, cin, height, width])], [("y", F, None)], [("w", weight), ("b", bias)]), weight


def test_float32_kernel_specs_are_unchanged_by_the_precision_option():
    original, _ = _conv_relu(16, 32, 3, 1, 1, 14, 14)
    graph = from_onnx(original)
    target = parse_target("llvm")
    default, fp32 = build_program(graph, target), build_program(graph, target, precision="fp32")
    assert sorted(default.kernels) == sorted(fp32.kernels) and not default.bf16_nodes
    assert all(PRECISION not in dict(spec.attrs) for spec in default.kernels.values() for spec in
               [m.spec for m in spec.members()])
    bf16 = build_program(graph, target, precision="bf16")
    convs = [{key for key, spec in program.kernels.items() if spec.op_type == "Conv"} for program in (default, bf16)]
    assert list(bf16.bf16_nodes.values()) == ["Conv"] and convs[0].isdisjoint(convs[1])
    packed = [w for name, w in bf16.weights.items() if "::packed" in name]
    assert [w.dtype for w in packed] == [np.uint16]  # the artifact stores the weight in bf16: half the bytes


CONV_CASES = {
    "stem_7x7_stride2_3_channels_column_pairs": (3, 64, 7, 2, 3, 32, 32),
    "3x3_one_channel_column_pairs": (1, 16, 3, 1, 1, 12, 19),
    "5x5_6_channels_channel_pairs": (6, 16, 5, 1, 2, 12, 12),
    "1x1_stride2_padded_channels": (24, 40, 1, 2, 0, 15, 15),
    "1x1_stride2_downsample_packs_the_pixels_it_reads": (64, 128, 1, 2, 0, 56, 56),
    "1x1_stride2_padded_input": (16, 32, 1, 2, 1, 9, 9),
    "1x1_stride3_odd_width": (16, 32, 1, 3, 0, 10, 11),
    "3x3_narrow_rows_32_channel_tiles": (64, 64, 3, 1, 1, 7, 7),
    "3x3_tall_narrow_swapped": (16, 32, 3, 1, 1, 20, 5),
    "3x3_wide": (32, 48, 3, 1, 1, 28, 28),
    "3x3_wide_32_channel_tiles": (32, 64, 3, 1, 1, 28, 28),
    "3x3_narrow_rows_prefetching_the_next_blocks_weights": (256, 512, 3, 1, 1, 7, 7),
    "3x3_stride2_prefetching_the_next_blocks_weights": (256, 512, 3, 2, 1, 14, 14),
}


@needs_bf16
@pytest.mark.parametrize("case", CONV_CASES.values(), ids=CONV_CASES.keys())
def test_bf16_conv_equals_float32_conv_of_bf16_rounded_inputs(case, kernel_cache):
    cin, cout, kernel, stride, pad, height, width = case
    original, weight = _conv_relu(*case)
    x = RNG.standard_normal((1, cin, height, width)).astype(np.float32)
    artifact = compile_model(original, precision="bf16", cache_dir=kernel_cache)
    assert list(artifact.report()["precision"]["bf16_nodes"].values()) == ["Conv"]
    got = artifact.run({"x": x})["y"]
    rounded, _ = _conv_relu(*case, weight=round_to_bf16(weight))
    rounded.graph.initializer[1].CopyFrom(original.graph.initializer[1])  # the bias stays float32, as the kernel's
    want = run_onnxruntime(rounded, {"x": round_to_bf16(x)})[0]
    # bf16 x bf16 products are exact in float32: only the order of the float32 sums differs.
    np.testing.assert_allclose(got, want, rtol=0, atol=4e-6 * np.abs(want).max())


def _kernel_asm(original) -> str:
    """The assembly of the bf16 conv kernel of a one-conv model."""
    from tessel.backends.lower import build

    target = parse_target("llvm")
    program = build_program(from_onnx(original), target, precision="bf16")
    [spec] = [spec for spec in program.kernels.values() if PRECISION in dict(spec.members()[0].spec.attrs)]
    return build(spec, target).mod.inspect_source("asm")


@needs_bf16
def test_bf16_convs_with_large_weights_and_small_tiles_prefetch_the_next_blocks_weights():
    # 2.4 MB of weights on 7-pixel rows: the next 32 output channels' weights, one prefetch per 128-byte step.
    large, _ = _conv_relu(256, 512, 3, 1, 1, 7, 7)
    assert "prefetcht1\t147456(" in _kernel_asm(large)  # 256 × 9 × 32 × 2 bytes further: the next block
    # 1.2 MB on 14-pixel rows: a register tile of 1.8 KB, in a heap workspace, which a prefetch would spill.
    tiled, _ = _conv_relu(256, 256, 3, 1, 1, 14, 14)
    small, _ = _conv_relu(64, 128, 3, 1, 1, 7, 7)  # 0.15 MB: stays in L2
    assert "prefetch" not in _kernel_asm(tiled) and "prefetch" not in _kernel_asm(small)


@needs_bf16
def test_bf16_conv_unpacking_rows_with_a_residual_epilogue_equals_float32_on_bf16_rounded_inputs(kernel_cache):
    # An NCHW result is unpacked row by row from a per-thread row buffer: a batch of 2, rows of 13 pixels (tiles
    # padded past the row) and an epilogue reading another input (a residual Add) check the row's indexing.
    weight = (RNG.standard_normal((32, 16, 3, 3)) * 0.2).astype(np.float32)
    bias = RNG.standard_normal(32).astype(np.float32)

    def residual(w):
        nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1] * 4),
                 helper.make_node("Add", ["c", "r"], ["s"]), helper.make_node("Relu", ["s"], ["y"])]
        inputs = [("x", F, [2, 16, 13, 13]), ("r", F, [2, 32, 13, 13])]
        return model(nodes, inputs, [("y", F, None)], [("w", w), ("b", bias)])

    x = RNG.standard_normal((2, 16, 13, 13)).astype(np.float32)
    r = RNG.standard_normal((2, 32, 13, 13)).astype(np.float32)
    artifact = compile_model(residual(weight), precision="bf16", cache_dir=kernel_cache)
    assert list(artifact.report()["precision"]["bf16_nodes"].values()) == ["Conv"]
    want = run_onnxruntime(residual(round_to_bf16(weight)), {"x": round_to_bf16(x), "r": r})[0]
    np.testing.assert_allclose(artifact.run({"x": x, "r": r})["y"], want, rtol=0, atol=4e-6 * np.abs(want).max())


@needs_bf16
@pytest.mark.slow  # ~15 s: it compiles and times every candidate
def test_algorithm_selection_of_a_bf16_compile_times_the_bf16_kernels(kernel_cache, tmp_path, monkeypatch):
    monkeypatch.setenv("TESSEL_CACHE_DIR", str(tmp_path))  # a profile database of this test's own
    original, _ = _conv_relu(16, 32, 3, 1, 1, 14, 14)
    artifact = compile_model(original, precision="bf16", algo_select="dp", cache_dir=kernel_cache)
    assert list(artifact.report()["precision"]["bf16_nodes"].values()) == ["Conv"]
    [kernel] = [path.stem for path in (artifact.directory / "kernels").iterdir()]  # the fused bf16 Conv + Relu
    timed = json.loads((tmp_path / "profiles.json").read_text())
    assert f"{kernel}@2" in timed or f"{kernel}@1" in timed  # the kernel run is the candidate timed, by its key


@needs_bf16
def test_bf16_convs_between_blocked_activations_stay_within_the_stated_tolerance_of_float32(kernel_cache):
    weights = [(RNG.standard_normal((64, 64, 3, 3)) * 0.06).astype(np.float32) for _ in range(2)]
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1] * 4), helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2"], ["c2"], pads=[1] * 4), helper.make_node("Add", ["c2", "x"], ["y"])]
    # 12-pixel rows: Winograd's default starts at 13 (winograd_blocks.by_default), so both convs run bf16.
    original = model(nodes, [("x", F, [1, 64, 12, 12])], [("y", F, None)], [("w1", weights[0]), ("w2", weights[1])])
    x = RNG.standard_normal((1, 64, 12, 12)).astype(np.float32)
    artifact = compile_model(original, precision="bf16", cache_dir=kernel_cache)
    assert artifact.report()["conv_layout"]["blocked_values"] == 1 and len(artifact.report()["precision"]["bf16_nodes"]) == 2
    want = run_onnxruntime(original, {"x": x})[0]
    assert np.abs(artifact.run({"x": x})["y"] - want).max() <= BF16_SCALED_TOL * np.abs(want).max()


@needs_bf16
def test_convs_winograd_runs_by_default_stay_float32_winograd_in_bf16(kernel_cache):
    # The second conv reads the first's blocked result on 16-pixel rows: Winograd's default
    # (winograd_blocks.by_default), whose float32 products do a quarter of the multiply-adds, beats bf16 there; the
    # first (an NCHW input) runs bf16.
    weights = [(RNG.standard_normal((64, 64, 3, 3)) * 0.06).astype(np.float32) for _ in range(2)]
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1] * 4), helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2"], ["y"], pads=[1] * 4)]
    original = model(nodes, [("x", F, [1, 64, 16, 16])], [("y", F, None)], [("w1", weights[0]), ("w2", weights[1])])
    x = RNG.standard_normal((1, 64, 16, 16)).astype(np.float32)
    artifact = compile_model(original, precision="bf16", cache_dir=kernel_cache)
    precision = artifact.report()["precision"]
    assert len(precision["bf16_nodes"]) == 1 and 0.45 < precision["bf16_flop_share"] < 0.55  # the first conv
    want = run_onnxruntime(original, {"x": x})[0]
    assert np.abs(artifact.run({"x": x})["y"] - want).max() <= BF16_SCALED_TOL * np.abs(want).max()


@needs_bf16
@pytest.mark.slow
def test_resnet18_in_bf16_keeps_float32_top1_on_100_random_inputs(kernel_cache):
    resnet = next(m for m in CORPUS if m.name == "resnet18")
    artifact = compile_model(str(resnet.path), precision="bf16", cache_dir=kernel_cache)
    # Every conv but the 7 that Winograd runs by default in float32 (56² × 64, 28² × 128): 13 of 20, 55% of the FLOPs.
    assert len(artifact.report()["precision"]["bf16_nodes"]) == 13
    rng = np.random.default_rng(2026)
    worst = 0.0
    for _ in range(100):
        x = rng.random((1, 3, 224, 224), dtype=np.float32)  # the corpus' "rand" fill
        got = next(iter(artifact.run({"input": x}).values()))
        want = run_onnxruntime(str(resnet.path), {"input": x})[0]
        assert got.argmax() == want.argmax()
        worst = max(worst, np.abs(got - want).max() / np.abs(want).max())
    assert worst <= BF16_SCALED_TOL
