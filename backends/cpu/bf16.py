"""bfloat16 dot products on AVX-512 (avx512_bf16): `vdpbf16ps`, f32 accumulation, for the bf16 conv and matmul kernels.

`vdpbf16ps acc, a, b` adds to each of acc's 16 f32 lanes i the two products
a[2i]·b[2i] + a[2i+1]·b[2i+1] of bf16 pairs. The kernels tensorize a 16-lane ×
2-pair reduction onto it: B is a (16, 2) tile of bf16 weights (16 output
channels, a pair along the reduction axis, packed that way at compile time), A
one bf16 pair of activations broadcast to every lane (LLVM folds the broadcast
into the instruction's memory operand, `{1to16}`).

TVM has no vector type LLVM's intrinsic takes (it lowers bfloat16 to i16 and
legalizes bf16 arithmetic to f32), so the kernel calls `tessel_dpbf16ps`, a
three-line LLVM function imported into the kernel's module (`pragma_import_llvm`)
that bitcasts i32 vectors to `<32 x bfloat>` and is inlined. bf16 values are
stored as uint16 bit patterns everywhere; f32 → bf16 rounds to nearest even, as
`vcvtneps2bf16` and OpenVINO/oneDNN do, and keeps NaN a NaN.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..tvm_env import tvm

# The CPU feature the kernels need (/proc/cpuinfo's flag).
CPU_FLAG = "avx512_bf16"
# Output lanes and reduction pairs of one instruction.
LANES, PAIR = 16, 2
DOT_INTRINSIC = "tessel_bf16_dot_16x2"
# The LLVM function the tensorized loop calls; imported into every bf16 kernel's module.
DOT_FUNCTION = "tessel_dpbf16ps"
DOT_LLVM = f"""
declare <16 x float> @llvm.x86.avx512bf16.dpbf16ps.512(<16 x float>, <32 x bfloat>, <32 x bfloat>)
define <16 x float> @{DOT_FUNCTION}(<16 x float> %acc, <16 x i32> %a, <16 x i32> %b) alwaysinline {{
  %x = bitcast <16 x i32> %a to <32 x bfloat>
  %y = bitcast <16 x i32> %b to <32 x bfloat>
  %r = call <16 x float> @llvm.x86.avx512bf16.dpbf16ps.512(<16 x float> %acc, <32 x bfloat> %x, <32 x bfloat> %y)
  ret <16 x float> %r
}}
"""
# The loop annotation that links DOT_LLVM into the kernel's LLVM module.
IMPORT_LLVM = "pragma_import_llvm"


def cpu_has_bf16(cpuinfo: str | Path = "/proc/cpuinfo") -> bool:
    """Whether this machine's CPU has avx512_bf16 (False where /proc/cpuinfo is missing)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return False
    return any(line.startswith("flags") and CPU_FLAG in line.split(":", 1)[1].split() for line in text.splitlines())


def to_bf16_bits(array: np.ndarray) -> np.ndarray:
    """float32 → bf16 bit patterns (uint16), rounded to nearest even; NaN stays a (quiet) NaN."""
    bits = np.ascontiguousarray(array, np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(array), np.uint16(0x7FC0), rounded)


def from_bf16_bits(bits: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (uint16) → the float32 values they are."""
    return (np.asarray(bits, np.uint16).astype(np.uint32) << 16).view(np.float32)


def round_to_bf16(array: np.ndarray) -> np.ndarray:
    """float32 values rounded to bf16 (and back to float32): what a bf16 kernel reads."""
    return from_bf16_bits(to_bf16_bits(array))


def bits_of(value):
    """TIR: the bf16 bit pattern (uint16) of a float32 expression, rounded to nearest even; NaN → quiet NaN."""
    tir, u32 = tvm().tirx, "uint32"
    bits = tir.reinterpret(u32, value)
    rounded = (bits + tir.const(0x7FFF, u32) + ((bits >> tir.const(16, u32)) & tir.const(1, u32))) >> tir.const(16, u32)
    return tir.Select(value != value, tir.const(0x7FC0, "uint16"), tir.Cast("uint16", rounded))


def value_of(bits):
    """TIR: the float32 value of a bf16 bit pattern (uint16). The tensorized loop's description reads it so."""
    tir = tvm().tirx
    return tir.reinterpret("float32", tir.Cast("uint32", bits) << tir.const(16, "uint32"))


@dataclass(frozen=True)
class NextBlockPrefetch:
    """Where a conv's dot products prefetch the next output-channel block's weights, spread over its output rows.

    A conv kernel computes each block of output channels row by row; every row reads the block's weights again.
    The first row waits on memory for them when they do not stay in a core's L2 from one run to the next (ResNet-18's
    stage-4 convs: 4.7 MB of bf16 weights, 0.29 ms each in the model against 0.24 alone with its weights warm;
    0.25-0.26 in the model with this prefetch). The first pixel of each register tile prefetches (to L2) the weight
    vector `block` elements further, the same step of the next block, in the steps t of the reduction for which
    t - r ≡ 0 (mod `spread`), r the packed input row the step reads: each output row prefetches a different
    1/spread of the next block, all of it by the block's last row (the gap memory has to fill spread over the block).

    `block`: weight elements per output-channel block; `step`: elements per reduction step (ocb × 2); `tile`:
    output pixels per register tile; `lanes`: output channels per tile (ocb); `row`: elements per packed input row;
    `rows`: packed input rows per channel block; `spread`: at most the output rows, coprime with the row stride;
    `blocks`: output-channel blocks (the last prefetches nothing: past it is no weight of this conv).
    """

    block: int
    step: int
    tile: int
    lanes: int
    row: int
    rows: int
    spread: int
    blocks: int

    def name(self) -> str:
        """The intrinsic's registered name: one per set of parameters."""
        return f"{DOT_INTRINSIC}_prefetch_" + "_".join(str(v) for v in (self.block, self.step, self.tile, self.lanes,
                                                                           self.row, self.rows, self.spread,
                                                                           self.blocks))


def dot_intrinsic(prefetch: NextBlockPrefetch | None = None) -> str:
    """The name of the tensor intrinsic C[16] += Σ_k A[k] · B[:, k] over a bf16 pair k (registered on first use);
    with `prefetch`, one that also prefetches the next block's weights."""
    from tvm.s_tir import TensorIntrin

    name = DOT_INTRINSIC if prefetch is None else prefetch.name()
    if TensorIntrin.get(name, allow_missing=True) is None:
        TensorIntrin.register(name, *_dot_functions(prefetch))
    return name


def _dot_functions(prefetch: NextBlockPrefetch | None = None):
    """The description (what the loop computes, as the kernels write it) and the implementation (one vdpbf16ps, and
    with `prefetch` a conditional prefetch of B's counterpart in the next weight block)."""
    from tvm.script import tirx as T

    u16, f32 = "uint16", "float32"  # names, not strings, in the annotations (which TVMScript evaluates)

    @T.prim_func(s_tir=True)
    def description(a: T.Buffer((PAIR,), u16, offset_factor=1), b: T.Buffer((LANES, PAIR), u16, offset_factor=1),
                    c: T.Buffer((LANES,), f32, offset_factor=1)) -> None:
        with T.sblock("root"):
            T.reads(c[0:LANES], a[0:PAIR], b[0:LANES, 0:PAIR])
            T.writes(c[0:LANES])
            for i in T.serial(0, LANES):
                for k in T.serial(0, PAIR):
                    with T.sblock("update"):
                        vi, vk = T.axis.remap("SR", [i, k])
                        c[vi] = c[vi] + (T.reinterpret("float32", T.shift_left(T.Cast("uint32", a[vk]), T.uint32(16)))
                                         * T.reinterpret("float32", T.shift_left(T.Cast("uint32", b[vi, vk]), T.uint32(16))))

    @T.macro
    def dot(a, b, c):
        """c += the 16 lanes' dot products of a's pair with b's: one vdpbf16ps."""
        c[T.ramp(T.int32(0), 1, LANES)] = T.call_pure_extern(
            "float32x16", DOT_FUNCTION, c.vload([0], "float32x16"),
            T.broadcast(T.reinterpret(a.vload([0], "uint16x2"), dtype="int32"), LANES),
            T.reinterpret(b.vload([0, 0], "uint16x32"), dtype="int32x16"))

    @T.prim_func(s_tir=True)
    def implementation(a: T.Buffer((PAIR,), u16, offset_factor=1), b: T.Buffer((LANES, PAIR), u16, offset_factor=1),
                       c: T.Buffer((LANES,), f32, offset_factor=1)) -> None:
        with T.sblock("root"):
            T.reads(c[0:LANES], a[0:PAIR], b[0:LANES, 0:PAIR])
            T.writes(c[0:LANES])
            dot(a, b, c)

    if prefetch is None:
        return description, implementation
    p = prefetch

    @T.prim_func(s_tir=True)
    def prefetching(a: T.Buffer((PAIR,), u16, offset_factor=1), b: T.Buffer((LANES, PAIR), u16, offset_factor=1),
                    c: T.Buffer((LANES,), f32, offset_factor=1)) -> None:
        with T.sblock("root"):
            T.reads(c[0:LANES], a[0:PAIR], b[0:LANES, 0:PAIR])
            T.writes(c[0:LANES])
            # The tile's first pixel (a constant once the tile's loops are unrolled), in 1 of `spread` steps, of a block
            # before the last.
            if T.floormod(T.floordiv(c.elem_offset, p.lanes), p.tile) == 0 and T.floormod(
                    T.floordiv(T.floormod(b.elem_offset, p.block), p.step)
                    - T.floormod(T.floordiv(a.elem_offset, p.row), p.rows), p.spread) == 0 and T.floordiv(
                    b.elem_offset, p.block) < p.blocks - 1:
                T.evaluate(T.call_intrin("void", "tirx.prefetch", b.access_ptr("r", offset=p.block), 0, 2, 1))
            dot(a, b, c)

    return description, prefetching
