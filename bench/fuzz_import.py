"""Fuzz the ONNX importer with mutated corpus model bytes.

Every mutated model must either import or raise Tessel's own error type
(TesselError): any other exception, or a crash of the process, is a bug.

    python bench/fuzz_import.py [--cases 5000] [--seed 0]
"""
from __future__ import annotations

import argparse
import random
import sys
import time
import traceback
from collections import Counter
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import onnx  # noqa: E402

import ir  # noqa: E402
from compiler.corpus import CorpusModel, load_corpus  # noqa: E402

# Models small enough that thousands of imports stay quick.
FUZZ_MODEL_BYTES = 600_000


def fuzz_models() -> list[CorpusModel]:
    """Corpus models (negative ones included) small enough to fuzz."""
    return [m for m in load_corpus() if m.path.stat().st_size <= FUZZ_MODEL_BYTES]


def mutate(data: bytes, rng: random.Random) -> bytes:
    """One random corruption: half the time of the raw bytes, half the time of the model's structure."""
    return mutate_bytes(data, rng) if rng.random() < 0.5 else mutate_structure(data, rng)


def mutate_structure(data: bytes, rng: random.Random) -> bytes:
    """A well-formed protobuf with one semantic fault: a dropped node, a rewired input, a changed
    attribute, dimension or op type (what a buggy exporter writes)."""
    model = onnx.ModelProto()
    model.ParseFromString(data)
    graph = model.graph
    nodes = list(graph.node)
    if not nodes:
        return data
    node = rng.choice(nodes)
    kind = rng.choice(("drop", "rewire", "attr", "dims", "op"))
    if kind == "drop":
        graph.node.remove(node)
    elif kind == "rewire" and node.input:
        names = [n for other in nodes for n in other.output] + [""]
        node.input[rng.randrange(len(node.input))] = rng.choice(names)
    elif kind == "attr" and node.attribute:
        attr = rng.choice(list(node.attribute))
        if attr.type == onnx.AttributeProto.INT:
            attr.i = rng.randint(-3, 10)
        elif attr.type == onnx.AttributeProto.INTS and attr.ints:
            attr.ints[rng.randrange(len(attr.ints))] = rng.randint(-3, 10)
        elif attr.type == onnx.AttributeProto.FLOAT:
            attr.f = rng.choice((0.0, -1.0, 1e30, float("nan")))
    elif kind == "dims":
        tensors = list(graph.initializer)
        if tensors:
            tensor = rng.choice(tensors)
            if tensor.dims:
                tensor.dims[rng.randrange(len(tensor.dims))] = rng.randint(0, 9)
    else:
        node.op_type = rng.choice(("Add", "Reshape", "Conv", "Gather", "Concat", "Transpose", "Split", "If", "Loop", "Nope"))
    return model.SerializeToString()


def mutate_bytes(data: bytes, rng: random.Random) -> bytes:
    """Flipped bytes, truncation, an inserted or zeroed run, or a copied chunk."""
    buf = bytearray(data)
    kind = rng.choice(("flip", "truncate", "insert", "zero", "splice"))
    if kind == "flip":
        for _ in range(rng.randint(1, 16)):
            buf[rng.randrange(len(buf))] = rng.randrange(256)
    elif kind == "truncate":
        del buf[rng.randrange(len(buf)):]
    elif kind == "insert":
        at = rng.randrange(len(buf))
        buf[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 32)))
    elif kind == "zero":
        at = rng.randrange(len(buf))
        buf[at:at + rng.randint(1, 64)] = bytes(min(64, len(buf) - at))
    else:
        start = rng.randrange(len(buf))
        chunk = buf[start:start + rng.randint(1, 256)]
        at = rng.randrange(len(buf))
        buf[at:at] = chunk
    return bytes(buf)


def run_case(model: CorpusModel, data: bytes) -> str:
    """'imported', or the name of the TesselError subclass raised; other exceptions propagate."""
    try:
        ir.from_onnx(data, model.input_shapes)
    except ir.TesselError as exc:
        return type(exc).__name__
    return "imported"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    models = fuzz_models()
    originals = {m.name: m.path.read_bytes() for m in models}
    outcomes: Counter = Counter()
    failures = 0
    start = time.perf_counter()
    for case in range(args.cases):
        model = models[case % len(models)]
        data = mutate(originals[model.name], rng)
        try:
            outcomes[run_case(model, data)] += 1
        except Exception:  # noqa: BLE001 - this is exactly what the fuzzer hunts for
            failures += 1
            print(f"case {case} ({model.name}): escaped exception", file=sys.stderr)
            traceback.print_exc()
    elapsed = time.perf_counter() - start
    print(f"{args.cases} mutated models from {len(models)} corpus models in {elapsed:.1f} s")
    for outcome, count in outcomes.most_common():
        print(f"  {outcome:<24} {count}")
    print(f"  {'escaped exceptions':<24} {failures}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
