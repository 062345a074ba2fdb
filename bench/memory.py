"""Memory plans per corpus model: Tessel's arena against its lower bound, no reuse, and TVM's planner.

Per non-negative corpus model: the activation arena Tessel plans, the lower
bound (most bytes live at once, in-place reuse counted), their ratio, the
total without any reuse, and the bytes TVM's Relax StaticPlanBlockMemory plans
for the same model (its storages plus the tensors it leaves unplanned, such as
function outputs) where TVM imports the model (each in its own process).
No kernels are compiled.

    python bench/memory.py [MODEL ...] [--skip-tvm]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

from tessel import ir  # noqa: E402
from tessel.backends.target import parse_target  # noqa: E402
from tessel.compiler.corpus import load_corpus  # noqa: E402
from tessel.compiler.memory import plan_program_memory  # noqa: E402
from tessel.compiler.pipeline import run_pipeline  # noqa: E402
from tessel.compiler.program import build_program  # noqa: E402

TVM_TIMEOUT_S = 900
MIB = 2**20


def tessel_plan(model):
    """Tessel's memory plan for a corpus model (default pipeline, llvm)."""
    graph, _ = run_pipeline(ir.from_onnx(str(model.path), model.input_shapes))
    return plan_program_memory(build_program(graph, parse_target("llvm")), "llvm")


def tvm_planned_bytes(model) -> int:
    """Bytes TVM's StaticPlanBlockMemory allocates (its storages plus the tensors it leaves unplanned, such as
    the outputs), plus the input tensors its caller allocates (Tessel's arena holds the inputs too)."""
    import os

    os.environ.setdefault("TVM_NUM_THREADS", str(os.cpu_count()))
    import onnx
    import tvm
    from tvm import relax
    from tvm.relax.frontend.onnx import from_onnx
    from tvm.target import Target

    passes = tvm.transform.Sequential([
        relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(), relax.transform.FoldConstant(),
        relax.transform.FuseOps(), relax.transform.FuseTIR(), relax.transform.RewriteDataflowReshape(),
        relax.transform.ToNonDataflow(), relax.transform.RemovePurityChecking(), relax.transform.CallTIRRewrite(),
        relax.transform.StaticPlanBlockMemory(),
    ])
    mod = from_onnx(onnx.load(str(model.path)), shape_dict={k: list(v) for k, v in model.input_shapes.items()},
                    keep_params_in_input=False)
    with Target.from_device("cpu"):
        planned = passes(mod)
    storage_op = tvm.ir.Op.get("relax.memory.alloc_storage")
    unplanned_op = tvm.ir.Op.get("relax.builtin.alloc_tensor")
    total = 0
    for block in planned["main"].body.blocks:
        for binding in block.bindings:
            value = binding.value
            if not isinstance(value, relax.Call):
                continue
            if value.op == storage_op:
                total += int(value.args[0].values[0])
            elif value.op == unplanned_op:
                count = 1
                for d in value.args[0].values:
                    count *= int(d)
                total += count * tvm.DataType(value.args[1].value).bits // 8
    for value in ir.from_onnx(str(model.path), model.input_shapes).inputs:
        total += value.type.nbytes
    return total


def _tvm_isolated(name: str) -> tuple[int | None, str]:
    command = [sys.executable, str(Path(__file__).resolve()), "--tvm-worker", name]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=TVM_TIMEOUT_S, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return None, "timed out"
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return None, ((done.stderr.strip().splitlines() or ["failed"])[-1])[:100]
    return json.loads(lines[-1])["bytes"], ""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", help="corpus model names (default: every non-negative model)")
    parser.add_argument("--skip-tvm", action="store_true", help="do not run TVM's planner")
    parser.add_argument("--tvm-worker", metavar="MODEL", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    corpus = {m.name: m for m in load_corpus()}
    if args.tvm_worker:
        print(json.dumps({"bytes": tvm_planned_bytes(corpus[args.tvm_worker])}))
        return 0
    names = args.models or [m.name for m in corpus.values() if not m.negative]
    print(f"{'model':<24} {'arena MiB':>10} {'bound MiB':>10} {'ratio':>6} {'no-reuse MiB':>13} {'TVM MiB':>9} {'arena/TVM':>10}")
    worst_ratio, over_tvm = 0.0, []
    for name in names:
        plan = tessel_plan(corpus[name])
        tvm_bytes, why = (None, "skipped") if args.skip_tvm else _tvm_isolated(name)
        versus = plan.arena_bytes / tvm_bytes if tvm_bytes else None
        worst_ratio = max(worst_ratio, plan.ratio)
        if versus is not None and versus > 1:
            over_tvm.append(name)
        tvm_cell = f"{tvm_bytes / MIB:>9.2f}" if tvm_bytes else f"{'n/a':>9}"
        versus_cell = f"{versus:>10.2f}" if versus is not None else f"{'':>10}"
        print(f"{name:<24} {plan.arena_bytes / MIB:>10.2f} {plan.bound_bytes / MIB:>10.2f} {plan.ratio:>6.3f} "
              f"{plan.no_reuse_bytes / MIB:>13.2f} {tvm_cell} {versus_cell}"
              + (f"  tvm: {why}" if tvm_bytes is None and not args.skip_tvm else ""), flush=True)
    print(f"worst arena/bound ratio: {worst_ratio:.3f}; arena above TVM's total: {', '.join(over_tvm) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
