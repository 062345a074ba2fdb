"""Reverse-mode autodiff: every gradient rule against float64 central finite differences on small random
instances, plus the pass's own behaviour (paths, accumulation, missing rules)."""
from __future__ import annotations

import numpy as np
import pytest

from tessel.ir.grad_ops import REFERENCE
from tessel.ir.graph import Graph
from tessel.ir.interpret import interpret
from tessel.ir.schema import TESSEL_DOMAIN
from tessel.ir.types import TensorType
from tessel.passes.autodiff import MissingGradientError, differentiate
from tessel.passes.base import add_op
from tests.passes.gradcheck import Const, check_gradients


def rand(*shape, seed=0, low=None, high=None):
    """Seeded random float64 data: standard normal, or uniform in [low, high)."""
    rng = np.random.default_rng(seed + 7 * len(shape) + sum(shape))
    if low is not None:
        return rng.uniform(low, high, shape)
    return rng.standard_normal(shape)


def ints(*values):
    return Const(np.array(values, dtype=np.int64))


# ---- elementwise -------------------------------------------------------------------------------------

BINARY_CASES = [
    ("Add", (2, 3), (3,)), ("Add", (2, 1, 3), (4, 1)), ("Sub", (2, 3), (2, 1)), ("Mul", (3, 1), (1, 4)),
    ("Div", (2, 3), (3,)), ("Max", (2, 3), (3,)), ("Min", (3,), (2, 3)),
]


@pytest.mark.parametrize("op,a,b", BINARY_CASES, ids=[f"{c[0]}{c[1]}{c[2]}" for c in BINARY_CASES])
def test_broadcasting_binary_ops(op, a, b):
    divisor = rand(*b, seed=1, low=0.5, high=2.0) if op == "Div" else rand(*b, seed=1)
    check_gradients(op, {"a": rand(*a), "b": divisor})


def test_pow_with_float_and_integer_exponents():
    check_gradients("Pow", {"a": rand(2, 3, low=0.5, high=2.0), "b": rand(3, seed=2)})
    check_gradients("Pow", {"a": rand(2, 3), "b": Const(np.array(3, np.int64))})


def test_variadic_sum_mean_max():
    check_gradients("Sum", {"a": rand(2, 3), "b": rand(3, seed=1), "c": rand(2, 1, seed=2)})
    check_gradients("Mean", {"a": rand(2, 3), "b": rand(3, seed=1)})
    check_gradients("Max", {"a": rand(2, 3), "b": rand(3, seed=1), "c": rand(2, 1, seed=2)})


def test_max_shares_the_gradient_on_ties():
    got = check_gradients("Max", {"a": np.array([1.0, 2.0]), "b": np.array([1.0, 3.0])}, atol=1.0)
    graph_weights = np.random.default_rng(1000).standard_normal(2).astype(np.float32).astype(np.float64)
    np.testing.assert_allclose(got["a"], [graph_weights[0] / 2, 0.0], rtol=1e-6)


UNARY_CASES = [
    ("Neg", {}, None), ("Identity", {}, None), ("Sqrt", {}, (0.5, 2.0)), ("Exp", {}, None), ("Log", {}, (0.5, 2.0)),
    ("Abs", {}, None), ("Reciprocal", {}, (0.5, 2.0)), ("Relu", {}, None), ("LeakyRelu", {"alpha": 0.2}, None),
    ("Sigmoid", {}, None), ("Tanh", {}, None), ("Gelu", {}, None), ("Gelu", {"approximate": "tanh"}, None),
    ("Erf", {}, None), ("HardSwish", {}, (-4.0, 4.0)), ("HardSigmoid", {"alpha": 0.3, "beta": 0.4}, (-4.0, 4.0)),
    ("Softplus", {}, None), ("Elu", {"alpha": 0.7}, None), ("Selu", {}, None), ("Mish", {}, None),
    ("Softsign", {}, None), ("Softmax", {"axis": 1}, None), ("Softmax", {"axis": -1}, None),
    ("LogSoftmax", {"axis": 0}, None), ("LogSoftmax", {}, None),
]


@pytest.mark.parametrize("op,attrs,bounds", UNARY_CASES, ids=[f"{c[0]}{list(c[1].values())}" for c in UNARY_CASES])
def test_unary_ops(op, attrs, bounds):
    x = rand(3, 4, low=bounds[0], high=bounds[1]) if bounds else rand(3, 4)
    check_gradients(op, {"x": x}, attrs)


def test_cast_between_float_types_passes_the_gradient():
    check_gradients("Cast", {"x": rand(2, 3)}, {"to": 11})


def test_where_and_prelu():
    condition = Const(rand(2, 3, seed=5) > 0)
    check_gradients("Where", {"c": condition, "a": rand(2, 3), "b": rand(3, seed=1)})
    check_gradients("PRelu", {"x": rand(2, 3, 2), "slope": rand(3, 1, seed=1)})


def test_clip_passes_the_gradient_inside_the_bounds_only():
    x = np.array([-2.0, -0.3, 0.2, 0.9, 1.7])
    got = check_gradients("Clip", {"x": x, "lo": Const(np.array(-0.5, np.float32)), "hi": Const(np.array(1.0, np.float32))})
    assert got["x"][0] == 0 and got["x"][-1] == 0 and np.all(got["x"][1:4] != 0)
    check_gradients("Clip", {"x": x})


# ---- matrix products -----------------------------------------------------------------------------------

MATMUL_CASES = [((3, 4), (4, 2)), ((2, 3, 4), (4, 5)), ((2, 1, 3, 4), (3, 4, 2)), ((4,), (4, 3)), ((2, 3, 4), (4,)),
                ((4,), (4,)), ((3, 4), (2, 4, 5))]


@pytest.mark.parametrize("a,b", MATMUL_CASES, ids=[f"{a}x{b}" for a, b in MATMUL_CASES])
def test_matmul_batched_broadcast_and_vectors(a, b):
    check_gradients("MatMul", {"a": rand(*a), "b": rand(*b, seed=1)})


@pytest.mark.parametrize("trans_a,trans_b", [(0, 0), (1, 0), (0, 1), (1, 1)])
@pytest.mark.parametrize("c_shape", [(3,), (2, 1), (2, 3)])
def test_gemm(trans_a, trans_b, c_shape):
    a = rand(*((4, 2) if trans_a else (2, 4)))
    b = rand(*((3, 4) if trans_b else (4, 3)), seed=1)
    check_gradients("Gemm", {"a": a, "b": b, "c": rand(*c_shape, seed=2)},
                    {"alpha": 0.7, "beta": 1.3, "transA": trans_a, "transB": trans_b})


def test_gemm_without_bias():
    check_gradients("Gemm", {"a": rand(2, 4), "b": rand(4, 3, seed=1)})


# ---- reductions ----------------------------------------------------------------------------------------

REDUCE_OPS = ["ReduceSum", "ReduceMean", "ReduceSumSquare", "ReduceL2", "ReduceLogSumExp", "ReduceMax", "ReduceMin"]


@pytest.mark.parametrize("op", REDUCE_OPS)
@pytest.mark.parametrize("axes,keepdims", [((1,), 0), ((0, -1), 1), (None, 0)])
def test_reductions(op, axes, keepdims):
    inputs = {"x": rand(2, 3, 4)}
    if axes is not None:
        inputs["axes"] = ints(*axes)
    check_gradients(op, inputs, {"keepdims": keepdims})


def test_reduce_max_shares_the_gradient_among_ties():
    got = check_gradients("ReduceMax", {"x": np.array([[1.0, 3.0, 3.0]]), "axes": ints(1)}, {"keepdims": 0}, atol=10.0)
    assert got["x"][0, 0] == 0 and got["x"][0, 1] == got["x"][0, 2]


def test_reduce_with_empty_axes_and_noop_passes_through():
    check_gradients("ReduceSum", {"x": rand(2, 3), "axes": Const(np.zeros(0, np.int64))}, {"noop_with_empty_axes": 1})


# ---- data movement -------------------------------------------------------------------------------------

def test_shape_changing_ops():
    check_gradients("Reshape", {"x": rand(2, 6), "shape": ints(3, -1, 2)})
    check_gradients("Flatten", {"x": rand(2, 3, 2)}, {"axis": 2})
    check_gradients("Squeeze", {"x": rand(2, 1, 3), "axes": ints(1)})
    check_gradients("Unsqueeze", {"x": rand(2, 3), "axes": ints(0, 3)})
    check_gradients("Transpose", {"x": rand(2, 3, 4)}, {"perm": [2, 0, 1]})
    check_gradients("Transpose", {"x": rand(2, 3)})
    check_gradients("Expand", {"x": rand(3, 1), "shape": ints(2, 3, 4)})
    check_gradients("Tile", {"x": rand(2, 3), "repeats": ints(2, 3)})


def test_concat_and_split():
    check_gradients("Concat", {"a": rand(2, 3), "b": rand(2, 1, seed=1), "c": Const(np.ones((2, 2), np.float32))}, {"axis": -1})
    check_gradients("Split", {"x": rand(5, 2), "split": ints(2, 3)}, {"axis": 0}, num_outputs=2)
    check_gradients("Split", {"x": rand(2, 6)}, {"axis": 1, "num_outputs": 3}, num_outputs=3)


SLICE_CASES = [((1,), (3,), (1,), None), ((0, 1), (-1, 100), (0, 1), None), ((4,), (0,), (1,), (-2,)),
               ((-1, 0), (-100, 4), (0, 1), (-1, 2)), ((1,), (4,), (-1,), (2,))]


@pytest.mark.parametrize("starts,ends,axes,steps", SLICE_CASES, ids=[str(i) for i in range(len(SLICE_CASES))])
def test_slice_with_steps_and_negatives(starts, ends, axes, steps):
    inputs = {"x": rand(3, 5), "starts": ints(*starts), "ends": ints(*ends), "axes": ints(*axes)}
    if steps is not None:
        inputs["steps"] = ints(*steps)
    check_gradients("Slice", inputs)


@pytest.mark.parametrize("axis,indices", [(0, [[0, 2], [2, -1]]), (1, [1, 1, 0]), (-1, 1)])
def test_gather_scatters_back_with_repeats(axis, indices):
    check_gradients("Gather", {"x": rand(3, 4, 2), "i": Const(np.array(indices, np.int64))}, {"axis": axis})


def test_pad_constant_mode():
    check_gradients("Pad", {"x": rand(2, 3), "pads": ints(1, 0, 2, 1), "v": Const(np.array(0.5, np.float32))})
    check_gradients("Pad", {"x": rand(2, 4, 3), "pads": ints(1, 0, 0, 2), "v": None, "axes": ints(1, 2)})


@pytest.mark.parametrize("attrs,scales", [
    ({"mode": "nearest"}, [1.0, 1.0, 2.0, 3.0]),
    ({"mode": "nearest", "coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"}, [1.0, 1.0, 2.0, 2.0]),
    ({"mode": "nearest"}, [1.0, 1.0, 1.5, 0.5]),
])
def test_resize_nearest(attrs, scales):
    check_gradients("Resize", {"x": rand(1, 2, 2, 4), "roi": None, "scales": Const(np.array(scales, np.float32))}, attrs)


# ---- the pass ------------------------------------------------------------------------------------------

def _graph_with_inputs(*shapes):
    graph = Graph()
    return graph, [graph.add_input(f"x{k}", TensorType("float32", s)) for k, s in enumerate(shapes)]


def _sum(graph, value):
    return add_op(graph, "ReduceSum", [value], {"keepdims": 0}).outputs[0]


def test_contributions_along_several_paths_add_up():
    graph, (x,) = _graph_with_inputs((3,))
    square = add_op(graph, "Mul", [x, x]).outputs[0]
    loss = _sum(graph, add_op(graph, "Add", [square, add_op(graph, "Exp", [x]).outputs[0]]).outputs[0])
    grads = differentiate(graph, loss, [x])
    graph.outputs = [grads["x0"]]
    data = rand(3)
    np.testing.assert_allclose(interpret(graph, {"x0": data})[grads["x0"].name], 2 * data + np.exp(data), rtol=1e-12)


def test_a_parameter_the_loss_does_not_use_gets_zeros_and_no_backward_nodes():
    graph, (x, unused) = _graph_with_inputs((2, 3), (4,))
    side = add_op(graph, "Exp", [unused]).outputs[0]
    loss = _sum(graph, add_op(graph, "Tanh", [x]).outputs[0])
    graph.outputs = [loss, side]
    before = [n.op_type for n in graph.nodes]
    grads = differentiate(graph, loss, [x, unused])
    graph.outputs = [grads["x1"]]
    assert interpret(graph, {"x0": rand(2, 3), "x1": rand(4)})[grads["x1"].name].tolist() == [0.0] * 4
    backward = [n.op_type for n in graph.nodes[len(before):]]
    assert "Exp" not in backward and grads["x1"].type == unused.type


def test_non_float_inputs_and_nodes_off_the_path_need_no_rule():
    graph, (x,) = _graph_with_inputs((2, 3))
    # ArgMax (no rule, integer output) and TopK's indices only feed the side output.
    side = add_op(graph, "ArgMax", [x], {"axis": 1}).outputs[0]
    loss = _sum(graph, add_op(graph, "Sigmoid", [x]).outputs[0])
    graph.outputs = [loss, side]
    grads = differentiate(graph, loss, [x])
    assert grads["x0"].type == x.type


def test_missing_rules_are_listed_all_at_once():
    graph, (x,) = _graph_with_inputs((1, 1, 2, 2))
    a = add_op(graph, "Sin", [x]).outputs[0]
    b = add_op(graph, "Cos", [a]).outputs[0]
    c = add_op(graph, "Resize", [b, None, graph.add_constant("s", np.array([1, 1, 2, 2], np.float32))],
               {"mode": "linear"}).outputs[0]
    d = add_op(graph, "Sin", [c]).outputs[0]
    loss = _sum(graph, add_op(graph, "Reshape", [d, graph.add_constant("shape", np.array([-1]))]).outputs[0])
    nodes = list(graph.nodes)
    with pytest.raises(MissingGradientError) as caught:
        differentiate(graph, loss, [x])
    assert caught.value.ops == ["Cos", "Resize", "Sin"]
    assert "3 op type(s)" in str(caught.value) and "mode 'linear'" in str(caught.value)
    assert graph.nodes == nodes


def test_the_loss_must_be_a_scalar():
    graph, (x,) = _graph_with_inputs((2,))
    with pytest.raises(ValueError, match="one-element"):
        differentiate(graph, add_op(graph, "Exp", [x]).outputs[0], [x])


# ---- convolution, pooling, normalization ---------------------------------------------------------------

def _needs(op):
    """Skip while ir/grad_ops.REFERENCE lacks `op` (helper B's gradient ops land in a separate branch)."""
    return pytest.mark.skipif(op not in REFERENCE, reason=f"ir/grad_ops.REFERENCE has no {op} yet (gradient ops branch)")


CONV_CASES = [
    ("plain", (1, 2, 5, 5), (3, 2, 3, 3), {}),
    ("stride-pads", (2, 2, 6, 5), (2, 2, 3, 2), {"strides": [2, 2], "pads": [1, 0, 1, 1]}),
    ("dilation", (1, 2, 7, 6), (2, 2, 2, 2), {"dilations": [2, 3], "strides": [1, 2]}),
    ("groups", (1, 4, 5, 5), (6, 2, 3, 3), {"group": 2, "pads": [1, 1, 1, 1]}),
    ("depthwise", (2, 3, 6, 6), (3, 1, 3, 3), {"group": 3, "strides": [2, 2], "pads": [1, 1, 1, 1]}),
    ("same-upper", (1, 2, 5, 6), (2, 2, 3, 3), {"auto_pad": "SAME_UPPER", "strides": [2, 2]}),
    ("1d", (2, 2, 7), (3, 2, 3), {"strides": [2], "pads": [1, 2]}),
]


@pytest.mark.parametrize("name,x,w,attrs", CONV_CASES, ids=[c[0] for c in CONV_CASES])
def test_conv_data_gradient(name, x, w, attrs):
    check_gradients("Conv", {"x": rand(*x), "w": Const(rand(*w, seed=1).astype(np.float32))}, attrs)


@_needs("ConvGradFilter")
@pytest.mark.parametrize("name,x,w,attrs", CONV_CASES, ids=[c[0] for c in CONV_CASES])
def test_conv_all_gradients(name, x, w, attrs):
    check_gradients("Conv", {"x": rand(*x), "w": rand(*w, seed=1), "b": rand(w[0], seed=2)}, attrs)


CONV_TRANSPOSE_CASES = [
    ("plain", (1, 3, 3, 3), (3, 2, 3, 3), {}),
    ("stride-pads-outpad", (2, 2, 3, 4), (2, 3, 3, 2), {"strides": [2, 2], "pads": [1, 0, 0, 1], "output_padding": [1, 0]}),
    ("groups-dilation", (1, 4, 3, 3), (4, 1, 2, 2), {"group": 2, "dilations": [2, 1]}),
    ("output-shape", (1, 2, 3, 3), (2, 2, 3, 3), {"strides": [2, 2], "output_shape": [6, 6]}),
]


@pytest.mark.parametrize("name,x,w,attrs", CONV_TRANSPOSE_CASES, ids=[c[0] for c in CONV_TRANSPOSE_CASES])
def test_conv_transpose_data_gradient(name, x, w, attrs):
    check_gradients("ConvTranspose", {"x": rand(*x), "w": Const(rand(*w, seed=1).astype(np.float32))}, attrs)


@_needs("ConvGradFilter")
@pytest.mark.parametrize("name,x,w,attrs", CONV_TRANSPOSE_CASES, ids=[c[0] for c in CONV_TRANSPOSE_CASES])
def test_conv_transpose_all_gradients(name, x, w, attrs):
    out_channels = w[1] * attrs.get("group", 1)
    check_gradients("ConvTranspose", {"x": rand(*x), "w": rand(*w, seed=1), "b": rand(out_channels, seed=2)}, attrs)


POOL_CASES = [
    ("plain", {"kernel_shape": [2, 2], "strides": [2, 2]}),
    ("overlap-pads", {"kernel_shape": [3, 3], "strides": [2, 1], "pads": [1, 1, 1, 0]}),
    ("ceil", {"kernel_shape": [2, 3], "strides": [2, 2], "ceil_mode": 1}),
    ("same-upper", {"kernel_shape": [3, 2], "strides": [2, 2], "auto_pad": "SAME_UPPER"}),
]


@_needs("MaxPoolGrad")
@pytest.mark.parametrize("name,attrs", POOL_CASES, ids=[c[0] for c in POOL_CASES])
def test_max_pool(name, attrs):
    check_gradients("MaxPool", {"x": rand(1, 2, 5, 5)}, attrs)


@_needs("AveragePoolGrad")
@pytest.mark.parametrize("include_pad", [0, 1])
@pytest.mark.parametrize("name,attrs", POOL_CASES, ids=[c[0] for c in POOL_CASES])
def test_average_pool(name, attrs, include_pad):
    check_gradients("AveragePool", {"x": rand(1, 2, 5, 5)}, {**attrs, "count_include_pad": include_pad})


def test_global_average_pool():
    check_gradients("GlobalAveragePool", {"x": rand(2, 3, 4, 3)})


@_needs("MaxPoolGrad")
def test_global_max_pool():
    check_gradients("GlobalMaxPool", {"x": rand(2, 3, 4, 3)})


@pytest.mark.parametrize("axis,scale_shape", [(-1, (5,)), (1, (3, 5)), (2, (1, 5))])
def test_layer_normalization(axis, scale_shape):
    check_gradients("LayerNormalization", {"x": rand(2, 3, 5), "scale": rand(*scale_shape, seed=1), "b": rand(5, seed=2)},
                    {"axis": axis, "epsilon": 1e-3})
    check_gradients("LayerNormalization", {"x": rand(2, 3, 5), "scale": rand(*scale_shape, seed=1)}, {"axis": axis})


@pytest.mark.parametrize("shape", [(2, 3, 4, 2), (4, 3)])
def test_batch_normalization_with_frozen_statistics(shape):
    channels = shape[1]
    check_gradients("BatchNormalization", {
        "x": rand(*shape), "scale": rand(channels, seed=1), "b": rand(channels, seed=2),
        "mean": Const(rand(channels, seed=3).astype(np.float32)),
        "var": Const(rand(channels, seed=4, low=0.5, high=2.0).astype(np.float32))}, {"epsilon": 1e-3})


@pytest.mark.parametrize("size", [3, 4])
def test_local_response_normalization(size):
    check_gradients("LRN", {"x": rand(2, 5, 2, 2)}, {"size": size, "alpha": 0.3, "beta": 0.75, "bias": 1.5})


def test_dropout_in_inference_form_passes_the_gradient():
    check_gradients("Dropout", {"x": rand(2, 3), "ratio": Const(np.array(0.5, np.float32))}, num_outputs=1)
    check_gradients("Dropout", {"x": rand(2, 3), "ratio": None, "training": Const(np.array(False))}, num_outputs=2)


# ---- whole blocks ----------------------------------------------------------------------------------------

def _attention_block():
    """x [2, 4, 6] -> LayerNorm -> single-head attention -> residual -> Gelu MLP -> mean: the loss.
    Parameters are graph inputs; returns (graph, loss, parameters, feeds in float64)."""
    rng = np.random.default_rng(11)
    shapes = {"x": (2, 4, 6), "ln_scale": (6,), "ln_bias": (6,), "wq": (6, 6), "wk": (6, 6), "wv": (6, 6),
              "w1": (6, 8), "b1": (8,), "w2": (8, 6)}
    graph = Graph()
    v = {name: graph.add_input(name, TensorType("float32", shape)) for name, shape in shapes.items()}

    def op(op_type, *inputs, **attrs):
        return add_op(graph, op_type, list(inputs), attrs).outputs[0]

    def const(array):
        return graph.add_constant("c", np.asarray(array))

    h = op("LayerNormalization", v["x"], v["ln_scale"], v["ln_bias"], axis=-1)
    q, k, val = (op("MatMul", h, v[w]) for w in ("wq", "wk", "wv"))
    heads = const(np.array([2, 4, 2, 3]))
    q = op("Transpose", op("Reshape", q, heads), perm=[0, 2, 1, 3])
    k = op("Transpose", op("Reshape", k, heads), perm=[0, 2, 3, 1])
    val = op("Transpose", op("Reshape", val, heads), perm=[0, 2, 1, 3])
    scores = op("Softmax", op("Div", op("MatMul", q, k), const(np.array(3.0 ** 0.5, np.float32))), axis=-1)
    attended = op("Reshape", op("Transpose", op("MatMul", scores, val), perm=[0, 2, 1, 3]), const(np.array([2, 4, 6])))
    r = op("Add", v["x"], attended)
    mlp = op("MatMul", op("Gelu", op("Add", op("MatMul", r, v["w1"]), v["b1"])), v["w2"])
    first, _ = add_op(graph, "Split", [op("Add", r, mlp), const(np.array([1, 3]))], {"axis": 1}, num_outputs=2).outputs
    loss = op("ReduceMean", op("Mul", first, first), keepdims=0)
    feeds = {name: rng.standard_normal(shape) * 0.5 for name, shape in shapes.items()}
    return graph, loss, list(v.values()), feeds


def test_attention_block_gradients_match_directional_finite_differences():
    graph, loss, params, feeds = _attention_block()
    grads = differentiate(graph, loss, params)
    graph.outputs = [loss, *grads.values()]
    got = interpret(graph, feeds)
    rng = np.random.default_rng(5)
    for name in feeds:
        direction = rng.standard_normal(feeds[name].shape)
        values = [interpret(graph, {**feeds, name: feeds[name] + sign * 1e-6 * direction})[loss.name] for sign in (1, -1)]
        expected = (values[0] - values[1]) / 2e-6
        assert np.sum(got[grads[name].name] * direction) == pytest.approx(expected, rel=1e-5, abs=1e-8), name


def test_the_backward_graph_is_valid_onnx_that_onnxruntime_runs_alike():
    import onnx
    from tessel import ir
    from tests.conftest import run_onnxruntime

    graph, loss, params, feeds = _attention_block()
    grads = differentiate(graph, loss, params)
    graph.outputs = [loss, *grads.values()]
    exported = ir.to_onnx(graph)
    onnx.checker.check_model(exported, full_check=True)
    feeds32 = {name: a.astype(np.float32) for name, a in feeds.items()}
    expected = interpret(graph, feeds)
    for value, have in zip(graph.outputs, run_onnxruntime(exported, feeds32)):
        np.testing.assert_allclose(have, expected[value.name], rtol=2e-4, atol=1e-5, err_msg=value.name)


@_needs("ConvGradFilter")
@_needs("MaxPoolGrad")
def test_small_cnn_gradients_match_directional_finite_differences():
    rng = np.random.default_rng(12)
    shapes = {"x": (2, 2, 6, 6), "w1": (4, 2, 3, 3), "b1": (4,), "bn_scale": (4,), "bn_bias": (4,),
              "dw": (4, 1, 3, 3), "fc": (3, 4), "fc_b": (3,)}
    graph = Graph()
    v = {name: graph.add_input(name, TensorType("float32", shape)) for name, shape in shapes.items()}

    def op(op_type, *inputs, **attrs):
        return add_op(graph, op_type, list(inputs), attrs).outputs[0]

    stats = [graph.add_constant(n, a.astype(np.float32)) for n, a in (("mean", rng.standard_normal(4)),
                                                                        ("var", rng.uniform(0.5, 2, 4)))]
    h = op("Conv", v["x"], v["w1"], v["b1"], pads=[1, 1, 1, 1])
    h = op("Relu", op("BatchNormalization", h, v["bn_scale"], v["bn_bias"], *stats))
    h = op("MaxPool", h, kernel_shape=[2, 2], strides=[2, 2])
    h = op("Conv", h, v["dw"], group=4, pads=[1, 1, 1, 1], strides=[2, 2])
    h = op("Flatten", op("GlobalAveragePool", h))
    logits = op("Gemm", h, v["fc"], v["fc_b"], transB=1)
    loss = op("ReduceSum", op("Mul", op("LogSoftmax", logits), graph.add_constant("t", np.eye(3)[[0, 2]].astype(np.float32))),
              keepdims=0)
    grads = differentiate(graph, loss, list(v.values()))
    graph.outputs = [loss, *grads.values()]
    feeds = {name: rng.standard_normal(shape) for name, shape in shapes.items()}
    got = interpret(graph, feeds)
    for name in feeds:
        direction = rng.standard_normal(feeds[name].shape)
        values = [interpret(graph, {**feeds, name: feeds[name] + sign * 1e-6 * direction})[loss.name] for sign in (1, -1)]
        assert np.sum(got[grads[name].name] * direction) == pytest.approx((values[0] - values[1]) / 2e-6, rel=1e-5), name


def _gelu_mlp_plan():
    """Memory plan of x -> MatMul -> Gelu -> MatMul -> mean square, differentiated and fused, and its kernels."""
    from tessel.passes.fuse import fuse
    from tessel.passes.graph_memory import plan_graph_memory

    graph = Graph()
    x = graph.add_input("x", TensorType("float32", (64, 4)))
    w1 = graph.add_input("w1", TensorType("float32", (4, 64)))
    w2 = graph.add_input("w2", TensorType("float32", (64, 4)))
    hidden = add_op(graph, "Gelu", [add_op(graph, "MatMul", [x, w1]).outputs[0]]).outputs[0]
    y = add_op(graph, "MatMul", [hidden, w2]).outputs[0]
    loss = add_op(graph, "ReduceMean", [add_op(graph, "Mul", [y, y]).outputs[0]], {"keepdims": 0}).outputs[0]
    grads = differentiate(graph, loss, [w1, w2])
    graph.outputs = [loss, *grads.values()]
    fuse(graph)
    return plan_graph_memory(graph), len(graph.nodes)


def test_gelu_derivative_fuses_into_one_kernel_and_allocates_less(monkeypatch):
    """Written with x read twice (Phi(x) + x phi(x)), the derivative fused into two kernels, the first one's
    result an extra activation-sized buffer; written on u = x / sqrt(2) alone it is one kernel."""
    from tessel.passes import gradients
    from tessel.passes.gradients.builder import Rule
    from tessel.passes.gradients.elementwise import _unary

    def two_groups(b, node, x, y):
        half, one = b.scalar(0.5, x), b.scalar(1.0, x)
        cdf = b.mul(half, b.add(one, b.op("Erf", [b.mul(x, b.scalar(2 ** -0.5, x))])))
        pdf = b.mul(b.scalar((2 * np.pi) ** -0.5, x), b.op("Exp", [b.mul(b.scalar(-0.5, x), b.mul(x, x))]))
        return b.add(cdf, b.mul(x, pdf))

    plan, kernels = _gelu_mlp_plan()
    monkeypatch.setitem(gradients.GRADIENT_RULES, "Gelu", Rule(_unary(two_groups)))
    old_plan, old_kernels = _gelu_mlp_plan()
    assert kernels == old_kernels - 1
    assert old_plan.no_reuse_bytes - plan.no_reuse_bytes == 64 * 64 * 4
    assert plan.arena_bytes <= old_plan.arena_bytes


@pytest.mark.parametrize("shape", [(3, 2, 2, 2), (5, 3)])
def test_batch_statistics(shape):
    """Training-mode BatchNormalization's statistics: the closed-form gradient of the mean and the variance."""
    check_gradients("BatchStats", {"x": rand(*shape)}, num_outputs=2, domain=TESSEL_DOMAIN)
