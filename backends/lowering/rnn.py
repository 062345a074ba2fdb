"""LSTM and GRU as hand-written TIR kernels (the recurrence has no TE form).

Per direction: project every time step's input (X·Wᵀ + biases), then walk the
sequence doing only the recurrent matrix-vector product and the gate
arithmetic. Directions of a bidirectional layer run in parallel.

The products take one of two forms (`_matvec`). Over many steps the kernel
reads W and R transposed (constants transposed at compile time,
backends/cpu/packing.py; others by the kernel first), then each product is
multiply-adds vectorized along the gate rows; over a few steps that transpose costs more than all the products
(silero_vad's one-step LSTM: 2 ms of its 2.06), so the products read the
weights in their ONNX layout, as dot products vectorized along each row.
The transposed form walks the gate rows in blocks of up to BLOCK lanes whose
running sums stay in registers over the whole product, back and forth from one
step to the next; the input projection is a GEMM over all steps in register
tiles of several rows, and the weights are transposed in tiles. Gate activations are
rational approximations (`_fast_tanh`) so that they vectorize along the hidden
units like the rest of the step.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

from ..cpu.packing import RNN_ROW_PAD, RNN_TRANSPOSED, rnn_reads_transposed
from ..tvm_env import tvm
from .context import LowerContext

_tvm = tvm()
from tvm.script.ir_builder import IRBuilder  # noqa: E402
from tvm.script.ir_builder import tirx as T  # noqa: E402

LANES = 16
# Gate rows whose running sums one product keeps in registers (8 AVX2 or 4 AVX-512 registers). Measured on
# gru_classifier's GRU (AVX-512): 32 rows 0.39 ms, 64 0.29, 128 0.29 (and 128 would spill on AVX2).
BLOCK = 64
# The input projection is a GEMM (steps × batch rows of X times Wᵀ) in register tiles of PROJECTION_ROWS rows ×
# PROJECTION_LANES gate rows: 16 AVX-512 vectors of running sums, each weight vector loaded once for four rows and
# each input value broadcast once for four vectors. A tile of one row and 8 vectors (before) loaded a weight vector
# per FMA: lstm_tagger's second layer (64 steps, 512 inputs, 1024 gate rows each way) spent 0.89 ms in it on an AMD
# Zen 4, which loads one 64-byte vector per cycle, and 0.6 ms in these tiles (the layer alone: 1.53 → 1.31 ms).
PROJECTION_ROWS = 4
PROJECTION_LANES = 64
# Columns of Wᵀ one pass of the projection reads: 16 KiB of its block, half of a 32 KiB L1 (AMD Zen 4's).
PROJECTION_TILE_K = 64
# Side of the square tiles in which the kernel transposes the weights.
TRANSPOSE_TILE = 16


@dataclass(frozen=True)
class PrimFuncResult:
    """A rule's result when it writes the whole kernel itself (arguments: runtime inputs, then outputs)."""

    func: object


@contextlib.contextmanager
def _vector_loop(extent: int, vectorize: bool = True):
    """Loop over `extent`, vectorized LANES at a time where it divides evenly; yields the index."""
    if not vectorize or extent % LANES or extent < LANES:
        with T.serial(0, extent) as j:
            yield j
        return
    with T.serial(0, extent // LANES) as outer:
        with T.vectorized(0, LANES) as inner:
            yield outer * LANES + inner


@dataclass(frozen=True)
class _Weights:
    """A weight tensor of shape [dirs, rows, n] (W or R), and its transpose [dirs, n, rows + RNN_ROW_PAD] when the kernel
    reads one."""

    tensor: object
    transposed: object
    part: object  # [dirs, LANES] partial sums of the dot-product form
    block: object  # [BLOCK] running sums of the transposed form (None on GPUs)
    projection: tuple = ()  # PROJECTION_ROWS buffers [PROJECTION_LANES], the projection's running sums (CPU only)


def _block_size(rows: int, vectorize: bool, most: int = BLOCK) -> int:
    """The largest block of LANES multiples up to `most` that divides `rows` (0: none, products go row by row)."""
    if not vectorize:
        return 0
    return next((size for size in range(most, LANES - 1, -LANES) if rows % size == 0), 0)


def _matvec(weights: _Weights, d, out, where, rows: int, n: int, x, base, vectorize: bool, offset: int = 0,
            backwards=False) -> None:
    """out[where(j)] = base(j) + Σ_k<n x(k) · weights[d, offset + j, k] for each j < rows. `backwards` (an
    expression): walk the transposed weights' blocks last to first."""
    if weights.transposed is not None:
        wt = weights.transposed
        size = _block_size(rows, vectorize)
        if not size:
            with T.serial(0, rows) as j:
                T.buffer_store(out, base(j), where(j))
            with T.serial(0, n) as k:
                with T.serial(0, rows) as j:
                    T.buffer_store(out, out[tuple(where(j))] + x(k) * wt[d, k, offset + j], where(j))
            return
        blocks = rows // size
        with T.serial(0, blocks) as outer:
            block = T.Select(backwards, blocks - 1 - outer, outer) if backwards is not False else outer
            _block_product(weights, d, block * size, size, n, x, base, out, where, offset)
        return
    with T.serial(0, rows) as j:
        total = _dot(weights.part, d, n, x, lambda k: weights.tensor[d, offset + j, k], vectorize)
        T.buffer_store(out, base(j) + total, where(j))


def _block_product(weights: _Weights, d, first, size: int, n: int, x, base, out, where, offset: int = 0) -> None:
    """out[where(j)] = base(j) + Σ_k<n x(k) · weights[d, offset + j, k] for the `size` rows j from `first`, through
    the transposed weights. The block's sums live in a small stack buffer that LLVM keeps in registers across the
    loop over k."""
    acc, wt = weights.block, weights.transposed
    with T.vectorized(0, size) as lane:
        T.buffer_store(acc, base(first + lane), [lane])
    with T.serial(0, n) as k:
        with T.vectorized(0, size) as lane:
            T.buffer_store(acc, acc[lane] + x(k) * wt[d, k, offset + first + lane], [lane])
    with T.vectorized(0, size) as lane:
        T.buffer_store(out, acc[lane], where(first + lane))


def _transpose(src, dst, d, rows: int, cols: int, vectorize: bool) -> None:
    """dst[d, k, j] = src[d, j, k], tile by tile: a row-by-row copy writes each element to another cache line
    (and, for lstm_tagger's 1024 gate rows, another page)."""
    tile = TRANSPOSE_TILE
    with T.serial(0, (rows + tile - 1) // tile) as row_tile:
        with T.serial(0, (cols + tile - 1) // tile) as col_tile:
            with T.serial(0, T.min(tile, cols - col_tile * tile)) as kk:
                if vectorize and rows % tile == 0:
                    rows_loop = T.vectorized(0, tile)  # gathers one column of the tile, writes one vector
                else:
                    rows_loop = T.serial(0, T.min(tile, rows - row_tile * tile))
                with rows_loop as jj:
                    j, k = row_tile * tile + jj, col_tile * tile + kk
                    T.buffer_store(dst, src[d, j, k], [d, k, j])


def _dot(part, d, n: int, a, b, vectorize: bool):
    """The sum over k < n of a(k) · b(k): LANES partial sums in part[d, :] over the whole vectors, their
    total, then the last n % LANES products one by one."""
    lanes = LANES if vectorize and n >= LANES else 1
    with T.serial(0, lanes) as lane:
        T.buffer_store(part, T.float32(0.0), [d, lane])
    with T.serial(0, n // lanes) as outer:
        with (T.vectorized if lanes > 1 else T.serial)(0, lanes) as lane:
            k = outer * lanes + lane
            T.buffer_store(part, part[d, lane] + a(k) * b(k), [d, lane])
    total = part[d, 0]
    for lane in range(1, lanes):
        total = total + part[d, lane]
    for k in range(n - n % lanes, n):
        total = total + a(k) * b(k)
    return total


# Odd numerator and even denominator coefficients of tanh's rational approximation on [-9, 9] (Eigen's, as TVM's
# fast_tanh): relative error ~1e-7 in float32, and only multiply-adds and one division, which vectorize.
_TANH_NUMERATOR = (-2.76076847742355e-16, 2.00018790482477e-13, -8.60467152213735e-11, 5.12229709037114e-08,
                   1.48572235717979e-05, 6.37261928875436e-04, 4.89352455891786e-03)
_TANH_DENOMINATOR = (1.19825839466702e-06, 1.18534705686654e-04, 2.26843463243900e-03, 4.89352518554385e-03)


def _polynomial(coefficients, x):
    """Horner's rule over `coefficients`, highest power first."""
    total = T.float32(coefficients[0])
    for coefficient in coefficients[1:]:
        total = total * x + T.float32(coefficient)
    return total


def _fast_tanh(x):
    """tanh(x) as a vectorizable rational function (beyond ±9 float32's tanh is ±1)."""
    x = T.max(T.min(x, T.float32(9.0)), T.float32(-9.0))
    square = x * x
    return x * _polynomial(_TANH_NUMERATOR, square) / _polynomial(_TANH_DENOMINATOR, square)


def _sigmoid(x):
    """σ(x) = (1 + tanh(x / 2)) / 2, through the vectorizable tanh."""
    return T.float32(0.5) + T.float32(0.5) * _fast_tanh(T.float32(0.5) * x)


def _check(ctx: LowerContext, gates: int) -> None:
    defaults = ("Sigmoid", "Tanh", "Tanh") if gates == 4 else ("Sigmoid", "Tanh")
    direction = ctx.attr("direction", "forward")
    count = 2 if direction == "bidirectional" else 1
    activations = ctx.attr("activations")
    if activations and tuple(activations) != defaults * count:
        raise ctx.fail(f"activations {list(activations)} are not supported (only the defaults {list(defaults)})")
    if gates == 4 and ctx.input(7) is not None:
        raise ctx.fail("peephole weights (input P) are not supported")
    lens = ctx.data(4)
    steps = ctx.input_types[0].shape[1 if ctx.attr("layout", 0) else 0]
    if lens is not None and (lens != steps).any():
        raise ctx.fail("sequence_lens shorter than the sequence is not supported")
    if str(ctx.input_types[0].dtype) != "float32":
        raise ctx.fail("only float32 recurrences are supported")


def _recurrent(ctx: LowerContext, gates: int):
    _check(ctx, gates)
    layout = ctx.attr("layout", 0)
    x_type, w_type = ctx.input_types[0], ctx.input_types[1]
    steps, batch, width = (x_type.shape[1], x_type.shape[0], x_type.shape[2]) if layout else x_type.shape
    # Constant weights arrive transposed (backends/cpu/packing.py); others are transposed here on every call.
    packed = bool(ctx.attr(RNN_TRANSPOSED, 0))
    hidden = ctx.attr("hidden_size")
    dirs, gh = w_type.shape[0], gates * hidden
    clip = ctx.attr("clip")
    reverse_only = ctx.attr("direction", "forward") == "reverse"
    lbr = ctx.attr("linear_before_reset", 0)
    input_forget = ctx.attr("input_forget", 0)
    present = [i for i, t in enumerate(ctx.input_types) if t is not None and i != 4]
    outs = [i for i, t in enumerate(ctx.output_types) if t is not None]

    with IRBuilder() as ib:
        with T.prim_func():
            T.func_name("main")
            args = {i: T.arg(f"in{i}", T.buffer(ctx.input_types[i].shape, "float32")) for i in present}
            results = {i: T.arg(f"out{i}", T.buffer(ctx.output_types[i].shape, "float32")) for i in outs}
            X, W, R = args[0], args[1], args[2]
            bias = args.get(3)
            h0, c0 = args.get(5), args.get(6) if gates == 4 else None
            part = T.alloc_buffer((dirs, LANES), "float32")
            transpose = rnn_reads_transposed(x_type)
            if packed:
                wt, rt = W, R
            else:
                wt = T.alloc_buffer((dirs, width, gh + RNN_ROW_PAD), "float32") if transpose else None
                rt = T.alloc_buffer((dirs, hidden, gh + RNN_ROW_PAD), "float32") if transpose else None
            gx = T.alloc_buffer((dirs, steps, batch, gh), "float32")
            acc = T.alloc_buffer((dirs, batch, gh), "float32")
            h = T.alloc_buffer((dirs, batch, hidden), "float32")
            c = T.alloc_buffer((dirs, batch, hidden), "float32")
            rh = T.alloc_buffer((dirs, batch, hidden), "float32")
            with contextlib.ExitStack() as device:
                if ctx.gpu:
                    # The recurrence is sequential: one GPU thread walks it (correct, not fast).
                    device.enter_context(T.launch_thread("blockIdx.x", 1))
                    device.enter_context(T.launch_thread("threadIdx.x", 1))
                    loop = T.serial(0, dirs)
                else:
                    loop = T.parallel(0, dirs) if dirs > 1 else T.serial(0, dirs)
                d = device.enter_context(loop)
                # Each direction's own block sums: declared inside its (parallel) loop, on the stack.
                block = None if ctx.gpu else T.alloc_buffer((BLOCK,), "float32")
                # One buffer per row of the tile: TVM keeps each under 1 KiB on the stack (a 4 × 64 one would be a
                # heap workspace, whose sums LLVM stores after every multiply-add).
                projection = () if ctx.gpu else tuple(T.alloc_buffer((PROJECTION_LANES,), "float32")
                                                      for _ in range(PROJECTION_ROWS))
                w_weights, r_weights = _Weights(W, wt, part, block, projection), _Weights(R, rt, part, block)
                if transpose and not packed:
                    _transpose(W, wt, d, gh, width, not ctx.gpu)
                    _transpose(R, rt, d, gh, hidden, not ctx.gpu)

                def start(j):
                    if bias is None:
                        return T.float32(0.0)
                    # GRU keeps the recurrent bias of its candidate gate for the reset product.
                    recurrent_bias = bias[d, gh + j] if gates == 4 else T.if_then_else(
                        j < 2 * hidden, bias[d, gh + j], T.float32(0.0))
                    return bias[d, j] + recurrent_bias

                _project(w_weights, d, X, gx, start, steps, batch, gh, width, layout, not ctx.gpu)
                with T.serial(0, batch) as b:
                    with T.serial(0, hidden) as q:
                        T.buffer_store(h, h0[d, b, q] if h0 is not None else T.float32(0.0), [d, b, q])
                        if gates == 4:
                            T.buffer_store(c, c0[d, b, q] if c0 is not None else T.float32(0.0), [d, b, q])
                with T.serial(0, steps) as s:
                    if reverse_only:
                        t = steps - 1 - s
                    elif dirs > 1:
                        t = T.Select(d == 1, steps - 1 - s, s)
                    else:
                        t = s
                    with T.serial(0, batch) as b:
                        _step(gates, d, t, b, gx, acc, r_weights, h, c, rh, bias, hidden, gh, clip, lbr, input_forget, results,
                              layout, not ctx.gpu)
                with T.serial(0, batch) as b:
                    with T.serial(0, hidden) as q:
                        if 1 in results:
                            T.buffer_store(results[1], h[d, b, q], [b, d, q] if layout else [d, b, q])
                        if 2 in results:
                            T.buffer_store(results[2], c[d, b, q], [b, d, q] if layout else [d, b, q])
    return [PrimFuncResult(ib.get())]


def _project(weights: _Weights, d, X, gx, start, steps: int, batch: int, gh: int, width: int, layout: int,
             vectorize: bool) -> None:
    """gx[d, t, b, :] = start + X[t, b, :] · Wᵀ for every step and batch row. With transposed weights, block by
    block of gate rows and tile by tile of Wᵀ's columns (in L1 while every row reads them), in register tiles of
    PROJECTION_ROWS rows (`_tile_product`)."""

    def x_at(row, k):
        t, b = row // batch, row % batch
        return X[b, t, k] if layout else X[t, b, k]

    def at(row, j):
        return [d, row // batch, row % batch, j]

    size = _block_size(gh, vectorize, PROJECTION_LANES) if weights.transposed is not None else 0
    if not size:
        with T.serial(0, steps) as t:
            with T.serial(0, batch) as b:
                _matvec(weights, d, gx, lambda j: [d, t, b, j], gh, width,
                        lambda k: x_at(t * batch + b, k), start, vectorize)
        return
    rows = steps * batch
    tiled = rows - rows % PROJECTION_ROWS
    with T.serial(0, gh // size) as outer:
        first = outer * size
        for first_k in range(0, width, PROJECTION_TILE_K):
            count = min(PROJECTION_TILE_K, width - first_k)

            def base(row, j):
                return start(j) if first_k == 0 else gx[tuple(at(row, j))]

            if tiled:
                with T.serial(0, tiled // PROJECTION_ROWS) as tile:
                    _tile_product(weights, d, first, size, first_k, count, tile * PROJECTION_ROWS, PROJECTION_ROWS,
                                  x_at, base, gx, at)
            for row in range(tiled, rows):
                _tile_product(weights, d, first, size, first_k, count, row, 1, x_at, base, gx, at)


def _tile_product(weights: _Weights, d, first, size: int, first_k: int, count: int, first_row, rows: int, x, base,
                  out, at) -> None:
    """out[at(r, j)] = base(r, j) + Σ_{first_k ≤ k < first_k + count} x(r, k) · weights[d, j, k] for the `rows` rows r
    from `first_row` and the `size` gate rows j from `first`: a register tile (the stack buffers weights.projection,
    which LLVM keeps in registers across the loop over k; its rows are unrolled, each weight vector loaded once)."""
    sums, wt = weights.projection[:rows], weights.transposed
    for r, acc in enumerate(sums):
        with T.vectorized(0, size) as lane:
            T.buffer_store(acc, base(first_row + r, first + lane), [lane])
    with T.serial(0, count) as k:
        for r, acc in enumerate(sums):
            with T.vectorized(0, size) as lane:
                product = x(first_row + r, first_k + k) * wt[d, first_k + k, first + lane]
                T.buffer_store(acc, acc[lane] + product, [lane])
    for r, acc in enumerate(sums):
        with T.vectorized(0, size) as lane:
            T.buffer_store(out, acc[lane], at(first_row + r, first + lane))


def _clip(value, clip):
    if clip is None:
        return value
    return T.max(T.min(value, T.float32(clip)), T.float32(-clip))


def _step(gates, d, t, b, gx, acc, R: _Weights, h, c, rh, bias, hidden, gh, clip, lbr, input_forget, results, layout,
          vectorize):
    """One time step for one batch row: recurrent product, gates, new state, output."""
    # For GRU without linear_before_reset, the candidate gate's product waits for r ⊙ h.
    product = gh if gates == 4 or lbr else 2 * hidden
    # Every step reads all of R; walked in the same order each step, R a little larger than a core's L2
    # (lstm_tagger's 256 × 1024 floats: 1 MiB, the L2 of an AMD Zen 4 core) is evicted just before it is read again
    # and every step reads it all from L3. Walked back and forth, each step starts on the blocks the last one read
    # (lstm_tagger on a Zen 4, 4 alternating rounds: 2.51-2.59 → 2.46-2.54 ms).
    backwards = T.floormod(t, 2) == 1
    _matvec(R, d, acc, lambda j: [d, b, j], product, hidden, lambda k: h[d, b, k], lambda j: gx[d, t, b, j], vectorize,
            backwards=backwards)
    if gates == 4:
        with _vector_loop(hidden, vectorize) as q:
            i = _sigmoid(_clip(acc[d, b, q], clip))
            o = _sigmoid(_clip(acc[d, b, hidden + q], clip))
            f = T.float32(1.0) - i if input_forget else _sigmoid(_clip(acc[d, b, 2 * hidden + q], clip))
            g = _fast_tanh(_clip(acc[d, b, 3 * hidden + q], clip))
            T.buffer_store(c, f * c[d, b, q] + i * g, [d, b, q])
            T.buffer_store(h, o * _fast_tanh(c[d, b, q]), [d, b, q])
            _emit_y(results, layout, t, d, b, q, h)
        return
    candidate_bias = 2 * hidden + gh  # position of the candidate gate's recurrent bias in B
    if lbr:
        # acc holds gx + h·Rhᵀ for the candidate gate: keep h·Rhᵀ + Rbh for the reset product.
        with _vector_loop(hidden, vectorize) as q:
            bias_h = bias[d, candidate_bias + q] if bias is not None else T.float32(0.0)
            T.buffer_store(rh, acc[d, b, 2 * hidden + q] - gx[d, t, b, 2 * hidden + q] + bias_h, [d, b, q])
    else:
        with _vector_loop(hidden, vectorize) as q:
            T.buffer_store(rh, _sigmoid(_clip(acc[d, b, hidden + q], clip)) * h[d, b, q], [d, b, q])
        _matvec(R, d, acc, lambda q: [d, b, 2 * hidden + q], hidden, hidden, lambda k: rh[d, b, k],
                lambda q: gx[d, t, b, 2 * hidden + q] + (bias[d, candidate_bias + q] if bias is not None else T.float32(0.0)),
                vectorize, offset=2 * hidden, backwards=backwards)
    with _vector_loop(hidden, vectorize) as q:
        z = _sigmoid(_clip(acc[d, b, q], clip))
        if lbr:
            r = _sigmoid(_clip(acc[d, b, hidden + q], clip))
            candidate = _fast_tanh(_clip(gx[d, t, b, 2 * hidden + q] + r * rh[d, b, q], clip))
        else:
            candidate = _fast_tanh(_clip(acc[d, b, 2 * hidden + q], clip))
        T.buffer_store(h, (T.float32(1.0) - z) * candidate + z * h[d, b, q], [d, b, q])
        _emit_y(results, layout, t, d, b, q, h)


def _emit_y(results, layout, t, d, b, q, h) -> None:
    if 0 in results:
        T.buffer_store(results[0], h[d, b, q], [b, t, d, q] if layout else [t, d, b, q])


RULES = {
    "LSTM": lambda ctx: _recurrent(ctx, 4),
    "GRU": lambda ctx: _recurrent(ctx, 3),
}
STATIC_INPUTS = {"LSTM": {4}, "GRU": {4}}
