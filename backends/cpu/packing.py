"""Compile-time weight packing for the fast conv and matmul kernels.

Conv weights (K, C, R, S) become (K/ocb, C/icb, R, S, icb, ocb) and constant
matmul weights (K, N) become (⌈N/nb⌉, K, nb), the layouts the register-tiled
schedules read contiguously; depthwise and grouped conv weights get their
kernels' layouts (depthwise_conv.py, grouped_conv.py). The compiler applies `plan_packing` to the
node's constant inputs once; the kernel then receives the packed array.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from tessel.ir.types import TensorType

from ..kernel import ALGORITHM, BF16, PRECISION
from .bf16 import LANES, PAIR, to_bf16_bits
from .grouped_tiles import pointwise_applies, pointwise_rows

# Attribute names the packed kernels read (they are not ONNX attributes).
CONV_BLOCKS = "tessel_conv_blocks"
MATMUL_BLOCK = "tessel_matmul_block"
MATMUL_PANEL = 16
# Output rows at least this wide fill a conv's register tile with one 16-channel vector per pixel.
NARROW_ROW = 12
# A bf16 conv of at most this many input channels (an image's RGB) pairs neighbouring kernel columns, not channels:
# three channels in pairs waste a quarter of the work on a zero channel, seven columns an eighth on a zero column.
BF16_WINDOW_PAIRS = "tessel_bf16_window_pairs"
BF16_WINDOW_MAX_CHANNELS = 4
# The depthwise kernel's channel block cb.
DEPTHWISE_BLOCK = "tessel_depthwise_block"
# The grouped kernel's (rows, R, S): the row tile of its packed weights and the kernel window the packing flattened.
GROUPED_LAYOUT = "tessel_grouped_layout"
# An LSTM/GRU kernel's W and R arrive transposed to (dirs, n, gate rows + RNN_ROW_PAD) (backends/lowering/rnn.py).
RNN_TRANSPOSED = "tessel_rnn_transposed"
# Unused floats after each row of a transposed RNN weight. The products walk a block of gate columns down all n
# rows; rows of 1024 floats (lstm_tagger's 4 × 256 gates) are 4 KiB apart and fall into the same few L1 sets,
# so the block was evicted as it was read.
RNN_ROW_PAD = 16
# Time steps × batch rows from which the recurrence reads its weights transposed (measured: 100 steps of
# gru_classifier run 1.4-2x faster transposed, 1 step of silero_vad's LSTM 35x faster as dot products).
RNN_TRANSPOSE_MIN_ROWS = 8


@dataclass(frozen=True)
class Packing:
    """Extra kernel attributes and the packed replacement of some constant inputs, by position."""

    attrs: tuple[tuple[str, Any], ...]
    arrays: Mapping[int, np.ndarray]
    # Packed arrays the artifact stores as the constant itself, transformed at load: the plan's entry
    # (runtime/load_transforms.py), by position. Winograd's are 4× a 3×3 weight's bytes.
    at_load: Mapping[int, dict] = field(default_factory=dict)


def _block(size: int, preferred: int = 16) -> int:
    """The largest of preferred, 8, 4, 2, 1 dividing `size` (the whole size when it is small)."""
    if size <= preferred:
        return size
    for block in (preferred, 8, 4, 2, 1):
        if size % block == 0:
            return block
    return 1


def conv_blocks(out_channels: int, in_channels: int, out_width: int | None = None) -> tuple[int, int]:
    """(icb, ocb): 16-channel blocks, or the whole channel count when it is smaller; 32 output channels where
    output rows (`out_width`, when known) are narrower than NARROW_ROW: a register tile of one row's pixels then
    holds too few accumulators for the FMAs' latency, and two 16-channel vectors per pixel double them, each
    broadcast input value feeding two FMAs."""
    if out_width is not None and out_width < NARROW_ROW and out_channels % (2 * LANES) == 0:
        return min(in_channels, 16), 2 * LANES
    return min(in_channels, 16), min(out_channels, 16)


def f32_conv_blocks(out_channels: int, in_channels: int, out_width: int) -> tuple[int, int]:
    """(icb, ocb) of a float32 conv's packed kernel: 32 output channels wherever they come in 32s, on rows of any
    width: two 16-channel vectors per pixel, each broadcast input value feeding two FMAs, and 28 accumulators in a
    tile of 14 pixels (packed_kernels.TILE_ACCUMULATORS). Measured on ResNet-18: its 3 × 3 convs on 56² to 14² ran
    7-11% faster than with 16 channels, the stem 18% (with its rows unpacked as they are made); 64 channels on its
    7-pixel rows (7 × 4 accumulators and 4 weight vectors fill all 32 registers) ran 30-60% slower."""
    icb, ocb = conv_blocks(out_channels, in_channels, out_width)
    if out_channels % (2 * LANES) == 0 or _pads_to_pairs(out_channels):
        return icb, 2 * LANES
    return icb, ocb


def _pads_to_pairs(out_channels: int) -> bool:
    """Whether output channels that do not fill 16-channel blocks (so are zero-padded already; such a result is never
    kept blocked, nor run `direct`) are padded to 32s instead, for two vectors per pixel, where that adds at most a
    32nd to the work. topology_squeezenet's classifier conv (512 → 1000 channels on 13²: 1024 instead of 1008; min
    of 450 runs in the program) took 0.395 instead of 0.427 ms."""
    return out_channels % LANES != 0 and (-out_channels) % (2 * LANES) * 2 * LANES <= out_channels


def pack_conv_weight(weight: np.ndarray, icb: int, ocb: int) -> np.ndarray:
    """(K, C, R, S) → (⌈K/ocb⌉, ⌈C/icb⌉, R, S, icb, ocb), zero-padding channels up to whole blocks."""
    k, c, r, s = weight.shape
    kp, cp = -(-k // ocb) * ocb, -(-c // icb) * icb
    padded = np.zeros((kp, cp, r, s), weight.dtype)
    padded[:k, :c] = weight
    return np.ascontiguousarray(padded.reshape(kp // ocb, ocb, cp // icb, icb, r, s).transpose(0, 2, 4, 5, 3, 1))


def bf16_conv_blocks(out_channels: int, in_channels: int, out_width: int) -> tuple[int, int] | None:
    """(icb, ocb) of a bf16 conv, or None where the output channels are fewer than 16 (the conv stays float32).

    As `conv_blocks`, the input block rounded up to a pair; ocb is 32 output channels (two vdpbf16ps per broadcast
    pair) wherever they come in 32s, on rows of any width: measured on ResNet-18 (narrow rows: its 7 × 7 convs ran
    at ~55% of the bf16 peak with 16-channel tiles; wide rows: its 56 × 56 to 14 × 14 3 × 3 convs ran 7-12%
    faster). A conv pairing kernel columns (BF16_WINDOW_MAX_CHANNELS input channels at most) keeps
    `conv_blocks`' tiles: ResNet-18's stem ran ~10% slower with 32 channels on its 112-pixel rows.
    """
    if out_channels < LANES:
        return None
    icb, ocb = conv_blocks(out_channels, in_channels, out_width)
    if out_channels % (2 * LANES) == 0 and in_channels > BF16_WINDOW_MAX_CHANNELS:
        ocb = 2 * LANES
    return icb + icb % PAIR, ocb


def tile_axis(attrs: Mapping[str, Any], height: int, width: int) -> tuple[int, int]:
    """(swap, output extent along the register tiles' axis) of a conv's packed kernel: tiles run along the width,
    and a tall, narrow input runs with height and width swapped."""
    swap = int(width < 8 <= height)
    strides = attrs.get("strides") or [1, 1]
    return swap, -(-(height if swap else width) // strides[0 if swap else -1])


def pack_conv_weight_bf16(weight: np.ndarray, icb: int, ocb: int) -> np.ndarray:
    """(K, C, R, S) float32 → (⌈K/ocb⌉, ⌈C/icb⌉, R, S, icb/2, ocb, 2) bf16 bits (uint16): each (ocb, 2) tile is
    one vdpbf16ps operand, the pair along the input channels (the reduction axis)."""
    blocked = pack_conv_weight(weight, icb, ocb)  # (K/ocb, C/icb, R, S, icb, ocb)
    kb, cb, r, s = blocked.shape[:4]
    pairs = blocked.reshape(kb, cb, r, s, icb // PAIR, PAIR, ocb).transpose(0, 1, 2, 3, 4, 6, 5)
    return np.ascontiguousarray(to_bf16_bits(np.ascontiguousarray(pairs)))


def pack_conv_weight_bf16_window(weight: np.ndarray, ocb: int) -> np.ndarray:
    """(K, C, R, S) float32 → (⌈K/ocb⌉, C, R, ⌈S/2⌉, ocb, 2) bf16 bits: the pair along the kernel's columns (the
    last one zero-padded to a pair), for convs of very few input channels."""
    k, c, r, s = weight.shape
    padded = np.zeros((-(-k // ocb) * ocb, c, r, -(-s // PAIR) * PAIR), np.float32)
    padded[:k, :, :, :s] = weight
    tiles = padded.reshape(-1, ocb, c, r, padded.shape[3] // PAIR, PAIR).transpose(0, 2, 3, 4, 1, 5)
    return np.ascontiguousarray(to_bf16_bits(np.ascontiguousarray(tiles)))


def pack_matmul_weight(weight: np.ndarray, block: int) -> np.ndarray:
    """(K, N) → (⌈N/nb⌉, K, nb), zero-padding the columns up to whole panels."""
    k, n = weight.shape
    padded = np.zeros((k, -(-n // block) * block), weight.dtype)
    padded[:, :n] = weight
    return np.ascontiguousarray(padded.reshape(k, -1, block).transpose(1, 0, 2))


def matmul_packs(columns: int) -> bool:
    """Whether a constant (K, N) matmul weight is packed: N of at least one panel (a partial last panel is
    zero-padded: ppocr_v4_rec's 120 × 6625 classifier ran the generic kernel at 1 GFLOP/s), not narrower
    ones, whose padding would multiply the work."""
    return columns >= MATMUL_PANEL


def depthwise_block(channels: int) -> int:
    """The channel block: one 16-lane vector, or all the channels when there are fewer."""
    return min(channels, 16)


def pack_depthwise_weight(weight: np.ndarray, block: int) -> np.ndarray:
    """(C, 1, R, S) → (⌈C/cb⌉, R, S, cb), zero-padding the channels up to whole blocks."""
    c, _, r, s = weight.shape
    cp = -(-c // block) * block
    padded = np.zeros((cp, r, s), weight.dtype)
    padded[:c] = weight[:, 0]
    return np.ascontiguousarray(padded.reshape(cp // block, block, r, s).transpose(0, 2, 3, 1))


def grouped_rows(group_out_channels: int) -> int:
    """Output channels per register tile: 8 where they divide the group's channels, else 4 (zero rows pad)."""
    return 8 if group_out_channels % 8 == 0 else 4


def pack_grouped_weight(weight: np.ndarray, groups: int, rows: int) -> np.ndarray:
    """(K, Cg, R, S) → (G, ⌈Kg/rows⌉, Cg·R·S, rows), zero-padding each group's output channels to whole tiles."""
    k = weight.shape[0]
    per_group = k // groups
    padded_rows = -(-per_group // rows) * rows
    flat = weight.reshape(groups, per_group, -1)
    padded = np.zeros((groups, padded_rows, flat.shape[2]), weight.dtype)
    padded[:, :per_group] = flat
    return np.ascontiguousarray(padded.reshape(groups, padded_rows // rows, rows, -1).transpose(0, 1, 3, 2))


def conv_kind(attrs: Mapping[str, Any], input_type: TensorType, weight_shape: Sequence[int]) -> str:
    """"dense" (group 1), "depthwise" (one input and one output channel per group) or "grouped"."""
    groups = attrs.get("group", 1)
    if groups == 1:
        return "dense"
    if input_type.rank == 4 and groups == input_type.shape[1] == weight_shape[0]:
        return "depthwise"
    return "grouped"


def default_conv_algorithm(kind: str) -> str:
    """The algorithm a conv of this kind runs unless selection chose another."""
    return "grouped_gemm" if kind == "grouped" else "nchwc"


def _plan_grouped_packing(attrs: Mapping[str, Any], algorithm: str, input_type: TensorType,
                          weight: np.ndarray) -> Packing | None:
    """The packing of a 2-D depthwise ("nchwc") or grouped ("grouped_gemm") conv's weights."""
    if input_type.rank != 4 or weight.ndim != 4:
        return None
    kind = conv_kind(attrs, input_type, weight.shape)
    if kind == "depthwise" and algorithm == "nchwc":
        block = depthwise_block(weight.shape[0])
        return Packing(((DEPTHWISE_BLOCK, block),), {1: pack_depthwise_weight(weight, block)})
    if kind == "grouped" and algorithm == "grouped_gemm":
        groups = attrs["group"]
        per_group = weight.shape[0] // groups
        pointwise = pointwise_applies(weight.shape[2:], attrs.get("strides") or (1, 1), attrs.get("pads") or ())
        rows = (pointwise and pointwise_rows(per_group, *input_type.shape[2:])) or grouped_rows(per_group)
        layout = (rows, *weight.shape[2:])
        return Packing(((GROUPED_LAYOUT, layout),), {1: pack_grouped_weight(weight, groups, rows)})
    return None


def rnn_reads_transposed(x_type: TensorType) -> bool:
    """Whether an LSTM/GRU over input `x_type` ([steps, batch, width] or batch-first) reads Wᵀ and Rᵀ."""
    return x_type.shape[0] * x_type.shape[1] >= RNN_TRANSPOSE_MIN_ROWS


def _plan_rnn_packing(input_types: Sequence[TensorType | None], constants: Sequence[np.ndarray | None]) -> Packing | None:
    """Constant W and R of a recurrence long enough to read them transposed, transposed once here instead of on
    every call (lstm_tagger's kernels spent about a third of their time on it)."""
    if constants[1] is None or constants[2] is None or input_types[0].dtype != "float32":
        return None
    if not rnn_reads_transposed(input_types[0]):
        return None
    return Packing(((RNN_TRANSPOSED, 1),), {index: pack_rnn_weight(constants[index]) for index in (1, 2)})


def pack_rnn_weight(weight: np.ndarray) -> np.ndarray:
    """(dirs, gate rows, n) → (dirs, n, gate rows + RNN_ROW_PAD), the pad zero."""
    dirs, rows, n = weight.shape
    packed = np.zeros((dirs, n, rows + RNN_ROW_PAD), weight.dtype)
    packed[:, :, :rows] = weight.transpose(0, 2, 1)
    return packed


def plan_packing(op_type: str, attrs: Mapping[str, Any], input_types: Sequence[TensorType | None],
                 constants: Sequence[np.ndarray | None], precision: str = "fp32") -> Packing | None:
    """How to pack this node's constant weights for a fast kernel, or None to use the generic one.

    The packed algorithms (conv "nchwc" and "direct", matmul "packed"; the defaults) pack weights;
    conv "winograd" transforms them. A depthwise conv's "nchwc" and a grouped conv's "grouped_gemm"
    (their defaults) pack them for their own kernels. LSTM and GRU weights are transposed.
    With `precision` "bf16", a dense 2-D conv's packed weights are bf16 (`bf16_packing`); where it does not
    apply the conv packs as in float32.
    """
    if precision == BF16:
        packing = bf16_packing(op_type, attrs, input_types, constants)
        if packing is not None:
            return packing
    if op_type in ("LSTM", "GRU"):
        return _plan_rnn_packing(input_types, constants)
    algorithm = attrs.get(ALGORITHM, "nchwc" if op_type == "Conv" else "packed")
    if op_type == "Conv" and attrs.get("group", 1) != 1:
        if constants[1] is None or not input_types or input_types[0] is None or input_types[0].dtype != "float32":
            return None
        kind = conv_kind(attrs, input_types[0], constants[1].shape)
        return _plan_grouped_packing(attrs, attrs.get(ALGORITHM, default_conv_algorithm(kind)), input_types[0],
                                     constants[1])
    if algorithm == "winograd" and constants[1] is not None and constants[1].ndim == 4:
        from .winograd import transform_weight, weight_at_load

        return Packing((), {1: transform_weight(constants[1])}, {1: weight_at_load(constants[1])})
    if algorithm not in ("nchwc", "direct", "packed"):
        return None
    if not input_types or input_types[0] is None or input_types[0].dtype != "float32":
        return None
    if op_type == "Conv" and constants[1] is not None and attrs.get("group", 1) == 1 and input_types[0].rank in (3, 4):
        weight = constants[1]
        if weight.ndim == 3:  # a 1-D conv runs as a 2-D conv of height 1
            weight = weight[:, :, None, :]
        height, width = (1, input_types[0].shape[2]) if input_types[0].rank == 3 else input_types[0].shape[2:]
        swap, out_width = tile_axis(attrs, height, width)
        icb, ocb = f32_conv_blocks(*weight.shape[:2], out_width)
        if swap:
            weight = weight.transpose(0, 1, 3, 2)
        return Packing(((CONV_BLOCKS, (icb, ocb, swap)),), {1: pack_conv_weight(weight, icb, ocb)})
    if op_type == "MatMul" and constants[1] is not None and input_types[1].rank == 2 and input_types[0].rank >= 2:
        if matmul_packs(input_types[1].shape[1]):
            return Packing(((MATMUL_BLOCK, MATMUL_PANEL),), {1: pack_matmul_weight(constants[1], MATMUL_PANEL)})
    if op_type == "Gemm" and constants[1] is not None and not attrs.get("transA", 0):
        weight = constants[1].T if attrs.get("transB", 0) else constants[1]
        if matmul_packs(weight.shape[1]):
            return Packing(((MATMUL_BLOCK, MATMUL_PANEL),), {1: pack_matmul_weight(np.ascontiguousarray(weight), MATMUL_PANEL)})
    return None


def bf16_packing(op_type: str, attrs: Mapping[str, Any], input_types: Sequence[TensorType | None],
                 constants: Sequence[np.ndarray | None]) -> Packing | None:
    """The bf16 packing of a dense 2-D float32 conv with a constant weight and at least 16 output channels, run by
    the packed kernel ("nchwc"; "direct" packs its input too in bf16); None for anything else."""
    algorithm = attrs.get(ALGORITHM, "nchwc")
    if op_type != "Conv" or algorithm not in ("nchwc", "direct") or attrs.get("group", 1) != 1:
        return None
    if not input_types or input_types[0] is None or input_types[0].dtype != "float32" or input_types[0].rank != 4:
        return None
    weight = constants[1] if len(constants) > 1 else None
    if weight is None or weight.ndim != 4:
        return None
    swap, out_width = tile_axis(attrs, *input_types[0].shape[2:])
    blocks = bf16_conv_blocks(weight.shape[0], weight.shape[1], out_width)
    if blocks is None:
        return None
    icb, ocb = blocks
    if swap:
        weight = weight.transpose(0, 1, 3, 2)
    dilations = attrs.get("dilations") or [1, 1]
    if weight.shape[1] <= BF16_WINDOW_MAX_CHANNELS and weight.shape[3] > 1 and not swap and dilations[1] == 1:
        return Packing(((CONV_BLOCKS, (1, ocb, swap)), (PRECISION, BF16), (BF16_WINDOW_PAIRS, 1)),
                       {1: pack_conv_weight_bf16_window(weight, ocb)})
    return Packing(((CONV_BLOCKS, (icb, ocb, swap)), (PRECISION, BF16)), {1: pack_conv_weight_bf16(weight, icb, ocb)})
