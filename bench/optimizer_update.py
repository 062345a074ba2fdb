"""AdamW update of ResNet-18's parameters (11.7M floats): Tessel's AdamWUpdate kernels vs torch.optim.AdamW.

Tessel: passes/optimizer_update.py's update graph for every parameter, one compiled AdamWUpdate kernel per
parameter (backends/lowering/optimizer.py), called in turn as a step's program would. PyTorch:
torch.optim.AdamW(foreach=True).step(), and its fused CPU kernel (fused=True), on the same shapes. Each engine
runs in its own process (TVM's and PyTorch's thread pools would compete), with the same number of threads.
Prints the median step time of each and the memory traffic it implies (an AdamW update reads the parameter,
its gradient and both slots and writes the parameter and both slots: 28 bytes per float32).

    TVM_NUM_THREADS=2 python bench/optimizer_update.py [--threads 2] [--repeats 20]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

BYTES_PER_ELEMENT = 7 * 4


def resnet18_shapes() -> list[tuple[int, ...]]:
    """The parameter shapes of torchvision's ResNet-18 (conv weights, BN scale and bias, fc): 11,689,512 floats."""
    shapes: list[tuple[int, ...]] = [(64, 3, 7, 7), (64,), (64,)]
    channels = 64
    for stage, width in enumerate((64, 128, 256, 512)):
        for block in range(2):
            downsample = stage > 0 and block == 0
            shapes += [(width, channels, 3, 3), (width,), (width,), (width, width, 3, 3), (width,), (width,)]
            if downsample:
                shapes += [(width, channels, 1, 1), (width,), (width,)]
            channels = width
    return shapes + [(1000, 512), (1000,)]


def _median_seconds(run, repeats: int) -> float:
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def tessel_step(shapes, rng):
    """A function running one AdamW step of Tessel's kernels over parameters of `shapes`."""
    from tessel.backends.kernel import ARG, KernelInput, KernelSpec
    from tessel.backends.lower import build
    from tessel.backends.target import parse_target
    from tessel.backends.tvm_env import tvm
    from tessel.compiler.optim import AdamW
    from tessel.ir.graph import Graph
    from tessel.ir.types import TensorType
    from tessel.passes.optimizer_update import add_updates

    graph = Graph()
    params = {}
    for k, shape in enumerate(shapes):
        param = graph.add_input(f"p{k}", TensorType("float32", shape))
        params[f"p{k}"] = (param, graph.add_input(f"p{k}.grad", TensorType("float32", shape)))
    optimizer = AdamW(lr=1e-3)
    add_updates(graph, optimizer.rule, params)
    runtime = tvm().runtime
    scalars = {name: runtime.tensor(value) for name, value in optimizer.step_scalars(0).items()}
    kernels, calls = {}, []
    for node in graph.nodes:
        spec = KernelSpec(node.op_type, tuple(sorted(node.attrs.items())),
                          tuple(KernelInput(v.type.spec(), ARG) for v in node.inputs),
                          tuple(v.type.spec() for v in node.outputs))
        if spec not in kernels:
            kernels[spec] = build(spec, parse_target("llvm"))["main"]
        # Non-negative tensors: exp_avg_sq must be (its square root is taken).
        args = [scalars[v.name] if v.name in scalars else
                runtime.tensor(np.abs(rng.standard_normal(v.type.shape)).astype(np.float32)) for v in node.inputs]
        calls.append((kernels[spec], args + [runtime.tensor(np.zeros(v.type.shape, np.float32))
                                              for v in node.outputs]))

    def step():
        for kernel, args in calls:
            kernel(*args)

    return step, len(kernels)


def torch_step(shapes, rng, threads: int, **flavour):
    """A function running one torch.optim.AdamW(**flavour) step (foreach=True or fused=True) over parameters of
    `shapes`."""
    import torch

    torch.set_num_threads(threads)
    params = [torch.tensor(rng.standard_normal(s).astype(np.float32), requires_grad=True) for s in shapes]
    for p in params:
        p.grad = torch.tensor(rng.standard_normal(p.shape).astype(np.float32))
    optimizer = torch.optim.AdamW(params, lr=1e-3, **flavour)

    def step():
        with torch.no_grad():
            optimizer.step()

    return step


ENGINES = ("tessel", "torch-foreach", "torch-fused")


def _measure(engine: str, threads: int, repeats: int) -> dict:
    """{"name", "seconds"} of one engine's median AdamW step, in this process."""
    shapes, rng = resnet18_shapes(), np.random.default_rng(0)
    if engine == "tessel":
        step, distinct = tessel_step(shapes, rng)
        name = f"tessel AdamWUpdate ({distinct} kernels)"
    else:
        flavour = engine.split("-")[1]
        step, name = torch_step(shapes, rng, threads, **{flavour: True}), f"torch.optim.AdamW({flavour}=True)"
    return {"name": name, "seconds": _median_seconds(step, repeats)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=int(os.environ.get("TVM_NUM_THREADS", os.cpu_count() or 1)))
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--engine", choices=ENGINES, help="measure one engine here and print JSON (default: each "
                                                          "engine in its own process, as a table)")
    args = parser.parse_args(argv)
    os.environ["TVM_NUM_THREADS"] = str(args.threads)
    if args.engine:
        print(json.dumps(_measure(args.engine, args.threads, args.repeats)))
        return 0
    elements = sum(int(np.prod(s)) for s in resnet18_shapes())
    megabytes = elements * BYTES_PER_ELEMENT / 1e6
    print(f"AdamW update, {len(resnet18_shapes())} ResNet-18 parameters, {elements / 1e6:.2f}M floats, "
          f"{megabytes:.0f} MB moved per step, {args.threads} thread(s)")
    print(f"{'engine':<34} {'step ms':>9} {'GB/s':>7}")
    for engine in ENGINES:
        command = [sys.executable, __file__, "--engine", engine, "--threads", str(args.threads),
                   "--repeats", str(args.repeats)]
        result = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
        print(f"{result['name']:<34} {1e3 * result['seconds']:>9.2f} {megabytes / 1e3 / result['seconds']:>7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
