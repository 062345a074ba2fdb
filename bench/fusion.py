"""Kernel counts before and after fusion, per corpus model, and what each pass did.

For every model: kernel calls per run with the whole pipeline except fusion,
and with fusion; their ratio; the number of fused groups and the bytes of
intermediate tensors that are no longer written to memory. No kernels are
compiled, so this runs in seconds.

    python bench/fusion.py [MODEL ...]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

from tessel import ir  # noqa: E402
from tessel.compiler.corpus import load_corpus  # noqa: E402
from tessel.compiler.pipeline import PIPELINE, run_pipeline  # noqa: E402

# The models whose kernel count fusion must at least halve (issue: graph passes).
HEADLINE = ("resnet18", "yolov8n_320", "ppocr_v4_det", "minigpt_small")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", help="corpus model names (default: every non-negative model)")
    args = parser.parse_args(argv)
    corpus = [m for m in load_corpus() if not m.negative and (not args.models or m.name in args.models)]
    print(f"{'model':<24} {'nodes':>6} {'after':>6} {'unfused':>8} {'fused':>6} {'ratio':>6} {'groups':>7} {'MiB saved':>10}")
    for model in corpus:
        graph = ir.from_onnx(str(model.path), model.input_shapes)
        nodes = sum(1 for _ in graph.walk_nodes())
        graph, records = run_pipeline(graph, PIPELINE)
        fuse = records[-1]
        mark = "  *" if model.name in HEADLINE else ""
        print(f"{model.name:<24} {nodes:>6} {fuse.nodes_after:>6} {fuse.kernels_before:>8} {fuse.kernels_after:>6} "
              f"{fuse.kernels_before / max(1, fuse.kernels_after):>5.2f}x {fuse.stats['groups']:>7} "
              f"{fuse.stats['intermediate_bytes_saved'] / 2**20:>10.1f}{mark}")
    print("* headline models: fusion must at least halve their kernel count")
    return 0


if __name__ == "__main__":
    sys.exit(main())
