"""Evaluate one op on constant inputs, for folding at import time.

Uses ONNX's reference implementation of each op (`onnx.reference`), so folded
values follow the ONNX specification exactly.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
from onnx import helper
from onnx.reference import ReferenceEvaluator

from .attributes import Attributes
from .onnx_proto import attribute_proto
from .schema import CANONICAL_OPSET, OpSchema


def evaluate(schema: OpSchema, attrs: Attributes, inputs: Sequence[np.ndarray | None], num_outputs: int) -> list[np.ndarray]:
    """Run the op on numpy inputs (None for an omitted optional input) and return its outputs."""
    in_names = [f"i{k}" if a is not None else "" for k, a in enumerate(inputs)]
    out_names = [f"o{k}" for k in range(num_outputs)]
    node = helper.make_node(schema.op_type, in_names, out_names, domain=schema.domain)
    node.attribute.extend(attribute_proto(n, schema.attributes[n].kind, v) for n, v in attrs.items())
    evaluator = ReferenceEvaluator(node, opsets={"": CANONICAL_OPSET})
    feeds = {name: np.asarray(a) for name, a in zip(in_names, inputs) if a is not None}
    return [np.asarray(r) for r in evaluator.run(None, feeds)]
