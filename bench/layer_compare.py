"""Per layer, Tessel's kernel time against OpenVINO f32's layer time on one corpus model, side by side.

Each engine runs in its own process (thread pools of one skew the other on 2
cores). Tessel: the model compiled as `tessel compile` does (extra options
with --algo-select), then each kernel call timed on its own (`tessel run
--profile`'s medians). OpenVINO: f32 forced, the same threads, PERF_COUNT on;
each layer's real time is its median over the inferences. `--bf16`: Tessel
compiled with `--precision bf16` beside OpenVINO bf16 (INFERENCE_PRECISION_HINT
bf16, its default on CPUs with avx512_bf16). The two are joined
by the ONNX node that a Tessel kernel is named after (`fused_node_Conv_298` is
`node_Conv_298` with what was fused into it) and that OpenVINO keeps as its
layer's name; OpenVINO's fused layers (a conv's add and ReLU) are counted on
the layer that executed them. Every number is measured. With PERF_COUNT on,
OpenVINO's layer times add up to more than its latency without it (ResNet-18:
13.9 ms of layers against 8.4 ms end to end, one run): compare its layers with
each other, and whole models with bench/latency.py.

    python bench/layer_compare.py resnet18 [--runs 50] [--algo-select off|dp] [--bf16] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

from tessel.compiler.corpus import load_corpus  # noqa: E402


def _model(name: str):
    """The corpus entry called `name` (SystemExit 2 with one line when there is none)."""
    models = {model.name: model for model in load_corpus()}
    if name not in models:
        print(f"layer_compare: no corpus model {name!r}", file=sys.stderr)
        raise SystemExit(2)
    return models[name]


# OpenVINO's INFERENCE_PRECISION_HINT for each precision a run compares in.
OPENVINO_PRECISION = {"fp32": "f32", "bf16": "bf16"}


def tessel_layers(model, runs: int, algo_select: str, precision: str = "fp32") -> list[dict]:
    """Per kernel call: node, op, median ms and GFLOP (`tessel run --profile`), compiled in `precision`."""
    from tessel.backends.kernel import ALGORITHM
    from tessel.compiler.api import compile as compile_model
    from tessel.compiler.kernel_profile import kernel_profile

    artifact = compile_model(model.path, input_shapes=model.input_shapes, algo_select=algo_select,
                             precision=precision)
    rows = kernel_profile(artifact, model.make_inputs(), runs)
    # A kernel's chosen algorithm is an attribute of its anchor op, inside a fused node's body.
    chosen = {}
    for node in json.loads((artifact.directory / "graph.json").read_text())["graph"]["nodes"]:
        found = re.search(rf'"{ALGORITHM}": "(\w+)"', json.dumps(node))
        if found:
            chosen[node["name"]] = found.group(1)
    return [{"node": row["node"], "op": row["op"], "ms": row["ms"], "gflop": row["gflop"],
             "algorithm": chosen.get(row["node"], "")} for row in rows]


def openvino_layers(model, runs: int, precision: str = "fp32") -> list[dict]:
    """Per executed OpenVINO layer: name, exec type and median real ms over `runs` inferences, in `precision`
    (OpenVINO's INFERENCE_PRECISION_HINT: f32 or bf16)."""
    import openvino as ov

    core = ov.Core()
    network = core.read_model(str(model.path))
    network.reshape({name: list(shape) for name, shape in model.input_shapes.items()})
    compiled = core.compile_model(network, "CPU", {"INFERENCE_PRECISION_HINT": OPENVINO_PRECISION[precision],
                                                   "PERF_COUNT": "YES", "INFERENCE_NUM_THREADS": os.cpu_count() or 1})
    request = compiled.create_infer_request()
    feeds = model.make_inputs()
    for _ in range(10):
        request.infer(feeds)
    samples: dict[str, list[float]] = {}
    kinds: dict[str, str] = {}
    for _ in range(runs):
        request.infer(feeds)
        for info in request.get_profiling_info():
            if info.status != info.Status.EXECUTED:
                continue
            samples.setdefault(info.node_name, []).append(info.real_time.total_seconds() * 1e3)
            kinds[info.node_name] = info.exec_type
    return [{"node": name, "exec_type": kinds[name], "ms": statistics.median(times)}
            for name, times in samples.items()]


# Each engine's measurement, by --worker: (corpus model, runs, Tessel's algorithm selection, precision) -> rows.
WORKERS = {"tessel": tessel_layers,
           "openvino": lambda model, runs, algo_select, precision: openvino_layers(model, runs, precision)}


def _isolated(kind: str, name: str, runs: int, algo_select: str, precision: str = "fp32") -> list[dict]:
    """One engine's layers, measured in a fresh process."""
    command = [sys.executable, str(Path(__file__).resolve()), name, "--worker", kind, "--runs", str(runs),
               "--algo-select", algo_select] + (["--bf16"] if precision == "bf16" else [])
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, timeout=1800)
    lines = [line for line in done.stdout.splitlines() if line.startswith("[")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["failed"])[-1]
        raise RuntimeError(f"{kind}: {tail}")
    return json.loads(lines[-1])


def _onnx_node(tessel_node: str) -> str:
    """The ONNX node a Tessel kernel is named after (its `fused_` prefix dropped)."""
    return re.sub(r"^fused_", "", tessel_node)


def side_by_side(tessel: list[dict], openvino: list[dict]) -> list[dict]:
    """Rows in the order of Tessel's profile (slowest kernel first), each joined to OpenVINO's layer of the same
    ONNX node where it has one; OpenVINO's remaining layers last."""
    by_name = {row["node"]: row for row in openvino}
    rows, used = [], set()
    for row in tessel:
        match = by_name.get(_onnx_node(row["node"]))
        if match:
            used.add(match["node"])
        rows.append({"node": row["node"], "algorithm": row["algorithm"], "gflop": row["gflop"],
                     "tessel_ms": row["ms"], "openvino_ms": match["ms"] if match else None,
                     "exec_type": match["exec_type"] if match else ""})
    for row in openvino:
        if row["node"] not in used and row["ms"] > 0:
            rows.append({"node": row["node"], "algorithm": "", "gflop": 0.0, "tessel_ms": None,
                         "openvino_ms": row["ms"], "exec_type": row["exec_type"]})
    return rows


def _cell(value: float | None, digits: int = 3) -> str:
    return f"{value:.{digits}f}" if value is not None else "-"


def print_table(rows: list[dict]) -> None:
    """The side-by-side table, with totals and the gap per layer (Tessel minus OpenVINO, ms)."""
    print(f"{'node':<28} {'algo':<9} {'GFLOP':>7} {'tessel ms':>10} {'GFLOP/s':>8} {'openvino ms':>12} "
          f"{'GFLOP/s':>8} {'gap ms':>8}  openvino exec type")
    for row in rows:
        t, o, g = row["tessel_ms"], row["openvino_ms"], row["gflop"]
        gap = t - o if t is not None and o is not None else None
        print(f"{row['node'][:28]:<28} {row['algorithm'][:9]:<9} {g:>7.4f} {_cell(t):>10} "
              f"{_cell(g / t * 1e3 if g and t else None, 1):>8} {_cell(o):>12} "
              f"{_cell(g / o * 1e3 if g and o else None, 1):>8} {_cell(gap):>8}  {row['exec_type']}")
    tessel_total = sum(row["tessel_ms"] or 0.0 for row in rows)
    openvino_total = sum(row["openvino_ms"] or 0.0 for row in rows)
    ratio = f"{tessel_total / openvino_total:.3f}" if openvino_total else "-"
    print(f"total (sum of layers, measured): tessel {tessel_total:.3f} ms, openvino {openvino_total:.3f} ms, "
          f"ratio {ratio}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a corpus model name")
    parser.add_argument("--runs", type=int, default=50, help="timed runs per layer (default 50)")
    parser.add_argument("--algo-select", default="off", choices=("off", "dp", "ilp"),
                        help="Tessel's algorithm selection (as `tessel compile --algo-select`)")
    parser.add_argument("--bf16", action="store_true",
                        help="Tessel with --precision bf16 beside OpenVINO bf16 (default: both float32)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    parser.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.runs < 1:
        print("layer_compare: --runs must be at least 1", file=sys.stderr)
        return 2
    model = _model(args.model)
    precision = "bf16" if args.bf16 else "fp32"
    if args.worker:
        print(json.dumps(WORKERS[args.worker](model, args.runs, args.algo_select, precision)))
        return 0
    try:
        rows = side_by_side(_isolated("tessel", args.model, args.runs, args.algo_select, precision),
                            _isolated("openvino", args.model, args.runs, args.algo_select, precision))
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        print(f"layer_compare: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
