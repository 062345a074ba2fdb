"""Register tiles of the pointwise grouped conv kernel (grouped_conv.py: a 1×1, stride-1, unpadded grouped conv run
as one GEMM per group that reads the NCHW input and writes the NCHW output itself).

Its weights are packed with as many rows per tile as the kernel's register tile has output channels, so the
packing (packing.py) and the kernel both choose the tile here. The choice is estimated, not measured: a reduction
step costs max(FMA issue slots, loads) — a 16-lane FMA takes two 256-bit slots, an 8-lane one one; the loads are
the tile's input vectors and one weight broadcast per row — and the tile with the most useful multiply-adds per
unit of that cost wins, more accumulators breaking ties, within TILE_REGISTERS accumulators (of 32 vector
registers). Tile rows divide the group's output channels (no zero rows), so every tile is whole.
"""
from __future__ import annotations

from typing import Sequence

LANES = 16
TILE_REGISTERS = 24
# A flat tile holds at most this many vectors of pixels per output channel.
MAX_TILE_VECTORS = 4


def pointwise_applies(kernel: Sequence[int], strides: Sequence[int], pads: Sequence[int]) -> bool:
    """Whether a grouped conv is 1×1, stride 1 and unpadded: its groups' GEMMs can read the NCHW input itself."""
    return tuple(kernel) == (1, 1) and all(s == 1 for s in strides) and not any(pads)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def flat_tile(out_per_group: int, pixels: int) -> tuple[int, int] | None:
    """(rows, width): `rows` output channels × `width` pixels of the flattened image, whole 16-lane vectors that
    divide it; None when no such width divides the image's pixels (LLVM spills vectors of other widths)."""
    best = None
    for rows in _divisors(out_per_group):
        for vectors in range(1, MAX_TILE_VECTORS + 1):
            if pixels % (vectors * LANES) or rows * vectors > TILE_REGISTERS:
                continue
            key = (rows * vectors / max(2 * rows * vectors, vectors + rows), rows * vectors)
            if best is None or key > best[0]:
                best = (key, (rows, vectors * LANES))
    return None if best is None else best[1]


def row_tile(out_per_group: int, oh: int, ow: int) -> tuple[int, int] | None:
    """(rows, image rows): `rows` output channels × image rows dividing the image's, each row padded to whole
    16-lane vectors (the padding lanes load as zeros); None for rows of 8 pixels or fewer, where LLVM turns the
    masked rows into shuffles."""
    if ow <= LANES // 2:
        return None
    vectors = -(-ow // LANES)
    best = None
    for rows in _divisors(out_per_group):
        for image_rows in _divisors(oh):
            accumulators = rows * image_rows * vectors
            if accumulators > TILE_REGISTERS:
                continue
            key = (rows * image_rows * ow / max(2 * accumulators, image_rows * vectors + rows), accumulators)
            if best is None or key > best[0]:
                best = (key, (rows, image_rows))
    return None if best is None else best[1]


def pointwise_rows(out_per_group: int, oh: int, ow: int) -> int | None:
    """The tile rows of the pointwise kernel for this image (flat tiles where whole vectors divide it, else tiles
    of image rows); None where neither applies (the general kernel runs)."""
    tile = flat_tile(out_per_group, oh * ow) or row_tile(out_per_group, oh, ow)
    return None if tile is None else tile[0]
