"""Compile-time weight packing for the fast conv and matmul kernels.

Conv weights (K, C, R, S) become (K/ocb, C/icb, R, S, icb, ocb) and constant
matmul weights (K, N) become (N/nb, K, nb), the layouts the register-tiled
schedules read contiguously. The compiler applies `plan_packing` to the
node's constant inputs once; the kernel then receives the packed array.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from tessel.ir.types import TensorType

from ..kernel import ALGORITHM

# Attribute names the packed kernels read (they are not ONNX attributes).
CONV_BLOCKS = "tessel_conv_blocks"
MATMUL_BLOCK = "tessel_matmul_block"
MATMUL_PANEL = 16


@dataclass(frozen=True)
class Packing:
    """Extra kernel attributes and the packed replacement of some constant inputs, by position."""

    attrs: tuple[tuple[str, Any], ...]
    arrays: Mapping[int, np.ndarray]


def _block(size: int, preferred: int = 16) -> int:
    """The largest of preferred, 8, 4, 2, 1 dividing `size` (the whole size when it is small)."""
    if size <= preferred:
        return size
    for block in (preferred, 8, 4, 2, 1):
        if size % block == 0:
            return block
    return 1


def conv_blocks(out_channels: int, in_channels: int) -> tuple[int, int]:
    """(icb, ocb): 16-channel blocks, or the whole channel count when it is smaller."""
    return min(in_channels, 16), min(out_channels, 16)


def pack_conv_weight(weight: np.ndarray, icb: int, ocb: int) -> np.ndarray:
    """(K, C, R, S) → (⌈K/ocb⌉, ⌈C/icb⌉, R, S, icb, ocb), zero-padding channels up to whole blocks."""
    k, c, r, s = weight.shape
    kp, cp = -(-k // ocb) * ocb, -(-c // icb) * icb
    padded = np.zeros((kp, cp, r, s), weight.dtype)
    padded[:k, :c] = weight
    return np.ascontiguousarray(padded.reshape(kp // ocb, ocb, cp // icb, icb, r, s).transpose(0, 2, 4, 5, 3, 1))


def pack_matmul_weight(weight: np.ndarray, block: int) -> np.ndarray:
    """(K, N) → (N/nb, K, nb)."""
    k, n = weight.shape
    return np.ascontiguousarray(weight.reshape(k, n // block, block).transpose(1, 0, 2))


def plan_packing(op_type: str, attrs: Mapping[str, Any], input_types: Sequence[TensorType | None],
                 constants: Sequence[np.ndarray | None]) -> Packing | None:
    """How to pack this node's constant weights for a fast kernel, or None to use the generic one.

    The packed algorithms (conv "nchwc" and "direct", matmul "packed"; the defaults) pack weights;
    conv "winograd" transforms them.
    """
    algorithm = attrs.get(ALGORITHM, "nchwc" if op_type == "Conv" else "packed")
    if algorithm == "winograd" and constants[1] is not None and constants[1].ndim == 4:
        from .winograd import transform_weight

        return Packing((), {1: transform_weight(constants[1])})
    if algorithm not in ("nchwc", "direct", "packed"):
        return None
    if not input_types or input_types[0] is None or input_types[0].dtype != "float32":
        return None
    if op_type == "Conv" and constants[1] is not None and attrs.get("group", 1) == 1 and input_types[0].rank in (3, 4):
        weight = constants[1]
        if weight.ndim == 3:  # a 1-D conv runs as a 2-D conv of height 1
            weight = weight[:, :, None, :]
        icb, ocb = conv_blocks(*weight.shape[:2])
        height, width = (1, input_types[0].shape[2]) if input_types[0].rank == 3 else input_types[0].shape[2:]
        # Register tiles run along the width: a tall, narrow input runs with height and width swapped.
        swap = int(width < 8 <= height)
        if swap:
            weight = weight.transpose(0, 1, 3, 2)
        return Packing(((CONV_BLOCKS, (icb, ocb, swap)),), {1: pack_conv_weight(weight, icb, ocb)})
    if op_type == "MatMul" and constants[1] is not None and input_types[1].rank == 2 and input_types[0].rank >= 2:
        n = input_types[1].shape[1]
        if n % MATMUL_PANEL == 0:
            return Packing(((MATMUL_BLOCK, MATMUL_PANEL),), {1: pack_matmul_weight(constants[1], MATMUL_PANEL)})
    if op_type == "Gemm" and constants[1] is not None and not attrs.get("transA", 0):
        weight = constants[1].T if attrs.get("transB", 0) else constants[1]
        if weight.shape[1] % MATMUL_PANEL == 0:
            return Packing(((MATMUL_BLOCK, MATMUL_PANEL),), {1: pack_matmul_weight(np.ascontiguousarray(weight), MATMUL_PANEL)})
    return None
