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
    schedule_tiles(sch, block, outer, big, (row_inner,), pixel_inner, reduce, tile, at=pixel_outer)


def schedule_tiles(sch, block, outer, big: bool, unrolled, lanes, reduction, written, at=None) -> None:
    """The register tiles of a product `block` whose loops are placed: `outer` in parallel when `big`, the tile's
    loops `unrolled`, `lanes` vectorized, `written` (the tile's write-back) done under `at` (default: `outer`) and
    vectorized, and the reduction's init split off at `reduction`. The depthwise and grouped convs' tiles use it
    too."""
    if big:
        sch.parallel(outer)
    for loop in unrolled:
        sch.unroll(loop)
    sch.vectorize(lanes)
    sch.reverse_compute_at(written, outer if at is None else at)
    try_step(lambda: sch.vectorize(sch.get_loops(written)[-1]))
    sch.decompose_reduction(block, reduction)
