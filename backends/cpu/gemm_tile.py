"""The register-tiled product shared by the im2col and Winograd convs: out[..., row, pixel] = Σ w[row, ·] · in[·, pixel]."""
from __future__ import annotations

from .schedule import try_step

# A tile is ROWS output rows (the first of these dividing the row count) × PIXELS pixels (one vector).
PIXELS = 16
ROW_CHOICES = (4, 2, 1)


def tiled_gemm(sch, name: str, rows: int, big: bool) -> None:
    """Schedule a block (batch..., row, pixel; reduce): register tiles of `rows` × PIXELS, accumulated in registers."""
    block = sch.get_sblock(name)
    tile = sch.cache_write(block, 0, "global")
    *batch, row, pixel, reduce = sch.get_loops(block)
    row_outer, row_inner = sch.split(row, [None, rows])
    pixel_outer, pixel_inner = sch.split(pixel, [None, PIXELS])
    sch.reorder(*batch, row_outer, pixel_outer, reduce, row_inner, pixel_inner)
    outer = sch.fuse(*batch, row_outer)
    if big:
        sch.parallel(outer)
    sch.unroll(row_inner)
    sch.vectorize(pixel_inner)
    sch.reverse_compute_at(tile, pixel_outer)
    try_step(lambda: sch.vectorize(sch.get_loops(tile)[-1]))
    sch.decompose_reduction(block, reduce)
