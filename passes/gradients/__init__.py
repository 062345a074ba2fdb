"""Reverse-mode gradient rules, one per op type: `rule_for` (used by passes/autodiff.py).

Rules live in modules by op family; each builds the backward nodes of one forward node. `GRADIENT_RULES` holds
the ONNX ops', `TESSEL_GRADIENT_RULES` the Tessel-domain ops' (the collectives, BatchStats).
"""
from __future__ import annotations

from tessel.ir.graph import Node
from tessel.ir.schema import TESSEL_DOMAIN

from . import collectives, elementwise, nn, reduce, tensor
from .builder import GradBuilder, Rule, is_float

GRADIENT_RULES: dict[str, Rule] = {**elementwise.RULES, **nn.RULES, **reduce.RULES, **tensor.RULES}
TESSEL_GRADIENT_RULES: dict[str, Rule] = {**collectives.RULES, **nn.TESSEL_RULES}


def rule_for(node: Node) -> Rule | None:
    """The gradient rule of `node`'s op in its domain, or None when there is none."""
    if node.domain == "":
        return GRADIENT_RULES.get(node.op_type)
    return TESSEL_GRADIENT_RULES.get(node.op_type) if node.domain == TESSEL_DOMAIN else None


__all__ = ["GRADIENT_RULES", "TESSEL_GRADIENT_RULES", "GradBuilder", "Rule", "is_float", "rule_for"]
