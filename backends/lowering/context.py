"""What a lowering rule sees of the node it lowers."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from tessel.ir.errors import TesselError
from tessel.ir.types import TensorType


# A block annotation: the block is elementwise over buffers of one shape (no broadcasting), so a schedule may run
# all its loops as one flat loop (vectorized whatever the innermost axis' length).
FLAT_LOOPS_ATTR = "tessel_flat_loops"
# A parallel region costs more than it saves on less work than this (loop iterations × reduction length); shared
# by the CPU schedules and the rules that write their own loops.
MIN_PARALLEL_WORK = 16384
# A reduction along the contiguous last axis of rows at least this long accumulates REDUCTION_LANES partial results
# per row, a vector of them, then reduces across them: the CPU schedule splits them off (rfactor), and the NaN-keeping
# max and min, which rfactor does not know, split them in their lowering.
ROW_REDUCTION_MIN = 64
REDUCTION_LANES = 16


class LoweringError(TesselError):
    """An op (or one of its attribute combinations) has no TVM lowering."""


@dataclass
class LowerContext:
    """One node to lower: attributes, TE inputs (None where omitted), compile-time data, output types."""

    op_type: str
    attrs: Mapping[str, Any]
    inputs: Sequence[Any]
    input_types: Sequence[TensorType | None]
    const_data: Sequence[np.ndarray | None]
    output_types: Sequence[TensorType | None]
    gpu: bool = False
    arch: str | None = None  # the GPU's architecture (sm_90), None on a CPU
    tf32: bool = False  # convolutions may run on TF32 tensor cores (backends/target.py)
    # The op is its kernel's only member and its inputs are the kernel's arguments as they are (no blocked view):
    # a rule may then write the whole kernel itself (lowering/rnn.py's PrimFuncResult).
    whole_kernel: bool = False

    def attr(self, name: str, default: Any = None) -> Any:
        """An attribute value, or `default` when it is absent."""
        return self.attrs.get(name, default)

    def data(self, index: int) -> np.ndarray | None:
        """Compile-time data of input `index`, None when the input is omitted."""
        if index >= len(self.const_data):
            return None
        return self.const_data[index]

    def require_data(self, index: int) -> np.ndarray:
        """Compile-time data of input `index`; raise LoweringError when it is only known at run time."""
        value = self.data(index)
        if value is None:
            raise LoweringError(f"{self.op_type}: input {index} must be a compile-time constant")
        return value

    def input(self, index: int):
        """TE tensor of input `index`, or None when omitted."""
        return self.inputs[index] if index < len(self.inputs) else None

    def out_shape(self, index: int = 0) -> tuple[int, ...]:
        """Static shape of output `index`."""
        return self.output_types[index].shape

    def out_dtype(self, index: int = 0) -> str:
        """Element type of output `index`."""
        return self.output_types[index].dtype

    def fail(self, why: str) -> LoweringError:
        """A LoweringError naming this op."""
        return LoweringError(f"{self.op_type}: {why}")


@dataclass(frozen=True)
class SelfScheduled:
    """A rule's result that brings its own schedule: `schedule(sch)` runs on the kernel's s_tir Schedule."""

    outputs: Sequence[Any]
    schedule: Callable[[Any], None]
