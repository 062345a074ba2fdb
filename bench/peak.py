"""The machine's measured FMA peak: register-resident FMA kernels built by TVM for this CPU, f32 and bf16.

Each thread runs CHAINS independent accumulator chains of 16-lane vectors that
never leave the registers (the loop body is nothing but `vfmadd` on zmm
registers, or `vdpbf16ps` for bf16, built for llvm with the host's -mcpu), as
../shared/docs/cpu-schedules/fma_peak.c does in C. A multiply-add counts two
FLOPs; `vdpbf16ps` does 32 of them per instruction (pairs of bf16 products
accumulated in f32). bf16 is measured only where the CPU has avx512_bf16.

The machine is shared and its speed varies between runs: compare a kernel's
GFLOP/s with the peak measured in the same run (bench/latency.py does).

    python bench/peak.py [--threads N] [--seconds S] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

from tessel.backends.tvm_env import set_threads, tvm  # noqa: E402

# 12 chains hide the FMA latency (4 cycles) on two pipes and leave registers for the constants.
CHAINS = 12
LANES = 16
# Best of this many timed calls; each call runs about --seconds / REPEATS.
REPEATS = 5


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo; the platform's processor string elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown CPU"


def cpu_flags() -> set[str]:
    """The CPU's feature flags (empty where /proc/cpuinfo is missing)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _fma_kernel(threads: int, dtype: str):
    """A PrimFunc(out float32[threads, 16], iterations int32): `threads` parallel workers, each CHAINS chains of
    16-lane FMAs (dtype "float32") or bf16 dot products (dtype "bfloat16") for `iterations` rounds."""
    from tvm.script import tirx as T

    ramp = T.Ramp(0, 1, LANES)

    def bf16_pairs(value: float):
        # 32 bf16 lanes made from two 16-lane f32 vectors (the instruction LLVM's intrinsic takes).
        return T.call_llvm_pure_intrin("bfloat16x32", "llvm.x86.avx512bf16.cvtne2ps2bf16.512",
                                       T.Broadcast(T.float32(value), LANES), T.Broadcast(T.float32(value), LANES))

    @T.prim_func
    def fma_f32(out: T.Buffer((threads, LANES), "float32"), iterations: T.int32):
        for t in T.parallel(threads):
            acc = T.alloc_buffer((CHAINS, LANES), "float32", scope="local")
            for c in T.unroll(CHAINS):
                for lane in T.vectorized(LANES):
                    acc[c, lane] = T.float32(1.0) + T.Cast("float32", c)
            for _ in range(iterations):
                for c in T.unroll(CHAINS):
                    for lane in T.vectorized(LANES):
                        acc[c, lane] = acc[c, lane] * T.float32(0.999999) + T.float32(1e-7)
            for lane in T.vectorized(LANES):
                out[t, lane] = T.float32(0)
            for c in range(CHAINS):
                for lane in T.vectorized(LANES):
                    out[t, lane] = out[t, lane] + acc[c, lane]

    @T.prim_func
    def fma_bf16(out: T.Buffer((threads, LANES), "float32"), iterations: T.int32):
        for t in T.parallel(threads):
            acc = T.alloc_buffer((CHAINS, LANES), "float32", scope="local")
            for c in T.unroll(CHAINS):
                for lane in T.vectorized(LANES):
                    acc[c, lane] = T.float32(1.0) + T.Cast("float32", c)
            for _ in range(iterations):
                for c in T.unroll(CHAINS):
                    acc[c, ramp] = T.call_llvm_pure_intrin("float32x16", "llvm.x86.avx512bf16.dpbf16ps.512",
                                                           acc[c, ramp], bf16_pairs(1e-3), bf16_pairs(1e-3))
            for lane in T.vectorized(LANES):
                out[t, lane] = T.float32(0)
            for c in range(CHAINS):
                for lane in T.vectorized(LANES):
                    out[t, lane] = out[t, lane] + acc[c, lane]

    return fma_f32 if dtype == "float32" else fma_bf16


def measure_peak(threads: int, dtype: str = "float32", seconds: float = 1.0) -> float:
    """GFLOP/s of `threads` threads running register-resident FMAs of `dtype` ("float32" or "bfloat16"): the
    best of REPEATS calls, together about `seconds` long. TVM must run at least `threads` threads."""
    import numpy as np

    tvm_module = tvm()
    function = tvm_module.compile(_fma_kernel(threads, dtype), target=tvm_module.target.Target.from_device("cpu"))
    kernel = function["fma_f32" if dtype == "float32" else "fma_bf16"]
    out = tvm_module.runtime.tensor(np.zeros((threads, LANES), np.float32))
    flops_per_iteration = threads * CHAINS * LANES * 2 * (2 if dtype == "bfloat16" else 1)
    iterations = 10_000
    while True:  # grow the call until it is long enough to time
        started = time.perf_counter()
        kernel(out, iterations)
        elapsed = time.perf_counter() - started
        if elapsed >= seconds / REPEATS / 4 or iterations >= 1 << 30:
            break
        iterations *= 4
    iterations = min(1 << 30, max(1, int(iterations * seconds / REPEATS / max(elapsed, 1e-9))))
    best = float("inf")
    for _ in range(REPEATS):
        started = time.perf_counter()
        kernel(out, iterations)
        best = min(best, time.perf_counter() - started)
    return flops_per_iteration * iterations / best / 1e9


def measure(threads: int, seconds: float = 1.0) -> dict:
    """The CPU, its -mcpu, and the f32 (and bf16 where the CPU has it) peaks on one thread and on `threads`."""
    set_threads(threads)
    tvm_module = tvm()
    dtypes = ["float32"] + (["bfloat16"] if "avx512_bf16" in cpu_flags() else [])
    peaks = {dtype: {str(n): round(measure_peak(n, dtype, seconds), 1) for n in sorted({1, threads})}
             for dtype in dtypes}
    return {"cpu": cpu_model(), "mcpu": str(tvm_module.target.Target.from_device("cpu").attrs.get("mcpu", "")),
            "threads": threads, "gflops": peaks, "measured": True}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads (default: every core)")
    parser.add_argument("--seconds", type=float, default=1.0, help="timed seconds per measurement (default 1)")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    args = parser.parse_args(argv)
    if args.threads < 1 or args.seconds <= 0:
        print("peak.py: error: --threads and --seconds must be positive", file=sys.stderr)
        return 2
    result = measure(args.threads, args.seconds)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"CPU: {result['cpu']} (llvm -mcpu={result['mcpu']})")
    for dtype, by_threads in result["gflops"].items():
        cells = ", ".join(f"{n} thread{'s' if n != '1' else ''}: {gflops:.1f} GFLOP/s" for n, gflops in by_threads.items())
        print(f"{dtype} FMA peak (measured): {cells}")
    if "bfloat16" not in result["gflops"]:
        print("bfloat16: not measured (the CPU lacks avx512_bf16)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
