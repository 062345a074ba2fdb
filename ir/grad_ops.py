"""Tessel's gradient ops (domain "tessel"): the ops reverse-mode autodiff needs that ONNX does not define.

`REFERENCE` maps each op type to a numpy implementation, `(attrs, inputs) -> outputs`, used by the IR
interpreter (ir/interpret.py) to check gradient rules against finite differences.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from .attributes import Attributes

Reference = Callable[[Attributes, Sequence[np.ndarray]], list[np.ndarray]]

REFERENCE: dict[str, Reference] = {}
