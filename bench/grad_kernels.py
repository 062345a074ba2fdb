"""The backward kernels of a conv net on CPU against PyTorch, on ResNet-18's layer shapes at batch 16.

Per conv layer: the filter gradient (ConvGradFilter) against torch.nn.grad.conv2d_weight and the data gradient
(ConvTranspose(dy, W), what autodiff emits) against torch.nn.grad.conv2d_input; then the stem's MaxPoolGrad
against max_pool2d's backward. Each kernel is built through the normal kernel path (backends/lower.py), checked
against PyTorch's result, and timed (best of --runs, alternating with PyTorch's call) in the same process as PyTorch with the same threads.
Prints ms, GFLOP/s and the ratio Tessel / PyTorch per layer, and the geomean ratio.

    flock /tmp/tessel_heavy.lock nice -n 5 python bench/grad_kernels.py [--batch 16] [--threads 2] [--runs 5]
        [--layers conv1,layer1,...] [--ops filter,data,pool]
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from tessel.backends.kernel import ARG, KernelInput, KernelSpec  # noqa: E402
from tessel.backends.lower import build  # noqa: E402
from tessel.backends.target import parse_target  # noqa: E402
from tessel.backends.tvm_env import tvm  # noqa: E402
from tessel.ir.schema import TESSEL_DOMAIN, get_schema  # noqa: E402
from tessel.ir.types import TensorType  # noqa: E402

# ResNet-18's distinct convs: (in channels, input size, out channels, kernel, stride, pad).
LAYERS = {
    "conv1": (3, 224, 64, 7, 2, 3),
    "layer1": (64, 56, 64, 3, 1, 1),
    "layer2.down3x3": (64, 56, 128, 3, 2, 1),
    "layer2.down1x1": (64, 56, 128, 1, 2, 0),
    "layer2": (128, 28, 128, 3, 1, 1),
    "layer3.down3x3": (128, 28, 256, 3, 2, 1),
    "layer3.down1x1": (128, 28, 256, 1, 2, 0),
    "layer3": (256, 14, 256, 3, 1, 1),
    "layer4.down3x3": (256, 14, 512, 3, 2, 1),
    "layer4.down1x1": (256, 14, 512, 1, 2, 0),
    "layer4": (512, 7, 512, 3, 1, 1),
}
LLVM = parse_target("llvm")


def best_times(first, second, runs: int) -> tuple[float, float]:
    """The fastest of `runs` calls of each (after a warm-up), alternating them so both see the same machine load."""
    first()
    second()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(runs):
        for fn, spent in zip((first, second), times):
            start = time.perf_counter()
            fn()
            spent.append(time.perf_counter() - start)
    return min(times[0]), min(times[1])


def tessel_kernel(op_type: str, domain: str, raw_attrs: dict, arrays: list[np.ndarray]):
    """(a no-argument call running the compiled kernel, its output tensor) for one op on `arrays`."""
    schema = get_schema(op_type, domain)
    attrs = schema.make_attributes(raw_attrs, "bench")
    types = [TensorType.of(a) for a in arrays]
    out = schema.infer(attrs, types, [None] * len(types), 1)[0]
    spec = KernelSpec(op_type, tuple(sorted(attrs.items())), tuple(KernelInput(t.spec(), ARG) for t in types),
                      (out.spec(),))
    fn = build(spec, LLVM)["main"]
    runtime = tvm().runtime
    args = [runtime.tensor(a) for a in arrays]
    result = runtime.tensor(np.zeros(out.shape, np.float32))
    return (lambda: fn(*args, result)), result


def compare(label: str, flops: float, tessel_call, tessel_out, torch_call, runs: int) -> float:
    """Check Tessel's result against PyTorch's, time both, print a line; returns the time ratio."""
    want = torch_call().numpy()
    tessel_call()
    error = np.abs(tessel_out.numpy() - want).max() / max(np.abs(want).max(), 1e-30)
    ours, theirs = best_times(tessel_call, torch_call, runs)
    print(f"{label:34s} tessel {ours * 1e3:8.2f} ms {flops / ours / 1e9:6.0f} GFLOP/s | torch {theirs * 1e3:8.2f} ms "
          f"{flops / theirs / 1e9:6.0f} GFLOP/s | ratio {ours / theirs:5.2f} | rel err {error:.1e}", flush=True)
    return ours / theirs


def conv_layer(name: str, batch: int, ops: set[str], runs: int) -> list[float]:
    """Time the filter and data gradients of one conv layer; the ratios."""
    channels, size, out_channels, kernel, stride, pad = LAYERS[name]
    out_size = (size + 2 * pad - kernel) // stride + 1
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, channels, size, size)).astype(np.float32)
    w = rng.standard_normal((out_channels, channels, kernel, kernel)).astype(np.float32)
    dy = rng.standard_normal((batch, out_channels, out_size, out_size)).astype(np.float32)
    flops = 2.0 * batch * out_channels * channels * kernel * kernel * out_size * out_size
    xt, wt, dyt = torch.from_numpy(x), torch.from_numpy(w), torch.from_numpy(dy)
    window = dict(strides=(stride, stride), pads=(pad,) * 4)
    ratios = []
    if "filter" in ops:
        call, out = tessel_kernel("ConvGradFilter", TESSEL_DOMAIN, dict(window, kernel_shape=(kernel, kernel)), [x, dy])
        ratios.append(compare(f"{name} filter grad", flops, call, out,
                              lambda: torch.nn.grad.conv2d_weight(xt, wt.shape, dyt, stride, pad), runs))
    if "data" in ops and name != "conv1":  # the stem's input (the image) needs no gradient
        extra = size - ((out_size - 1) * stride - 2 * pad + kernel)
        call, out = tessel_kernel("ConvTranspose", "", dict(window, output_padding=(extra, extra)), [dy, w])
        ratios.append(compare(f"{name} data grad (ConvTranspose)", flops, call, out,
                              lambda: torch.nn.grad.conv2d_input(xt.shape, wt, dyt, stride, pad), runs))
    return ratios


def stem_pool(batch: int, runs: int) -> float:
    """Time MaxPoolGrad of ResNet-18's stem pool (3x3, stride 2, pad 1 over 64 x 112 x 112)."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((batch, 64, 112, 112)).astype(np.float32)
    dy = rng.standard_normal((batch, 64, 56, 56)).astype(np.float32)
    call, out = tessel_kernel("MaxPoolGrad", TESSEL_DOMAIN, dict(kernel_shape=(3, 3), strides=(2, 2), pads=(1,) * 4),
                              [x, dy])
    xt, dyt = torch.from_numpy(x), torch.from_numpy(dy)
    _, indices = torch.nn.functional.max_pool2d(xt, 3, 2, 1, return_indices=True)

    def torch_grad():
        return torch.ops.aten.max_pool2d_with_indices_backward(dyt, xt, [3, 3], [2, 2], [1, 1], [1, 1], False, indices)

    return compare("maxpool grad (stem)", float(dy.size * 9), call, out, torch_grad, runs)


def main() -> None:
    """Parse the arguments, run the comparisons, print the geomean ratio."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2, help="PyTorch's threads (TVM's: TVM_NUM_THREADS)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--layers", default=",".join(LAYERS))
    parser.add_argument("--ops", default="filter,data,pool")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ops = set(args.ops.split(","))
    unknown = [name for name in args.layers.split(",") if name not in LAYERS]
    if unknown:
        print(f"error: unknown layer(s) {', '.join(unknown)}; known: {', '.join(LAYERS)}", file=sys.stderr)
        sys.exit(2)
    ratios = []
    for name in args.layers.split(","):
        ratios += conv_layer(name, args.batch, ops, args.runs)
    if "pool" in ops:
        ratios.append(stem_pool(args.batch, args.runs))
    if ratios:
        print(f"geomean ratio tessel / torch over {len(ratios)} kernels: "
              f"{math.exp(sum(map(math.log, ratios)) / len(ratios)):.2f}")


if __name__ == "__main__":
    main()
