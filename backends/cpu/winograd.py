"""Winograd F(m×m, 3×3) convolution for 3×3, stride-1 convs: fewer multiplies, more workspace.

Weights are transformed to U = G·g·Gᵀ as (α, α, C, K) with α = m + 2, at load
(runtime/load_transforms.py: the artifact stores the 3×3 weight, a quarter of the
bytes). Per run: input tiles are gathered and transformed (V = Bᵀ·d·B, two
passes with the constants folded into the code), a
batched GEMM over the channels makes M = U·V for each of the α² points, and the
inverse transform (Aᵀ·M·A, two passes) writes the output with its epilogue.
The gathered tiles, V, M and the inverse-transformed tiles are the
workspace — about 2·α²/m² times the input and output, growing with the batch,
which is what makes micro-batching pay for it.
"""
from __future__ import annotations

import functools

import numpy as np

from ..lowering.context import LowerContext, SelfScheduled
from ..tvm_env import tvm
from .gemm_tile import PIXELS, ROW_CHOICES, tiled_gemm
from .schedule import MIN_PARALLEL_WORK, schedule_rows
from .winograd_weights import winograd_entry, winograd_weight

_tvm = tvm()
te, tir = _tvm.te, _tvm.tirx

TILE = 4


@functools.lru_cache(maxsize=None)
def transform_matrices(tile: int = TILE) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(A, B, G) of F(tile×tile, 3×3) by Cook-Toom on TVM's interpolation points (float64)."""
    from tvm.topi.nn.winograd_util import _cook_toom_convolution, _interpolation_points

    return _cook_toom_convolution(_interpolation_points(tile + 1), tile, 3)


def transform_weight(weight: np.ndarray, tile: int = TILE) -> np.ndarray:
    """(K, C, 3, 3) → U = G·g·Gᵀ laid out (α, α, C, K), float32."""
    return winograd_weight(weight, transform_matrices(tile)[2])


def weight_at_load(weight: np.ndarray, tile: int = TILE) -> dict:
    """The plan's entry that makes `transform_weight(weight, tile)` at load from `weight` itself."""
    return winograd_entry(weight, transform_matrices(tile)[2])


def applies(kernel: tuple[int, int], strides, dilations) -> bool:
    """Winograd here covers 3×3 kernels with stride 1 and no dilation."""
    return tuple(kernel) == (3, 3) and tuple(strides) == (1, 1) and tuple(dilations) == (1, 1)


def combine(matrix: np.ndarray, index, term) -> object:
    """Σ_r matrix[r, index] · term(r) for a loop variable `index`, as a select over its values.

    Each branch is a sum with constant coefficients and no zero terms; once the
    index's loop is unrolled, the select folds and only that branch remains.
    """
    rows, cols = matrix.shape
    expr = None
    for col in reversed(range(cols)):
        branch = None
        for row in range(rows):
            coefficient = float(matrix[row, col])
            if coefficient == 0.0:
                continue
            value = term(row)
            value = value if coefficient == 1.0 else value * tir.const(coefficient, "float32")
            branch = value if branch is None else branch + value
        branch = branch if branch is not None else tir.const(0.0, "float32")
        expr = branch if expr is None else tir.Select(index == col, branch, expr)
    return expr


def conv_winograd(ctx: LowerContext, before, after):
    """Dense 2-D 3×3 stride-1 conv with weights pre-transformed to (α, α, C, K)."""
    x, u, bias = ctx.input(0), ctx.input(1), ctx.input(2)
    n, c, h, wd = (int(d) for d in x.shape)
    alpha, _, _, k = (int(d) for d in u.shape)
    m = alpha - 2
    _, _, oh, ow = ctx.out_shape()
    (pt, pl) = before
    a_np, b_np, _ = transform_matrices(m)
    tiles_h, tiles_w = -(-oh // m), -(-ow // m)
    tiles = n * tiles_h * tiles_w
    padded = -(-tiles // PIXELS) * PIXELS

    def tile_input(ya, xb, ci, p):
        ni, rest = p // (tiles_h * tiles_w), p % (tiles_h * tiles_w)
        y = (rest // tiles_w) * m + ya - pt
        q = (rest % tiles_w) * m + xb - pl
        inside = tir.all(p < tiles, y >= 0, y < h, q >= 0, q < wd)
        return tir.if_then_else(inside, x[ni, ci, y, q], tir.const(0.0, x.dtype))

    # Input tiles gathered once (overlapping, zero-padded), then transformed along rows and columns.
    gathered = te.compute((alpha, alpha, c, padded), tile_input, name="wino_tiles")
    half = te.compute((alpha, alpha, c, padded),
                      lambda e, xb, ci, p: combine(b_np, e, lambda r: gathered[r, xb, ci, p]), name="wino_in_rows")
    data = te.compute((alpha, alpha, c, padded),
                      lambda e, nu, ci, p: combine(b_np, nu, lambda r: half[e, r, ci, p]), name="wino_in")
    rc = te.reduce_axis((0, c), "rc")
    product = te.compute((alpha, alpha, k, padded),
                         lambda e, nu, ko, p: te.sum(u[e, nu, rc, ko] * data[e, nu, rc, p], axis=rc), name="wino_gemm")
    out_rows = te.compute((m, alpha, k, padded),
                          lambda vh, nu, ko, p: combine(a_np, vh, lambda r: product[r, nu, ko, p]),
                          name="wino_out_rows")
    result = te.compute((m, m, k, padded),
                        lambda vh, vw, ko, p: combine(a_np, vw, lambda r: out_rows[vh, r, ko, p]), name="wino_out")

    def output(ni, ko, y, q):
        p = ni * (tiles_h * tiles_w) + (y // m) * tiles_w + q // m
        value = result[y % m, q % m, ko, p]
        return value + bias[ko] if bias is not None else value

    out = te.compute(ctx.out_shape(), output, name="wino_result")
    rows = next(r for r in ROW_CHOICES if k % r == 0)
    big = n * k * oh * ow * c * 9 >= MIN_PARALLEL_WORK * 16

    def schedule(sch) -> None:
        # Each transform runs as one pass per (channel, vector of tiles), its halves in registers.
        # Each transform's first pass is computed inside its second (in registers): two fewer
        # round trips of the tiles through memory. The gather stays its own pass.
        for name in ("wino_in_rows", "wino_out_rows"):
            sch.compute_inline(sch.get_sblock(name))
        # The gather runs one vector per row of tiles: the tile index's divisions then fold into the
        # loop indices (a vector of 16 flat tile numbers would divide per lane); it reads stride m.
        _schedule_pass(sch, "wino_tiles", tiles_w, big)
        for name in ("wino_in", "wino_out"):
            _schedule_pass(sch, name, PIXELS, big)
        tiled_gemm(sch, "wino_gemm", rows, big)
        schedule_rows(sch, "wino_result", big, ow % 4 == 0)

    return SelfScheduled([out], schedule)


def _schedule_pass(sch, name: str, lanes: int, big: bool) -> None:
    """(s0, s1, channel, tile): vectors of `lanes` tiles per channel, the small s0 × s1 loops unrolled."""
    block = sch.get_sblock(name)
    s0, s1, channel, tile = sch.get_loops(block)
    outer, inner = sch.split(tile, [None, lanes])
    sch.reorder(channel, outer, s0, s1, inner)
    fused = sch.fuse(channel, outer)
    if big:
        sch.parallel(fused)
    sch.unroll(s0)
    sch.unroll(s1)
    sch.vectorize(inner)
