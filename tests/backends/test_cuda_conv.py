"""The CUDA implicit-GEMM conv (backends/cuda/conv.py): its arithmetic checked on the CPU (the unscheduled kernel
computes the same values as the GPU schedule of it), its schedule compiled for CUDA, its configurations."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from tessel.backends.cuda import conv as cuda_conv
from tessel.backends.cuda.conv import ConvShape, GemmConfig, chosen_config, conv_gemm, heuristic_config
from tessel.backends.lowering.context import LowerContext
from tessel.backends.tvm_env import tvm
from tessel.ir.types import TensorType

SHAPES = {  # (batch, channels, height, width, out channels, kernel, stride, dilation, pads top/left/bottom/right)
    "7x7_stride2": (1, 3, 20, 20, 16, (7, 7), 2, 1, (3, 3, 3, 3)),
    "3x3_odd_sizes": (2, 5, 9, 11, 7, (3, 3), 1, 1, (1, 1, 1, 1)),
    "1x1": (1, 16, 7, 7, 33, (1, 1), 1, 1, (0, 0, 0, 0)),
    "dilated_uneven_pads": (1, 8, 10, 10, 8, (3, 3), 2, 2, (0, 1, 2, 1)),
    "3x1": (2, 4, 9, 9, 8, (3, 1), 1, 1, (1, 0, 1, 0)),
}
CONFIGS = [GemmConfig(64, 64, 16, 4, 4, 1), GemmConfig(32, 32, 16, 2, 2, 2), GemmConfig(128, 128, 8, 8, 8, 4)]


def _conv(shape, config: GemmConfig, with_relu: bool = False):
    """(PrimFunc inputs + output tensors, the SelfScheduled result, output type) of a conv + bias."""
    mod = tvm()
    te = mod.te
    batch, channels, height, width, out_channels, (kh, kw), stride, dilation, pads = shape
    x_type = TensorType("float32", (batch, channels, height, width))
    w_type = TensorType("float32", (out_channels, channels, kh, kw))
    b_type = TensorType("float32", (out_channels,))
    spec = ConvShape(batch, channels, height, width, out_channels, (kh, kw), (stride, stride), (dilation, dilation), pads)
    out_type = TensorType("float32", (batch, out_channels, *spec.out_size))
    placeholders = [te.placeholder(t.shape, t.dtype, name=n) for t, n in zip((x_type, w_type, b_type), "xwb")]
    ctx = LowerContext("Conv", {"strides": (stride, stride), "dilations": (dilation, dilation), "pads": pads},
                       placeholders, [x_type, w_type, b_type], [None] * 3, [out_type], gpu=True, arch="sm_90")
    result = conv_gemm(ctx, list(pads[:2]), list(pads[2:]), config)
    out = result.outputs[0]
    if with_relu:
        out = te.compute(out.shape, lambda *i: mod.tirx.max(out(*i), mod.tirx.const(0.0, "float32")), name="relu")
    return placeholders + [out], result, out_type


def _reference(x, w, b, stride, dilation, pads):
    torch = pytest.importorskip("torch")
    padded = torch.nn.functional.pad(torch.from_numpy(x).double(), (pads[1], pads[3], pads[0], pads[2]))
    return torch.nn.functional.conv2d(padded, torch.from_numpy(w).double(), torch.from_numpy(b).double(),
                                      stride=stride, dilation=dilation).numpy()


@pytest.mark.parametrize("name,config", [(name, CONFIGS[k % len(CONFIGS)]) for k, name in enumerate(SHAPES)],
                         ids=lambda v: v if isinstance(v, str) else f"{v.bm}x{v.bn}x{v.bk}_split{v.split_k}")
def test_implicit_gemm_computes_the_conv(name, config):
    mod = tvm()
    tensors, _, out_type = _conv(SHAPES[name], config)
    executable = mod.compile(mod.te.create_prim_func(tensors), target="llvm")
    rng = np.random.default_rng(0)
    x, w, b = (rng.standard_normal([int(d) for d in t.shape]).astype(np.float32) for t in tensors[:3])
    out = mod.runtime.tensor(np.zeros(out_type.shape, np.float32))
    executable["main"](*(mod.runtime.tensor(a) for a in (x, w, b)), out)
    _, _, _, _, _, _, stride, dilation, pads = SHAPES[name]
    np.testing.assert_allclose(out.numpy(), _reference(x, w, b, stride, dilation, pads), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("shape,split_k,kernels", [
    ((1, 8, 8, 8, 32, (3, 3), 1, 1, (1, 1, 1, 1)), 1, 1),  # M 32, N 64: whole tiles, the epilogue in the GEMM
    (SHAPES["3x3_odd_sizes"], 1, 2),  # padded tiles: a second kernel over the real outputs runs the epilogue
    (SHAPES["3x3_odd_sizes"], 4, 2),  # split K: the second kernel sums the partial products
])
def test_schedule_compiles_to_cuda_with_the_epilogue_folded_in(shape, split_k, kernels):
    from tessel.backends.target import TargetSpec, tvm_target

    mod = tvm()
    tensors, result, _ = _conv(shape, GemmConfig(32, 32, 16, 2, 2, split_k), with_relu=True)
    sch = mod.s_tir.Schedule(mod.te.create_prim_func(tensors))
    result.schedule(sch)
    target = TargetSpec("cuda", "sm_90")
    with tvm_target(target):
        executable = mod.compile(mod.IRModule({"main": sch.mod["main"]}), target=tvm_target(target))
    source = next(m for m in executable.mod.imports if m.kind == "cuda").inspect_source()
    # Each kernel appears twice: its declaration and its definition.
    assert source.count("__global__") == 2 * kernels
    assert "__shared__" in source
    assert "max(" in source  # the ReLU runs where the result is written, not in a kernel of its own


def test_heuristic_fills_the_gpu():
    small = heuristic_config(512, 49, 4608)  # ResNet-18's last stage at batch 1: few tiles, a long K
    assert small.split_k > 1 and small.threads <= 1024
    big = heuristic_config(64, 200704, 147)  # its first conv at batch 16: tiles enough
    assert big.split_k == 1 and big.bn == 128
    for m, n, k in [(16, 12, 27), (1, 1, 1), (1024, 3, 9)]:
        config = heuristic_config(m, n, k)
        assert config.threads <= 1024 and config.bm % config.tm == 0 and config.bn % config.tn == 0


def test_chosen_config_reads_the_timed_table(tmp_path, monkeypatch):
    shape = ConvShape(1, 64, 56, 56, 64, (3, 3), (1, 1), (1, 1), (1, 1, 1, 1))
    table = tmp_path / "conv_configs.json"
    table.write_text(json.dumps({"archs": {"sm_90": {shape.key(): {"config": GemmConfig(64, 128, 8, 4, 8, 2).to_json()}}}}))
    monkeypatch.setattr(cuda_conv, "TUNED_CONFIGS", table)
    cuda_conv._tuned.cache_clear()
    try:
        assert chosen_config(shape, "sm_90") == (GemmConfig(64, 128, 8, 4, 8, 2), True)
        assert chosen_config(shape, "sm_80") == (heuristic_config(*shape.gemm), False)
    finally:
        cuda_conv._tuned.cache_clear()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_fused_conv_add_relu_is_one_gpu_kernel(tmp_path):
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from tessel.compiler.api import compile

    rng = np.random.default_rng(0)
    weight = numpy_helper.from_array(rng.standard_normal((32, 4, 3, 3)).astype(np.float32), "w")
    bias = numpy_helper.from_array(rng.standard_normal(32).astype(np.float32), "b")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
         helper.make_node("Add", ["c", "r"], ["s"]), helper.make_node("Relu", ["s"], ["y"])],
        "conv_add_relu", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8, 8]),
                          helper.make_tensor_value_info("r", TensorProto.FLOAT, [1, 32, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 32, 8, 8])], [weight, bias])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = tmp_path / "conv_add_relu.onnx"
    onnx.save(model, path)
    artifact = compile(path, target="cuda:sm_90", cache_dir=tmp_path / "cache")
    (library,) = sorted((artifact.directory / "kernels").glob("*.so"))
    source = library.with_suffix(".cu").read_text()
    # M 32 and N 64 fill whole tiles: the add and the ReLU run in the GEMM kernel, the only one.
    assert source.count("__global__") == 2 and "__shared__" in source


def test_double_buffered_schedule_doubles_the_shared_tiles():
    from tessel.backends.target import TargetSpec, tvm_target

    mod = tvm()
    sources = []
    for stages in (1, 2):
        tensors, result, _ = _conv((1, 8, 8, 8, 32, (3, 3), 1, 1, (1, 1, 1, 1)), GemmConfig(32, 32, 16, 2, 2, 1, stages))
        sch = mod.s_tir.Schedule(mod.te.create_prim_func(tensors))
        result.schedule(sch)
        target = TargetSpec("cuda", "sm_90")
        with tvm_target(target):
            executable = mod.compile(mod.IRModule({"main": sch.mod["main"]}), target=tvm_target(target))
        sources.append(next(m for m in executable.mod.imports if m.kind == "cuda").inspect_source())
    # 32x16 weights and 16x32 columns: 512 floats each, twice that with a second buffer.
    assert "conv_columns_shared_ptr[512]" in sources[0] and "conv_columns_shared_ptr[1024]" in sources[1]
