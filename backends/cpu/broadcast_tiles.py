"""The register tiles of the CPU gradient kernels: out[row, column] = Σ a(row, ·) · b(·, column), where each a is one
broadcast scalar and b a vector of 16 contiguous columns (backends/cpu/conv_grad_filter.py, conv_transpose.py)."""
from __future__ import annotations

from .schedule import try_step

LANES = 16
# A register tile: ROWS rows × 2 vectors of columns: 16 accumulators, half of AVX-512's registers.
ROWS = 8
COLUMNS = 2 * LANES


def tile_columns(columns: int) -> int:
    """The columns of a tile for a product this wide (a whole number of vectors dividing it)."""
    return COLUMNS if columns % COLUMNS == 0 else LANES


def vectorize_row(sch, loop) -> None:
    """Vectorize a copy's innermost loop by at most one vector of 16 or 8 lanes (wider vectors of gathers compile
    for minutes)."""
    extent = int(sch.get(loop).extent)
    lanes = next((v for v in (LANES, LANES // 2) if extent % v == 0), None)
    if lanes is not None and extent > lanes:
        loop = sch.split(loop, [None, lanes])[1]
    if lanes is not None or extent <= LANES:
        try_step(lambda: sch.vectorize(loop))


def tile_product(sch, name: str, rows: int, parallel: bool, lead: int = 0):
    """Schedule block `name`, loops (lead..., row, column, reduce...), as register tiles of `rows` × tile_columns;
    tiles (column blocks outer, so a strip of b stays in cache) run in parallel when `parallel`. Returns the
    loop of tiles."""
    block = sch.get_sblock(name)
    tile = sch.cache_write(block, 0, "global")
    loops = sch.get_loops(block)
    outer, row, column, reduce = loops[:lead], loops[lead], loops[lead + 1], loops[lead + 2:]
    row_outer, row_inner = sch.split(row, [None, rows])
    column_outer, column_inner = sch.split(column, [None, tile_columns(int(sch.get(column).extent))])
    vectors, lanes = sch.split(column_inner, [None, LANES])
    sch.reorder(*outer, column_outer, row_outer, *reduce, row_inner, vectors, lanes)
    sch.reverse_compute_at(tile, row_outer)
    try_step(lambda: sch.vectorize(sch.get_loops(tile)[-1]))
    sch.unroll(row_inner)
    sch.unroll(vectors)
    sch.vectorize(lanes)
    tiles = sch.fuse(column_outer, row_outer)
    if parallel:
        sch.parallel(tiles)
    sch.decompose_reduction(block, reduce[0])
    return tiles
