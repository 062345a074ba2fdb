"""Which algorithms can run a conv or matmul kernel (its "anchor" op).

Conv (dense, 2-D, float32) on llvm: "nchwc" (weights packed at compile time,
register-tiled; the default), "im2col" (column buffer + GEMM), "direct" (the
same register tiles reading the input in place: no workspace) and, for 3×3
stride-1 convs, "winograd" (F(4×4, 3×3); on an NCHW[16]c input, winograd_blocks.py). A 2-D depthwise conv
on llvm: "nchwc" (channel-blocked,
depthwise_conv.py; the default) and "generic" (the target-neutral rule); another grouped conv: "grouped_gemm"
(a GEMM per group, grouped_conv.py; the default) and "generic". On cuda: "gemm" (an implicit GEMM with shared-memory tiles,
cuda/conv.py; the default) and "direct" (dlight's schedule of the generic rule). "im2col" is not offered on cuda:
dlight's GEMV schedule of its column product writes wrong results for tiles that wrap a row (yolov8n_320's
1×1 conv on [1,16,4,2100] on an H100).
Matmul with constant weights on llvm: "packed" (the default) and "direct".
The backward convolutions of a training step (ConvTranspose, the data gradient; ConvGradFilter, the filter
gradient), whose weights are known only at run time, on llvm: "tiled" (register-tiled products, the default) and
"generic" (the target-neutral rule under the generic schedule); elsewhere "generic" only.
A ConvTranspose whose weights are constant (inference) and whose kernel equals its strides (no pads) runs
"upsample" by default (conv_transpose_upsample.py); a training step's keeps "tiled".
The chosen one is the ALGORITHM attribute of the op in its kernel spec (variants.py lowers it). Without
algorithm selection a kernel runs the default, except where `default_algorithm` names another.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from tessel.ir.types import TensorType

from ..kernel import ALGORITHM
from .conv_transpose_upsample import shape_applies as upsample_applies
from .packing import (NARROW_ROW, conv_blocks, conv_kind, default_conv_algorithm, f32_conv_blocks, plan_packing,
                      tile_axis)
from .winograd import applies as winograd_applies
from .winograd_blocks import by_default as winograd_by_default

# float32 lanes of an AVX-512 vector: a conv of fewer output channels has scalar packed tiles.
F32_LANES = 16
# The widest register tile `direct` runs (pixels; packed_kernels.conv_packed's choice).
MAX_DIRECT_TILE = 16

# The ops with several algorithms to choose from (where `algorithms` finds them applicable).
ALGORITHM_OPS = ("Conv", "MatMul", "Gemm")
# The backward convolutions: selectable with their weights (and, for ConvGradFilter, dy) as kernel arguments.
BACKWARD_OPS = ("ConvTranspose", "ConvGradFilter")


def algorithms(op_type: str, attrs: Mapping[str, Any], input_types: Sequence[TensorType | None],
               constants: Sequence[np.ndarray | None], target_kind: str) -> tuple[str, ...]:
    """The algorithms that can run this op, its default first; () when there is no choice to make."""
    if op_type not in ALGORITHM_OPS or not input_types or input_types[0] is None or input_types[0].dtype != "float32":
        return ()
    if len(constants) < 2 or constants[1] is None:
        return ()
    packs = plan_packing(op_type, {k: v for k, v in attrs.items() if k != ALGORITHM}, input_types, constants) is not None
    if op_type == "Conv":
        if input_types[0].rank != 4:
            return ()
        if attrs.get("group", 1) != 1:
            kind = conv_kind(attrs, input_types[0], constants[1].shape)
            return (default_conv_algorithm(kind), "generic") if target_kind == "llvm" and packs else ()
        if target_kind != "llvm":
            return ("gemm", "direct")
        out_channels, in_channels = constants[1].shape[:2]
        # Direct writes whole channel blocks straight to the output: the channels must fill them.
        whole_blocks = out_channels % conv_blocks(out_channels, in_channels)[1] == 0
        choices = ("nchwc", "im2col") + (("direct",) if whole_blocks else ()) if packs else ("im2col",)
        spatial = constants[1].shape[2:]
        if winograd_applies(spatial, attrs.get("strides") or (1, 1), attrs.get("dilations") or (1, 1)):
            choices += ("winograd",)
        return choices
    if target_kind == "llvm" and packs:
        return ("packed", "direct")
    return ()


def backward_algorithms(op_type: str, attrs: Mapping[str, Any], input_types: Sequence[TensorType | None],
                        target_kind: str) -> tuple[str, ...]:
    """The algorithms of a backward convolution, its default first; () for other ops."""
    if op_type not in BACKWARD_OPS or len(input_types) < 2 or input_types[0] is None or input_types[1] is None:
        return ()
    # The conditions of the tiled kernels' `applies` (cpu/conv_transpose.py, cpu/conv_grad_filter.py).
    tiled = (target_kind == "llvm" and attrs.get("group", 1) == 1 and input_types[0].rank == 4
             and input_types[0].dtype == "float32" and input_types[1].dtype == "float32")
    return ("tiled", "generic") if tiled else ("generic",)


# The widest output rows a 1 × 1 conv of an NCHW kernel argument runs direct on (`default_algorithm`).
MAX_DIRECT_NCHW_ROW = 28


def _out_rows(attrs: Mapping[str, Any], x: TensorType) -> int:
    """The output row width of a 1 × 1 stride-1 conv of `x` along its register tiles' axis."""
    return tile_axis(attrs, *x.shape[2:])[1]


def _out_width(attrs: Mapping[str, Any], x: TensorType) -> int:
    """The output row width of a 3×3 stride-1 conv of `x`: its explicit pads, or its `auto_pad` (SAME keeps it)."""
    auto_pad = attrs.get("auto_pad", "NOTSET")
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        return int(x.shape[-1])
    pads = list(attrs.get("pads") or [0, 0, 0, 0]) if auto_pad == "NOTSET" else [0, 0, 0, 0]
    return int(x.shape[-1]) + pads[1] + pads[3] - 2


def default_algorithm(op_type: str, attrs: Mapping[str, Any], input_types: Sequence[TensorType | None],
                      constants: Sequence[np.ndarray | None], target_kind: str, reads_blocks: bool,
                      input_blocked: bool = False, input_computed: bool = True) -> str | None:
    """The algorithm an op runs when no selection chose one, where it is not the first of `algorithms`; else None.

    A 3×3 stride-1 conv whose input is itself an NCHW[16]c argument of its kernel (`input_blocked`: not computed
    in the kernel, as a fused Concat of blocked parts is, which the blocked Winograd kernel does not read) runs
    "winograd" (winograd_blocks.py: F(4×4, 3×3) on the blocks) where `winograd_blocks.by_default` says it measured
    faster: wide rows, whole register tiles, at most 128 × 128 channels.

    Any other conv whose input arrives in NCHW[16]c (`reads_blocks`: every activation it is computed from is kept
    blocked) runs "direct" where a register tile of CONV_TILE_CHOICES divides its output rows (in more than one tile
    when the conv pads): packing that input copies it whole (only adding the padding), and reading it in place costs
    little once the kernel's loops are cut where the padding and a fused Concat's parts start (packed_kernels.py):
    only the edge tiles and rows check. Measured on YOLOv8n's (320²) kernels, each alone (TVM's time_evaluator, min
    over 5 rounds of 5 × 20 runs, interleaved with "nchwc"): its 3 × 3 convs 1-11% faster (stride 2: 8-11%), its 1 ×
    1 convs on 10-pixel rows 30-37%; in the program (min of 360 runs) its kernels' times add up to 4.73 against
    main's 6.11 ms (with the Concat and 10-pixel tile changes; before Winograd's default). On ResNet-18 (min of 240
    runs in the program) its 3 × 3 convs on rows of 56 and 28 pixels ran the same or 2% faster, its 7-pixel rows
    (one padded tile) 20% slower: those keep "nchwc". (Before the loop cutting, direct ran only 1 × 1 stride-1 convs
    on rows of at least 12 pixels: 1.5-3.3× faster there, 1.6× slower on 10-pixel rows.) Rows that no tile of
    CONV_TILE_CHOICES divides run the widest tile that does: topology_squeezenet's 1 × 1 convs on rows of 55, 27 and
    13 pixels (tiles of 11, 9, 13; min of 450 runs in the program, interleaved with main) took 0.014-0.027 instead of
    0.030-0.051 ms on 55², 0.015-0.025 instead of 0.032-0.037 on 27², 0.008-0.024 instead of 0.014-0.033 on 13²: its
    kernels' sum 1.69 → 1.48 ms (nchwc packed them into 14-pixel tiles, copying each input whole).
    A 1 × 1 stride-1 conv of fewer output channels than a vector (YOLOv8n's DFL conv: one) runs direct whatever its
    input: its packed tiles are one channel wide, scalar (59 → 8 µs in the model); not a wider window (mtcnn_pnet's
    3 × 3 stem of 10 channels on its NCHW image: the model ran 2.7× slower). An NCHW input with an elementwise
    prologue (ppocr_v4_rec's squeeze-excite scaling) ran 2× slower direct: NCHW inputs computed in the kernel keep the
    default. A 1 × 1 stride-1 conv that reads an NCHW input as it is (`input_computed` False: a kernel argument, such
    as a Concat's result that several convs read) runs "direct" on rows of NARROW_ROW to MAX_DIRECT_NCHW_ROW pixels:
    packing copies the whole input once per call, a cost shared by few output-channel blocks where the conv has few
    output channels. Measured on topology_inception_v2 (each kernel's min over 120 runs in the program, interleaved
    with "nchwc", two runs): its 26 such convs on 28² and 14² rows (192-576 input channels) took 1.605 instead of
    1.940 ms (3-35% each faster), but 1024 → 192-352 channels on 7² rows ran 2-8% slower (each 16-channel step reads
    16 rows of 28 bytes). Without the upper bound, ppocr_v4_det ran 1.33× slower: four of its convs changed, on rows of
    160, 80, 40 and 20 pixels (12-42 input channels on the wide ones).
    """
    if op_type == "ConvTranspose" and target_kind == "llvm":
        return "upsample" if _upsamples(attrs, input_types, constants) else None
    if op_type != "Conv" or target_kind != "llvm":
        return None
    choices = algorithms(op_type, attrs, input_types, constants, target_kind)
    if input_blocked and "winograd" in choices and winograd_by_default(constants[1].shape, _out_width(attrs,
                                                                                                      input_types[0])):
        return "winograd"
    if "direct" not in choices:
        return None
    pointwise = (tuple(constants[1].shape[2:]) == (1, 1) and tuple(attrs.get("strides") or (1, 1)) == (1, 1)
                 and not any(attrs.get("pads") or ()) and attrs.get("auto_pad", "NOTSET") in ("NOTSET", "VALID"))
    if pointwise and constants[1].shape[0] < F32_LANES:
        return "direct"
    nchw_argument = pointwise and not reads_blocks and not input_computed
    if nchw_argument and NARROW_ROW <= _out_rows(attrs, input_types[0]) <= MAX_DIRECT_NCHW_ROW:
        return "direct" if _direct_tiles(attrs, input_types[0], constants[1], widest=False) else None
    return "direct" if reads_blocks and _direct_tiles(attrs, input_types[0], constants[1]) else None


def _upsamples(attrs: Mapping[str, Any], input_types: Sequence[TensorType | None],
               constants: Sequence[np.ndarray | None]) -> bool:
    """Whether a ConvTranspose runs "upsample": float32, constant weights, kernel == strides without pads."""
    if len(input_types) < 2 or len(constants) < 2 or constants[1] is None or input_types[0] is None:
        return False
    x, w = input_types[0], input_types[1]
    return x.dtype == w.dtype == "float32" and upsample_applies(attrs, x.shape, w.shape)


def _direct_tiles(attrs: Mapping[str, Any], x: TensorType, weight: np.ndarray, widest: bool = True) -> bool:
    """Whether a register tile divides the conv's output rows (`direct` needs whole tiles: it writes them straight
    to the output), in more than one tile where the conv pads its input: one of CONV_TILE_CHOICES or, `widest`, any
    of at least the smallest of them (fewer pixels leave too few accumulators). The NCHW-argument rule keeps
    CONV_TILE_CHOICES: the widest tiles were measured on blocked inputs only."""
    from .packed_kernels import CONV_TILE_CHOICES, TILE_ACCUMULATORS

    swap, _ = tile_axis(attrs, *x.shape[2:])
    if swap or attrs.get("auto_pad", "NOTSET") not in ("NOTSET", "VALID"):
        return False
    pads = attrs.get("pads") or (0, 0, 0, 0)
    dilation = (attrs.get("dilations") or (1, 1))[-1]
    stride = (attrs.get("strides") or (1, 1))[-1]
    out_width = (x.shape[3] + pads[1] + pads[3] - dilation * (weight.shape[3] - 1) - 1) // stride + 1
    vectors = -(-f32_conv_blocks(*weight.shape[:2], out_width)[1] // F32_LANES)
    fits = [t for t in range(min(CONV_TILE_CHOICES), MAX_DIRECT_TILE + 1)
            if out_width % t == 0 and t * vectors <= TILE_ACCUMULATORS]
    # The kernel's tile (packed_kernels.conv_packed): the first of CONV_TILE_CHOICES that divides the rows, else the
    # widest that does (SqueezeNet's rows of 55, 27 and 13 pixels: 11, 9 and 13).
    tile = next((t for t in CONV_TILE_CHOICES if t in fits), None) or (max(fits, default=None) if widest else None)
    # A padded row of one tile keeps the padding checks inside its tile (on its first and last pixels).
    return tile is not None and (out_width > tile or not any(pads))
