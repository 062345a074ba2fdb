"""Inputs already on a GPU (runtime/device_inputs.py): recognised by their DLPack device, refused by a CPU artifact
in one line. The copy into a cuda artifact's arena runs on the GPU (bench/gpu_check.py times it)."""
from __future__ import annotations

import numpy as np
import pytest

from tessel.runtime.device_inputs import on_gpu, shape_and_dtype
from tessel.runtime.errors import InputError


class _CudaTensor:
    """Stands for a tensor in GPU memory: only its DLPack device is asked."""

    def __dlpack_device__(self):
        return (2, 0)  # kDLCUDA, GPU 0


def test_only_device_memory_counts_as_on_a_gpu():
    assert on_gpu(_CudaTensor())
    assert not on_gpu(np.zeros(3)) and not on_gpu([1.0, 2.0])
    assert shape_and_dtype([[1.0, 2.0]]) == ((1, 2), np.dtype("float64"))


def test_a_cpu_artifact_refuses_an_input_on_a_gpu_in_one_line(tmp_path, kernel_cache):
    import onnx
    from onnx import TensorProto, helper

    from tessel.compiler.api import compile
    from tessel.runtime.executor import Executor

    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "relu",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    path = tmp_path / "relu.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    artifact = compile(path, cache_dir=kernel_cache)  # its temporary folder lives as long as it does
    executor = Executor(artifact.directory)
    with pytest.raises(InputError, match="input 'x' is on a GPU; this artifact runs on the CPU"):
        executor.run({"x": _CudaTensor()})
    np.testing.assert_array_equal(executor.run({"x": -np.ones((2, 3), np.float32)})["y"], np.zeros((2, 3)))
