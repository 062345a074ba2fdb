"""The multi-GPU check: a 2-worker cuda artifact (pipeline placement) run by torchrun over NCCL on a GPU machine.

Two steps, as for bench/gpu_check.py (whose packing and runtime install this reuses):

1. here (CPU, nvcc): `python bench/gpu_multi_check.py pack --arch sm_90 -o out/gpu_multi`
   compiles a corpus model (default mtcnn_onet) for `cuda:sm_90` on 2 devices
   with pipeline placement, computes onnxruntime's CPU outputs on the corpus
   inputs and writes one folder: the artifact's files, the inputs and reference
   outputs, a runtime-only TVM and the tvm-ffi wheel for the GPU machine's Python.
2. there: `python bench/gpu_multi_check.py run out/gpu_multi --json $OUT/multi.json`
   unpacks TVM's runtime into a temporary folder and starts the two workers with
   torchrun (`python -m torch.distributed.run --standalone --nproc-per-node 2 -m
   tessel.runtime.worker`): worker r runs on GPU r, the stages exchange their
   tensors over NCCL straight from the GPU arenas; rank 0's outputs are compared
   with onnxruntime's (rtol 1e-3, atol 1e-4) and the pipeline's latency and
   streamed time per batch are printed.

The run needs a machine with at least 2 GPUs. The GPU machines this project is
lent have one GPU, and NCCL refuses two ranks on one GPU ("Duplicate GPU
detected"), so there the run stops at once with one line (exit 2) and the
device run waits for a multi-GPU machine. Without a GPU, everything up to the
device run is tested (tests/runtime/test_gpu_workers.py).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.gpu_check import (ATOL, RTOL, _artifact_files, _compare, _load_npz, _npz_bytes, _reference,  # noqa: E402
                             ffi_wheel, install_runtime, make_inputs, runtime_tarball)

WORKERS = 2
ARTIFACT = "artifact"  # the packed artifact's folder inside the pack
EXIT_NO_GPUS = 2


def pack(target: str, out: Path, model_name: str, cache_dir: Path | None, python: str = "312") -> Path:
    """Compile the model for `target` on WORKERS devices (pipeline), compute its reference and write the pack."""
    os.environ.setdefault("TVM_CUDA_COMPILE_MODE", "nvcc")
    from tessel.compiler.api import compile as tessel_compile
    from tessel.compiler.corpus import load_corpus

    model = next((m for m in load_corpus() if m.name == model_name and not m.negative), None)
    if model is None:
        raise SystemExit(f"gpu multi check: no non-negative corpus model named {model_name!r}")
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    started = time.perf_counter()
    # No profile: this machine cannot time cuda kernels; pipeline placement cuts by the cost model's estimates.
    artifact = tessel_compile(model.path, target=target, input_shapes=model.input_shapes, devices=WORKERS,
                              placement="pipeline", profile=False, cache_dir=str(cache_dir) if cache_dir else None)
    stages = [sum(i["op"] not in ("Send", "Recv") for i in w["instructions"]) for w in artifact.plan["workers"]]
    for relative, data in _artifact_files(artifact.directory).items():
        (out / ARTIFACT / relative).parent.mkdir(parents=True, exist_ok=True)
        (out / ARTIFACT / relative).write_bytes(data)
    recipe = {"seed": 0, "inputs": [[name, spec["fill"], spec["dtype"], list(spec["shape"])]
                                    for name, spec in model.inputs.items()]}
    inputs = make_inputs(recipe)
    (out / "inputs.npz").write_bytes(_npz_bytes(inputs))
    (out / "expected.npz").write_bytes(_npz_bytes(_reference(model.path, inputs, None)))
    runtime_tarball(out / "tvm_runtime.tar.gz")
    shutil.copy(ffi_wheel(out.parent / "wheels", python), out)
    (out / "check.json").write_text(json.dumps({"model": model.name, "target": target, "workers": WORKERS,
                                                "instructions_per_worker": stages}))
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"{out}: {model.name} on {WORKERS} cuda workers ({stages} instructions besides transfers), "
          f"{size / 2**20:.1f} MiB, {time.perf_counter() - started:.0f} s")
    return out


def gpu_shortfall(have: int) -> str | None:
    """The line that stops the run on a machine with fewer than WORKERS GPUs, or None."""
    if have >= WORKERS:
        return None
    return (f"gpu multi check: needs {WORKERS} GPUs, this machine has {have}; NCCL refuses two ranks on one GPU "
            "(\"Duplicate GPU detected\"), so this check waits for a machine with several GPUs")


def run(folder: Path, json_path: Path | None, repeat: int = 20, timeout_s: float = 120.0) -> int:
    """Run the packed artifact on WORKERS GPUs with torchrun over NCCL; 0 when rank 0's outputs equal the reference."""
    import torch

    shortfall = gpu_shortfall(torch.cuda.device_count() if torch.cuda.is_available() else 0)
    if shortfall:
        print(shortfall)
        return EXIT_NO_GPUS
    scratch = Path(tempfile.mkdtemp(prefix="tessel-gpu-multi-"))
    try:
        install_runtime(folder, scratch / "site")
        env = {**os.environ, "TVM_USE_RUNTIME_LIB": "1",
               "PYTHONPATH": os.pathsep.join([str(scratch / "site"), str(REPO), os.environ.get("PYTHONPATH", "")])}
        outputs, report = scratch / "outputs.npz", scratch / "times.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORKERS}",
                   "-m", "tessel.runtime.worker", str(folder / ARTIFACT), "--inputs", str(folder / "inputs.npz"),
                   "--outputs", str(outputs), "--report", str(report), "--repeat", str(repeat),
                   "--timeout", str(timeout_s)]
        started = time.perf_counter()
        done = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True)
        wall = time.perf_counter() - started
        if done.returncode != 0:
            lines = [line for line in (done.stderr + done.stdout).splitlines() if "tessel worker" in line]
            print(f"gpu multi check: torchrun exited with {done.returncode}: "
                  f"{lines[-1] if lines else (done.stderr.strip().splitlines() or ['no message'])[-1]}")
            return 1
        info = json.loads((folder / "check.json").read_text())
        matches, worst = _compare(_load_npz(outputs), _load_npz(folder / "expected.npz"))
        times = json.loads(report.read_text())
        row = {"model": info["model"], "target": info["target"], "workers": WORKERS, "backend": "nccl",
               "gpus": [torch.cuda.get_device_name(i) for i in range(WORKERS)], "matches": matches,
               "max_error": worst, "latency_ms": 1e3 * times["latency_s"] if times["latency_s"] else None,
               "ms_per_batch_streamed": 1e3 * times["seconds_per_batch"] if times["seconds_per_batch"] else None,
               "wall_s": wall}
        print(f"{row['model']} on {WORKERS} x {row['gpus'][0]} over NCCL: "
              f"{'equals' if matches else 'DIFFERS FROM'} onnxruntime (max error {worst:.2e}, rtol {RTOL}, "
              f"atol {ATOL}); latency {row['latency_ms']} ms, streamed {row['ms_per_batch_streamed']} ms per batch")
        if json_path:
            json_path.write_text(json.dumps(row, indent=1))
        return 0 if matches else 1
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """`pack` (CPU machine with nvcc) or `run` (a machine with 2 GPUs)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("pack", help="compile and pack the 2-worker check (CPU machine with nvcc)")
    p.add_argument("--arch", default="sm_90", help="the GPUs' architecture (sm_90: H100/H200)")
    p.add_argument("-o", "--out", type=Path, default=Path("out/gpu_multi"))
    p.add_argument("--model", default="mtcnn_onet", help="the corpus model to place on the two GPUs")
    p.add_argument("--cache-dir", type=Path, help="kernel cache (default: Tessel's)")
    p.add_argument("--python", default="312", help="the GPU machine's Python, for the tvm-ffi wheel")
    r = commands.add_parser("run", help="run the packed artifact on 2 GPUs with torchrun over NCCL")
    r.add_argument("folder", type=Path)
    r.add_argument("--json", type=Path, help="where to write the result row")
    r.add_argument("--repeat", type=int, default=20, help="streamed runs timed after the first")
    args = parser.parse_args(argv)
    if args.command == "pack":
        pack(f"cuda:{args.arch}", args.out, args.model, args.cache_dir, args.python)
        return 0
    return run(args.folder, args.json, args.repeat)


if __name__ == "__main__":
    sys.exit(main())
