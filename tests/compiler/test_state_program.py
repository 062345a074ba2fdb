"""compiler/state_program.py: the state taken out of a program's inputs and outputs, Assigns added, the arena."""
from __future__ import annotations

import numpy as np
import pytest

from tessel.compiler.memory import plan_program_memory
from tessel.compiler.program import Program
from tessel.compiler.state_program import PersistentState, with_state
from tessel.runtime.instructions import Assign, KernelCall, View


def _program() -> Program:
    """y = k(x, W viewed flat); W_next = k2(W); z = k3(y): W is state."""
    instructions = [View("flat", "Reshape", input="W", output="W_flat"),
                    KernelCall("use", "Mul", kernel="k", inputs=("x", "W_flat"), outputs=("y",)),
                    KernelCall("next", "Neg", kernel="k2", inputs=("W",), outputs=("W_next",)),
                    KernelCall("late", "Neg", kernel="k3", inputs=("y",), outputs=("z",))]
    values = {"x": "float32[6]", "W": "float32[2,3]", "W_flat": "float32[6]", "y": "float32[6]",
              "W_next": "float32[2,3]", "z": "float32[6]"}
    return Program(instructions, {}, values, {}, ["x", "W"], ["z", "W_next"])


def test_state_leaves_inputs_and_outputs_and_is_assigned_last():
    program = with_state(_program(), PersistentState({"W": np.zeros((2, 3), np.float32)}, {"W": "W_next"}))
    assert program.inputs == ["x"] and program.outputs == ["z"] and program.state == ["W"]
    assert program.instructions[-1] == Assign("assign/W", "Assign", src="W_next", dst="W")


def test_the_state_and_its_views_live_outside_the_arena_and_updates_live_until_assigned():
    program = with_state(_program(), PersistentState({"W": np.zeros((2, 3), np.float32)}, {"W": "W_next"}))
    plan = plan_program_memory(program, "llvm")
    assert set(plan.offsets) == {"x", "y", "W_next", "z"}
    # Nothing reads W_next but the Assign at the end: z, written after it, may not take its bytes.
    assert plan.offsets["W_next"] != plan.offsets["z"]
    without_assign = plan_program_memory(_program(), "llvm")
    assert "W_flat" in without_assign.offsets


@pytest.mark.parametrize("state, problem", [
    (PersistentState({"V": np.zeros(1)}, {}), "state 'V' is not an input of the graph"),
    (PersistentState({"W": np.zeros(1)}, {"x": "y"}), "update of 'x', which is not a state value"),
    (PersistentState({"W": np.zeros(1)}, {"W": "W_flat"}), "update 'W_flat' is not an output of the graph"),
])
def test_state_that_is_not_the_graphs_is_refused(state, problem):
    with pytest.raises(ValueError, match=problem):
        with_state(_program(), state)
