"""Lowering of one IR op to a TVM tensor-expression (TE) computation.

Each lowering rule takes a `LowerContext` (typed attributes, input
placeholders, compile-time input data, output types) and returns the output
tensors. Inputs that shape the computation (a Reshape's shape, a Slice's
starts, a Pad's pads, ...) are compile-time data, listed by `static_inputs`.
"""
from __future__ import annotations

from .context import LowerContext, LoweringError
from .registry import RULES, static_inputs, supports

__all__ = ["LowerContext", "LoweringError", "RULES", "static_inputs", "supports"]
