"""The charts a compile writes into reports/, and matplotlib staying out of `import tessel` and the CLI's start."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from tessel.compiler.api import compile
from tests.compiler.chart_checks import assert_chart


def _tiny_model():
    """x → Relu → MatMul(w) → Sigmoid: two devices' worth of work at batch 4."""
    w = numpy_helper.from_array(np.full((8, 8), 0.1, np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["r"], name="relu"), helper.make_node("MatMul", ["r", "w"], ["m"], name="mm"),
         helper.make_node("Sigmoid", ["m"], ["y"], name="sig")],
        "tiny", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_two_device_compile_writes_gantt_and_memory_charts_as_png_and_svg(kernel_cache):
    artifact = compile(_tiny_model(), devices=2, placement="pipeline", microbatches=2, profile=False,
                       cache_dir=kernel_cache)
    reports = artifact.directory / "reports"
    assert_chart([reports / "placement_gantt.png", reports / "placement_gantt.svg"],
                 ["tiny: pipeline placement on 2 devices, 2 micro-batches", "device 0", "device 1", "micro-batch 1",
                  "node times estimated"])
    assert_chart([reports / "memory_timeline.png", reports / "memory_timeline.svg"],
                 ["device 0", "device 1", "live bytes (KiB)", "lower bound"], min_height=400)


def test_importing_tessel_its_cli_and_the_chart_modules_leaves_matplotlib_unloaded():
    code = ("import sys, tessel, tessel.compiler.cli\n"
            "from tessel.compiler.plots import algo_selection, gantt, memory_timeline, placement_alternatives\n"
            "print('matplotlib' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
