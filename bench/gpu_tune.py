"""Tile configurations of the CUDA implicit-GEMM conv (backends/cuda/conv.py), timed on a GPU machine.

Two steps, like bench/gpu_check.py (the GPU machine has no TVM compiler and no nvcc):

1. here: `python bench/gpu_tune.py pack --arch sm_90 --models resnet18 --batches 1 16 -o out/gpu_tune`
   finds every dense conv shape of the models (at each batch), compiles each
   shape's candidate configurations (conv + bias + ReLU, nvcc fatbin) and packs
   them with the runtime-only TVM.
2. there: `python bench/gpu_tune.py run out/gpu_tune --json $OUT/tune.json`
   checks every candidate against PyTorch's float64 conv on the GPU, times it
   (CUDA events, median) next to PyTorch's cuDNN conv of the same shape, and
   writes the table. `pack --tf32` packs tensor-core (TF32) candidates instead,
   checked at TF32's tolerance and recorded under "sm_90+tf32".
3. here again: `python bench/gpu_tune.py record tune.json` writes the fastest
   correct configuration of every shape into backends/cuda/conv_configs.json,
   which the conv lowering reads for that architecture (the timings kept beside it).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.gpu_check import ffi_wheel, install_runtime, runtime_tarball  # noqa: E402 - after the path set-up above

# A candidate is right when it is this close to PyTorch's float64 conv (rtol and atol).
F32_TOLERANCE, TF32_TOLERANCE = 1e-3, 1e-2


def conv_shapes(model_path: Path, input_shapes, batches) -> list:
    """The distinct dense 2-D float32 conv shapes of a model after Tessel's graph passes, at each batch."""
    from tessel import ir
    from tessel.backends.cuda.conv import ConvShape
    from tessel.compiler.pipeline import run_pipeline, select_passes
    from tessel.passes.fuse import kernel_members

    graph, _ = run_pipeline(ir.from_onnx(str(model_path), input_shapes), select_passes([]))
    shapes = []
    for node in graph.nodes:
        members, outer = kernel_members(node)
        for member in members:
            if member.op_type != "Conv" or member.attrs.get("group", 1) != 1:
                continue
            x, w = (outer.get(id(v), v) for v in member.inputs[:2])
            if x.type.rank != 4 or x.type.dtype != "float32":
                continue
            pads = tuple(member.attrs.get("pads") or (0, 0, 0, 0))
            if member.attrs.get("auto_pad", "NOTSET") not in ("NOTSET", "VALID"):
                continue
            _, c, h, wd = x.type.shape
            k, _, kh, kw = w.type.shape
            for batch in batches:
                shape = ConvShape(batch, c, h, wd, k, (kh, kw), tuple(member.attrs.get("strides") or (1, 1)),
                                  tuple(member.attrs.get("dilations") or (1, 1)), pads)
                if shape not in shapes:
                    shapes.append(shape)
    return shapes


def candidates(shape) -> list:
    """The configurations worth timing for a shape: every tile that does not dwarf the GEMM, with the K splits
    that leave each split at least 4 K-steps and the grid under four blocks per multiprocessor, and the
    heuristic's choice."""
    from tessel.backends.cuda.conv import DEFAULT_SM_COUNT, GemmConfig, heuristic_config

    m, n, k = shape.gemm
    tiles = [(128, 128, 8, 8, 8), (64, 128, 8, 4, 8), (128, 64, 8, 8, 4), (64, 64, 16, 4, 4), (32, 64, 16, 2, 4),
             (32, 32, 16, 2, 2)]
    found = [heuristic_config(m, n, k)]
    for bm, bn, bk, tm, tn in tiles:
        if bm > max(32, 2 * m) or bn > max(32, 2 * n):
            continue
        blocks = -(-m // bm) * -(-n // bn)
        # No split, and the split that fills about two waves of blocks.
        ideal = 1 << max(0, (2 * DEFAULT_SM_COUNT // blocks).bit_length() - 1)
        for split in sorted({1, ideal}):
            config = GemmConfig(bm, bn, bk, tm, tn, split)
            if split <= 16 and k // (bk * split) >= 4 and config not in found:
                found.append(config)
    return found


def tf32_candidates(shape) -> list:
    """The tensor-core configurations worth timing for a shape: the heuristic's and every tile that does not dwarf
    the GEMM (warp tiles 32 x 32 to 64 x 64), with and without the K split that fills about two waves."""
    from tessel.backends.cuda.conv import DEFAULT_SM_COUNT
    from tessel.backends.cuda.conv_tf32 import MmaConfig, heuristic_mma_config

    m, n, k = shape.gemm
    found = [heuristic_mma_config(m, n, k)]
    for bm, bn, bk, warps_m, warps_n in [(128, 128, 16, 2, 2), (128, 128, 32, 2, 2), (64, 128, 16, 2, 2),
                                         (128, 64, 16, 2, 2), (64, 64, 16, 2, 2), (64, 64, 32, 2, 2),
                                         (128, 128, 16, 2, 4), (32, 64, 16, 1, 2)]:
        if bm > max(32, 2 * m) or bn > max(32, 2 * n):
            continue
        blocks = -(-m // bm) * -(-n // bn)
        ideal = 1 << max(0, (2 * DEFAULT_SM_COUNT // blocks).bit_length() - 1)
        for split in sorted({1, ideal}):
            config = MmaConfig(bm, bn, bk, warps_m, warps_n, split)
            if split <= 16 and k // (bk * split) >= 4 and config.fits and config not in found:
                found.append(config)
    return found


def tf32_refined_candidates(shape, arch: str) -> list:
    """The tensor-core configurations worth timing next to a shape's recorded best: it double-buffered, with
    K-steps of 32, with twice the warps, with half or twice its K split, and the other tile shapes at its split."""
    from dataclasses import replace

    from tessel.backends.cuda.conv import chosen_config
    from tessel.backends.cuda.conv_tf32 import MmaConfig

    best, timed = chosen_config(shape, arch, tf32=True)
    if not timed:
        return tf32_candidates(shape)
    m, n, k = shape.gemm
    variants = [dict(stages=2), dict(bk=32), dict(bk=32, stages=2), dict(warps_m=2, warps_n=4),
                dict(warps_m=4, warps_n=2), dict(split_k=best.split_k * 2), dict(split_k=max(1, best.split_k // 2)),
                dict(split_k=best.split_k * 2, stages=2)]
    variants += [dict(bm=bm, bn=bn, warps_m=2, warps_n=2) for bm, bn in ((64, 64), (64, 128), (128, 64), (128, 128))]
    found = [best]
    for change in variants:
        try:
            config = replace(best, **change)
        except ValueError:  # warps that do not divide the tile
            continue
        steps = k // (config.bk * config.split_k)
        if config.fits and steps >= 2 and config.bm <= max(32, 2 * m) and config.bn <= max(32, 2 * n) \
                and config not in found:
            found.append(config)
    return found


def refined_candidates(shape, arch: str) -> list:
    """The configurations worth timing next to a shape's recorded best: it and each large tile double-buffered
    (`stages` 2), and the large tiles with K-steps of 16, at the recorded best's K split."""
    from dataclasses import replace

    from tessel.backends.cuda.conv import GemmConfig, chosen_config

    best, timed = chosen_config(shape, arch)
    found = [best, replace(best, stages=2)]
    for bm, bn, bk, tm, tn in [(128, 128, 16, 8, 8), (128, 128, 8, 8, 8), (64, 128, 16, 4, 8), (128, 64, 16, 8, 4)]:
        for stages in (1, 2) if bk == 16 and bm == bn == 128 else (2,):
            config = GemmConfig(bm, bn, bk, tm, tn, best.split_k, stages)
            if config not in found:
                found.append(config)
    return found if timed else candidates(shape)


def _kernel(shape, config, arch: str):
    """Conv + bias + ReLU of `shape` with `config` (a tensor-core one for an MmaConfig), compiled for CUDA (a
    CudaExecutable)."""
    from tessel.backends.cuda.conv import conv_gemm
    from tessel.backends.cuda.conv_tf32 import MmaConfig
    from tessel.backends.cuda.schedule import compile as cuda_compile
    from tessel.backends.lowering.context import LowerContext
    from tessel.backends.target import TargetSpec
    from tessel.backends.tvm_env import tvm
    from tessel.ir.types import TensorType

    mod = tvm()
    te = mod.te
    (m, _, _), (oh, ow) = shape.gemm, shape.out_size
    types = [TensorType("float32", (shape.batch, shape.channels, shape.height, shape.width)),
             TensorType("float32", (m, shape.channels, *shape.kernel)), TensorType("float32", (m,))]
    placeholders = [te.placeholder(t.shape, t.dtype, name=name) for t, name in zip(types, ("x", "w", "b"))]
    out_type = TensorType("float32", (shape.batch, m, oh, ow))
    ctx = LowerContext("Conv", {"strides": shape.strides, "dilations": shape.dilations, "pads": shape.pads},
                       placeholders, types, [None] * 3, [out_type], gpu=True, arch=arch)
    result = conv_gemm(ctx, list(shape.pads[:2]), list(shape.pads[2:]), config)
    conv = result.outputs[0]
    relu = te.compute(conv.shape, lambda *i: mod.tirx.max(conv(*i), mod.tirx.const(0.0, "float32")), name="relu")
    sch = mod.s_tir.Schedule(te.create_prim_func(placeholders + [relu]))
    result.schedule(sch)
    func = sch.mod["main"].with_attr("tirx.is_scheduled", True)
    return cuda_compile(func, TargetSpec("cuda", arch, tf32=isinstance(config, MmaConfig)), scheduled=True)


def pack(arch: str, models: list[str], batches: list[int], out: Path, python: str, limit: int | None,
         refine: bool = False, tf32: bool = False) -> None:
    """Compile every shape's candidates (tensor-core ones with `tf32`) into `out` with the runtime-only TVM."""
    os.environ.setdefault("TVM_CUDA_COMPILE_MODE", "nvcc")
    from tessel.compiler.corpus import load_corpus

    if out.exists():
        shutil.rmtree(out)
    (out / "kernels").mkdir(parents=True)
    runtime_tarball(out / "tvm_runtime.tar.gz")
    ffi_wheel(out, python)
    cases = []
    for model in load_corpus():
        if model.name not in models:
            continue
        for shape in conv_shapes(model.path, model.input_shapes, batches):
            rows = []
            if tf32:
                found = tf32_refined_candidates(shape, arch) if refine else tf32_candidates(shape)
            else:
                found = refined_candidates(shape, arch) if refine else candidates(shape)
            for config in found[:limit]:
                name = f"{shape.key()}-{'x'.join(str(v) for v in config.to_json().values())}"
                started = time.perf_counter()
                _kernel(shape, config, arch).export_library(out / "kernels" / f"{name}.so")
                rows.append({"config": config.to_json(), "library": f"kernels/{name}.so"})
                print(f"{model.name} {shape.key()} {config} {time.perf_counter() - started:.1f} s", flush=True)
            cases.append({"model": model.name, "shape": shape.key(), "fields": _shape_fields(shape),
                          "candidates": rows})
    (out / "tune.json").write_text(json.dumps({"arch": arch, "tf32": tf32, "cases": cases}, indent=1))
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"{out}: {len(cases)} shapes, {sum(len(c['candidates']) for c in cases)} kernels, {size / 2**20:.1f} MiB")


def _shape_fields(shape) -> dict:
    return {"batch": shape.batch, "channels": shape.channels, "height": shape.height, "width": shape.width,
            "out_channels": shape.out_channels, "kernel": list(shape.kernel), "strides": list(shape.strides),
            "dilations": list(shape.dilations), "pads": list(shape.pads)}


def _torch_conv(torch, x, w, b, fields):
    """PyTorch's conv + bias + ReLU (cuDNN), padding inside the conv where it is symmetric."""
    top, left, bottom, right = fields["pads"]
    padding = (top, left)
    if (top, left) != (bottom, right):
        x, padding = torch.nn.functional.pad(x, (left, right, top, bottom)), (0, 0)
    return torch.relu(torch.nn.functional.conv2d(x, w, b, stride=fields["strides"], padding=padding,
                                                 dilation=fields["dilations"]))


def _median_ms(torch, call, runs: int = 30) -> float:
    """Median of `runs` CUDA-event timings of `call` (on the default stream, which TVM launches on too)."""
    for _ in range(3):
        call()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return float(np.median(times))


def run(folder: Path, json_path: Path | None) -> int:
    """Check and time every candidate on this machine's GPU."""
    import tempfile

    import torch

    scratch = Path(tempfile.mkdtemp(prefix="tessel-gpu-tune-"))
    install_runtime(folder, scratch / "site")
    from tessel.backends.tvm_env import enable_cuda, tvm

    mod = tvm()
    if not enable_cuda() or not mod.cuda(0).exist:
        print("gpu tune: TVM's CUDA runtime sees no GPU here")
        return 2
    device = mod.cuda(0)
    plan = json.loads((folder / "tune.json").read_text())
    # TF32 rounds each input to 11 significant bits: cuDNN's own TF32 convs are off by a few 1e-3 on these shapes.
    tolerance = TF32_TOLERANCE if plan.get("tf32") else F32_TOLERANCE
    rng = np.random.default_rng(0)
    results = []
    for case in plan["cases"]:
        f = case["fields"]
        x = rng.standard_normal((f["batch"], f["channels"], f["height"], f["width"])).astype(np.float32)
        w = (rng.standard_normal((f["out_channels"], f["channels"], *f["kernel"])) / np.sqrt(
            f["channels"] * f["kernel"][0] * f["kernel"][1])).astype(np.float32)
        b = rng.standard_normal(f["out_channels"]).astype(np.float32)
        tx, tw, tb = (torch.from_numpy(a).cuda() for a in (x, w, b))
        want = _torch_conv(torch, tx.double(), tw.double(), tb.double(), f).cpu().numpy()
        torch.backends.cudnn.allow_tf32 = True
        torch_ms = _median_ms(torch, lambda: _torch_conv(torch, tx, tw, tb, f))
        torch_tf32_error = float(np.max(np.abs(_torch_conv(torch, tx, tw, tb, f).cpu().numpy() - want)))
        torch.backends.cudnn.allow_tf32 = False
        torch_fp32_ms = _median_ms(torch, lambda: _torch_conv(torch, tx, tw, tb, f))
        args = [mod.runtime.tensor(a, device) for a in (x, w, b)] + [mod.runtime.empty(want.shape, "float32", device)]
        # Every candidate writes over NaN: an output it leaves unwritten fails it, not passes on the last one's values.
        poison = np.full(want.shape, np.nan, np.float32)
        rows = []
        for candidate in case["candidates"]:
            row = {"config": candidate["config"]}
            try:
                args[-1].copyfrom(poison)
                function = mod.runtime.load_module(str(folder / candidate["library"]))["main"]
                function(*args)
                device.sync()
                got = args[-1].numpy()
                error = float(np.max(np.abs(got - want)))
                row.update(ok=bool(np.allclose(got, want, rtol=tolerance, atol=tolerance)), max_error=error,
                           ms=_median_ms(torch, lambda: function(*args)))
            except Exception as exc:  # noqa: BLE001 - a failing candidate is a row of the table
                row.update(ok=False, error=f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1:]}")
            rows.append(row)
        good = [r for r in rows if r.get("ok")]
        best = min(good, key=lambda r: r["ms"]) if good else None
        results.append({"model": case["model"], "shape": case["shape"], "torch_ms": torch_ms,
                        "torch_fp32_ms": torch_fp32_ms, "torch_tf32_max_error": torch_tf32_error, "candidates": rows,
                        "best": best})
        print(f"{case['shape']:40s} torch {torch_ms:.4f} ({torch_fp32_ms:.4f} f32) ms  best "
              f"{best['ms'] if best else float('nan'):.4f} ms {best['config'] if best else 'NONE'}  "
              f"{sum(not r.get('ok') for r in rows)} wrong of {len(rows)}", flush=True)
    report = {"device": device.device_name, "arch": plan["arch"], "tf32": bool(plan.get("tf32")), "cases": results}
    if json_path:
        json_path.write_text(json.dumps(report, indent=1))
    shutil.rmtree(scratch, ignore_errors=True)
    return 0 if all(r["best"] for r in results) else 1


def record(report_path: Path, into: Path) -> None:
    """Write each shape's fastest correct configuration of a `run` report into the tuned-configuration file."""
    report = json.loads(report_path.read_text())
    from tessel.backends.cuda.conv import tuned_arch_key

    table = json.loads(into.read_text()) if into.exists() else {"archs": {}}
    entries = table["archs"].setdefault(tuned_arch_key(report["arch"], report.get("tf32", False)), {})
    for case in report["cases"]:
        if case["best"] is None:
            continue
        entries[case["shape"]] = {"config": case["best"]["config"], "ms": round(case["best"]["ms"], 5),
                                  "torch_ms": round(case["torch_ms"], 5), "device": report["device"]}
    into.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    print(f"{into}: {len(entries)} shapes for {tuned_arch_key(report['arch'], report.get('tf32', False))}")


def main(argv: list[str] | None = None) -> int:
    """`pack` here, `run` on the GPU machine, `record` here."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("pack")
    p.add_argument("--arch", default="sm_90")
    p.add_argument("--models", nargs="+", default=["resnet18"])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    p.add_argument("--python", default="312")
    p.add_argument("--limit", type=int, help="at most this many candidates per shape")
    p.add_argument("--refine", action="store_true",
                   help="time variants of each shape's recorded best (double-buffered, longer K-steps) instead")
    p.add_argument("--tf32", action="store_true", help="tensor-core (TF32) configurations instead")
    p.add_argument("-o", "--out", type=Path, default=REPO / "out" / "gpu_tune")
    r = commands.add_parser("run")
    r.add_argument("folder", type=Path)
    r.add_argument("--json", type=Path)
    c = commands.add_parser("record")
    c.add_argument("report", type=Path)
    c.add_argument("--into", type=Path, default=REPO / "backends" / "cuda" / "conv_configs.json")
    args = parser.parse_args(argv)
    if args.command == "pack":
        pack(args.arch, args.models, args.batches, args.out, args.python, args.limit, args.refine, args.tf32)
        return 0
    if args.command == "record":
        record(args.report, args.into)
        return 0
    return run(args.folder, args.json)


if __name__ == "__main__":
    sys.exit(main())
