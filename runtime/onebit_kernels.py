"""The 1-bit codec's loops (runtime/ps_compression.OneBit) as machine code, compiled once per process with llvmlite.

A vector is cut into segments, segment s being elements [bounds[s], bounds[s+1]); each segment has two
reconstruction values, means[2s] for its non-negative and means[2s+1] for its negative elements. The sign bits
are numpy.packbits' layout: element j is bit 7 - j % 8 of byte j // 8. Every kernel is one pass over the
vector without temporaries (numpy needed about ten whole-vector passes and as many temporaries of the vector's
size: ResNet-18's 47 MB gradients took 0.2 s to encode with error feedback, and its time grew with the load).

- `sums`: per segment, the number of non-negative elements, their sum and the sum of all (float64).
- `pack`: the sign bits written into `bits`, each element replaced by what its reconstruction value lost
  (element - value): the encoder's residual, in place.
- `decode` / `decode_add`: each element's reconstruction value written into, or added to, `out`.
"""
from __future__ import annotations

import ctypes
import threading

import numpy as np

# Each function loops over the segments (label seg) and, inside, over a segment's elements (label elem).
_SEGMENT_LOOP = """
entry:
  %any = icmp sgt i64 %nseg, 0
  br i1 %any, label %seg, label %done
seg:
  %s = phi i64 [0, %entry], [%s.next, %seg.end]
{segment_phis}
  %lo.p = getelementptr i64, ptr %bounds, i64 %s
  %lo = load i64, ptr %lo.p
  %s.next = add i64 %s, 1
  %hi.p = getelementptr i64, ptr %bounds, i64 %s.next
  %hi = load i64, ptr %hi.p
{segment_setup}
  %nonempty = icmp slt i64 %lo, %hi
  br i1 %nonempty, label %elem, label %seg.end
elem:
  %j = phi i64 [%lo, %seg], [%j.next, %elem]
{element_body}
  %j.next = add i64 %j, 1
  %more = icmp slt i64 %j.next, %hi
  br i1 %more, label %elem, label %seg.end
seg.end:
{segment_end}
  %again = icmp slt i64 %s.next, %nseg
  br i1 %again, label %seg, label %done
done:
  ret void
}}
"""

_PAIR = """
  %pair = shl i64 %s, 1"""


def _value(sign: str) -> str:
    """IR loading the reconstruction value of an element whose sign bit is the i64 `sign` (1: non-negative):
    means[2s + 1 - sign], a load rather than a select, which x86 compiles to a branch that random signs
    mispredict half the time."""
    return f"""
  %pick = sub i64 1, {sign}
  %slot = add i64 %pair, %pick
  %value.p = getelementptr float, ptr %means, i64 %slot
  %value = load float, ptr %value.p"""


_SUMS = """
define void @sums(ptr noalias %x, i64 %nseg, ptr noalias %bounds, ptr noalias %counts, ptr noalias %up_sums,
                  ptr noalias %all_sums) {""" + _SEGMENT_LOOP.format(
    segment_phis="",
    segment_setup="",
    element_body="""
  %count = phi i64 [0, %seg], [%count.next, %elem]
  %up = phi double [0.0, %seg], [%up.next, %elem]
  %all = phi double [0.0, %seg], [%all.next, %elem]
  %xp = getelementptr float, ptr %x, i64 %j
  %v = load float, ptr %xp
  %wide = fpext float %v to double
  %all.next = fadd double %all, %wide
  %nonneg = fcmp oge float %v, 0.0
  %mask = sext i1 %nonneg to i64
  %wide.bits = bitcast double %wide to i64
  %kept.bits = and i64 %wide.bits, %mask
  %kept = bitcast i64 %kept.bits to double
  %up.next = fadd double %up, %kept
  %one = zext i1 %nonneg to i64
  %count.next = add i64 %count, %one""",
    segment_end="""
  %count.s = phi i64 [0, %seg], [%count.next, %elem]
  %up.s = phi double [0.0, %seg], [%up.next, %elem]
  %all.s = phi double [0.0, %seg], [%all.next, %elem]
  %count.p = getelementptr i64, ptr %counts, i64 %s
  store i64 %count.s, ptr %count.p
  %up.p = getelementptr double, ptr %up_sums, i64 %s
  store double %up.s, ptr %up.p
  %all.p = getelementptr double, ptr %all_sums, i64 %s
  store double %all.s, ptr %all.p""")

_PACK = """
define void @pack(ptr noalias %x, i64 %nseg, ptr noalias %bounds, ptr noalias %means, ptr noalias %bits) {""" + \
    _SEGMENT_LOOP.format(
        # The signs so far, shifted left one bit per element (element j in bit 0): after each element its
        # byte's bits so far are stored in place (a store without a load, so no element waits on the one before).
        segment_phis="  %acc.seg = phi i32 [0, %entry], [%acc.end, %seg.end]",
        segment_setup=_PAIR,
        element_body="""
  %acc = phi i32 [%acc.seg, %seg], [%acc.next, %elem]
  %xp = getelementptr float, ptr %x, i64 %j
  %v = load float, ptr %xp
  %nonneg = fcmp oge float %v, 0.0
  %sign = zext i1 %nonneg to i64""" + _value("%sign") + """
  %lost = fsub float %v, %value
  store float %lost, ptr %xp
  %acc.shifted = shl i32 %acc, 1
  %bit = zext i1 %nonneg to i32
  %acc.next = or i32 %acc.shifted, %bit
  %low = and i64 %j, 7
  %shift = sub i64 7, %low
  %shift32 = trunc i64 %shift to i32
  %placed = shl i32 %acc.next, %shift32
  %byte.value = trunc i32 %placed to i8
  %byte = lshr i64 %j, 3
  %bp = getelementptr i8, ptr %bits, i64 %byte
  store i8 %byte.value, ptr %bp""",
        segment_end="  %acc.end = phi i32 [%acc.seg, %seg], [%acc.next, %elem]")

_DECODE = """
define void @{name}(ptr noalias %bits, i64 %nseg, ptr noalias %bounds, ptr noalias %means, ptr noalias %out) {""" + \
    _SEGMENT_LOOP.format(
        segment_phis="",
        segment_setup=_PAIR,
        element_body="""
  %byte = lshr i64 %j, 3
  %bp = getelementptr i8, ptr %bits, i64 %byte
  %packed = load i8, ptr %bp
  %low = and i64 %j, 7
  %shift = sub i64 7, %low
  %shift8 = trunc i64 %shift to i8
  %moved = lshr i8 %packed, %shift8
  %bit = and i8 %moved, 1
  %sign = zext i8 %bit to i64""" + _value("%sign") + """
  %op = getelementptr float, ptr %out, i64 %j
{store}""",
        segment_end="")

_STORE = "  store float %value, ptr %op"
_ADD = """  %old = load float, ptr %op
  %sum = fadd float %old, %value
  store float %sum, ptr %op"""


def _ir() -> str:
    """The module's LLVM IR text."""
    return "\n".join([_SUMS, _PACK, _DECODE.replace("{name}", "decode").replace("{store}", _STORE),
                      _DECODE.replace("{name}", "decode_add").replace("{store}", _ADD)])


class _Kernels:
    """The compiled functions (their engine must outlive them)."""

    def __init__(self):
        import llvmlite.binding as llvm

        llvm.initialize_native_target()
        llvm.initialize_native_asmprinter()
        machine = llvm.Target.from_default_triple().create_target_machine(
            cpu=llvm.get_host_cpu_name(), features=llvm.get_host_cpu_features().flatten(), opt=3)
        module = llvm.parse_assembly(_ir())
        module.verify()
        module.triple, module.data_layout = machine.triple, str(machine.target_data)
        builder = llvm.create_pass_builder(machine, llvm.create_pipeline_tuning_options(speed_level=3))
        builder.getModulePassManager().run(module, builder)  # LLVM's O3 pipeline
        self._engine = llvm.create_mcjit_compiler(module, machine)
        self._engine.finalize_object()
        void_p, i64 = ctypes.c_void_p, ctypes.c_int64
        five = ctypes.CFUNCTYPE(None, void_p, i64, void_p, void_p, void_p)
        self.sums = ctypes.CFUNCTYPE(None, void_p, i64, void_p, void_p, void_p, void_p)(
            self._engine.get_function_address("sums"))
        self.pack = five(self._engine.get_function_address("pack"))
        self.decode = five(self._engine.get_function_address("decode"))
        self.decode_add = five(self._engine.get_function_address("decode_add"))


_compiled: list[_Kernels] = []
_compiling = threading.Lock()


def kernels() -> _Kernels:
    """This process's compiled 1-bit kernels (compiled on first use: 0.3 to 1 s, so a codec compiles them when made).
    Compiled once under a lock: a second copy made by a racing thread could be freed, machine code and all, while a
    kernel taken from it runs."""
    with _compiling:
        if not _compiled:
            _compiled.append(_Kernels())
        return _compiled[0]


def _address(array: np.ndarray, dtype) -> int:
    """The data address of a C-contiguous array of `dtype`, which a kernel reads or writes directly (ValueError
    for any other array: a kernel would read the wrong memory)."""
    if array.dtype != dtype or not array.flags.c_contiguous:
        raise ValueError(f"a 1-bit kernel needs a contiguous {np.dtype(dtype)} array, not {array.dtype} "
                         f"{'contiguous' if array.flags.c_contiguous else 'strided'}")
    return array.ctypes.data


def _segments(bounds: np.ndarray, size: int, bit_bytes: int) -> tuple[int, int]:
    """(segment count, address of `bounds`) once the segments are known to lie within a vector of `size`
    elements whose sign bits take `bit_bytes` bytes, in order (ValueError otherwise)."""
    if bounds.size < 1 or bounds[0] != 0 or bounds[-1] > size or 8 * bit_bytes < bounds[-1] \
            or np.any(np.diff(bounds) < 0):
        raise ValueError(f"1-bit segments ending at {bounds[-1] if bounds.size else None} do not fit a vector of "
                         f"{size} elements with {bit_bytes} bytes of sign bits")
    return bounds.size - 1, _address(bounds, np.int64)


def segment_sums(vector: np.ndarray, bounds: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per segment of float32 `vector`: (count of non-negative elements, their sum, the sum of all), float64 sums."""
    count, segments = _segments(bounds, vector.size, (vector.size + 7) // 8)
    counts, ups, alls = np.empty(count, np.int64), np.empty(count), np.empty(count)
    kernels().sums(_address(vector, np.float32), count, segments, _address(counts, np.int64),
                   _address(ups, np.float64), _address(alls, np.float64))
    return counts, ups, alls


def pack_signs(vector: np.ndarray, bounds: np.ndarray, means: np.ndarray, bits: np.ndarray) -> None:
    """Write `vector`'s sign bits (1: non-negative) into `bits`, and replace each element by itself minus its
    segment's reconstruction value (`means`, float32 pairs: non-negative, negative)."""
    count, segments = _segments(bounds, vector.size, bits.size)
    if means.size != 2 * count:
        raise ValueError(f"1-bit means: {means.size} values for {count} segments")
    kernels().pack(_address(vector, np.float32), count, segments, _address(means, np.float32),
                   _address(bits, np.uint8))


def unpack_values(bits: np.ndarray, bounds: np.ndarray, means: np.ndarray, out: np.ndarray, add: bool) -> None:
    """Each element's reconstruction value from its sign bit, written into `out` or, with `add`, added to it."""
    count, segments = _segments(bounds, out.size, bits.size)
    if means.size != 2 * count:
        raise ValueError(f"1-bit means: {means.size} values for {count} segments")
    kernel = kernels().decode_add if add else kernels().decode
    kernel(_address(bits, np.uint8), count, segments, _address(means, np.float32), _address(out, np.float32))
