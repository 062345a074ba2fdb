"""Typed node attributes, validated against an op schema."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import numpy as np

# Attribute kinds, named after ONNX's AttributeProto types.
KINDS = ("int", "float", "string", "ints", "floats", "strings", "tensor", "graph")


@dataclass(frozen=True)
class AttrSpec:
    """One attribute an op accepts: its kind, whether it is required, its default."""

    name: str
    kind: str
    required: bool = False
    default: Any = None


def coerce(spec: AttrSpec, value: Any) -> Any:
    """Convert `value` to the Python type of `spec.kind`, or raise TypeError."""
    from .graph import Graph

    kind = spec.kind
    if kind == "int" and isinstance(value, (int, np.integer)) and not isinstance(value, float):
        return int(value)
    if kind == "float" and isinstance(value, (int, float, np.integer, np.floating)):
        return float(value)
    if kind == "string" and isinstance(value, (str, bytes)):
        return value.decode("utf-8", "replace") if isinstance(value, bytes) else value
    if kind in ("ints", "floats", "strings") and isinstance(value, (list, tuple, np.ndarray)):
        element = AttrSpec(spec.name, kind[:-1])
        return tuple(coerce(element, v) for v in value)
    if kind == "tensor" and isinstance(value, np.ndarray):
        array = np.array(value, copy=True)
        array.setflags(write=False)
        return array
    if kind == "graph" and isinstance(value, Graph):
        return value
    raise TypeError(f"attribute '{spec.name}' must be of kind {kind}, got {type(value).__name__}")


class Attributes(Mapping[str, Any]):
    """An immutable mapping of attribute name to typed value (int, float, str, tuples, array, Graph)."""

    __slots__ = ("_items",)

    def __init__(self, items: Mapping[str, Any] | None = None):
        self._items = dict(items or {})

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"Attributes({self._items!r})"
