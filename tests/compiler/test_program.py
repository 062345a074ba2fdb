"""compiler/program.py: Tessel-domain ops that have a TVM lowering become kernel calls."""
from __future__ import annotations

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
