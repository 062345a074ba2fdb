"""compiler/state_program.py: the state taken out of a program's inputs and outputs, Assigns added, the arena."""
from __future__ import annotations

import numpy as np
import pytest

from tessel.compiler.memory import plan_program_memory
from tessel.compiler.program import Program
from tessel.compiler.state_program import PersistentState, with_state
from tessel.runtime.instructions import AllReduce, Assign, KernelCall, View


def _program() -> Program:
    """W_next = k2(W); y = k(x, W viewed flat); z = k3(y): W is state."""
    instructions = [View("flat", "Reshape", input="W", output="W_flat"),
                    KernelCall("next", "Neg", kernel="k2", inputs=("W",), outputs=("W_next",)),
                    KernelCall("use", "Mul", kernel="k", inputs=("x", "W_flat"), outputs=("y",)),
                    KernelCall("late", "Neg", kernel="k3", inputs=("y",), outputs=("z",))]
    values = {"x": "float32[6]", "W": "float32[2,3]", "W_flat": "float32[6]", "y": "float32[6]",
              "W_next": "float32[2,3]", "z": "float32[6]"}
    return Program(instructions, {}, values, {}, ["x", "W"], ["z", "W_next"])


def _with_state() -> Program:
    return with_state(_program(), PersistentState({"W": np.zeros((2, 3), np.float32)}, {"W": "W_next"}))


def test_state_leaves_inputs_and_outputs_and_is_assigned_after_its_last_read():
    program = _with_state()
    assert program.inputs == ["x"] and program.outputs == ["z"] and program.state == ["W"]
    # 'use' reads W through its view: the Assign follows it, and comes before 'late'.
    assert [i.node for i in program.instructions] == ["flat", "next", "use", "assign/W", "late"]
    assert program.instructions[3] == Assign("assign/W", "Assign", src="W_next", dst="W")


def test_the_state_and_its_views_live_outside_the_arena_and_updates_only_until_assigned():
    plan = plan_program_memory(_with_state(), "llvm")
    assert set(plan.offsets) == {"x", "y", "W_next", "z"}
    assert plan.offsets["W_next"] != plan.offsets["y"]  # both live while 'use' runs
    assert plan.arena_bytes == 3 * 64  # x, y, and W_next then z in its bytes
    assert "W_flat" in plan_program_memory(_program(), "llvm").offsets


def test_an_update_of_a_state_nothing_reads_is_assigned_once_computed():
    program = with_state(_program(), PersistentState({"x": np.zeros(6, np.float32), "W": np.zeros((2, 3), np.float32)},
                                                     {"x": "z", "W": "W_next"}))
    assert [i.node for i in program.instructions] == ["flat", "next", "use", "assign/W", "late", "assign/x"]


@pytest.mark.parametrize("state, problem", [
    (PersistentState({"V": np.zeros(1)}, {}), "state 'V' is not an input of the graph"),
    (PersistentState({"W": np.zeros(1)}, {"x": "y"}), "update of 'x', which is not a state value"),
    (PersistentState({"W": np.zeros(1)}, {"W": "y"}), "update 'y' is not an output of the graph"),
])
def test_state_that_is_not_the_graphs_is_refused(state, problem):
    with pytest.raises(ValueError, match=problem):
        with_state(_program(), state)


def _training_program(reduced: bool = False) -> Program:
    """A step whose SGD update of W (and its momentum M) comes last: W's gradient is ready after 'grad_w', W's last
    other read is 'grad_x'. `reduced`: the gradient is all-reduced first (data-parallel)."""
    grad = "gW_mean" if reduced else "gW"
    instructions = [KernelCall("fwd", "MatMul", kernel="k1", inputs=("x", "W"), outputs=("y",)),
                    KernelCall("grad_w", "MatMul", kernel="k2", inputs=("x", "y"), outputs=("gW",)),
                    *([AllReduce("mean", "AllReduce", tensor="gW", reduction="mean", output=grad)] if reduced else []),
                    KernelCall("grad_x", "MatMul", kernel="k3", inputs=("y", "W"), outputs=("gx",)),
                    KernelCall("late", "Neg", kernel="k4", inputs=("gx",), outputs=("z",)),
                    KernelCall("update", "SGDUpdate", kernel="k5", inputs=("W", grad, "lr", "M"),
                               outputs=("W_next", "M_next"), inplace=(("W_next", "W"), ("M_next", "M")))]
    values = {"x": "float32[4,4]", "W": "float32[4,4]", "M": "float32[4,4]", "y": "float32[4,4]", grad: "float32[4,4]",
              "gW": "float32[4,4]", "gx": "float32[4,4]", "z": "float32[4,4]", "lr": "float32[]",
              "W_next": "float32[4,4]", "M_next": "float32[4,4]"}
    return Program(instructions, {}, values, {}, ["x", "lr", "W", "M"], ["z", "W_next", "M_next"])


def _trained(program: Program) -> Program:
    zeros = np.zeros((4, 4), np.float32)
    return with_state(program, PersistentState({"W": zeros, "M": zeros}, {"W": "W_next", "M": "M_next"}))


def test_an_update_runs_once_its_gradient_is_ready_and_writes_the_state_in_place():
    program = _trained(_training_program())
    assert [i.node for i in program.instructions] == ["fwd", "grad_w", "grad_x", "update", "late"]
    update = program.instructions[3]
    assert update.outputs == ("W", "M") and update.inplace == ()
    assert not any(isinstance(i, Assign) for i in program.instructions)
    assert not {"W_next", "M_next"} & set(program.values)
    plan = plan_program_memory(program, "llvm")
    assert set(plan.offsets) == {"x", "y", "gW", "gx", "z", "lr"}
    assert next(s for s in plan.storages if "gW" in s.values).end == 3  # the gradient dies at the update


def test_an_update_waiting_on_a_collective_keeps_its_place():
    program = _trained(_training_program(reduced=True))
    assert [i.node for i in program.instructions] == ["fwd", "grad_w", "mean", "grad_x", "late", "update"]
    assert program.instructions[-1].outputs == ("W", "M")


def test_a_state_read_after_its_update_is_assigned():
    program = _training_program()
    reader = KernelCall("reader", "Neg", kernel="k6", inputs=("W",), outputs=("w2",))
    program = _trained(Program(program.instructions + [reader], {}, {**program.values, "w2": "float32[4,4]"}, {},
                               program.inputs, program.outputs + ["w2"]))
    # M is read by nothing after the update: written in place; W is read after it: assigned.
    assert [i.node for i in program.instructions] == ["fwd", "grad_w", "grad_x", "late", "update", "reader", "assign/W"]
    assert program.instructions[4].outputs == ("W_next", "M")
