"""A generic CPU schedule for any PrimFunc made from TE: inline, parallelize, vectorize.

Injective producers are inlined into their consumers. Every remaining block
runs its outer spatial loops in parallel; a block's innermost spatial loop is
vectorized, and a reduction block moves its reduction loops inside so the
vectorized spatial tile accumulates in registers. A block its rule marks flat
(FLAT_LOOPS_ATTR: elementwise over buffers of one shape) runs as one loop. A kernel that
normalizes rows (LayerNorm, Softmax: reductions along a row, then elementwise over it) runs
row by row instead, every block inside one parallel loop over the rows. Index arguments that a
Gather-like block asked to check are asserted in range before the kernel body.
"""
from __future__ import annotations

import dataclasses

from ..lowering.context import FLAT_LOOPS_ATTR, MIN_PARALLEL_WORK, REDUCTION_LANES, ROW_REDUCTION_MIN
from ..lowering.index_checks import CHECK_ATTR, IndexCheck, add_index_checks
from ..tvm_env import tvm

_tvm = tvm()
s_tir = _tvm.s_tir

VECTOR_LANES = (16, 8, 4)
MIN_PARALLEL_EXTENT = 2
# Pooling rows up to this long with no vector width dividing them accumulate a whole row at once.
MAX_ROW_TILE = 32
# A row-normalizing kernel runs row by row (`_rows_together`) from this many rows: on fewer, the row loop alone
# would leave cores idle that the blocks' own parallel loops keep busy.
ROWS_TOGETHER_MIN = 8


def _extent(sch, loop) -> int:
    extent = sch.get(loop).extent
    return int(extent) if hasattr(extent, "value") or isinstance(extent, int) else int(extent.value)


def try_step(action) -> bool:
    try:
        action()
        return True
    except Exception:  # noqa: BLE001 - a schedule step TVM rejects leaves the schedule unchanged
        return False


def _is_reduction(iter_var) -> bool:
    return int(iter_var.iter_type) == 2


def _iter_kinds(sch, block) -> list[bool]:
    """True per block iterator that is a reduction."""
    return [_is_reduction(iv) for iv in sch.get(block).iter_vars]


def lanes_for(extent: int) -> int | None:
    """The widest vector width in VECTOR_LANES that divides `extent`; None when none does."""
    for lanes in VECTOR_LANES:
        if extent % lanes == 0 and extent >= lanes:
            return lanes
    return None


def writes_blocks(sch, name: str) -> bool:
    """Whether block `name` writes an NCHW[b]c buffer: one dimension more than its loops."""
    block = sch.get_sblock(name)
    return len(sch.get(block).writes[0].region) == len(sch.get_loops(block)) + 1


def reads_blocks(x) -> bool:
    """Whether `x` is the NCHW view of an NCHW[b]c kernel argument (backends/lower.py's view of a blocked argument):
    a compute over one 5-D placeholder."""
    te = _tvm.te
    if not isinstance(x.op, te.ComputeOp) or len(x.op.input_tensors) != 1:
        return False
    source = x.op.input_tensors[0]
    return isinstance(source.op, te.PlaceholderOp) and source.ndim == 5


def schedule_rows(sch, name: str, parallel: bool, vectorize: bool) -> None:
    """A conv's NCHW output block: every axis but the last fused (and parallel), the last vectorized.

    When the block writes NCHW[b]c (its result kept blocked for the next conv), the
    channel loop splits into blocks and the b channels of a pixel are the vector.
    """
    block = sch.get_sblock(name)
    loops = sch.get_loops(block)
    if writes_blocks(sch, name):
        written = sch.get(block).writes[0].source
        n, c, *pixels = loops
        blocks, channels = sch.split(c, [None, int(written.shape[-1])])
        sch.reorder(n, blocks, *pixels, channels)
        loops = [n, blocks, *pixels, channels]
        vectorize = True
    outer = sch.fuse(*loops[:-1])
    if parallel:
        sch.parallel(outer)
    try_step(lambda: sch.vectorize(loops[-1]) if vectorize else None)


def schedule(func, index_checks: bool = True):
    """A scheduled copy of `func` (a PrimFunc) for CPU.

    With the index checks its Gather-like blocks ask for (lowering/index_checks.py);
    `index_checks=False` leaves them out, to measure what they cost (bench/index_checks.py).
    """
    sch = s_tir.Schedule(func)
    root = sch.get_sblock("root")
    checks = _index_checks(sch, root) if index_checks else []
    for block in reversed(sch.get_child_blocks(root)):
        feeds_reduction = any(any(_iter_kinds(sch, c)) for c in sch.get_consumers(block))
        # A padding or layout stage inlined into a reduction puts bounds checks in its inner loop.
        if not any(_iter_kinds(sch, block)) and not feeds_reduction and not _stores_indices(sch, block):
            try_step(lambda b=block: sch.compute_inline(b))
    together = _rows_together(sch)
    if together is not None:
        return add_index_checks(together.mod["main"], checks)
    for block in sch.get_child_blocks(root):
        if any(_iter_kinds(sch, block)):
            _schedule_reduction(sch, block)
        else:
            _schedule_spatial(sch, block)
    return add_index_checks(sch.mod["main"], checks)


def _work(sch, block) -> int:
    """Iterations of `block`'s loop nest (its spatial extents times its reduction lengths)."""
    work = 1
    for loop in sch.get_loops(block):
        work *= _extent(sch, loop)
    return work


def _rows_together(sch):
    """A copy of `sch` whose blocks all run inside one (parallel) loop over the rows of the kernel's output, or None
    when the kernel is not of that form.

    The form: the last block writes the output elementwise, the blocks before it reduce or map along the rows it
    writes (a LayerNorm's mean and variance, a Softmax's max and sum). Scheduled block by block, each of them is a
    parallel loop of its own, and on small rows (minigpt_small's 64 × 256 LayerNorm: seven loops) the cores' fork
    and join costs more than the arithmetic; row by row there is one, and a row's intermediates stay in L1. The rows
    are the output's leading loops, as many as every block computes without repeating work (a reduction over
    the rows themselves, e.g. a BatchNorm's statistics, cannot go inside them).
    """
    root = sch.get_sblock("root")
    blocks = sch.get_child_blocks(root)
    if len(blocks) < 2 or any(_iter_kinds(sch, blocks[-1])) or not any(any(_iter_kinds(sch, b)) for b in blocks[:-1]):
        return None
    if any(_stores_indices(sch, b) or _is_pooling(sch, b) for b in blocks):
        return None
    names = [sch.get(b).name_hint for b in blocks]
    for depth in range(len(sch.get_loops(blocks[-1])) - 1, 0, -1):
        trial = s_tir.Schedule(sch.mod)
        if try_step(lambda t=trial, d=depth: _run_rows_together(t, names, d)):
            return trial
    return None


class _NotTogether(Exception):
    """The kernel does not run row by row: too few rows, a reduction that is not along whole vectors of a row,
    or a block that would repeat work inside the row loop."""


def _run_rows_together(sch, names: list[str], depth: int) -> None:
    """Put every block of `names` (the last one writing the output) inside the output's first `depth` loops,
    fused into one row loop; raises when a block would repeat work there or the rows are too few.

    A reduction along its rows splits into vector lanes first (rfactor refuses a block that is not the first
    in its loop, as it is once inside the rows)."""
    blocks = [sch.get_sblock(name) for name in names]
    for block in blocks[:-1]:
        if not any(_iter_kinds(sch, block)):
            continue
        loops = sch.get_loops(block)
        # Only whole vectors of a row (a product's reduction reads its weight across rows and keeps its own
        # register tiles; a row with a partial last vector keeps the schedule that runs it apart).
        if not (_reads_rows(sch, loops[-1]) and _extent(sch, loops[-1]) % REDUCTION_LANES == 0
                and _row_reduction_applies(sch, block)):
            raise _NotTogether(f"block {sch.get(block).name_hint} does not reduce whole vectors of a row")
        _, lane = sch.split(loops[-1], [None, REDUCTION_LANES])
        sch.rfactor(lane, len(sch.get(block).writes[0].region))
    inside = sch.get_child_blocks(sch.get_sblock("root"))
    work = {sch.get(block).name_hint: _work(sch, block) for block in inside}
    out_loops = sch.get_loops(inside[-1])
    rows = sch.fuse(*out_loops[:depth]) if depth > 1 else out_loops[0]
    count = _extent(sch, rows)
    if count < ROWS_TOGETHER_MIN:
        raise _NotTogether(f"{count} rows")
    for block in reversed(inside[:-1]):
        sch.compute_at(block, rows, preserve_unit_loops=False)
    for name in work:
        if count * _inner_work(sch, sch.get_sblock(name), rows) != work[name]:
            raise _NotTogether(f"block {name} repeats work inside the rows")
    if sum(work.values()) >= MIN_PARALLEL_WORK:
        sch.parallel(rows)
    for block in sch.get_child_blocks(sch.get_sblock("root")):
        if any(_iter_kinds(sch, block)):
            _reduce_inside_row(sch, block)
        else:
            _map_inside_row(sch, block)


def _reduce_inside_row(sch, block) -> None:
    """A reduction block inside the row loop: its innermost spatial loop (a vector of lane partials, or of
    outputs) goes inside the reduction loops and is vectorized, so the partial results accumulate in a register."""
    loops = sch.get_loops(block)[1:]
    kinds = _loop_kinds(sch, block, loops)
    spatial = [loop for loop, is_reduce in zip(loops, kinds) if not is_reduce]
    reduce = [loop for loop, is_reduce in zip(loops, kinds) if is_reduce]
    if not spatial or not reduce:
        return
    extent = _extent(sch, spatial[-1])
    if lanes_for(extent) != extent or extent > VECTOR_LANES[0]:
        return
    sch.reorder(*spatial[:-1], *reduce, spatial[-1])
    # Vectorized while the block still has its init: decomposed, it is no longer a reduction block TVM vectorizes.
    try_step(lambda: sch.vectorize(spatial[-1]))
    init = sch.decompose_reduction(block, reduce[0])
    try_step(lambda: sch.vectorize(sch.get_loops(init)[-1]))


def _loop_kinds(sch, block, loops) -> list[bool]:
    """True per loop of `loops` that some reduction iterator of `block` is bound to."""
    _, bindings = _bindings(sch, sch.get_loops(block)[-1])
    return [any(_is_reduction(iter_var) and _uses(value, sch.get(loop).loop_var) for iter_var, value in bindings)
            for loop in loops]


def _map_inside_row(sch, block) -> None:
    """An elementwise block inside the row loop: its innermost loop vectorized."""
    loops = sch.get_loops(block)[1:]
    if not loops:
        return
    extent = _extent(sch, loops[-1])
    lanes = lanes_for(extent)
    if lanes is not None:
        _, vector = sch.split(loops[-1], [None, lanes])
        try_step(lambda: sch.vectorize(vector))
    elif extent >= 2 * VECTOR_LANES[0]:
        try_step(lambda: _vectorize_whole_vectors(sch, loops[-1], extent))


def _inner_work(sch, block, rows) -> int:
    """Iterations of `block`'s loops inside the loop `rows` (the block must be inside it)."""
    loops = [sch.get(loop) for loop in sch.get_loops(block)]
    row_loop = sch.get(rows)
    at = next((i for i, loop in enumerate(loops) if loop.same_as(row_loop)), None)
    if at is None:
        raise _NotTogether("a block outside the rows")
    work = 1
    for loop in loops[at + 1:]:
        work *= int(loop.extent)
    return work


def _index_checks(sch, root) -> list:
    """The index checks the kernel's blocks ask for (read before inlining moves their reads elsewhere);
    a check of indices the kernel computes names the buffer its block stores them in."""
    checks: list[IndexCheck] = []
    for block in sch.get_child_blocks(root):
        text = sch.get(block).annotations.get(CHECK_ATTR)
        if text is None:
            continue
        check = IndexCheck.parse(str(text))
        if check.arg < 0:
            check = dataclasses.replace(check, buffer=sch.get(block).writes[0].source.name)
        if check not in checks:
            checks.append(check)
    return checks


def _stores_indices(sch, block) -> bool:
    """Whether `block` stores computed indices for a check after the body (it must not be inlined)."""
    text = sch.get(block).annotations.get(CHECK_ATTR)
    return text is not None and IndexCheck.parse(str(text)).arg < 0


def _parallel(sch, loops, work: int) -> None:
    """Fuse `loops` and run them in parallel when the block does enough work to pay for it."""
    if not loops:
        return
    loop = sch.fuse(*loops) if len(loops) > 1 else loops[0]
    if _extent(sch, loop) >= MIN_PARALLEL_EXTENT and work >= MIN_PARALLEL_WORK:
        sch.parallel(loop)


def _schedule_spatial(sch, block) -> None:
    loops = sch.get_loops(block)
    if not loops:
        return
    extents = [_extent(sch, loop) for loop in loops]
    work = 1
    for e in extents:
        work *= e
    if sch.get(block).annotations.get(FLAT_LOOPS_ATTR) is not None:
        _schedule_flat(sch, loops, work)
        return
    last_lanes = lanes_for(extents[-1])
    if len(loops) > 1:
        # Keep the innermost axis on its own (vectorized when it divides evenly): index
        # arithmetic and broadcast operands then stay out of the inner loop.
        if last_lanes is not None:
            outer, inner = sch.split(loops[-1], [None, last_lanes])
            try_step(lambda: sch.vectorize(inner))
        if work >= MIN_PARALLEL_WORK:
            try_step(lambda: sch.parallel(sch.fuse(*loops[:-1])))
        if last_lanes is None and extents[-1] >= 2 * VECTOR_LANES[0]:
            try_step(lambda: _vectorize_whole_vectors(sch, loops[-1], extents[-1]))
        return
    fused = sch.fuse(*loops) if len(loops) > 1 else loops[0]
    lanes = lanes_for(work)
    if lanes is not None and work >= 2 * lanes:
        outer, inner = sch.split(fused, [None, lanes])
        try_step(lambda: sch.vectorize(inner))
        if work >= MIN_PARALLEL_WORK:
            try_step(lambda: sch.parallel(outer))
    elif work >= MIN_PARALLEL_WORK:
        try_step(lambda: sch.parallel(fused))


def _vectorize_whole_vectors(sch, loop, extent: int) -> None:
    """Vectorize a row no lane count divides: its whole vectors run apart from the last few elements.

    LLVM would vectorize the plain loop only where it can prove the buffers apart, which it cannot for
    two buffers the kernel allocates itself (a fused producer's result read by the next stage).
    """
    lanes = VECTOR_LANES[0]
    whole, _ = sch.loop_partition(loop, [extent - extent % lanes, None])
    for child in sch.get_child_blocks(whole):
        _, vector = sch.split(sch.get_loops(child)[-1], [None, lanes])
        sch.vectorize(vector)


def _schedule_flat(sch, loops, work: int) -> None:
    """A block marked FLAT_LOOPS_ATTR (elementwise over buffers of one shape): its loops fused into one, parallel.

    Not split: the fused loop's buffer indices then simplify to the loop variable itself (split, they stay
    divisions and TVM's vector loads become gathers), and LLVM vectorizes the contiguous loop, whatever the
    length of the innermost axis. The other blocks of a multi-output compute share the loop nest.
    """
    if any(int(sch.get(loop).kind) for loop in loops):
        return  # the loop nest of an earlier block of the same compute: already scheduled
    fused = sch.fuse(*loops) if len(loops) > 1 else loops[0]
    if work >= MIN_PARALLEL_WORK:
        try_step(lambda: sch.parallel(fused))


def _is_pooling(sch, block) -> bool:
    """Whether `block` is a TOPI pooling window reduction (TOPI tags it with its schedule rule)."""
    rule = sch.get(block).annotations.get("schedule_rule")
    return rule is not None and str(rule).startswith("meta_schedule.pool")


def _schedule_reduction(sch, block) -> None:
    loops = sch.get_loops(block)
    kinds = _iter_kinds(sch, block)
    if len(loops) != len(kinds):
        return
    spatial = [loop for loop, is_reduce in zip(loops, kinds) if not is_reduce]
    reduce = [loop for loop, is_reduce in zip(loops, kinds) if is_reduce]
    work = 1
    for loop in loops:
        work *= _extent(sch, loop)
    reordered = try_step(lambda: sch.reorder(*spatial, *reduce))
    if reordered and _reads_rows(sch, reduce[-1]) and _row_reduction_applies(sch, block):
        # Rows reduced along their contiguous last axis: vector lanes split each row, not across rows.
        try_step(lambda: _parallel(sch, spatial, work))
        try_step(lambda: _vectorize_row_reduction(sch, block, reduce[-1]))
        return
    if not spatial:
        return
    last = spatial[-1]
    extent = _extent(sch, last)
    lanes = lanes_for(extent)
    if lanes is not None and reordered:
        width = next(lanes * k for k in (4, 2, 1) if extent % (lanes * k) == 0)
        # Accumulate a register tile of `width` outputs, then copy it out.
        tile = sch.cache_write(block, 0, "global")
        outer, inner = sch.split(last, [None, width])
        sch.reorder(outer, *reduce, inner)
        vector_outer, vector = sch.split(inner, [None, lanes])
        try_step(lambda: sch.unroll(vector_outer))
        try_step(lambda: sch.vectorize(vector))
        sch.reverse_compute_at(tile, outer)
        try_step(lambda: sch.vectorize(sch.get_loops(tile)[-1]))
        if len(spatial) > 1:
            _parallel(sch, spatial[:-1], work)
        try_step(lambda: sch.decompose_reduction(block, reduce[0]))
        return
    if (_is_pooling(sch, block) and len(spatial) > 1 and extent <= MAX_ROW_TILE
            and try_step(lambda: sch.reorder(*spatial[:-1], *reduce, last))):
        # A short row of pooling windows that no vector width divides: accumulate the whole row in
        # registers (the window loops outside it), one vector of `extent` lanes.
        tile = sch.cache_write(block, 0, "global")
        try_step(lambda: sch.vectorize(last))
        sch.reverse_compute_at(tile, spatial[-2])
        try_step(lambda: sch.vectorize(sch.get_loops(tile)[-1]))
        _parallel(sch, spatial[:-1], work)
        try_step(lambda: sch.decompose_reduction(block, reduce[0]))
        return
    if reordered:
        try_step(lambda: _parallel(sch, spatial, work))


def _bindings(sch, loop):
    """The block `loop` directly holds and its (iterator, bound expression) pairs; (None, []) if it holds none."""
    realize = sch.get(loop).body
    if not hasattr(realize, "iter_values"):
        return None, []
    return realize.block, list(zip(realize.block.iter_vars, realize.iter_values))


def _uses(expr, var) -> bool:
    return any(v.same_as(var) for v in _tvm.tirx.analysis.undefined_vars(expr))


def _reads_rows(sch, loop) -> bool:
    """Whether `loop`, a block's innermost (reduction) loop, walks the last axis of every buffer the block
    reads with it, and runs long enough to fill the vector lanes several times: its reads are then rows."""
    if _extent(sch, loop) < ROW_REDUCTION_MIN:
        return False
    block, bindings = _bindings(sch, loop)
    loop_var = sch.get(loop).loop_var
    var = next((iter_var.var for iter_var, value in bindings if value.same_as(loop_var)), None)
    if var is None:
        return False
    used = [[_uses(r.min, var) for r in region.region] for region in block.reads]
    return any(axes[-1] for axes in used) and not any(any(axes[:-1]) for axes in used)


def _row_reduction_applies(sch, block) -> bool:
    """Whether `_vectorize_row_reduction` goes through, tried on a copy of the schedule: TVM's rfactor knows only
    the reducers in its registry (sum, product, min, max, ...), not a NaN-keeping select, and a step failing
    halfway would leave the row loop split with a predicate in it."""
    trial = s_tir.Schedule(sch.mod)

    def attempt():
        copy = trial.get_sblock(sch.get(block).name_hint)
        _vectorize_row_reduction(trial, copy, trial.get_loops(copy)[-1])

    return try_step(attempt)


def _first_reduction_loop(sch, block):
    """The outermost loop a reduction iterator of `block` (directly under its innermost loop) is bound to."""
    loops = sch.get_loops(block)
    _, bindings = _bindings(sch, loops[-1])
    return next(loop for loop in loops if any(_is_reduction(iter_var) and _uses(value, sch.get(loop).loop_var)
                                              for iter_var, value in bindings))


def _vectorize_row_reduction(sch, block, loop) -> None:
    """Split a row reduction into REDUCTION_LANES partial results that accumulate in vector lanes (rfactor),
    then reduce the lanes once per row: without fast-math LLVM keeps a scalar sum or max in order, one
    element per add latency. A row length no lane count divides runs its last partial vector apart, so the
    main loop carries no predicate. The partials start above the outermost reduction loop (a reduction over
    several axes, e.g. N, H and W, keeps them across its outer axes)."""
    extent = _extent(sch, loop)
    outer, lane = sch.split(loop, [None, REDUCTION_LANES])
    factor_axis = len(sch.get(block).writes[0].region)
    partial = sch.rfactor(lane, factor_axis)
    init = sch.decompose_reduction(partial, _first_reduction_loop(sch, partial))
    try_step(lambda: sch.vectorize(sch.get_loops(init)[-1]))
    if extent % REDUCTION_LANES == 0:
        try_step(lambda: sch.vectorize(sch.get_loops(partial)[-1]))
        return
    # The partitioned loops keep the split's predicate in TIR, so TVM will not vectorize them; lowering drops it
    # from the whole vectors' loop (provably true there), which LLVM then vectorizes.
    sch.loop_partition(sch.get_loops(partial)[-2], [extent // REDUCTION_LANES, None])


def schedule_around(func, anchor_schedule, anchor_blocks: frozenset[str]):
    """Schedule a fused kernel whose anchor (a packed conv or matmul) brings its own schedule.

    The other blocks are folded into the anchor first: producers that feed a
    layout stage (a pad feeding a conv's packing) and intermediate epilogue ops
    are inlined (producers feeding the reduction itself stay a separate loop nest
    inside the kernel), and the final
    epilogue op is inlined into the anchor's output block. Then the anchor's
    schedule runs; any block left over gets the generic schedule.
    """
    sch = s_tir.Schedule(func)
    root = sch.get_sblock("root")
    checks = _index_checks(sch, root)

    def others():
        return [b for b in sch.get_child_blocks(root) if sch.get(b).name_hint not in anchor_blocks]

    for block in reversed(others()):
        feeds_reduction = any(any(_iter_kinds(sch, c)) for c in sch.get_consumers(block))
        # Inlined into the anchor's reduction, a producer would run in its innermost loop.
        if not any(_iter_kinds(sch, block)) and not feeds_reduction and not _stores_indices(sch, block):
            try_step(lambda b=block: sch.compute_inline(b))
    for block in others():
        if not _stores_indices(sch, block):
            try_step(lambda b=block: sch.reverse_compute_inline(b))
    anchor_schedule(sch)
    for block in others():
        if any(_iter_kinds(sch, block)):
            _schedule_reduction(sch, block)
        else:
            _schedule_spatial(sch, block)
    return add_index_checks(sch.mod["main"], checks)
