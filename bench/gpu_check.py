"""The GPU check: CUDA artifacts compiled here, verified and timed on a GPU machine in one command.

The GPU machines start bare (Python 3.12, torch, numpy, onnx, onnxruntime; no
TVM, no nvcc, no network) and take a limited amount of files per command, so
the check is two steps:

1. here (CPU, nvcc): `python bench/gpu_check.py pack --arch sm_90 -o out/gpu_check`
   compiles every non-negative corpus model (and ResNet-18 at batch 16) for the
   GPU's architecture, computes onnxruntime's CPU outputs on the corpus inputs,
   and writes one or more parts (`part0/`, `part1/`, ...) each under the size
   limit: the artifacts' files stored once by content hash and deflated (the
   topology models' weights are made by ConstantOfShape: VGG-19's 550 MB of
   them deflate to under a megabyte), the inputs and
   reference outputs, a runtime-only TVM (the installed wheel without its
   compiler library) and the tvm-ffi wheel for the GPU machine's Python.
2. there: `python bench/gpu_check.py run out/gpu_check/part0 [part1 ...] --json $OUT/gpu.json`
   unpacks TVM's runtime into a temporary folder, imports it with
   TVM_USE_RUNTIME_LIB=1 (its compiler library is not even there), and for each
   model loads the artifact, runs it twice on a poisoned arena, compares with
   onnxruntime (rtol 1e-3, atol 1e-4), and times it; ResNet-18 is also timed in
   PyTorch eager (cuDNN) with the same weights.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

RTOL, ATOL = 1e-3, 1e-4
# TF32 cases (--allow-tf32) round every conv input to 11 significant bits, as PyTorch's cuDNN default does: they are
# held to this tolerance, and the table shows PyTorch's own TF32 error beside theirs.
TF32_RTOL, TF32_ATOL = 1e-2, 1e-2
# What a runtime-only TVM leaves out of the installed package: the compiler library and sources.
RUNTIME_EXCLUDES = ("lib/libtvm_compiler.so", "3rdparty", "src", "include", "web")
TORCH_MODELS = ("resnet18", "resnet18_b16")  # the cases also timed in PyTorch eager


# ---- pack (CPU machine) -------------------------------------------------------------------------
def _cases():
    """(case name, corpus model, batch or None, input recipe, TF32 allowed) for every non-negative corpus model,
    ResNet-18 at 16, and ResNet-18 at 1 and 16 on TF32 tensor cores.

    A recipe is what the corpus says to fill each input with, in order, from one seed: the device makes the same
    arrays (checked by their hash) instead of carrying them (ResNet-18's batch of 16 alone is 9.6 MB).
    """
    from tessel.compiler.corpus import load_corpus

    for model in load_corpus():
        if model.negative:
            continue
        specs = [[name, spec["fill"], spec["dtype"], list(spec["shape"])] for name, spec in model.inputs.items()]
        yield model.name, model, None, {"seed": 0, "inputs": specs}, False
        if model.name == "resnet18":
            batch16 = {"seed": 0, "inputs": [[n, f, d, [16, *s[1:]]] for n, f, d, s in specs]}
            yield "resnet18_b16", model, 16, batch16, False
            yield "resnet18_tf32", model, None, {"seed": 0, "inputs": specs}, True
            yield "resnet18_b16_tf32", model, 16, batch16, True


def make_inputs(recipe: dict) -> dict[str, np.ndarray]:
    """The inputs a recipe describes (the corpus fills, drawn in order from one generator)."""
    from tessel.compiler.corpus import fill

    rng = np.random.default_rng(recipe["seed"])
    return {name: fill(how, dtype, tuple(shape), rng) for name, how, dtype, shape in recipe["inputs"]}


def _inputs_digest(inputs: dict[str, np.ndarray]) -> str:
    digest = hashlib.sha256()
    for name, value in inputs.items():
        digest.update(name.encode() + str(value.dtype).encode() + str(value.shape).encode())
        digest.update(np.ascontiguousarray(value).tobytes())
    return digest.hexdigest()


def _reference(model_path: Path, inputs: dict[str, np.ndarray], batch: int | None) -> dict[str, np.ndarray]:
    """onnxruntime's outputs; a model re-batched by Tessel is run sample by sample (its ONNX fixes batch 1)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    if batch is None:
        return dict(zip(names, session.run(None, inputs)))
    samples = [session.run(None, {n: v[i:i + 1] for n, v in inputs.items()}) for i in range(batch)]
    return {name: np.concatenate([s[k] for s in samples]) for k, name in enumerate(names)}


def runtime_tarball(destination: Path) -> None:
    """TVM's installed Python package without its compiler library, as a .tar.gz."""
    import importlib.util

    package = Path(importlib.util.find_spec("tvm").origin).parent

    def keep(info: tarfile.TarInfo):
        relative = info.name.split("/", 1)[1] if "/" in info.name else ""
        if "__pycache__" in info.name or relative.startswith(RUNTIME_EXCLUDES):
            return None
        return info

    with tarfile.open(destination, "w:gz") as tar:
        tar.add(package, arcname="tvm", filter=keep)


def ffi_wheel(destination: Path, python: str) -> Path:
    """The pinned tvm-ffi wheel for the GPU machine's Python (pip download; cached in `destination`).

    For this machine's own Python the installed package is zipped instead (no download).
    """
    import importlib.util
    import zipfile
    from importlib.metadata import version

    if python == f"{sys.version_info.major}{sys.version_info.minor}":
        package = Path(importlib.util.find_spec("tvm_ffi").origin).parent
        wheel = destination / f"apache_tvm_ffi-{version('apache-tvm-ffi')}-cp{python}-installed.whl"
        destination.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as archive:
            for path in package.rglob("*"):
                if path.is_file() and "__pycache__" not in path.parts:
                    archive.write(path, Path("tvm_ffi") / path.relative_to(package))
        return wheel
    found = sorted(destination.glob(f"apache_tvm_ffi-*-cp{python}-*.whl"))
    if not found:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--python-version", python[0] + "." + python[1:], "--platform", "manylinux_2_28_x86_64",
                        "-d", str(destination), f"apache-tvm-ffi=={version('apache-tvm-ffi')}"], check=True)
        found = sorted(destination.glob(f"apache_tvm_ffi-*-cp{python}-*.whl"))
    return found[-1]


def _store(files: dict[str, bytes]) -> dict[str, str]:
    return {relative: hashlib.sha256(data).hexdigest() for relative, data in files.items()}


def _artifact_files(directory: Path) -> dict[str, bytes]:
    """The files the executor reads (plan, kernel libraries, weights), with the plan resealed to list only those.

    The model copy, the graph and the kernels' CUDA sources stay behind: the
    executor never reads them, and they would triple what the device must carry.
    """
    from tessel.runtime.artifact_files import KNOWN_FILES, PLAN_FILE, read_plan, referenced_files, sealed_plan_bytes

    plan = read_plan(directory)
    needed = [name for name in referenced_files(directory, plan) if name not in KNOWN_FILES]
    plan["hashes"] = {name: digest for name, digest in plan["hashes"].items() if name in needed}
    files = {name: (directory / name).read_bytes() for name in needed}
    files[PLAN_FILE] = sealed_plan_bytes(plan)
    return files


def _force_algorithm(algorithm: str) -> None:
    """Bench only: every conv and matmul kernel compiled with `algorithm` (to time the algorithms against each other
    on the GPU, where the profile database cannot be filled from this machine)."""
    from tessel.compiler import program

    original = program.ProgramBuilder.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.algorithm = algorithm

    program.ProgramBuilder.__init__ = init


def pack(target: str, out: Path, limit_mib: float, only: list[str] | None, cache_dir: Path | None,
         python: str = "312", algorithm: str | None = None) -> list[Path]:
    """Compile, compute references and write the parts; returns their folders."""
    os.environ.setdefault("TVM_CUDA_COMPILE_MODE", "nvcc")
    from tessel.compiler.api import compile as tessel_compile

    if algorithm:
        _force_algorithm(algorithm)

    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    shared = out / "shared"
    shared.mkdir()
    runtime_tarball(shared / "tvm_runtime.tar.gz")
    wheel = ffi_wheel(out / "wheels", python)
    fixed_bytes = (shared / "tvm_runtime.tar.gz").stat().st_size + wheel.stat().st_size
    budget = int(limit_mib * 2**20) - fixed_bytes
    cases, blobs = [], {}
    for name, model, batch, recipe, tf32 in _cases():
        if only and name not in only or tf32 and not target.startswith("cuda"):
            continue
        inputs = make_inputs(recipe)
        started = time.perf_counter()
        artifact = tessel_compile(model.path, target=target, input_shapes=model.input_shapes, batch=batch,
                                  cache_dir=str(cache_dir) if cache_dir else None, allow_tf32=tf32)
        files = _artifact_files(artifact.directory)
        expected = _reference(model.path, inputs, batch)
        files["case/inputs.json"] = json.dumps({**recipe, "sha256": _inputs_digest(inputs)}).encode()
        files["case/expected.npz"] = _npz_bytes(expected)
        if name.startswith(TORCH_MODELS) and _torch_weights(files) is None:
            files["case/torch_weights.npz"] = _npz_bytes(_onnx_weights(model.path))
        hashes = _store(files)
        for relative, data in files.items():
            blobs.setdefault(hashes[relative], zlib.compress(data, 6))
        cases.append({"name": name + (f"_{algorithm}" if algorithm else ""), "files": hashes,
                      "tolerance": [TF32_RTOL, TF32_ATOL] if tf32 else [RTOL, ATOL]})
        print(f"packed {name}: {sum(len(d) for d in files.values()) / 2**20:.1f} MiB in {time.perf_counter() - started:.0f} s",
              flush=True)
    parts = _split(cases, blobs, budget)
    folders = []
    for index, part in enumerate(parts):
        folder = out / f"part{index}"
        (folder / "blobs").mkdir(parents=True)
        shutil.copy(shared / "tvm_runtime.tar.gz", folder)
        shutil.copy(wheel, folder)
        for case in part:
            for digest in case["files"].values():
                blob = folder / "blobs" / digest
                if not blob.exists():
                    blob.write_bytes(blobs[digest])
        (folder / "cases.json").write_text(json.dumps({"target": target, "cases": part}, indent=1))
        size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
        print(f"{folder}: {', '.join(c['name'] for c in part)} ({size / 2**20:.1f} MiB)")
        folders.append(folder)
    shutil.rmtree(shared)
    return folders


def _split(cases: list[dict], blobs: dict[str, bytes], budget: int) -> list[list[dict]]:
    """Cases into parts whose distinct (deflated) blobs stay under `budget` bytes (first fit, largest first)."""
    def size(digests) -> int:
        return sum(len(blobs[d]) for d in digests)

    parts: list[tuple[list[dict], set[str]]] = []
    for case in sorted(cases, key=lambda c: -size(set(c["files"].values()))):
        digests = set(case["files"].values())
        if size(digests) > budget:
            raise SystemExit(f"{case['name']} alone needs {size(digests) / 2**20:.1f} MiB, over the part limit")
        for members, held in parts:
            if size(held | digests) <= budget:
                members.append(case)
                held |= digests
                break
        else:
            parts.append(([case], set(digests)))
    return [members for members, _ in parts]


def _npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    import io

    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def _onnx_weights(model_path: Path) -> dict[str, np.ndarray]:
    """The ONNX model's initializers that PyTorch's ResNet-18 takes, by name."""
    import onnx
    from onnx import numpy_helper

    from bench.torch_models import resnet18_weight_names

    wanted = set(resnet18_weight_names())
    return {t.name: numpy_helper.to_array(t) for t in onnx.load(str(model_path)).graph.initializer if t.name in wanted}


def _torch_weights(files: dict[str, bytes]) -> dict[str, np.ndarray] | None:
    """PyTorch's weights from the case's files: the artifact's own weights when they hold them under the ONNX names
    (then nothing more is carried), else the copy packed beside them."""
    import io

    from bench.torch_models import resnet18_weight_names

    for name in ("weights.npz", "case/torch_weights.npz"):
        if name in files:
            with np.load(io.BytesIO(files[name]), allow_pickle=False) as data:
                if all(n in data.files for n in resnet18_weight_names()):
                    return {n: data[n] for n in resnet18_weight_names()}
    return None


# ---- run (GPU machine) --------------------------------------------------------------------------
def install_runtime(part: Path, into: Path) -> None:
    """Unpack the runtime-only TVM and the tvm-ffi wheel into `into` and import TVM from there."""
    import zipfile

    with tarfile.open(part / "tvm_runtime.tar.gz") as tar:
        tar.extractall(into, filter="data")
    for wheel in part.glob("apache_tvm_ffi-*.whl"):
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(into)
    for library in into.rglob("*.so*"):
        library.chmod(0o755)
    os.environ["TVM_USE_RUNTIME_LIB"] = "1"
    sys.path.insert(0, str(into))


def _materialize(part: Path, case: dict, into: Path) -> Path:
    """The case's files inflated into `into`, each checked against the hash it was packed under."""
    for relative, digest in case["files"].items():
        target = into / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        data = zlib.decompress((part / "blobs" / digest).read_bytes())
        if hashlib.sha256(data).hexdigest() != digest:
            raise RuntimeError(f"{relative}: the packed blob does not hash to {digest}")
        target.write_bytes(data)
    return into


def _load_npz(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as data:
        return {name: data[name] for name in data.files}


def _compare(got: dict[str, np.ndarray], want: dict[str, np.ndarray], rtol: float = RTOL,
             atol: float = ATOL) -> tuple[bool, float]:
    """Whether every output equals its reference within rtol/atol (NaN equal to NaN at the same places), and the
    largest error (infinite where NaN or infinity stands on one side only)."""
    ok, worst = True, 0.0
    for name, expected in want.items():
        actual = got[name]
        if actual.shape != expected.shape:
            return False, float("inf")
        if actual.size:
            difference = np.abs(actual.astype(np.float64) - expected.astype(np.float64))
            both_nan = np.isnan(actual) & np.isnan(expected) if actual.dtype.kind == "f" else False
            worst = max(worst, float(np.max(np.where(both_nan, 0.0, np.nan_to_num(difference, nan=np.inf)))))
        ok = ok and bool(np.allclose(actual, expected, rtol=rtol, atol=atol, equal_nan=True))
    return ok, worst


def _time_ms(call, seconds: float = 1.0, warmup: int = 3) -> float:
    """Median milliseconds of `call` (which must finish its GPU work before returning): at least 10 samples
    over `seconds`, or 3 when one call takes longer than that."""
    for _ in range(warmup):
        started = time.perf_counter()
        call()
        if time.perf_counter() - started > seconds:
            break
    slow = time.perf_counter() - started > seconds
    samples, deadline = [], time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(samples) < (3 if slow else 10):
        started = time.perf_counter()
        call()
        samples.append((time.perf_counter() - started) * 1e3)
    return float(np.median(samples))


def _torch_row(weights: dict[str, np.ndarray], inputs: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> dict:
    import torch

    from bench.torch_models import resnet18

    model = resnet18(weights).cuda().eval()
    (x,) = inputs.values()
    device_x = torch.from_numpy(x).cuda()

    def call():
        with torch.no_grad():
            y = model(device_x)
        torch.cuda.synchronize()
        return y

    with torch.no_grad():
        got = call().cpu().numpy()
    ok, error = _compare({"y": got}, {"y": next(iter(expected.values()))})
    tf32_ms = _time_ms(call)  # PyTorch's default: cuDNN may run float32 convs on TF32 tensor cores

    def call_with_copies():
        # What Tessel's run does: the numpy input copied to the GPU, the output copied back.
        with torch.no_grad():
            return model(torch.from_numpy(x).cuda()).cpu().numpy()

    io_ms = _time_ms(call_with_copies)
    allowed = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        fp32_ms = _time_ms(call)
    finally:
        torch.backends.cudnn.allow_tf32 = allowed
    return {"torch_ms": tf32_ms, "torch_fp32_ms": fp32_ms, "torch_io_ms": io_ms, "torch_matches": ok,
            "torch_max_error": error}


def run(parts: list[Path], json_path: Path | None, dump_to: Path | None = None, profile: bool = False) -> int:
    """Verify and time every case of the parts on this machine's GPU; 0 when every model matches."""
    scratch = Path(tempfile.mkdtemp(prefix="tessel-gpu-check-"))
    try:
        install_runtime(parts[0], scratch / "site")
        from tessel.backends.tvm_env import enable_cuda, tvm
        from tessel.runtime.executor import Executor

        tvm_module = tvm()
        on_gpu = any(json.loads((p / "cases.json").read_text())["target"].startswith("cuda") for p in parts)
        if on_gpu and (not enable_cuda() or not tvm_module.cuda(0).exist):
            print("gpu check: TVM's CUDA runtime sees no GPU here")
            return 2
        device = tvm_module.cuda(0) if on_gpu else tvm_module.cpu(0)
        device_name = device.device_name if on_gpu else "cpu"
        print(f"device: {device_name}; TVM {tvm_module.__version__}, runtime library only: "
              f"{'libtvm_compiler' not in open('/proc/self/maps').read()}", flush=True)
        rows = []
        for part in parts:
            plan = json.loads((part / "cases.json").read_text())
            for case in plan["cases"]:
                rows.append(_check_case(part, case, scratch / case["name"], Executor, dump_to, profile))
                _print_row(rows[-1])
        ok = all(r.get("matches") and r.get("device_inputs_match", True) for r in rows)
        print(f"{sum(bool(r.get('matches')) for r in rows)} of {len(rows)} models equal onnxruntime's CPU outputs "
              f"(rtol {RTOL}, atol {ATOL}; the TF32 cases rtol {TF32_RTOL}, atol {TF32_ATOL})")
        if json_path:
            json_path.write_text(json.dumps({"device": device_name, "rows": rows}, indent=1))
        return 0 if ok else 1
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


DUMP_ELEMENTS = 1 << 13  # larger values are dumped as an even sample of this many elements (the device returns a few MB)


def dump_steps(executor, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every value each top-level kernel call writes, read right after the call (the arena reuses its bytes later),
    by value name; values over DUMP_ELEMENTS as an even sample. A debugging aid: comparing a device's dump with
    one made elsewhere finds the first kernel that goes wrong."""
    from tessel.runtime.instructions import KernelCall

    executor.run(inputs)
    for name in executor.plan["inputs"]:
        executor._memory.write(executor._buffer(name), np.asarray(inputs[name]))  # noqa: SLF001
    arrays = {}
    for instruction, op in zip(executor.run_instructions, executor._ops):  # noqa: SLF001 - the executor's own bindings
        op()
        if not isinstance(instruction, KernelCall):
            continue
        for name in instruction.outputs:
            value = np.asarray(executor._memory.read(executor._buffer(name))).reshape(-1)  # noqa: SLF001
            arrays[name] = value[::max(1, value.size // DUMP_ELEMENTS)].copy()
    return arrays


def compare_dumps(device: Path, reference: Path) -> list[tuple[str, float, str]]:
    """(value, max error, note) for every value both dumps hold, in the device dump's step order."""
    rows = []
    with np.load(device, allow_pickle=False) as got, np.load(reference, allow_pickle=False) as want:
        for name in got.files:
            if name not in want.files:
                continue
            a, b = got[name], want[name]
            if a.shape != b.shape:
                rows.append((name, float("inf"), f"{a.shape} vs {b.shape}"))
                continue
            _, error = _compare({"v": a}, {"v": b})
            scale = float(np.max(np.abs(b[np.isfinite(b)]))) if np.isfinite(b).any() else 0.0
            rows.append((name, error, f"nan {int(np.isnan(a).sum())}/{int(np.isnan(b).sum())}, |ref| max {scale:.3g}"))
    return rows


def _check_case(part: Path, case: dict, folder: Path, executor_cls, dump_to: Path | None = None,
                profile: bool = False) -> dict:
    row = {"model": case["name"]}
    try:
        directory = _materialize(part, case, folder)
        recipe = json.loads((directory / "case/inputs.json").read_text())
        inputs = make_inputs(recipe)
        if _inputs_digest(inputs) != recipe["sha256"]:
            raise RuntimeError("this machine's numpy draws other inputs from the recipe than the packing machine did")
        expected = _load_npz(directory / "case/expected.npz")
        executor = executor_cls(directory)
        worst, ok = 0.0, True
        for _ in range(2):
            executor.poison()
            good, error = _compare(executor.run(inputs), expected, *case.get("tolerance", (RTOL, ATOL)))
            ok, worst = ok and good, max(worst, error)
        row.update(matches=ok, max_error=worst, tolerance=case.get("tolerance", [RTOL, ATOL]),
                   tessel_ms=_time_ms(lambda: executor.run(inputs)))
        if str(executor.plan["target"]).startswith("cuda"):
            row.update(_device_input_row(executor, inputs, expected, case.get("tolerance", (RTOL, ATOL))))
        if dump_to is not None:
            dump_to.mkdir(parents=True, exist_ok=True)
            np.savez_compressed(dump_to / f"{case['name']}.npz", **dump_steps(executor, inputs))
        if profile:
            row["slowest_steps"] = executor.profile(inputs, runs=5)[:6]
        if case["name"].startswith(TORCH_MODELS):
            files = {n: (directory / n).read_bytes() for n in ("weights.npz", "case/torch_weights.npz") if (directory / n).exists()}
            row.update(_torch_row(_torch_weights(files), inputs, expected))
    except Exception as exc:  # noqa: BLE001 - one model's failure is a row of the table, not the end of the check
        row.update(matches=False, error=f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}")
    return row


def _device_input_row(executor, inputs: dict[str, np.ndarray], expected: dict[str, np.ndarray], tolerance) -> dict:
    """The run with its inputs already on the GPU (PyTorch CUDA tensors, copied device to device), as PyTorch's
    own timing has them: whether it still matches, and its time."""
    import torch

    on_gpu = {name: torch.from_numpy(array).cuda() for name, array in inputs.items()}
    torch.cuda.synchronize()
    executor.poison()
    good, _ = _compare(executor.run(on_gpu), expected, *tolerance)
    return {"device_inputs_match": good, "tessel_device_ms": _time_ms(lambda: executor.run(on_gpu))}


def _print_row(row: dict) -> None:
    if "error" in row:
        print(f"{row['model']:22s} FAILED  {row['error']}", flush=True)
        return
    torch_part = ""
    if "torch_ms" in row:
        torch_part = (f"  torch eager {row['torch_ms']:8.3f} ms (TF32 allowed; {row['torch_fp32_ms']:.3f} ms strict f32; "
                      f"{row['torch_io_ms']:.3f} ms numpy in and out as Tessel's run)"
                      f"  tessel/torch {row['tessel_ms'] / row['torch_ms']:5.2f} ({row['tessel_ms'] / row['torch_fp32_ms']:.2f}; "
                      f"{row['tessel_ms'] / row['torch_io_ms']:.2f})"
                      f"  (torch TF32 max error {row['torch_max_error']:.3g})")
    device_part = ""
    if "tessel_device_ms" in row:
        device_part = (f" ({row['tessel_device_ms']:.3f} ms inputs on the GPU"
                       f"{'' if row['device_inputs_match'] else ', MISMATCH'})")
        if "torch_ms" in row:
            torch_part += f"  on-GPU inputs: tessel/torch {row['tessel_device_ms'] / row['torch_ms']:.2f}"
    print(f"{row['model']:22s} {'ok     ' if row['matches'] else 'MISMATCH'} max error {row['max_error']:9.3g}  "
          f"tessel {row['tessel_ms']:8.3f} ms{device_part}{torch_part}", flush=True)


def main(argv: list[str] | None = None) -> int:
    """`pack` here, `run` on the GPU machine."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("pack", help="compile and pack the check (CPU machine with nvcc)")
    p.add_argument("--target", default="cuda:sm_90", help="cuda:sm_90 for H100/H200 (llvm packs a CPU dry run)")
    p.add_argument("-o", "--out", type=Path, default=REPO / "out" / "gpu_check")
    p.add_argument("--limit-mib", type=float, default=60.0, help="largest part (the device's carry limit, less margin)")
    p.add_argument("--models", nargs="*", help="only these cases (default: every non-negative corpus model)")
    p.add_argument("--cache-dir", type=Path)
    p.add_argument("--python", default="312", help="the GPU machine's Python as in wheel tags (312 for 3.12)")
    p.add_argument("--force-algorithm", help="bench only: compile every conv with this algorithm (cases get its name)")
    r = commands.add_parser("run", help="verify and time the packed models (GPU machine)")
    r.add_argument("parts", nargs="+", type=Path)
    r.add_argument("--json", type=Path)
    r.add_argument("--dump", type=Path, help="also write every kernel step's outputs per model into this folder")
    r.add_argument("--profile", action="store_true", help="also time each step (the slowest go into the JSON)")
    d = commands.add_parser("compare-dump", help="the error of every value two dumps share, in step order")
    d.add_argument("device", type=Path)
    d.add_argument("reference", type=Path)
    args = parser.parse_args(argv)
    if args.command == "pack":
        pack(args.target, args.out, args.limit_mib, args.models, args.cache_dir, args.python, args.force_algorithm)
        return 0
    if args.command == "compare-dump":
        for name, error, note in compare_dumps(args.device, args.reference):
            print(f"{error:10.3g}  {name}  ({note})")
        return 0
    return run(args.parts, args.json, args.dump, args.profile)


if __name__ == "__main__":
    sys.exit(main())
