"""Which inputs decide shapes: by op and version, and traced back to the graph inputs."""
from __future__ import annotations

from onnx import helper

from tessel.ir.shape_operands import shape_deciding_inputs, shape_operand_positions
from tests.ir.helpers import F, I64, model


def test_positions_follow_the_op_version():
    assert shape_operand_positions("Resize", 10) == [1]  # Resize-10: X, scales
    assert shape_operand_positions("Resize", 13) == [1, 2, 3]  # roi, scales, sizes
    assert shape_operand_positions("ReduceSum", 11) == []  # axes was an attribute
    assert shape_operand_positions("Slice", 13) == [1, 2, 3, 4]
    assert shape_operand_positions("Relu", 13) == []


def test_inputs_are_traced_through_nodes_but_not_through_shape():
    nodes = [helper.make_node("Cast", ["k"], ["k64"], to=I64), helper.make_node("TopK", ["x", "k64"], ["v", "i"]),
             helper.make_node("Shape", ["z"], ["zs"]), helper.make_node("Reshape", ["x", "zs"], ["y"])]
    m = model(nodes, [("x", F, [6]), ("k", F, [1]), ("z", F, [2, 3])],
              [("v", F, None), ("i", I64, None), ("y", F, None)])
    assert shape_deciding_inputs(m) == {"k": ["TopK '#1' K"]}
