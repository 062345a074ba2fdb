"""Reverse-mode gradient rules, one per op type: `GRADIENT_RULES` (used by passes/autodiff.py).

Rules live in modules by op family; each builds the backward nodes of one forward node.
"""
from __future__ import annotations

from . import elementwise, nn, reduce, tensor
from .builder import GradBuilder, Rule, is_float

GRADIENT_RULES: dict[str, Rule] = {**elementwise.RULES, **nn.RULES, **reduce.RULES, **tensor.RULES}

__all__ = ["GRADIENT_RULES", "GradBuilder", "Rule", "is_float"]
