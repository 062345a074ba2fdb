"""The gradient ops' schemas and numpy references (ir/grad_ops.py) against PyTorch autograd."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tessel.ir.grad_ops import REFERENCE
from tessel.ir.schema import TESSEL_DOMAIN, InferenceFailure, get_schema
from tessel.ir.types import TensorType


def _attrs(op_type, **raw):
    return get_schema(op_type, TESSEL_DOMAIN).make_attributes(raw, "test")


def _infer(op_type, attrs, *types):
    return get_schema(op_type, TESSEL_DOMAIN).infer(attrs, list(types), [None] * len(types), 1)[0]


def _random(rng, *shape):
    return rng.standard_normal(shape)


@pytest.mark.parametrize("shape,out,kernel,stride,pad,dilation,group", [
    ((2, 4, 7, 6), 6, (3, 3), (1, 1), (1, 1), (1, 1), 1),
    ((2, 4, 9, 8), 6, (3, 2), (2, 3), (1, 0), (1, 1), 2),
    ((1, 3, 8, 8), 3, (3, 3), (2, 2), (2, 2), (2, 2), 3),  # depthwise, dilated
    ((3, 2, 5, 5), 4, (1, 1), (1, 1), (0, 0), (1, 1), 1),
    ((2, 3, 11), 5, (4,), (2,), (1,), (2,), 1),  # 1-D
])
def test_conv_grad_filter_matches_torch(shape, out, kernel, stride, pad, dilation, group):
    rng = np.random.default_rng(0)
    x = _random(rng, *shape)
    w = torch.tensor(_random(rng, out, shape[1] // group, *kernel), requires_grad=True)
    conv = F.conv2d if len(kernel) == 2 else F.conv1d
    y = conv(torch.tensor(x), w, None, stride, pad, dilation, group)
    dy = _random(rng, *y.shape)
    y.backward(torch.tensor(dy))
    attrs = _attrs("ConvGradFilter", kernel_shape=kernel, strides=stride, pads=pad + pad, dilations=dilation,
                   group=group)
    (grad,) = REFERENCE["ConvGradFilter"](attrs, [x, dy])
    np.testing.assert_allclose(grad, w.grad.numpy(), rtol=1e-10, atol=1e-10)
    assert _infer("ConvGradFilter", attrs, TensorType.of(x), TensorType.of(dy)) == TensorType.of(grad)


def test_conv_grad_filter_asymmetric_pads():
    rng = np.random.default_rng(1)
    x, w = _random(rng, 2, 3, 6, 7), torch.tensor(_random(rng, 4, 3, 3, 3), requires_grad=True)
    y = F.conv2d(F.pad(torch.tensor(x), (2, 0, 0, 1)), w, stride=2)
    dy = _random(rng, *y.shape)
    y.backward(torch.tensor(dy))
    attrs = _attrs("ConvGradFilter", kernel_shape=(3, 3), strides=(2, 2), pads=(0, 2, 1, 0))
    np.testing.assert_allclose(REFERENCE["ConvGradFilter"](attrs, [x, dy])[0], w.grad.numpy(), rtol=1e-10)


def _max_pool_case(x, kernel, stride, pad, dilation=1, ceil=False, seed=0):
    xt = torch.tensor(x, requires_grad=True)
    pool = F.max_pool2d if x.ndim == 4 else F.max_pool1d
    y = pool(xt, kernel, stride, pad, dilation, ceil_mode=ceil)
    dy = np.random.default_rng(seed).standard_normal(y.shape)
    y.backward(torch.tensor(dy))
    rank = x.ndim - 2
    attrs = _attrs("MaxPoolGrad", kernel_shape=(kernel,) * rank, strides=(stride,) * rank, pads=(pad,) * 2 * rank,
                   dilations=(dilation,) * rank, ceil_mode=int(ceil))
    (grad,) = REFERENCE["MaxPoolGrad"](attrs, [x, dy])
    np.testing.assert_allclose(grad, xt.grad.numpy(), rtol=1e-12, atol=1e-12)
    assert _infer("MaxPoolGrad", attrs, TensorType.of(x), TensorType.of(dy)) == TensorType.of(x)
    # The forward that keeps each window's tap, and the gradient through the taps, give the same.
    taps_attrs = _attrs("MaxPoolWithTaps", **attrs)
    pooled, taps = REFERENCE["MaxPoolWithTaps"](taps_attrs, [x])
    np.testing.assert_array_equal(pooled, y.detach().numpy())
    assert get_schema("MaxPoolWithTaps", TESSEL_DOMAIN).infer(taps_attrs, [TensorType.of(x)], [None], 2) == [
        TensorType.of(pooled), TensorType("int32", pooled.shape)]
    grad_attrs = _attrs("MaxPoolTapsGrad", **attrs, input_shape=x.shape)
    (through_taps,) = REFERENCE["MaxPoolTapsGrad"](grad_attrs, [taps, dy])
    np.testing.assert_array_equal(through_taps, grad)
    assert _infer("MaxPoolTapsGrad", grad_attrs, TensorType.of(taps), TensorType.of(dy)) == TensorType.of(x)


@pytest.mark.parametrize("shape,kernel,stride,pad,dilation,ceil", [
    ((2, 3, 8, 8), 3, 2, 1, 1, False),   # ResNet's stem pool
    ((1, 2, 7, 7), 3, 2, 1, 1, True),
    ((1, 2, 9, 9), 2, 2, 0, 2, False),
    ((2, 2, 6, 6), 2, 2, 0, 1, True),
    ((2, 3, 10), 3, 2, 1, 1, True),      # 1-D
])
def test_max_pool_grad_matches_torch(shape, kernel, stride, pad, dilation, ceil):
    _max_pool_case(np.random.default_rng(2).standard_normal(shape), kernel, stride, pad, dilation, ceil)


def test_max_pool_grad_ties_go_to_the_first_maximum():
    x = np.random.default_rng(3).integers(0, 3, (2, 2, 7, 7)).astype(np.float64)  # many ties
    _max_pool_case(x, 3, 1, 1)
    _max_pool_case(x, 3, 2, 1, ceil=True)


def test_max_pool_grad_padding_never_wins():
    x = -np.ones((1, 1, 4, 4)) * np.inf  # every real element ties with the -inf padding
    _max_pool_case(x, 3, 2, 1)


@pytest.mark.parametrize("shape,kernel,stride,pad,ceil,include", [
    ((2, 3, 8, 8), 3, 2, 1, False, True),
    ((2, 3, 8, 8), 3, 2, 1, False, False),
    ((1, 2, 7, 7), 3, 2, 1, True, True),
    ((1, 2, 7, 7), 3, 2, 1, True, False),
    ((1, 2, 6, 6), 2, 2, 0, False, False),
    ((2, 2, 9), 4, 3, 2, True, True),     # 1-D
])
def test_average_pool_grad_matches_torch(shape, kernel, stride, pad, ceil, include):
    rng = np.random.default_rng(4)
    xt = torch.tensor(rng.standard_normal(shape), requires_grad=True)
    pool = F.avg_pool2d if len(shape) == 4 else F.avg_pool1d
    y = pool(xt, kernel, stride, pad, ceil_mode=ceil, count_include_pad=include)
    dy = rng.standard_normal(y.shape)
    y.backward(torch.tensor(dy))
    rank = len(shape) - 2
    attrs = _attrs("AveragePoolGrad", kernel_shape=(kernel,) * rank, strides=(stride,) * rank,
                   pads=(pad,) * 2 * rank, ceil_mode=int(ceil), count_include_pad=int(include), input_shape=shape)
    (grad,) = REFERENCE["AveragePoolGrad"](attrs, [dy])
    np.testing.assert_allclose(grad, xt.grad.numpy(), rtol=1e-12, atol=1e-12)
    assert _infer("AveragePoolGrad", attrs, TensorType.of(dy)) == TensorType.of(grad)


@pytest.mark.parametrize("shape", [(4, 3, 5, 2), (6, 2)])
def test_batch_stats_match_torch(shape):
    x = np.random.default_rng(5).standard_normal(shape) * 3 + 10
    axes = [0] + list(range(2, len(shape)))
    var, mean = torch.var_mean(torch.tensor(x), dim=axes, keepdim=True, correction=0)
    got = REFERENCE["BatchStats"](_attrs("BatchStats"), [x])
    np.testing.assert_allclose(got[0], mean.numpy(), rtol=1e-12)
    np.testing.assert_allclose(got[1], var.numpy(), rtol=1e-12)
    stat = TensorType("float64", (1, shape[1]) + (1,) * (len(shape) - 2))
    assert get_schema("BatchStats", TESSEL_DOMAIN).infer(_attrs("BatchStats"), [TensorType.of(x)], [None], 2) == [
        stat, stat]


def test_inference_rejects_a_dy_that_does_not_match_the_forward_op():
    attrs = _attrs("ConvGradFilter", kernel_shape=(3, 3))
    with pytest.raises(InferenceFailure, match="dy is"):
        _infer("ConvGradFilter", attrs, TensorType("float32", (1, 2, 5, 5)), TensorType("float32", (1, 4, 5, 5)))
    attrs = _attrs("ConvGradFilter", kernel_shape=(3, 3), group=3)
    with pytest.raises(InferenceFailure, match="group 3"):
        _infer("ConvGradFilter", attrs, TensorType("float32", (1, 2, 5, 5)), TensorType("float32", (1, 3, 3, 3)))
    attrs = _attrs("MaxPoolGrad", kernel_shape=(2,))
    with pytest.raises(InferenceFailure, match="kernel_shape"):
        _infer("MaxPoolGrad", attrs, TensorType("float32", (1, 2, 5, 5)), TensorType("float32", (1, 2, 4, 4)))
