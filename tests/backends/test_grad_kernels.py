"""The backward kernels of a training step on CPU: the gradient ops (backends/lowering/grad.py,
backends/cpu/conv_grad_filter.py) equal their numpy references (ir/grad_ops.py, themselves checked against PyTorch
in tests/ir/test_grad_ops.py); ConvTranspose (a Conv's data gradient) and a Conv whose weights are a kernel
argument (a parameter) equal PyTorch's."""
from __future__ import annotations

import numpy as np
import pytest

from tessel.backends.kernel import ARG, KernelInput, KernelSpec
from tessel.backends.lower import build
from tessel.backends.target import parse_target
from tessel.backends.tvm_env import tvm
from tessel.ir.grad_ops import REFERENCE
from tessel.ir.schema import TESSEL_DOMAIN, get_schema
from tessel.ir.types import TensorType

LLVM = parse_target("llvm")


def run_kernels(op_type: str, raw_attrs: dict, arrays: list[np.ndarray]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(the compiled kernel's outputs, the reference's) for one gradient op on `arrays` (float ones in float64)."""
    schema = get_schema(op_type, TESSEL_DOMAIN)
    attrs = schema.make_attributes(raw_attrs, "test")
    types = [TensorType.of(a) for a in arrays]
    outs = schema.infer(attrs, types, [None] * len(types), schema.max_outputs)
    spec = KernelSpec(op_type, tuple(sorted(attrs.items())), tuple(KernelInput(t.spec(), ARG) for t in types),
                      tuple(out.spec() for out in outs))
    runtime = tvm().runtime
    results = [runtime.tensor(np.zeros(out.shape, out.dtype)) for out in outs]
    build(spec, LLVM)["main"](*(runtime.tensor(a) for a in arrays), *results)
    want = REFERENCE[op_type](attrs, [a.astype(np.float64) if a.dtype.kind == "f" else a for a in arrays])
    return [r.numpy() for r in results], want


def run_kernel(op_type: str, raw_attrs: dict, arrays: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(the compiled kernel's output, the reference's) for a one-output gradient op on `arrays`."""
    (got,), (want,) = run_kernels(op_type, raw_attrs, arrays)
    return got, want


def _random(seed: int, *shape: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("x_shape,dy_shape,attrs", [
    ((2, 8, 9, 9), (2, 16, 9, 9), dict(kernel_shape=(3, 3), pads=(1, 1, 1, 1))),
    ((2, 3, 15, 12), (2, 20, 7, 6), dict(kernel_shape=(5, 3), pads=(2, 1, 1, 1), strides=(2, 2))),  # odd sizes
    ((3, 16, 6, 6), (3, 32, 3, 3), dict(kernel_shape=(1, 1), strides=(2, 2))),
    ((3, 2, 48, 48), (3, 16, 48, 48), dict(kernel_shape=(3, 3), pads=(1, 1, 1, 1))),  # one image per chunk
    ((2, 4, 8, 8), (2, 6, 4, 4), dict(kernel_shape=(3, 3), pads=(1, 1, 1, 1), strides=(2, 2), group=2)),
    ((2, 6, 9, 9), (2, 6, 9, 9), dict(kernel_shape=(3, 3), pads=(2, 2, 2, 2), dilations=(2, 2), group=6)),
    ((2, 5, 12), (2, 7, 6), dict(kernel_shape=(3,), pads=(1, 1), strides=(2,))),
    # 1x1 outputs (ResNet-18's last stage on 32x32 images): the chunk's copies have loops of extent 1 only
    ((4, 32, 2, 2), (4, 64, 1, 1), dict(kernel_shape=(3, 3), pads=(1, 1, 1, 1), strides=(2, 2))),
    ((4, 64, 1, 1), (4, 64, 1, 1), dict(kernel_shape=(3, 3), pads=(1, 1, 1, 1))),
    ((4, 32, 2, 2), (4, 64, 1, 1), dict(kernel_shape=(1, 1), strides=(2, 2))),
])
def test_conv_grad_filter_kernel(x_shape, dy_shape, attrs):
    got, want = run_kernel("ConvGradFilter", attrs, [_random(0, *x_shape), _random(1, *dy_shape)])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("x_shape,dy_shape,attrs", [
    ((2, 3, 8, 8), (2, 3, 4, 4), dict(kernel_shape=(3, 3), pads=(1, 1, 1, 1), strides=(2, 2))),
    ((1, 2, 7, 7), (1, 2, 4, 4), dict(kernel_shape=(3, 3), pads=(1, 1, 1, 1), strides=(2, 2), ceil_mode=1)),
    ((1, 2, 9, 9), (1, 2, 4, 4), dict(kernel_shape=(2, 2), strides=(2, 2), dilations=(2, 2))),
    ((2, 3, 10), (2, 3, 6), dict(kernel_shape=(3,), pads=(1, 1), strides=(2,), ceil_mode=1)),
])
def test_max_pool_grad_kernel_with_ties(x_shape, dy_shape, attrs):
    x = np.round(_random(2, *x_shape))  # many ties: the first maximum takes the gradient
    x.reshape(-1)[:3] = [np.nan, -np.inf, np.nan]
    dy = _random(3, *dy_shape)
    got, want = run_kernel("MaxPoolGrad", attrs, [x, dy])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    # The forward that keeps each window's first-maximum tap, and the gradient through the taps, give the same.
    (pooled, taps), (want_pooled, want_taps) = run_kernels("MaxPoolWithTaps", attrs, [x])
    np.testing.assert_array_equal(pooled, want_pooled.astype(np.float32))
    np.testing.assert_array_equal(taps, want_taps)
    through_taps, want_through = run_kernel("MaxPoolTapsGrad", dict(attrs, input_shape=x_shape), [taps, dy])
    np.testing.assert_allclose(through_taps, want_through, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(through_taps, got)


def test_max_pool_taps_padding_never_wins_a_window_of_minus_infinity():
    """The taps kernel reads x padded with -inf: where the maximum is -inf, only the real elements count."""
    x = np.full((1, 2, 5, 5), -np.inf, np.float32)
    x[0, 1, 1:, 1:] = 0.0
    attrs = dict(kernel_shape=(3, 3), pads=(1, 1, 1, 1), strides=(2, 2))
    (_, taps), (_, want) = run_kernels("MaxPoolWithTaps", attrs, [x])
    np.testing.assert_array_equal(taps, want)
    # Each window's first real element: the top-left windows start in the padding.
    np.testing.assert_array_equal(taps[0, 0], [[4, 3, 3], [1, 0, 0], [1, 0, 0]])


def _torch_taps(indices: np.ndarray, width: int, kernel, strides, pads) -> np.ndarray:
    """PyTorch's max-pool indices (flat positions in the image) as row-major tap numbers of each window."""
    rows, cols = np.divmod(indices, width)
    top = np.arange(indices.shape[2])[:, None] * strides[0] - pads[0]
    left = np.arange(indices.shape[3])[None, :] * strides[1] - pads[1]
    return ((rows - top) * kernel[1] + cols - left).astype(np.int32)


@pytest.mark.parametrize("shape,kernel,strides,pads", [
    ((2, 3, 40, 150), (3, 3), (2, 2), (1, 1)),  # ResNet's stem pool: a padded row wider than one whole vector
    ((2, 2, 12, 11), (5, 3), (1, 2), (2, 1)),
    ((1, 4, 9, 64), (2, 2), (2, 2), (0, 0)),
])
def test_one_pass_max_pool_taps_match_pytorch_indices(shape, kernel, strides, pads):
    """The CPU kernel that finds the taps in the pool's own pass (backends/cpu/max_pool_taps.py) against PyTorch's
    max_pool2d with indices, on a ReLU's output (many windows tie at 0: the first maximum must win)."""
    import torch

    x = np.maximum(np.round(_random(8, *shape) * 2), 0)
    attrs = dict(kernel_shape=kernel, strides=strides, pads=pads + pads)
    (pooled, taps), _ = run_kernels("MaxPoolWithTaps", attrs, [x])
    want, indices = torch.nn.functional.max_pool2d(torch.from_numpy(x), kernel, strides, pads, return_indices=True)
    np.testing.assert_array_equal(pooled, want.numpy())
    np.testing.assert_array_equal(taps, _torch_taps(indices.numpy(), shape[3], kernel, strides, pads))


def test_one_pass_kernels_take_only_float32_images_on_cpu():
    from tessel.backends.cpu import batch_stats, max_pool_taps
    from tessel.backends.lowering.context import LowerContext

    def context(shape, dtype="float32", gpu=False):
        x = tvm().te.placeholder(shape, dtype, name="x")
        return LowerContext("MaxPoolWithTaps", {"kernel_shape": (3,)}, [x], [TensorType(dtype, shape)], [None],
                            [TensorType(dtype, shape)], gpu=gpu)

    assert max_pool_taps.applies(context((2, 3, 8, 8)))
    assert not max_pool_taps.applies(context((2, 3, 8)))  # 1-D windows: the target-neutral rule
    assert not max_pool_taps.applies(context((2, 3, 8, 8), "float64"))
    assert not max_pool_taps.applies(context((2, 3, 8, 8), gpu=True))
    assert batch_stats.applies(context((2, 3)))
    assert not batch_stats.applies(context((2, 3, 8, 8), "float64"))


@pytest.mark.parametrize("shape", [(4, 3, 6, 5), (32, 2, 7, 7), (9, 4)])
def test_batch_stats_kernel(shape):
    x = _random(6, *shape) * 2 + 5  # a mean that dwarfs part of the spread
    (mean, var), (want_mean, want_var) = run_kernels("BatchStats", {}, [x])
    np.testing.assert_allclose(mean, want_mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(var, want_var, rtol=1e-5, atol=1e-6)


def test_batch_stats_keeps_a_nan_variance():
    x = _random(6, 4, 3, 5, 5) + 2
    x[1, 1, 2, 3] = np.nan
    (mean, var), _ = run_kernels("BatchStats", {}, [x])
    assert np.isnan(mean[0, 1]) and np.isnan(var[0, 1]) and not np.isnan(var[0, [0, 2]]).any()


@pytest.mark.parametrize("shape,mean,spread", [((16, 4, 28, 28), 1e3, 0.1), ((16, 4, 28, 28), -3e4, 1.0),
                                               ((64, 8, 7, 7), 50.0, 1e-3)])
def test_batch_stats_stays_accurate_where_the_mean_dwarfs_the_spread(shape, mean, spread):
    """|mean| / std of 1e4 to 5e4: E[x²] − E[x]² in float32 is off by 10x or more here; the CPU kernel's sums around
    each channel's first element (backends/cpu/batch_stats.py) keep the variance within 1e-5 of float64."""
    x = (np.random.default_rng(9).standard_normal(shape) * spread + mean).astype(np.float32)
    (got_mean, got_var), (want_mean, want_var) = run_kernels("BatchStats", {}, [x])
    np.testing.assert_allclose(got_mean, want_mean, rtol=1e-6)
    np.testing.assert_allclose(got_var, want_var, rtol=1e-5)


@pytest.mark.parametrize("dy_shape,attrs", [
    ((2, 3, 4, 4), dict(kernel_shape=(3, 3), pads=(1, 1, 1, 1), strides=(2, 2), count_include_pad=1)),
    ((1, 2, 4, 4), dict(kernel_shape=(3, 3), pads=(1, 1, 1, 1), strides=(2, 2), ceil_mode=1)),
    ((1, 2, 4, 4), dict(kernel_shape=(3, 3), pads=(1, 1, 1, 1), strides=(2, 2), ceil_mode=1, count_include_pad=1)),
    ((2, 2, 4), dict(kernel_shape=(4,), pads=(2, 2), strides=(3,))),
])
def test_average_pool_grad_kernel(dy_shape, attrs):
    input_shape = {4: (dy_shape[:2] + (8, 8)), 3: dy_shape[:2] + (9,)}[len(dy_shape)]
    if attrs.get("ceil_mode"):
        input_shape = dy_shape[:2] + (7, 7)
    got, want = run_kernel("AveragePoolGrad", dict(attrs, input_shape=input_shape), [_random(4, *dy_shape)])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def run_conv(op_type: str, x: np.ndarray, w: np.ndarray, bias: np.ndarray | None, attrs: dict) -> np.ndarray:
    """The output of the compiled Conv or ConvTranspose kernel, its weights a kernel argument."""
    schema = get_schema(op_type)
    values = schema.make_attributes(attrs, "test")
    arrays = [x, w] + ([bias] if bias is not None else [])
    types = [TensorType.of(a) for a in arrays]
    out = schema.infer(values, types, [None] * len(types), 1)[0]
    spec = KernelSpec(op_type, tuple(sorted(values.items())),
                      tuple(KernelInput(t.spec(), ARG) for t in types), (out.spec(),))
    runtime = tvm().runtime
    result = runtime.tensor(np.zeros(out.shape, np.float32))
    build(spec, LLVM)["main"](*(runtime.tensor(a) for a in arrays), result)
    return result.numpy()


# (dy shape, weight shape, stride, pad, dilation, group, output padding, bias): autodiff's data gradients
# (ConvTranspose(dy, W)) of dense, strided, dilated, grouped and depthwise convs.
CONV_TRANSPOSE_CASES = {
    "dense": ((2, 16, 6, 6), (16, 8, 3, 3), 1, 1, 1, 1, 0, False),
    # 576 KiB of weights (ResNet-18's layer2): the column strips run outside the row tiles
    "dense_wide": ((1, 128, 5, 5), (128, 128, 3, 3), 1, 1, 1, 1, 0, True),
    "stride2_outpad": ((2, 16, 4, 5), (16, 8, 3, 3), 2, 1, 1, 1, 1, True),
    "1x1_stride2": ((2, 32, 3, 3), (32, 16, 1, 1), 2, 0, 1, 1, 1, False),
    "dilated": ((1, 8, 5, 5), (8, 4, 3, 3), 1, 2, 2, 1, 0, False),
    "dilated_stride2": ((1, 8, 4, 4), (8, 4, 3, 3), 2, 2, 2, 1, 1, True),
    "grouped": ((2, 8, 4, 4), (8, 3, 3, 3), 2, 1, 1, 2, 1, False),
    "depthwise": ((2, 6, 5, 5), (6, 1, 3, 3), 1, 1, 1, 6, 0, True),
    "upsample": ((1, 4, 3, 3), (4, 5, 2, 2), 2, 0, 1, 1, 0, True),
    "1d": ((2, 4, 7), (4, 3, 4), 3, 1, 2, 1, 2, False),
}


@pytest.mark.parametrize("case", sorted(CONV_TRANSPOSE_CASES))
def test_conv_transpose_kernel_matches_torch(case):
    import torch

    dy_shape, w_shape, stride, pad, dilation, group, out_pad, with_bias = CONV_TRANSPOSE_CASES[case]
    rank = len(dy_shape) - 2
    dy, w = _random(5, *dy_shape), _random(6, *w_shape)
    bias = _random(7, w_shape[1] * group) if with_bias else None
    attrs = dict(strides=(stride,) * rank, pads=(pad,) * 2 * rank, dilations=(dilation,) * rank, group=group,
                 output_padding=(out_pad,) * rank)
    op = torch.nn.functional.conv_transpose2d if rank == 2 else torch.nn.functional.conv_transpose1d
    want = op(torch.from_numpy(dy), torch.from_numpy(w), None if bias is None else torch.from_numpy(bias), stride,
              pad, out_pad, group, dilation).numpy()
    np.testing.assert_allclose(run_conv("ConvTranspose", dy, w, bias, attrs), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("x_shape,w_shape,stride,pads,dilation,with_bias", [
    ((2, 8, 9, 9), (16, 8, 3, 3), 1, (1, 1, 1, 1), 1, True),
    ((2, 3, 13, 12), (20, 3, 5, 3), 2, (2, 1, 0, 1), 1, False),  # odd sizes, asymmetric pads, 20 channels
    ((1, 4, 10, 10), (8, 4, 3, 3), 1, (2, 2, 2, 2), 2, True),
])
def test_conv_with_runtime_weights_matches_torch(x_shape, w_shape, stride, pads, dilation, with_bias):
    import torch

    x, w = _random(8, *x_shape), _random(9, *w_shape)
    bias = _random(10, w_shape[0]) if with_bias else None
    attrs = dict(strides=(stride, stride), pads=pads, dilations=(dilation, dilation))
    padded = torch.nn.functional.pad(torch.from_numpy(x), (pads[1], pads[3], pads[0], pads[2]))
    want = torch.nn.functional.conv2d(padded, torch.from_numpy(w), None if bias is None else torch.from_numpy(bias),
                                      stride, 0, dilation).numpy()
    np.testing.assert_allclose(run_conv("Conv", x, w, bias, attrs), want, rtol=1e-4, atol=1e-4)
