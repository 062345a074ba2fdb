"""The instruction program: JSON round trip, field checks, renaming, walking."""
from __future__ import annotations

import json

import pytest

from tessel.runtime.instructions import (AllReduce, Branch, Fail, Gather, If, KernelCall, Piece, ProgramFormatError,
                                         Recv, Scatter, Send, View, from_json, kernel_call_count, kernel_keys,
                                         program_from_json, program_to_json, sent_values, walk)

KERNEL = KernelCall("conv", "Conv", kernel="k1", inputs=("x", "w"), outputs=("y",), inplace=(("y", "x"),),
                    pieces=(Piece("k2", ("x", "w"), 0, 1, "direct", ("x", "y")),
                            Piece("k3", ("x", "w"), 1, 3, "winograd", ("x", "y"))), algorithm="direct")
BRANCHY = If("if", "If", condition="c", outputs=("o",),
             then_branch=Branch((KERNEL,), ("y",)),
             else_branch=Branch((Fail("never", "Unreachable", message="no way"),), ("y",)))
EVERY_KIND = [KERNEL, View("flat", "Flatten", input="y", output="f", init=True), BRANCHY,
              Send("s", "Send", tensor="f", peer=1, tag=3), Recv("r", "Recv", output="g", peer=1, tag=4),
              Scatter("sc", "Scatter", output="x@slice", root=0, parts=2, tag=1 << 20, source="x"),
              Gather("ga", "Gather", input="y@slice", root=0, parts=2, tag=1 << 21),
              AllReduce("ar", "AllReduce", tensor="grad", reduction="mean"), Fail("f", "Unreachable", message="m")]


@pytest.mark.parametrize("instruction", EVERY_KIND, ids=lambda i: i.KIND)
def test_every_kind_round_trips_through_json_text(instruction):
    text = json.dumps(program_to_json([instruction]))
    assert program_from_json(json.loads(text)) == [instruction]


def test_fields_at_their_defaults_are_left_out():
    assert View("v", "Reshape", input="a", output="b").to_json() == \
        {"kind": "view", "node": "v", "op": "Reshape", "input": "a", "output": "b"}


@pytest.mark.parametrize("doc, where, problem", [
    ([], "steps[3]", "must be an object"),
    ({"kind": "load_library", "node": "n", "op": "o"}, "steps[3].kind", "unknown instruction kind"),
    ({"kind": "view", "node": "n", "op": "o", "input": "a"}, "steps[3]", "missing field 'output'"),
    ({"kind": "view", "op": "o", "input": "a", "output": "b"}, "steps[3]", "missing field 'node'"),
    ({"kind": "kernel", "node": "n", "op": "o", "kernel": "k", "outputs": [], "inputs": [1]}, "steps[3].inputs[0]", "must be a string"),
    ({"kind": "kernel", "node": "n", "op": "o", "kernel": "k", "inputs": [], "outputs": [], "init": 1}, "steps[3].init", "must be a boolean"),
    ({"kind": "send", "node": "n", "op": "o", "tensor": "t", "tag": 0, "peer": True}, "steps[3].peer", "must be an integer"),
    ({"kind": "send", "node": "n", "op": "o", "tensor": "t", "peer": 1, "tag": 0, "to": 1}, "steps[3].to", "unknown field"),
    ({"kind": "kernel", "node": "n", "op": "o", "kernel": "k", "inputs": [], "outputs": [], "inplace": [["y"]]}, "steps[3].inplace[0]",
     "must be a list of 2"),
    ({"kind": "kernel", "node": "n", "op": "o", "kernel": "k", "inputs": [], "outputs": [], "pieces": [{"kernel": "k"}]}, "steps[3].pieces[0]",
     "missing field 'inputs'"),
    ({"kind": "if", "node": "n", "op": "o", "condition": "c", "outputs": [], "else_branch": {"instructions": [], "results": []},
      "then_branch": {"instructions": [{"kind": "?"}], "results": []}},
     "steps[3].then_branch.instructions[0].kind", "unknown instruction kind"),
    ({"kind": "all_reduce", "node": "n", "op": "o", "tensor": "t", "reduction": "product"}, "steps[3].reduction",
     "is not one of"),
], ids=["not-object", "unknown-kind", "missing-field", "missing-node", "bad-name", "bad-bool", "bool-as-int",
        "unknown-field", "short-pair", "short-piece", "nested", "bad-reduction"])
def test_malformed_json_names_the_field(doc, where, problem):
    with pytest.raises(ProgramFormatError) as caught:
        from_json(doc, "steps[3]")
    assert caught.value.where == where and problem in caught.value.message


def test_renaming_reaches_every_value_name_and_nothing_else():
    renamed = BRANCHY.renamed({"x": "x@slice", "y": "y@slice", "c": "cond"})
    call = renamed.then_branch.instructions[0]
    assert renamed.condition == "cond" and renamed.then_branch.results == ("y@slice",)
    assert call.inputs == ("x@slice", "w") and call.outputs == ("y@slice",) and call.inplace == (("y@slice", "x@slice"),)
    assert all(p.sliced == ("x@slice", "y@slice") and p.inputs == ("x@slice", "w") for p in call.pieces)
    assert call.kernel == "k1" and call.node == "conv"  # kernels and nodes are not values
    assert Scatter("s", "Scatter", output="a", root=0, parts=2, tag=0).renamed({"a": "b"}).source is None


def test_reads_and_writes():
    assert list(KERNEL.reads()) == [("inputs[0]", "x"), ("inputs[1]", "w"), ("pieces[0].inputs[0]", "x"),
                                    ("pieces[0].inputs[1]", "w"), ("pieces[1].inputs[0]", "x"),
                                    ("pieces[1].inputs[1]", "w")]
    root = Scatter("s", "Scatter", output="part", root=0, parts=2, tag=0, source="whole")
    assert list(root.reads()) == [("source", "whole")] and root.writes() == ("part",)
    assert list(Scatter("s", "Scatter", output="part", root=0, parts=2, tag=0).reads()) == []
    assert Gather("g", "Gather", input="part", root=0, parts=2, tag=0).writes() == ()
    assert AllReduce("a", "AllReduce", tensor="t").writes() == ("t",)


def test_walk_kernels_calls_and_sent_values():
    program = [BRANCHY, KERNEL, *EVERY_KIND[3:8]]
    assert [i.node for i in walk([BRANCHY])] == ["if", "conv", "never"]
    assert list(kernel_keys(program)) == ["k1", "k2", "k3"] * 2
    assert kernel_call_count(program) == 2
    # Sends, a scatter root's whole tensor and a gather's slice off the root go out without waiting.
    assert sent_values(program) == ("f", "x", "y@slice")
