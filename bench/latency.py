"""Latency per corpus model: onnxruntime, OpenVINO, TVM's own pipeline, and Tessel (fused and unfused), all in one run.

Each measurement runs in a fresh process (thread pools of one runtime skew the
next on 2 cores). Prints a table with Tessel/onnxruntime ratios and their
geomean, the speedup fusion gives Tessel (the same pipeline without the fuse
pass), the speedup of keeping NCHW[16]c between conv kernels (the same compile
with `conv_layout="nchw"`), and how much faster Tessel is than TVM's own pipeline
(`relax.frontend.onnx.from_onnx` + `tvm.compile`) where TVM imports the model.
Tessel runs on its native host program (runtime/native_host.py); `py-host` is the
same artifact on the python host, and `overhead` is Tessel's run time minus the
time spent inside its kernels: what the host, Python's boundary included, costs
per run. It is estimated in pairs, in the measuring process: a run (`Artifact.run`,
timed from Python around the whole call, as the latency column times it) and then a
run of a timed copy of the native program on the same inputs, taken the same way
(read in place or copied in), which times each kernel call alone; `overhead` is the
median over the pairs of the run's time minus the paired run's kernel time. It
estimates the same quantity as the difference of the two medians (the JSON keeps
that one too, from the same samples, as `overhead_unpaired_us`), but pairing
cancels what drifts between samples (load, frequency), which on a 0.5 ms model
moves two medians taken apart by more than the few µs measured. Each kernel's
time includes about one clock read (~20 ns; `overhead` is low by that times the
kernel calls: 0.2 µs on mtcnn_pnet's 8, 0.5 µs on oww_embedding's 25).

OpenVINO is the second baseline: f32 forced (INFERENCE_PRECISION_HINT=f32; its
default on CPUs with avx512_bf16 is bf16), the same threads as onnxruntime; its
column says n/a where the `openvino` package is not installed. The run starts by
measuring the machine's f32 FMA peak (bench/peak.py, in its own process), and
each model's achieved GFLOP/s (FLOPs counted from the imported graph, ir/costs.py)
is shown with its share of that peak. Those are a direct convolution's FLOPs: an
effective rate, which passes the peak where Winograd convs (fewer multiplications)
run, as ResNet-18's and YOLOv8n's do by default.

`--bf16` (opt-in) adds a second table: OpenVINO bf16 (INFERENCE_PRECISION_HINT=bf16, its default on CPUs with
avx512_bf16) against Tessel compiled with `--precision bf16`, each in its own process, the same threads, in the
same rounds; with Tessel bf16's GFLOP/s against the bf16 peak bench/peak.py measures in the same run.

`--rounds N` measures onnxruntime, Tessel and OpenVINO N times in turn per model
(OpenVINO last: the engine right after it ran slower here; onnxruntime and Tessel
take turns to run first) and keeps each one's fastest median (the machine is
shared; the issue's method).

`--baseline DIR` also times Tessel as another checkout DIR builds it (e.g. a
git worktree of the commit before a change), alternating with this one
`--repeats` times per model, and prints this/baseline from the fastest median
of each: a change's before/after in one run, under the same load. With `--bf16`
both sides are compiled with `--precision bf16`.

    python bench/latency.py [MODEL ...] [--runs 20] [--skip-tvm] [--skip-unfused] [--skip-nchw]
                            [--skip-python-host] [--skip-openvino] [--bf16] [--rounds 1] [--baseline DIR] [--repeats 3]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

from tessel.compiler.corpus import load_corpus  # noqa: E402

TVM_TIMEOUT_S = 600
MIN_SAMPLE_S = 0.005
WARMUP_S = 0.2


def _median_ms(fn, runs: int) -> float:
    """Median milliseconds per call over `runs` samples, each sample long enough to time.

    A sample repeats the call for at least MIN_SAMPLE_S (a 0.1 ms model timed call by
    call reads the timer and the scheduler, not the model), after WARMUP_S of calls.
    """
    started = time.perf_counter()
    fn()
    once = time.perf_counter() - started
    calls = max(1, math.ceil(MIN_SAMPLE_S / max(once, 1e-6)))
    warm_until = time.perf_counter() + WARMUP_S
    while time.perf_counter() < warm_until:
        fn()
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - started) / calls)
    times.sort()
    return 1e3 * times[len(times) // 2]


def measure_onnxruntime(model, runs: int) -> dict:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = os.cpu_count() or 1
    options.log_severity_level = 3
    session = ort.InferenceSession(str(model.path), options, providers=["CPUExecutionProvider"])
    feeds = model.make_inputs()
    return {"ms": _median_ms(lambda: session.run(None, feeds), runs)}


def measure_openvino(model, runs: int, precision: str = "f32") -> dict:
    import openvino as ov

    core = ov.Core()
    network = core.read_model(str(model.path))
    network.reshape({name: list(shape) for name, shape in model.input_shapes.items()})
    compiled = core.compile_model(network, "CPU", {"INFERENCE_PRECISION_HINT": precision,
                                                   "INFERENCE_NUM_THREADS": os.cpu_count() or 1})
    request = compiled.create_infer_request()
    feeds = model.make_inputs()
    return {"ms": _median_ms(lambda: request.infer(feeds), runs)}


def measure_openvino_bf16(model, runs: int) -> dict:
    return measure_openvino(model, runs, precision="bf16")


def measure_tessel(model, runs: int, skip_passes=(), conv_layout="blocked", precision="fp32") -> dict:
    from tessel.compiler.api import compile as compile_model

    artifact = compile_model(model.path, input_shapes=model.input_shapes, skip_passes=skip_passes,
                             conv_layout=conv_layout, precision=precision)
    feeds = model.make_inputs()
    ms = _median_ms(lambda: artifact.run(feeds), runs)
    executor = artifact.executor() if artifact.devices == 1 and artifact.microbatches == 1 else None
    overhead = (_overhead_us(artifact, executor, feeds, runs, ms) if executor is not None and executor.host == "native"
                else {"overhead_us": None})
    return {"ms": ms, **overhead, "blocked": artifact.report()["conv_layout"]["blocked_values"]}


def _overhead_us(artifact, executor, feeds, runs: int, ms: float) -> dict:
    """The host's µs per run, paired (the module docstring): the median over pairs of one run's time minus the
    kernel time of a timed run right after it, on the same inputs; and, from the same samples, the median run
    minus the median kernel time (the estimator before pairing, for comparison)."""
    pairs = runs * max(1, math.ceil(MIN_SAMPLE_S / max(ms / 1e3, 1e-6)))
    given = artifact.with_defaults(feeds)
    run_times, kernel_times = [], []
    for _ in range(pairs):
        started = time.perf_counter()
        artifact.run(feeds)
        run_times.append(time.perf_counter() - started)
        kernel_times.extend(executor.kernel_times(given, 1))
    paired = statistics.median(r - k for r, k in zip(run_times, kernel_times))
    return {"overhead_us": 1e6 * paired,
            "overhead_unpaired_us": 1e6 * (statistics.median(run_times) - statistics.median(kernel_times))}


def measure_tessel_python_host(model, runs: int) -> dict:
    from tessel.compiler.api import compile as compile_model
    from tessel.runtime.executor import Executor

    artifact = compile_model(model.path, input_shapes=model.input_shapes)
    executor = Executor(artifact.directory, host="python")
    feeds = artifact.with_defaults(model.make_inputs())
    return {"ms": _median_ms(lambda: executor.run(feeds), runs)}


def measure_tessel_unfused(model, runs: int) -> dict:
    return measure_tessel(model, runs, skip_passes=("fuse",))


def measure_tessel_nchw(model, runs: int) -> dict:
    return measure_tessel(model, runs, conv_layout="nchw")


def measure_tessel_bf16(model, runs: int) -> dict:
    return measure_tessel(model, runs, precision="bf16")


def measure_tvm(model, runs: int) -> dict:
    import numpy as np
    import onnx
    import tvm
    from tvm import relax
    from tvm.relax.frontend.onnx import from_onnx

    proto = onnx.load(str(model.path))
    mod = from_onnx(proto, shape_dict={k: list(v) for k, v in model.input_shapes.items()}, keep_params_in_input=False)
    target = tvm.target.Target.from_device("cpu")
    executable = tvm.compile(mod, target=target)
    vm = relax.VirtualMachine(executable, tvm.cpu())
    feeds = model.make_inputs()
    inputs = [tvm.runtime.tensor(np.ascontiguousarray(feeds[name])) for name in model.input_shapes]
    return {"ms": _median_ms(lambda: vm["main"](*inputs), runs)}


MEASURES = {"onnxruntime": measure_onnxruntime, "openvino": measure_openvino, "tessel": measure_tessel, "tessel_unfused": measure_tessel_unfused,
            "tessel_nchw": measure_tessel_nchw, "tvm": measure_tvm,
            "tessel_python_host": measure_tessel_python_host, "openvino_bf16": measure_openvino_bf16,
            "tessel_bf16": measure_tessel_bf16}


def _isolated(kind: str, name: str, runs: int, timeout: float, root: Path = ROOT) -> tuple[dict | None, str]:
    """Run one measurement in a fresh process, with the Tessel of checkout `root`: ({"ms": median, ...} or None,
    why not)."""
    command = [sys.executable, str(root / "bench" / "latency.py"), "--worker", kind, name, "--runs", str(runs)]
    # The checkout's own packages come first, whatever is installed.
    env = {**os.environ, "PYTHONPATH": str(root), "TESSEL_MODELS": str(load_corpus()[0].path.parent)}
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=root, env=env)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout:.0f} s"
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["failed"])[-1]
        return None, tail[:120]
    return json.loads(lines[-1]), ""


def _ms(measured: tuple[dict | None, str]) -> float | None:
    return measured[0]["ms"] if measured[0] else None


def _measured_peak(dtype: str = "float32") -> tuple[float | None, str]:
    """The FMA peak of every core in GFLOP/s for `dtype` ("float32"; "bfloat16": vdpbf16ps) (bench/peak.py, in its
    own process), and the CPU it ran on."""
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "peak.py"), "--json"], capture_output=True,
                          text=True, timeout=300, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if done.returncode != 0:
        return None, (done.stderr.strip().splitlines() or ["failed"])[-1][:120]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if dtype not in result["gflops"]:
        return None, f"{result['cpu']} lacks {dtype}"
    return result["gflops"][dtype][str(result["threads"])], f"{result['cpu']}, {result['threads']} threads"


def _model_gflop(model) -> float | None:
    """GFLOP of one run, counted from the imported graph (None where it does not import)."""
    from tessel import ir
    from tessel.ir.analysis import total_flops

    try:
        return total_flops(ir.from_onnx(str(model.path), model.input_shapes)) / 1e9
    except Exception:  # a model Tessel cannot import has no FLOP count; its row says n/a
        return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", help="corpus model names (default: every non-negative one, the "
                                                   "model-zoo topologies included)")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--skip-tvm", action="store_true", help="do not measure TVM's own pipeline")
    parser.add_argument("--skip-unfused", action="store_true", help="do not measure Tessel without fusion")
    parser.add_argument("--skip-nchw", action="store_true", help="do not measure Tessel with NCHW between convs")
    parser.add_argument("--skip-python-host", action="store_true", help="do not measure Tessel on its python host")
    parser.add_argument("--skip-openvino", action="store_true", help="do not measure OpenVINO")
    parser.add_argument("--bf16", action="store_true",
                        help="also measure OpenVINO bf16 and Tessel --precision bf16 (a second table)")
    parser.add_argument("--baseline", metavar="DIR", type=Path,
                        help="also time Tessel from this checkout, alternating with this one (before/after a change)")
    parser.add_argument("--repeats", type=int, default=3, help="with --baseline: alternations per model")
    parser.add_argument("--rounds", type=int, default=1,
                        help="rounds of onnxruntime, Tessel and OpenVINO in turn per model (onnxruntime and Tessel "
                             "take turns to run first); each column its fastest median")
    parser.add_argument("--worker", nargs=2, metavar=("KIND", "MODEL"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    corpus = {m.name: m for m in load_corpus()}
    if args.worker:
        kind, name = args.worker
        print(json.dumps(MEASURES[kind](corpus[name], args.runs)))
        return 0
    names = args.models or [m.name for m in corpus.values() if not m.negative]
    unknown = [name for name in names if name not in corpus]
    if unknown:
        print(f"latency.py: error: not in the corpus: {', '.join(unknown)}", file=sys.stderr)
        return 2
    if args.baseline:
        return _before_after(names, args.baseline.resolve(), args.runs, args.repeats,
                             "tessel_bf16" if args.bf16 else "tessel")
    openvino = not args.skip_openvino and importlib.util.find_spec("openvino") is not None
    peak, where = _measured_peak()
    print("f32 FMA peak (measured, bench/peak.py): " + (f"{peak:.1f} GFLOP/s ({where})" if peak else f"n/a ({where})"),
          flush=True)
    print("GFLOP/s and %peak count the graph's direct-conv FLOPs: an effective rate (Winograd convs do fewer)")
    print(f"{'model':<20} {'onnxruntime':>12} {'openvino':>9} {'tvm':>10} {'unfused':>10} {'nchw':>10} {'py-host':>10} {'tessel':>10} "
          f"{'overhead':>9} {'tessel/ort':>11} {'tessel/ov':>10} {'GFLOP/s':>8} {'%peak':>6} {'fusion':>8} {'blocked':>8} {'layout':>8} {'tvm/tessel':>11}"
          "  (ms; overhead in µs)")
    ratios, ov_ratios, tvm_speedups, fusion_speedups, layout_speedups = [], [], [], [], []
    for name in names:
        ort_ms, ov_ms, (tessel, why) = _fastest_rounds(name, args.runs, args.rounds, openvino)
        tessel_ms, blocked = _ms((tessel, why)), (tessel or {}).get("blocked")
        overhead_us = (tessel or {}).get("overhead_us")
        python_ms = None if args.skip_python_host else _ms(_isolated("tessel_python_host", name, args.runs, 1800))
        unfused_ms = None if args.skip_unfused else _ms(_isolated("tessel_unfused", name, args.runs, 1800))
        # Without blocked activations both layouts compile to the same program: nothing to measure.
        nchw_ms = None if args.skip_nchw or not blocked else _ms(_isolated("tessel_nchw", name, args.runs, 1800))
        tvm, tvm_why = (None, "skipped") if args.skip_tvm else _isolated("tvm", name, max(3, args.runs // 4), TVM_TIMEOUT_S)
        tvm_ms = _ms((tvm, tvm_why))
        ratio = tessel_ms / ort_ms if tessel_ms and ort_ms else None
        ov_ratio = tessel_ms / ov_ms if tessel_ms and ov_ms else None
        gflop = _model_gflop(corpus[name])
        gflops = gflop / (tessel_ms / 1e3) if gflop and tessel_ms else None
        share = 100 * gflops / peak if gflops and peak else None
        speedup = tvm_ms / tessel_ms if tvm_ms and tessel_ms else None
        fusion = unfused_ms / tessel_ms if unfused_ms and tessel_ms else None
        layout = nchw_ms / tessel_ms if nchw_ms and tessel_ms else None
        if ratio:
            ratios.append(ratio)
        if ov_ratio:
            ov_ratios.append(ov_ratio)
        if speedup:
            tvm_speedups.append(speedup)
        if fusion:
            fusion_speedups.append(fusion)
        if layout:
            layout_speedups.append(layout)

        def cell(value, width, fmt="{:.2f}"):
            return f"{fmt.format(value) if value is not None else 'n/a':>{width}}"

        print(f"{name:<20} {cell(ort_ms, 12, '{:.3f}')} {cell(ov_ms, 9, '{:.3f}')} {cell(tvm_ms, 10)} {cell(unfused_ms, 10)} {cell(nchw_ms, 10)} "
              f"{cell(python_ms, 10, '{:.3f}')} {cell(tessel_ms, 10, '{:.3f}')} {cell(overhead_us, 9, '{:.1f}')} "
              f"{cell(ratio, 11)} {cell(ov_ratio, 10)} {cell(gflops, 8, '{:.1f}')} {cell(share, 6, '{:.0f}%')} "
              f"{cell(fusion, 8, '{:.2f}x')} "
              f"{cell(blocked, 8, '{}')} {cell(layout, 8, '{:.2f}x')} "
              f"{cell(speedup, 11, '{:.1f}x')}"
              + (f"  tessel: {why}" if why else "") + (f"  tvm: {tvm_why}" if tvm_ms is None and not args.skip_tvm else ""),
              flush=True)
    if ratios:
        print(f"geomean tessel/onnxruntime over {len(ratios)} models: {statistics.geometric_mean(ratios):.2f}")
    if ov_ratios:
        print(f"geomean tessel/openvino (f32) over {len(ov_ratios)} models: {statistics.geometric_mean(ov_ratios):.2f}")
    if fusion_speedups:
        print(f"fusion speedup (unfused/fused) geomean over {len(fusion_speedups)} models: "
              f"{statistics.geometric_mean(fusion_speedups):.2f}x")
    if layout_speedups:
        print(f"blocked layout speedup (nchw/blocked) geomean over the {len(layout_speedups)} models with blocked activations: "
              f"{statistics.geometric_mean(layout_speedups):.2f}x")
    if tvm_speedups:
        print(f"tessel vs TVM's pipeline: {min(tvm_speedups):.1f}x to {max(tvm_speedups):.1f}x faster on the {len(tvm_speedups)} models TVM runs")
    if args.bf16:
        _bf16_table(names, corpus, args.runs, args.rounds, openvino)
    return 0


def _bf16_table(names: list[str], corpus: dict, runs: int, rounds: int, openvino: bool) -> None:
    """OpenVINO bf16 against Tessel --precision bf16 per model (fastest medians of `rounds` alternating rounds), with
    Tessel bf16's GFLOP/s and its share of the bf16 peak measured now."""
    peak, where = _measured_peak("bfloat16")
    print("bf16 peak (measured, bench/peak.py, vdpbf16ps): " + (f"{peak:.1f} GFLOP/s ({where})" if peak else f"n/a ({where})"))
    print(f"{'model':<20} {'openvino bf16':>14} {'tessel bf16':>12} {'tessel/ov':>10} {'GFLOP/s':>8} {'%bf16 peak':>11}"
          "  (ms; fastest median per engine)")
    ratios = []
    for name in names:
        ov, tessel, why = [], [], ""
        for _ in range(rounds):
            ov.append(_ms(_isolated("openvino_bf16", name, runs, 600)) if openvino else None)
            measured = _isolated("tessel_bf16", name, runs, 1800)
            tessel.append(_ms(measured))
            why = why or measured[1]
        ov_ms, tessel_ms = min(filter(None, ov), default=None), min(filter(None, tessel), default=None)
        ratio = tessel_ms / ov_ms if ov_ms and tessel_ms else None
        if ratio:
            ratios.append(ratio)
        gflop = _model_gflop(corpus[name])
        gflops = gflop / (tessel_ms / 1e3) if gflop and tessel_ms else None
        cells = [f"{v:.3f}" if v is not None else "n/a" for v in (ov_ms, tessel_ms)]
        print(f"{name:<20} {cells[0]:>14} {cells[1]:>12} {f'{ratio:.2f}' if ratio else 'n/a':>10} "
              f"{f'{gflops:.1f}' if gflops else 'n/a':>8} {f'{100 * gflops / peak:.0f}%' if gflops and peak else 'n/a':>11}"
              + (f"  tessel: {why}" if tessel_ms is None and why else ""), flush=True)
    if ratios:
        print(f"geomean tessel bf16/openvino bf16 over {len(ratios)} models: "
              f"{statistics.geometric_mean(ratios):.2f}")


def _fastest_rounds(name: str, runs: int, rounds: int, openvino: bool) -> tuple:
    """onnxruntime's and OpenVINO's ms and Tessel's measurement, each the fastest median of `rounds` rounds that
    take the engines in turn (on a shared machine one engine's median can read several times its undisturbed
    time; alternating rounds give each engine a chance at a quiet moment).

    The engine right after OpenVINO's process ran slower on this VM (topology_resnet50, Tessel: 21.9 ms right after
    OpenVINO, 16.4 right after onnxruntime, same build, load under 1; onnxruntime 20.2 right after Tessel against
    18.3), so OpenVINO runs last in each round and onnxruntime and Tessel take turns to run first (the first follows
    the previous model's OpenVINO): over two rounds each runs once not right after OpenVINO."""
    ort, ov, tessel, why = [], [], None, ""
    for round_index in range(rounds):
        first_two = ["onnxruntime", "tessel"] if round_index % 2 == 0 else ["tessel", "onnxruntime"]
        for engine in first_two + (["openvino"] if openvino else []):
            if engine == "onnxruntime":
                ort.append(_ms(_isolated("onnxruntime", name, runs, 300)))
            elif engine == "openvino":
                ov.append(_ms(_isolated("openvino", name, runs, 600)))
            else:
                measured, why_not = _isolated("tessel", name, runs, 1800)
                if measured and (tessel is None or measured["ms"] < tessel["ms"]):
                    tessel = measured
                why = "" if tessel else why_not
    return min(filter(None, ort), default=None), min(filter(None, ov), default=None), (tessel, why)


def _before_after(names: list[str], baseline: Path, runs: int, repeats: int, kind: str = "tessel") -> int:
    """Tessel of `baseline` against this checkout's, alternating per model; the fastest median of each. `kind`: the
    measurement ("tessel", or "tessel_bf16" for both compiled with --precision bf16)."""
    print(f"{'model':<20} {'baseline ms':>12} {'this ms':>10} {'this/baseline':>14} {'overhead µs':>17}  (fastest of "
          f"{repeats} medians of {runs}; overhead: baseline/this, each one's fastest; baseline {baseline}; {kind})")
    ratios = []
    for name in names:
        samples: dict[str, list[float]] = {"baseline": [], "this": []}
        overheads: dict[str, list[float]] = {"baseline": [], "this": []}
        why = ""
        for _ in range(repeats):
            for side, root in (("baseline", baseline), ("this", ROOT)):
                measured = _isolated(kind, name, runs, 1800, root)
                if measured[0]:
                    samples[side].append(measured[0]["ms"])
                    if measured[0].get("overhead_us") is not None:
                        overheads[side].append(measured[0]["overhead_us"])
                else:
                    why = f"{side}: {measured[1]}"
        old = min(samples["baseline"], default=None)
        new = min(samples["this"], default=None)
        ratio = new / old if old and new else None
        if ratio:
            ratios.append(ratio)
        cells = [f"{v:.3f}" if v is not None else "n/a" for v in (old, new)]
        overhead = "/".join(f"{min(overheads[side]):.1f}" if overheads[side] else "n/a" for side in ("baseline", "this"))
        print(f"{name:<20} {cells[0]:>12} {cells[1]:>10} {f'{ratio:.3f}' if ratio else 'n/a':>14} {overhead:>17}"
              + (f"  {why}" if why else ""), flush=True)
    if ratios:
        print(f"geomean this/baseline over {len(ratios)} models: {statistics.geometric_mean(ratios):.3f}; "
              f"range {min(ratios):.3f} to {max(ratios):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
