"""compiler/program.py: Tessel-domain ops that have a TVM lowering become kernel calls."""
from __future__ import annotations

import numpy as np

from tessel.backends.target import parse_target
from tessel.compiler.program import build_program
from tessel.ir.graph import Graph
from tessel.ir.types import TensorType
from tessel.passes.optimizer_update import AdamWRule, add_updates
from tessel.runtime.instructions import KernelCall


def test_update_ops_are_kernel_calls():
    graph = Graph()
    params = {}
    for name, shape in {"w": (4, 3), "b": (4,)}.items():
        param = graph.add_input(name, TensorType("float32", shape))
        params[name] = (param, graph.add_input(f"{name}.grad", TensorType("float32", shape)))
    updates = add_updates(graph, AdamWRule(), params)
    graph.outputs = list(updates.next_values.values())
    program = build_program(graph, parse_target("llvm"))
    assert program.unsupported == []
    calls = [i for i in program.instructions if isinstance(i, KernelCall)]
    assert [len(c.outputs) for c in calls] == [3, 3]
    assert {spec.op_type for spec in program.kernels.values()} == {"AdamWUpdate"}


def test_only_kernels_taking_a_model_input_or_output_assume_less_alignment():
    """Kernels reading a model input, or writing or reading a model output (or a view of either), assume 16-byte
    alignment of it (numpy's own); every other kernel's spec, and so its cache key, is what it was."""
    from tessel.backends.kernel import ARG_ALIGNMENT
    from tessel.compiler.program import ProgramBuilder

    t, flat_t = TensorType("float32", (4, 8)), TensorType("float32", (32,))
    graph = Graph()
    x = graph.add_input("x", t)
    h = graph.add_node("Relu", [x], {}, [t], name="Relu_0").outputs[0]
    s = graph.add_node("Sigmoid", [h], {}, [t], name="Sigmoid_0").outputs[0]
    y = graph.add_node("Add", [s, s], {}, [t], name="Add_0").outputs[0]
    shape = graph.add_constant("shape", np.array([32], np.int64))
    flat = graph.add_node("Reshape", [y, shape], {}, [flat_t], name="Reshape_0").outputs[0]
    z = graph.add_node("Neg", [y], {}, [t], name="Neg_0").outputs[0]
    graph.outputs = [flat, z]
    target = parse_target("llvm")
    program = build_program(graph, target)
    calls = {i.node: i for i in program.instructions if isinstance(i, KernelCall)}
    alignment = {node: dict(program.kernels[call.kernel].attrs).get(ARG_ALIGNMENT) for node, call in calls.items()}
    # y is an output through the Reshape: Add writes it and Neg reads it in the output array.
    assert alignment == {"Relu_0": (16, 64), "Sigmoid_0": None, "Add_0": (64, 64, 16), "Neg_0": (16, 16)}
    unmarked = ProgramBuilder(target)  # no inputs or outputs known: no kernel marked
    unmarked.write(x)
    plain = {i.node: i.kernel for i in unmarked.instructions(graph) if isinstance(i, KernelCall)}
    assert plain["Sigmoid_0"] == calls["Sigmoid_0"].kernel and plain["Relu_0"] != calls["Relu_0"].kernel
