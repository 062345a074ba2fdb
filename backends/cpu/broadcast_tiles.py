"""The register tiles of the CPU gradient kernels: out[row, column] = Σ a(row, ·) · b(·, column), where each a is one
broadcast scalar and b a vector of 16 contiguous columns (backends/cpu/conv_grad_filter.py, conv_transpose.py)."""
from __future__ import annotations

from .schedule import try_step

LANES = 16
# A register tile: ROWS rows × 2 vectors of columns: 16 accumulators, half of AVX-512's registers.
ROWS = 8
COLUMNS = 2 * LANES
# Column operands (b) up to this size stay in L2 while every row tile sweeps them: the row tiles then run
# outermost, so the (larger) row operand streams from memory once. Bigger b: column strips outermost instead.
L2_RESIDENT_BYTES = 1 << 20


def rows_outer(column_operand_bytes: int) -> bool:
    """Whether row tiles run outside column strips, for a column operand (b) of this many bytes."""
    return column_operand_bytes <= L2_RESIDENT_BYTES


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


def tile_product(sch, name: str, rows: int, parallel: bool, lead: int = 0, row_tiles_outer: bool = False,
                 parallel_lead: bool = False):
    """Schedule block `name`, loops (lead..., row, column, reduce...), as register tiles of `rows` × tile_columns;
    tiles (column strips outer, so a strip of b stays in cache, or row tiles outer when `row_tiles_outer`) run in
    parallel when `parallel`; with `parallel_lead` the lead loops run in parallel instead (one parallel region
    around every tile of each lead index, such as independent chunks of a reduction). Returns the loop of tiles."""
    block = sch.get_sblock(name)
    tile = sch.cache_write(block, 0, "global")
    loops = sch.get_loops(block)
    outer, row, column, reduce = loops[:lead], loops[lead], loops[lead + 1], loops[lead + 2:]
    row_outer, row_inner = sch.split(row, [None, rows])
    column_outer, column_inner = sch.split(column, [None, tile_columns(int(sch.get(column).extent))])
    vectors, lanes = sch.split(column_inner, [None, LANES])
    first, second = (row_outer, column_outer) if row_tiles_outer else (column_outer, row_outer)
    sch.reorder(*outer, first, second, *reduce, row_inner, vectors, lanes)
    sch.reverse_compute_at(tile, second)
    try_step(lambda: sch.vectorize(sch.get_loops(tile)[-1]))
    sch.unroll(row_inner)
    sch.unroll(vectors)
    sch.vectorize(lanes)
    tiles = sch.fuse(first, second)
    if parallel and parallel_lead and outer:
        sch.parallel(sch.fuse(*outer) if len(outer) > 1 else outer[0])
    elif parallel:
        sch.parallel(tiles)
    sch.decompose_reduction(block, reduce[0])
    return tiles


def schedule_copies(sch, names, parallel: bool) -> None:
    """Schedule the operand copies `names` (padded inputs, channels-last weights: root blocks of 3+ loops) as rows:
    their two outer loops fused (in parallel when `parallel`), their innermost vectorized."""
    for name in names:
        loops = sch.get_loops(sch.get_sblock(name))
        outer = sch.fuse(*loops[:2])
        if parallel:
            sch.parallel(outer)
        vectorize_row(sch, loops[-1])


def schedule_nchw_output(sch, name: str, parallel: bool) -> None:
    """Schedule block `name`, which writes an NCHW output from channels-last tiles: by image rows, then channels,
    the row's columns vectorized; rows in parallel when `parallel`."""
    ni, channel, row, column = sch.get_loops(sch.get_sblock(name))
    sch.reorder(ni, row, channel, column)
    rows = sch.fuse(ni, row)
    if parallel:
        sch.parallel(rows)
    try_step(lambda: vectorize_row(sch, column))
