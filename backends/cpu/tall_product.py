"""Gemm with transA (out = alpha · Aᵀ·B + beta · C) over tall operands, as register tiles on CPU.

A training step's weight gradient of a matrix product shared by a batch is such a product: dW[i, j] = Σ_k x[k, i] ·
dy[k, j] over every row of the batch (passes/gradients/nn.py emits it as Gemm(x, dy, transA=1)), long next to its
small output (a transformer's 16,384 rows for a 32 × 96 weight; outputs up to MAX_OUTPUT elements). The generic schedule vectorizes it across the
output and reads a column of x per output row: 11–40 GFLOP/s here. Here it runs as the conv filter gradient
does (conv_grad_filter.py): each tile of ROWS × 32 outputs accumulates in registers while each x[k, i] is one
broadcast and each dy[k, j..j+15] one vector load, both read along their rows. The reduction is cut into chunks of
rows whose slices of A and B stay in L2; each chunk writes a partial result, and the partials are summed at the end
(a workspace of chunks × ⌈M/ROWS⌉·ROWS × ⌈N/16⌉·16 floats), then scaled and biased.
"""
from __future__ import annotations

from ..lowering.context import MIN_PARALLEL_WORK, LowerContext, SelfScheduled
from ..tvm_env import tvm
from .broadcast_tiles import LANES, ROWS, tile_product, vectorize_row
from .packed_kernels import gemm_epilogue
from .schedule import try_step

_tvm = tvm()
te, tir = _tvm.te, _tvm.tirx

# Below this many rows the product is not tall: the generic schedule, vectorized across the output, is as good.
MIN_DEPTH = 256
# A chunk's slices of A and B together take about this many bytes (half of a core's L2 here).
CHUNK_BYTES = 512 * 1024
# At most this many partial results, and at most WORKSPACE_BYTES of them (their workspace and their final sum grow
# with the count).
MAX_CHUNKS = 64
WORKSPACE_BYTES = 4 << 20
# Outputs up to this many elements (a weight of up to 256 KB: a register tile's A and B rows then stream from
# L2). Wider products would sweep their whole operands once per tile: they keep the generic schedule.
MAX_OUTPUT = 65536


def applies(ctx: LowerContext) -> bool:
    """Whether this kernel runs a Gemm with transA and without transB (backends/cpu/variants.py asks only for
    those): 2-D float32 operands, at least MIN_DEPTH rows long, an output of at most MAX_OUTPUT elements (padded),
    on CPU."""
    a_type, b_type = ctx.input_types[0], ctx.input_types[1]
    if ctx.gpu or a_type.dtype != "float32" or b_type.dtype != "float32" or a_type.rank != 2 or b_type.rank != 2:
        return False
    output = _padded(int(a_type.shape[1]), ROWS) * _padded(int(b_type.shape[1]), LANES)
    return int(a_type.shape[0]) >= MIN_DEPTH and output <= MAX_OUTPUT


def _padded(extent: int, multiple: int) -> int:
    return -(-extent // multiple) * multiple


def chunk_rows(depth: int, m: int, n: int) -> int:
    """Rows per chunk: their slices of A (m wide) and B (n wide) fit CHUNK_BYTES, a multiple of 16, at most
    MAX_CHUNKS chunks in all and their partial results at most WORKSPACE_BYTES; a divisor of `depth` near that
    size when one exists (no tail chunk)."""
    chunks = max(1, min(MAX_CHUNKS, WORKSPACE_BYTES // (4 * _padded(m, ROWS) * _padded(n, LANES))))
    target = max(16, CHUNK_BYTES // (4 * (m + n)) // 16 * 16, -(-depth // chunks))
    if target >= depth:
        return depth
    divisor = next((d for d in range(target, target // 2, -1) if depth % d == 0), None)
    return divisor or target


def gemm_tall(ctx: LowerContext):
    """out[M, N] = alpha · Σ_k a[k, i] · b[k, j] (+ beta · C) of a[K, M] and b[K, N] (see the module docstring)."""
    a, b, c = ctx.input(0), ctx.input(1), ctx.input(2)
    alpha, beta = float(ctx.attr("alpha", 1.0)), float(ctx.attr("beta", 1.0))
    depth, m = (int(d) for d in a.shape)
    n = int(b.shape[1])
    m_padded, n_padded = _padded(m, ROWS), _padded(n, LANES)
    rows = chunk_rows(depth, m, n)
    chunks, tail = divmod(depth, rows)
    zero = tir.const(0.0, b.dtype)

    def a_at(k, i):
        # Rows past M repeat the last column of A; the result drops them.
        return a[k, i if m_padded == m else tir.min(i, m - 1)]

    def b_at(k, j):
        if n_padded == n:
            return b[k, j]
        return tir.if_then_else(j < n, b[k, tir.min(j, n - 1)], zero)

    # B's rows padded to whole vectors, when N is not a whole number of them.
    b_padded = (te.compute((depth, n_padded), b_at, name="tall_b_padded") if n_padded != n else b)
    k = te.reduce_axis((0, rows), "k")
    partial = te.compute((chunks, m_padded, n_padded),
                         lambda ch, i, j: te.sum(a_at(ch * rows + k, i) * b_padded[ch * rows + k, j], axis=k),
                         name="tall_partial")
    rest = None
    if tail:
        kt = te.reduce_axis((0, tail), "kt")
        start = chunks * rows
        rest = te.compute((m_padded, n_padded),
                          lambda i, j: te.sum(a_at(start + kt, i) * b_padded[start + kt, j], axis=kt),
                          name="tall_tail")
    rc = te.reduce_axis((0, chunks), "rc")
    summed = te.compute((m, n), lambda i, j: te.sum(partial[rc, i, j], axis=rc), name="tall_sum")

    def finish(i, j):
        value = summed[i, j] + rest[i, j] if rest is not None else summed[i, j]
        return gemm_epilogue(value, i, j, alpha, beta, c, b.dtype)

    out = te.compute((m, n), finish, name="tall_out")
    big = m * n * depth >= MIN_PARALLEL_WORK * 16

    def schedule(sch) -> None:
        # Reshapes and copies feeding A and B are index maps: read through them instead of copying.
        for block in sch.get_producers(sch.get_sblock("tall_partial")):
            if sch.get(block).name_hint != "tall_b_padded":
                try_step(lambda blk=block: sch.compute_inline(blk))
        # Chunks in parallel (each writes its own partial): one parallel region, not one per chunk.
        tile_product(sch, "tall_partial", ROWS, big, lead=1, parallel_lead=chunks > 1)
        if n_padded != n:
            # Made whole before the chunks, in one pass over B (the tail chunk reads it too).
            vectorize_row(sch, sch.get_loops(sch.get_sblock("tall_b_padded"))[-1])
        if tail:
            tile_product(sch, "tall_tail", ROWS, False)
        total = sch.get_sblock("tall_sum")
        i, j, reduce = sch.get_loops(total)
        sch.reorder(i, reduce, j)
        init = sch.decompose_reduction(total, reduce)
        vectorize_row(sch, sch.get_loops(init)[-1])
        vectorize_row(sch, sch.get_loops(total)[-1])
        vectorize_row(sch, sch.get_loops(sch.get_sblock("tall_out"))[-1])

    return SelfScheduled([out], schedule)
