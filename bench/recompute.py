"""Recomputation of activations (passes/recompute.py) on training step graphs: peak before and after, extra FLOPs.

Per model (a small ResNet with BatchNorm written here in PyTorch, a deep MLP with GELU, the corpus ResNet-18) the step
graph is built with the passes (training import, ReduceMean of the output as the loss, autodiff), run through
the pipeline up to DCE, and planned for activation budgets of 90%, 75% and 60% of its planned arena. Printed per
budget: the arena before and after (passes/graph_memory.py, estimated), the bound and smallest reachable arena,
the extra FLOPs, the arena after fusion with and without recomputation, and the planning time. No kernels are
compiled.

    python bench/recompute.py [--budgets 0.9 0.75 0.6]
"""
from __future__ import annotations

import argparse
import io
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

from tessel.compiler.corpus import models_dir  # noqa: E402
from tessel.compiler.pipeline import PIPELINE, run_pipeline  # noqa: E402
from tessel.ir import from_onnx  # noqa: E402
from tessel.passes.autodiff import differentiate  # noqa: E402
from tessel.passes.base import add_op  # noqa: E402
from tessel.passes.fuse import FUSE  # noqa: E402
from tessel.passes.graph_memory import plan_graph_memory  # noqa: E402
from tessel.passes.recompute import RecomputeError, apply_recompute, plan_recompute  # noqa: E402
from tessel.passes.training_mode import prepare_training  # noqa: E402

MIB = 2**20


def torch_models() -> dict[str, bytes]:
    """ONNX exports of the PyTorch models (legacy exporter, no constant folding: BatchNorm stays)."""
    import torch

    class Block(torch.nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.c1, self.b1 = torch.nn.Conv2d(cin, cout, 3, stride, 1, bias=False), torch.nn.BatchNorm2d(cout)
            self.c2, self.b2 = torch.nn.Conv2d(cout, cout, 3, 1, 1, bias=False), torch.nn.BatchNorm2d(cout)
            self.down = (torch.nn.Sequential(torch.nn.Conv2d(cin, cout, 1, stride, bias=False),
                                             torch.nn.BatchNorm2d(cout)) if stride > 1 or cin != cout else None)

        def forward(self, x):
            y = self.b2(self.c2(torch.relu(self.b1(self.c1(x)))))
            return torch.relu(y + (self.down(x) if self.down is not None else x))

    class ResNet(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, 1, 1, bias=False), torch.nn.BatchNorm2d(16),
                                            torch.nn.ReLU())
            self.blocks = torch.nn.Sequential(Block(16, 16, 1), Block(16, 16, 1), Block(16, 32, 2), Block(32, 32, 1),
                                              Block(32, 64, 2), Block(64, 64, 1))
            self.fc = torch.nn.Linear(64, 10)

        def forward(self, x):
            return self.fc(self.blocks(self.stem(x)).mean((2, 3)))

    def mlp():
        layers = [torch.nn.Linear(256, 512)]
        for _ in range(12):
            layers += [torch.nn.GELU(), torch.nn.Linear(512, 512)]
        return torch.nn.Sequential(*layers, torch.nn.ReLU(), torch.nn.Linear(512, 10))

    torch.manual_seed(0)
    exported = {}
    for name, model, shape in (("resnet_bn_b32", ResNet(), (32, 3, 32, 32)), ("mlp13_b4096", mlp(), (4096, 256))):
        buffer = io.BytesIO()
        torch.onnx.export(model.eval(), (torch.randn(*shape),), buffer, dynamo=False, do_constant_folding=False,
                          input_names=["x"], output_names=["y"])
        exported[name] = buffer.getvalue()
    return exported


def step_graph(model):
    """The step graph after the pipeline's passes up to DCE, and its persistent inputs."""
    graph = from_onnx(model, training=True)
    training = prepare_training(graph)
    loss = add_op(graph, "ReduceMean", [graph.lookup(training.model_outputs[0])], {"keepdims": 0}).outputs[0]
    grads = differentiate(graph, loss, [graph.lookup(p) for p in training.parameters])
    graph.outputs = [loss, *grads.values()] + [graph.lookup(n) for n in training.state_updates.values()]
    graph, _ = run_pipeline(graph, [p for p in PIPELINE if p.name != "fuse"])
    return graph, set(training.state)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.9, 0.75, 0.6])
    args = parser.parse_args()
    models = {**torch_models(), "resnet18_corpus_b1": str(models_dir() / "resnet18.onnx")}
    print("| model | nodes | budget | arena before | after | bound | smallest | extra FLOPs | fused before "
          "| fused after | plan s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, model in models.items():
        for fraction in args.budgets:
            graph, state = step_graph(model)
            before, nodes = plan_graph_memory(graph, state).arena_bytes, len(graph.nodes)
            fused_before = plan_graph_memory(FUSE(step_graph(model)[0]).graph, state).arena_bytes  # a fresh copy
            started = time.perf_counter()
            try:
                plan = plan_recompute(graph, int(fraction * before), persistent=state)
            except RecomputeError as error:
                print(f"| {name} | {nodes} | {fraction:.0%} | {before / MIB:.2f} MiB | "
                      f"out of reach: smallest {error.floor_bytes / MIB:.2f} MiB | | | | | | |")
                continue
            seconds = time.perf_counter() - started
            apply_recompute(graph, plan, persistent=state)
            fused_after = plan_graph_memory(FUSE(graph).graph, state).arena_bytes
            print(f"| {name} | {nodes} | {fraction:.0%} | {before / MIB:.2f} MiB | "
                  f"{plan.peak_after / MIB:.2f} MiB | {plan.bound_after / MIB:.2f} MiB | "
                  f"{plan.floor_bytes / MIB:.2f} MiB | +{100 * plan.extra_flops / plan.step_flops:.1f}% | "
                  f"{fused_before / MIB:.2f} MiB | {fused_after / MIB:.2f} MiB | {seconds:.1f} |")


if __name__ == "__main__":
    main()
