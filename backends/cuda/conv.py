"""Dense 2-D convolutions on CUDA as implicit GEMMs with shared-memory tiles (the "gemm" conv algorithm).

A conv is the product of its weights, an M x K matrix (M output channels, K =
input channels x kernel height x kernel width), with the column matrix of its
input, K x N (N = batch x output height x output width). The column matrix is
never stored: each thread block computes the K-slices of it that its tile needs
straight from the input (padding as zeros) into shared memory, next to the
matching slice of the weights, and every thread accumulates a TM x TN register
tile; its TN columns are neighbours, read from shared memory as one vector.

Where the output has too few tiles to fill the GPU (small spatial sizes at
batch 1: ResNet-18's last stage has N = 49), the K dimension is split over
`split_k` blocks that write partial sums, and a second kernel adds them up and
runs the epilogue (the ops fused after the conv); so does a GEMM padded to
whole tiles, whose epilogue must not run on the padding.

The tile configuration comes from `conv_configs.json` (configurations timed on
a GPU by bench/gpu_tune.py, per architecture and conv shape) and, for a shape
not in it, from `heuristic_config`.
"""
from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Mapping

from ..kernel import ALGORITHM
from ..lowering.context import LowerContext, SelfScheduled
from ..lowering.nn import RULES as GENERIC_NN_RULES, conv_pads
from ..tvm_env import tvm
from .conv_blocks import COLUMN_BLOCK, GEMM_BLOCK, PARTIAL_BLOCK, WEIGHT_BLOCK, fold_consumers, read_index, schedule_sum
from .conv_tf32 import MmaConfig, heuristic_mma_config, schedule_mma

TUNED_CONFIGS = Path(__file__).with_name("conv_configs.json")
# The multiprocessors of the GPUs the heuristic sizes the grid for (H100 SXM: 132).
DEFAULT_SM_COUNT = 132


@dataclass(frozen=True)
class GemmConfig:
    """One thread block computes a BM x BN output tile in K-steps of BK; each of its (BM/TM) x (BN/TN) threads
    a TM x TN register tile; `split_k` blocks share one tile's K range."""

    bm: int = 64
    bn: int = 64
    bk: int = 16
    tm: int = 4
    tn: int = 4
    split_k: int = 1
    stages: int = 1  # 2: the next K-step's tiles are fetched into a second shared buffer while this one computes

    @property
    def threads(self) -> int:
        """Threads per block."""
        return (self.bm // self.tm) * (self.bn // self.tn)

    def to_json(self) -> dict[str, int]:
        """The configuration as a JSON object."""
        return asdict(self)


@dataclass(frozen=True)
class ConvShape:
    """What decides a conv's GEMM: the input's batch, channels and spatial size, the output channels, the window."""

    batch: int
    channels: int
    height: int
    width: int
    out_channels: int
    kernel: tuple[int, int]
    strides: tuple[int, int]
    dilations: tuple[int, int]
    pads: tuple[int, int, int, int]  # top, left, bottom, right

    @property
    def out_size(self) -> tuple[int, int]:
        """Output height and width."""
        (kh, kw), (sh, sw), (dh, dw) = self.kernel, self.strides, self.dilations
        top, left, bottom, right = self.pads
        return ((self.height + top + bottom - dh * (kh - 1) - 1) // sh + 1,
                (self.width + left + right - dw * (kw - 1) - 1) // sw + 1)

    @property
    def gemm(self) -> tuple[int, int, int]:
        """(M, N, K) of the implicit GEMM."""
        oh, ow = self.out_size
        return self.out_channels, self.batch * oh * ow, self.channels * self.kernel[0] * self.kernel[1]

    def key(self) -> str:
        """The shape as a key of the tuned configurations."""
        return "x".join(str(v) for v in (self.batch, self.channels, self.height, self.width, self.out_channels,
                                         *self.kernel, *self.strides, *self.dilations, *self.pads))


def gpu_rule(op_type: str, attrs: Mapping[str, Any]):
    """The GPU's own lowering rule for this op, None where the common rules apply: a Conv whose spec chose the
    "gemm" algorithm, or none."""
    if op_type == "Conv" and attrs.get(ALGORITHM) in (None, "gemm"):
        return _conv_rule
    return None


def _conv_rule(ctx: LowerContext):
    if not applies(ctx):
        return GENERIC_NN_RULES["Conv"](ctx)
    return conv_gemm(ctx, *conv_pads(ctx), arch=ctx.arch, tf32=ctx.tf32)


def applies(ctx: LowerContext) -> bool:
    """A dense (group 1) 2-D float32 conv on a GPU."""
    x, w = ctx.input_types[0], ctx.input_types[1]
    return (ctx.gpu and x is not None and w is not None and x.rank == 4 and w.rank == 4
            and ctx.attr("group", 1) == 1 and x.dtype == "float32" and w.dtype == "float32")


def conv_shape(ctx: LowerContext, before, after) -> ConvShape:
    """The ConvShape of a conv node (pads from backends/lowering/nn.conv_pads)."""
    batch, channels, height, width = ctx.input_types[0].shape
    out_channels, _, kh, kw = ctx.input_types[1].shape
    return ConvShape(batch, channels, height, width, out_channels, (kh, kw),
                     tuple(ctx.attr("strides") or (1, 1)), tuple(ctx.attr("dilations") or (1, 1)),
                     (before[0], before[1], after[0], after[1]))


def heuristic_config(m: int, n: int, k: int, sm_count: int = DEFAULT_SM_COUNT) -> GemmConfig:
    """A tile configuration for an M x N x K product when none was timed.

    The largest square-ish tile that still gives every multiprocessor a block,
    preferring one that divides the output (no padding: the epilogue runs in the
    GEMM kernel itself); then K is split until there are about two blocks per
    multiprocessor, as long as each split keeps at least 8 K-steps (fewer would
    spend the time on the partial sums).
    """
    candidates = [GemmConfig(128, 128, 8, 8, 8), GemmConfig(64, 128, 8, 4, 8), GemmConfig(64, 64, 16, 4, 4),
                  GemmConfig(32, 64, 16, 2, 4), GemmConfig(32, 32, 16, 2, 2)]
    viable = [c for c in candidates if c.bm <= max(32, m) and c.bn <= max(32, n)]
    filling = [c for c in viable if _blocks(m, n, c) >= sm_count]
    config = next((c for c in filling if m % c.bm == 0 and n % c.bn == 0), filling[0] if filling else viable[-1])
    split = 1
    while _blocks(m, n, config) * split * 2 <= 2 * sm_count and k // (config.bk * split * 2) >= 8:
        split *= 2
    return replace(config, split_k=split)


def _blocks(m: int, n: int, config: GemmConfig) -> int:
    return -(-m // config.bm) * -(-n // config.bn)


@functools.lru_cache(maxsize=1)
def _tuned() -> Mapping[str, Any]:
    if not TUNED_CONFIGS.exists():
        return {}
    return json.loads(TUNED_CONFIGS.read_text())


def chosen_config(shape: ConvShape, arch: str | None, tf32: bool = False) -> tuple[GemmConfig | MmaConfig, bool]:
    """The configuration timed best on this architecture for this shape, else the heuristic's; and whether it was
    timed.

    With `tf32` (tensor cores allowed, not required) it is the faster of the shape's timed tensor-core and SIMT
    configurations: at batch 1 ResNet-18's SIMT tiles beat its TF32 ones by up to 5x on an H200 (small GEMMs
    leave the tensor cores waiting on the column gathers). A shape whose tensor-core tiles were never timed gets
    the tensor-core heuristic.
    """
    archs = _tuned().get("archs", {})
    simt = archs.get(arch or "", {}).get(shape.key())
    if tf32:
        mma = archs.get(tuned_arch_key(arch, True), {}).get(shape.key())
        if mma is None:
            return heuristic_mma_config(*shape.gemm), False
        if simt is None or mma["ms"] <= simt["ms"]:
            return MmaConfig(**mma["config"]), True
    if simt is not None:
        return GemmConfig(**simt["config"]), True
    return heuristic_config(*shape.gemm), False


def tuned_arch_key(arch: str | None, tf32: bool) -> str:
    """The key of an architecture's timed configurations in conv_configs.json ("sm_90", or "sm_90+tf32")."""
    return f"{arch or ''}+tf32" if tf32 else arch or ""


def conv_gemm(ctx: LowerContext, before, after, config: GemmConfig | MmaConfig | None = None,
              arch: str | None = None, tf32: bool = False):
    """The conv as an implicit GEMM (plus bias) in the NCHW output layout, with its CUDA schedule.

    The GEMM is padded to whole tiles (zero weights and columns beyond the real
    ones), so no loop needs a bounds check and no thread reads past the input.
    A padded GEMM (or one split over K) writes its tiles to a buffer of partial
    products; a second kernel over the real outputs only sums them and runs the
    epilogue: folded into the tiles, the epilogue would also write the padding,
    past the end of the output.

    With `tf32` (or an MmaConfig) the product runs on tensor cores
    (cuda/conv_tf32.py): the staged weights and columns are rounded to TF32
    (10-bit mantissa, as cuDNN's TF32 convs do) and products accumulate in
    float32; its tiles always go through the partial-product buffer.
    """
    mod = tvm()
    te, tirx = mod.te, mod.tirx
    shape = conv_shape(ctx, before, after)
    config = config or chosen_config(shape, arch, tf32)[0]
    tensor_cores = isinstance(config, MmaConfig)
    staged = round_to_tf32 if tensor_cores else (lambda value: value)
    x, w, bias = ctx.input(0), ctx.input(1), ctx.input(2)
    (kh, kw), (sh, sw), (dh, dw) = shape.kernel, shape.strides, shape.dilations
    top, left = shape.pads[:2]
    oh, ow = shape.out_size
    m, n, k = shape.gemm
    window, plane = kh * kw, oh * ow
    mp, np_, kp = _round_up(m, config.bm), _round_up(n, config.bn), _round_up(k, config.bk * config.split_k)
    zero = tirx.const(0.0, "float32")

    def column(r, j):
        image, position = tirx.min(j // plane, shape.batch - 1), j % plane
        channel = tirx.min(r // window, shape.channels - 1)
        y = position // ow * sh + r // kw % kh * dh - top
        xx = position % ow * sw + r % kw * dw - left
        inside = tirx.all(r < k, j < n, y >= 0, y < shape.height, xx >= 0, xx < shape.width)
        return staged(tirx.if_then_else(inside, x[image, channel, y, xx], zero))

    def weight(i, r):
        inside = tirx.all(i < m, r < k)
        return staged(tirx.if_then_else(inside, w[tirx.min(i, m - 1), tirx.min(r // window, shape.channels - 1),
                                                  r // kw % kh, r % kw], zero))

    columns = te.compute((kp, np_), column, name=COLUMN_BLOCK)
    weights = te.compute((mp, kp), weight, name=WEIGHT_BLOCK)
    two_kernels = tensor_cores or config.split_k > 1 or (mp, np_) != (m, n)
    if two_kernels:
        per_split = kp // config.split_k
        rk = te.reduce_axis((0, per_split), name="rk")
        partial = te.compute((config.split_k, mp, np_),
                             lambda s, i, j: te.sum(weights[i, s * per_split + rk] * columns[s * per_split + rk, j],
                                                    axis=rk),
                             name=PARTIAL_BLOCK)
        rs = te.reduce_axis((0, config.split_k), name="rs")
        gemm = te.compute((m, n), lambda i, j: te.sum(partial[rs, i, j], axis=rs), name=GEMM_BLOCK)
    else:
        rk = te.reduce_axis((0, kp), name="rk")
        gemm = te.compute((m, n), lambda i, j: te.sum(weights[i, rk] * columns[rk, j], axis=rk), name=GEMM_BLOCK)
    def output(b, i, y, xx):
        value = gemm[i, b * plane + y * ow + xx]
        return value if bias is None else value + bias[i]

    out = te.compute((shape.batch, m, oh, ow), output, name="conv")
    if tensor_cores:
        return SelfScheduled([out], functools.partial(schedule_mma, config=config))
    return SelfScheduled([out], functools.partial(schedule_gemm, config=config, two_kernels=two_kernels))


def round_to_tf32(value):
    """`value` (float32) rounded to the nearest TF32 number, ties away from zero: the low 13 mantissa bits cleared
    after adding half of their range (tensor cores would otherwise truncate them)."""
    tirx = tvm().tirx
    bits = tirx.reinterpret("uint32", value)
    rounded = (bits + tirx.const(0x1000, "uint32")) & tirx.const(0xFFFFE000, "uint32")
    return tirx.reinterpret("float32", rounded)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def schedule_gemm(sch, config: GemmConfig, two_kernels: bool) -> None:
    """Schedule the implicit GEMM and fold the ops after it (the output view, the bias, the fused epilogue) into
    the block that writes its result (see module docstring): the tiles' own, or with `two_kernels` (partial
    products, conv_gemm) the sum's."""
    if two_kernels:
        schedule_sum(sch, sch.get_sblock(GEMM_BLOCK))
        _schedule_tiles(sch, sch.get_sblock(PARTIAL_BLOCK), config, partial=True)
    else:
        _schedule_tiles(sch, sch.get_sblock(GEMM_BLOCK), config, partial=False)


def _schedule_tiles(sch, block, config: GemmConfig, partial: bool) -> None:
    """The tiled GEMM: `partial`, the partial products (split axis first, the sum kernel takes the epilogue);
    else the result itself, the ops after it folded into its write-back."""
    local = sch.cache_write(block, 0, "local")
    if not partial:
        fold_consumers(sch, local)
    loops = sch.get_loops(block)
    split_loop, (i, j, r) = (loops[0], loops[1:]) if partial else (None, loops)
    bi, ti, ii = sch.split(i, [None, config.bm // config.tm, config.tm])
    bj, tj, ij = sch.split(j, [None, config.bn // config.tn, config.tn])
    ro, ri = sch.split(r, [None, config.bk])
    if split_loop is None:
        sch.reorder(bi, bj, ti, tj, ro, ri, ii, ij)
    else:
        sch.reorder(split_loop, bi, bj, ti, tj, ro, ri, ii, ij)
        sch.bind(split_loop, "blockIdx.z")
    sch.bind(bi, "blockIdx.y")
    sch.bind(bj, "blockIdx.x")
    sch.bind(ti, "threadIdx.y")
    sch.bind(tj, "threadIdx.x")
    sch.reverse_compute_at(local, tj)
    for name in (COLUMN_BLOCK, WEIGHT_BLOCK):
        staged = sch.get_sblock(name)
        sch.set_scope(staged, 0, "shared")
        sch.compute_at(staged, ro)
        fused = sch.fuse(*sch.get_loops(staged)[-2:])
        _, ty, tx = sch.split(fused, [None, config.bm // config.tm, config.bn // config.tn])
        sch.bind(ty, "threadIdx.y")
        sch.bind(tx, "threadIdx.x")
    column_registers = sch.cache_read(block, read_index(sch, block, COLUMN_BLOCK), "local")
    sch.compute_at(column_registers, ri)
    sch.vectorize(sch.get_loops(column_registers)[-1])
    if config.stages == 2:
        sch.annotate(ro, "software_pipeline_stage", [0, 0, 1])
        sch.annotate(ro, "software_pipeline_order", [0, 1, 2])
    sch.decompose_reduction(block, ro)
    for loop in (ri, ii, ij):
        sch.unroll(loop)
