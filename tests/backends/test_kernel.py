"""Kernel specs, the cache key, and lowering against the ONNX operator tests."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper
from onnx.backend.test.case.node import collect_testcases

from tessel.backends.kernel import ARG, BACKEND_ROOT, DATA, KernelInput, KernelSpec, backend_sources
from tessel.backends.lowering import RULES
from tessel.backends.target import TargetError, TargetSpec, parse_target
from tessel.compiler.api import compile

CASES = {c.name: c for c in collect_testcases()}

# ONNX node tests that exercise each lowering family (each runs compile → run and is compared
# with the test's expected outputs).
NODE_TESTS = [
    "test_add_bcast", "test_sub", "test_mul_bcast", "test_div", "test_pow", 
    "test_relu", "test_sigmoid", "test_tanh", "test_exp", "test_log", "test_sqrt", "test_erf", "test_leakyrelu",
    "test_hardsigmoid", "test_hardswish", "test_gelu_tanh_1", "test_prelu_broadcast", "test_clip", "test_where_example",
    "test_equal", "test_max_example", "test_mean_example", "test_sum_example",
    "test_transpose_all_permutations_3", "test_concat_3d_axis_1", "test_split_equal_parts_1d_opset18", "test_slice",
    "test_slice_neg_steps", "test_gather_negative_indices", "test_gather_elements_0", "test_expand_dim_changed",
    "test_tile", "test_constantofshape_float_ones", "test_reflect_pad", "test_edge_pad", "test_constant_pad",
    "test_resize_downsample_scales_linear", "test_resize_upsample_scales_nearest", "test_depthtospace_crd_mode_example",
    "test_reduce_mean_default_axes_keepdims_example", "test_reduce_sum_keepdims_example", "test_reduce_max_do_not_keepdims_example",
    "test_reduce_l2_keep_dims_example", "test_reduce_log_sum_exp_keepdims_example", "test_argmax_keepdims_example",
    "test_softmax_axis_0", "test_logsoftmax_axis_1", "test_conv_with_strides_and_asymmetric_padding",
    "test_conv_with_autopad_same", "test_convtranspose", "test_convtranspose_pads", "test_maxpool_2d_pads",
    "test_maxpool_2d_ceil", "test_averagepool_2d_pads_count_include_pad", "test_globalaveragepool", "test_globalmaxpool",
    "test_lrn", "test_batchnorm_example", "test_instancenorm_example", "test_layer_normalization_3d_axis1_epsilon",
    "test_matmul_3d", "test_matmul_2d", "test_gemm_all_attributes", "test_gemm_transposeB", "test_lstm_defaults",
    "test_lstm_with_initial_bias", "test_gru_defaults", "test_gru_seq_length", "test_gru_with_initial_bias",
]


@pytest.mark.parametrize("name", NODE_TESTS)
def test_onnx_node_test_through_the_backend(name, kernel_cache):
    case = CASES[name]
    inputs, expected = ([numpy_helper.to_array(a) if isinstance(a, onnx.TensorProto) else a for a in arrays]
                        for arrays in case.data_sets[0])
    model, feeds = _freeze_parameters(case.model, inputs)
    artifact = compile(model, input_shapes={k: v.shape for k, v in feeds.items()}, cache_dir=kernel_cache)
    outputs = artifact.run(feeds)
    for got, want in zip(outputs.values(), expected):
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-5)


def _freeze_parameters(model, inputs):
    """The node tests feed shape-carrying inputs (axes, pads, starts, scales) at run time; real
    models hold them as constants, which Tessel needs for static shapes. Make them initializers."""
    frozen = onnx.ModelProto()
    frozen.CopyFrom(model)
    graph = frozen.graph
    op = graph.node[0].op_type
    feeds = {}
    keep = []
    for position, (info, value) in enumerate(zip(list(graph.input), inputs)):
        parameter = (position > 0 or op == "ConstantOfShape") and (value.dtype == np.int64 or op == "Resize")
        if parameter:
            graph.initializer.append(numpy_helper.from_array(value, info.name))
        else:
            feeds[info.name] = value
            keep.append(info)
    del graph.input[:]
    graph.input.extend(keep)
    return frozen, feeds


def test_spec_json_round_trip_and_key():
    spec = KernelSpec(
        "Pad", (("mode", "reflect"),),
        (KernelInput("float32[1,3,4,4]", ARG), KernelInput("int64[8]", DATA, np.arange(8, dtype=np.int64)), None),
        ("float32[1,3,11,11]",),
    )
    again = KernelSpec.from_json(spec.to_json())
    assert again.to_json() == spec.to_json()
    assert spec.key(TargetSpec("llvm")) == again.key(TargetSpec("llvm"))
    assert spec.key(TargetSpec("llvm")) != spec.key(TargetSpec("cuda", "sm_80"))
    assert spec.arg_count == 1


def test_cache_keys_hash_every_backend_source_subpackages_included():
    hashed = {path.relative_to(BACKEND_ROOT).as_posix() for path in backend_sources()}
    assert {"kernel.py", "lowering/nn.py", "cpu/schedule.py", "cpu/winograd.py", "cuda/schedule.py"} <= hashed


def test_corpus_ops_all_have_rules():
    for op in ("Conv", "ConvTranspose", "LSTM", "GRU", "Resize", "LayerNormalization", "Gelu", "Softmax", "Where"):
        assert op in RULES


@pytest.mark.parametrize("text,expected", [("llvm", TargetSpec("llvm")), ("cuda:sm_80", TargetSpec("cuda", "sm_80"))])
def test_targets_parse(text, expected):
    assert parse_target(text) == expected


@pytest.mark.parametrize("text", ["cuda", "rocm", "cuda:80"])
def test_bad_targets_are_refused(text):
    with pytest.raises(TargetError):
        parse_target(text)


def test_a_kernel_assumes_the_alignment_its_spec_gives_each_argument():
    """ARG_ALIGNMENT relaxes TVM's 64-byte `llvm.assume` of the arguments it names (the others keep 64), and the op's
    lowering rule never sees it."""
    from tessel.backends.kernel import ARG_ALIGNMENT, arg_alignments
    from tessel.backends.lower import build, op_attrs

    plain = KernelSpec("Relu", (), (KernelInput("float32[4,64]", ARG),), ("float32[4,64]",))
    relaxed = KernelSpec("Relu", ((ARG_ALIGNMENT, (16, 64)),), plain.inputs, plain.outputs)
    assert arg_alignments(plain) is None and arg_alignments(relaxed) == (16, 64) and op_attrs(relaxed) == {}
    target = parse_target("llvm")
    assert relaxed.key(target) != plain.key(target)

    def assumed(spec):
        code = build(spec, target).mod.inspect_source("ll")
        return sorted({int(line.split("i64 ")[-1].split(")")[0]) for line in code.splitlines()
                       if "llvm.assume" in line and '"align"' in line})

    assert assumed(plain) == [64] and assumed(relaxed) == [16, 64]
