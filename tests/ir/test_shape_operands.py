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


def test_inputs_read_inside_an_if_branch_that_computes_a_shape_are_found():
    branch = lambda name: helper.make_graph(  # noqa: E731
        [helper.make_node("Identity", ["n"], [name])], name, [], [helper.make_tensor_value_info(name, I64, [2])])
    nodes = [helper.make_node("If", ["c"], ["target"], then_branch=branch("t"), else_branch=branch("e")),
             helper.make_node("Reshape", ["x", "target"], ["y"])]
    m = model(nodes, [("x", F, [6]), ("c", 9, []), ("n", I64, [2])], [("y", F, None)])
    assert shape_deciding_inputs(m) == {"c": ["Reshape '#1' shape"], "n": ["Reshape '#1' shape"]}
