"""What the fuzzer feeds Tessel: tiny seed models, and the mutations of models, artifacts and run inputs.

Everything here is deterministic in the `random.Random` it is given, so a case
is reproduced from its number and the fuzzer's seed alone.
"""
from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

F, I64 = TensorProto.FLOAT, TensorProto.INT64
SEED_OPSET = 18
# Integers that break index and size arithmetic: bounds, off-by-one, sign and 32/64-bit edges.
EDGE_INTS = (-(1 << 63), -(1 << 31), -11, -10, -1, 0, 1, 3, 9, 10, 19, 20, (1 << 31) - 1, 1 << 31, 1 << 40, (1 << 63) - 1)
EDGE_FLOATS = (float("nan"), float("inf"), float("-inf"), -0.0, 1e38, -1e38, 1e-45)


def _model(name: str, nodes, inputs, outputs, initializers=(), graph_inputs_with_defaults=()) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes, name,
        [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs]
        + [helper.make_tensor_value_info(n, F, list(np.shape(a))) for n, a in initializers if n in graph_inputs_with_defaults],
        [helper.make_tensor_value_info(n, t, s) for n, t, s in outputs],
        [numpy_helper.from_array(np.asarray(a), n) for n, a in initializers],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", SEED_OPSET)], ir_version=10)


def seed_models() -> dict[str, onnx.ModelProto]:
    """Tiny models covering the op families the fuzzer aims at: matmuls, convs, index ops, IEEE edge cases, defaults."""
    rng = np.random.default_rng(0)

    def w(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    return {
        "mlp": _model("mlp", [
            helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], name="fc1"),
            helper.make_node("Relu", ["h"], ["r"], name="relu"),
            helper.make_node("Gemm", ["r", "w2", "b2"], ["z"], name="fc2"),
            helper.make_node("Softmax", ["z"], ["y"], axis=-1, name="softmax"),
        ], [("x", F, [2, 8])], [("y", F, [2, 4])], [("w1", w(8, 16)), ("b1", w(16)), ("w2", w(16, 4)), ("b2", w(4))]),
        "conv": _model("conv", [
            helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1], name="conv"),
            helper.make_node("Relu", ["c"], ["r"], name="relu"),
            helper.make_node("MaxPool", ["r"], ["p"], kernel_shape=[2, 2], strides=[2, 2], name="pool"),
            helper.make_node("Flatten", ["p"], ["y"], name="flatten"),
        ], [("x", F, [1, 3, 8, 8])], [("y", F, [1, 64])], [("w", w(4, 3, 3, 3))]),
        "embed": _model("embed", [
            helper.make_node("Gather", ["table", "ids"], ["e"], name="embedding"),
            helper.make_node("ReduceMean", ["e", "axes"], ["y"], keepdims=0, name="mean"),
        ], [("ids", I64, [1, 5])], [("y", F, [1, 8])], [("table", w(20, 8)), ("axes", np.array([1], np.int64))]),
        "index": _model("index", [
            helper.make_node("GatherElements", ["x", "idx"], ["g"], axis=1, name="gather_elements"),
            helper.make_node("Gather", ["x", "idx"], ["y"], axis=1, name="gather_axis1"),
        ], [("x", F, [3, 4]), ("idx", I64, [3, 2])], [("g", F, [3, 2]), ("y", F, [3, 3, 2])]),
        "ieee": _model("ieee", [
            helper.make_node("Mul", ["x", "zero"], ["m"], name="times_zero"),
            helper.make_node("Relu", ["x"], ["r"], name="relu"),
            helper.make_node("Clip", ["x", "lo", "hi"], ["c"], name="clip"),
            helper.make_node("Max", ["x", "zero"], ["mx"], name="max"),
            helper.make_node("Sum", ["m", "r", "c", "mx"], ["y"], name="sum"),
        ], [("x", F, [2, 5])], [("y", F, [2, 5])],
            [("zero", np.float32(0)), ("lo", np.float32(-1)), ("hi", np.float32(1))]),
        "defaulted": _model("defaulted", [
            helper.make_node("Mul", ["x", "scale"], ["y"], name="scale"),
        ], [("x", F, [2, 3])], [("y", F, [2, 3])], [("scale", w(2, 3))], graph_inputs_with_defaults=("scale",)),
    }


# ---- models -----------------------------------------------------------------------------------------------

def mutate_model(model: onnx.ModelProto, rng: random.Random) -> onnx.ModelProto:
    """A copy of a small model with one or two faults of the kinds exporters and attackers produce."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for _ in range(rng.choice((1, 1, 2))):
        rng.choice(_MODEL_MUTATIONS)(copy, rng)
    return copy


def _input_dims(model, rng):
    vi = rng.choice(list(model.graph.input))
    dims = vi.type.tensor_type.shape.dim
    if dims:
        dims[rng.randrange(len(dims))].dim_value = rng.choice((0, 1, 2, 7, 1 << 20, 1 << 40))


def _opset(model, rng):
    model.opset_import[0].version = rng.choice((1, 6, 7, 11, 13, 21, 22, 999))


def _ir_version(model, rng):
    model.ir_version = rng.choice((0, 3, 4, 99))


def _duplicate_node(model, rng):
    node = rng.choice(list(model.graph.node))
    model.graph.node.append(node)


def _rename(model, rng):
    nodes = list(model.graph.node)
    a, b = rng.choice(nodes), rng.choice(nodes)
    if rng.random() < 0.5:
        b.name = a.name
    elif a.output and b.output:
        b.output[0] = a.output[0]


def _rewire(model, rng):
    nodes = list(model.graph.node)
    node = rng.choice(nodes)
    names = [o for n in nodes for o in n.output] + [vi.name for vi in model.graph.input] + ["", "missing"]
    if node.input:
        node.input[rng.randrange(len(node.input))] = rng.choice(names)


def _attribute(model, rng):
    node = rng.choice(list(model.graph.node))
    if node.attribute:
        attr = rng.choice(list(node.attribute))
        if attr.type == onnx.AttributeProto.INT:
            attr.i = rng.choice(EDGE_INTS)
        elif attr.type == onnx.AttributeProto.INTS and attr.ints:
            attr.ints[rng.randrange(len(attr.ints))] = rng.choice(EDGE_INTS)
        elif attr.type == onnx.AttributeProto.FLOAT:
            attr.f = rng.choice(EDGE_FLOATS)
    else:
        node.attribute.append(helper.make_attribute(rng.choice(("axis", "keepdims", "alpha")), rng.choice(EDGE_INTS)))


def _initializer(model, rng):
    inits = list(model.graph.initializer)
    if not inits:
        return
    tensor = rng.choice(inits)
    kind = rng.choice(("values", "dims", "shadow"))
    try:
        array = numpy_helper.to_array(tensor).copy()
    except ValueError:  # an earlier mutation already broke its dims
        array = np.zeros(0, np.float32)
    if kind == "values" and array.size:
        flat = array.reshape(-1)
        pool = EDGE_INTS if np.issubdtype(array.dtype, np.integer) else EDGE_FLOATS
        flat[rng.randrange(flat.size)] = np.array(rng.choice(pool)).astype(array.dtype)
        tensor.CopyFrom(numpy_helper.from_array(array, tensor.name))
    elif kind == "dims" and tensor.dims:
        tensor.dims[rng.randrange(len(tensor.dims))] = rng.choice((0, 1, 3, 1 << 30))
    else:
        model.graph.input.append(helper.make_tensor_value_info(tensor.name, tensor.data_type, list(tensor.dims)))


def _op_type(model, rng):
    node = rng.choice(list(model.graph.node))
    node.op_type = rng.choice(("Add", "Reshape", "Conv", "Gather", "Concat", "Transpose", "Softmax", "ReduceMax",
                               "ArgMax", "MatMul", "Tile", "ConstantOfShape", "Loop", "Nope"))


def _wide(model, rng):
    """A variadic op with very many inputs (the kind of graph that made TVM recurse too deeply)."""
    x = model.graph.input[0].name
    count = rng.choice((2, 64, 500, 1500))
    op = rng.choice(("Concat", "Sum"))
    model.graph.node.append(helper.make_node(op, [x] * count, ["wide"], **({"axis": 0} if op == "Concat" else {})))
    del model.graph.output[:]
    model.graph.output.append(helper.make_tensor_value_info("wide", model.graph.input[0].type.tensor_type.elem_type, None))


def _drop(model, rng):
    nodes = list(model.graph.node)
    if len(nodes) > 1:
        model.graph.node.remove(rng.choice(nodes))


_MODEL_MUTATIONS: tuple[Callable[[onnx.ModelProto, random.Random], None], ...] = (
    _input_dims, _input_dims, _opset, _ir_version, _duplicate_node, _rename, _rewire, _attribute, _attribute,
    _initializer, _initializer, _op_type, _drop, _wide,
)


# ---- artifacts --------------------------------------------------------------------------------------------

def mutate_artifact(directory: Path, outside: Path, rng: random.Random) -> str:
    """Damage the artifact in `directory` as an attacker or a broken disk would; returns what was done.

    Files of `outside` are the targets of links and paths that try to leave the artifact.
    """
    kind = rng.choice(("plan", "plan", "plan", "file", "file", "link"))
    if kind == "plan":
        plan = json.loads((directory / "plan.json").read_text())
        what = _mutate_json(plan, rng, outside)
        _write_plan(directory, plan, reseal=rng.random() < 0.8)
        return f"plan: {what}"
    files = sorted(p for p in directory.rglob("*") if p.is_file())
    target = rng.choice(files)
    relative = target.relative_to(directory).as_posix()
    if kind == "link":
        victim = rng.choice([*sorted(outside.iterdir()), Path("/dev/zero"), Path("/etc/passwd"), Path("/nonexistent")])
        target.unlink()
        os.symlink(victim, target)
        return f"{relative} -> symlink to {victim}"
    data = bytearray(target.read_bytes())
    action = rng.choice(("truncate", "flip", "empty", "npy-header"))
    if action == "truncate" and data:
        del data[rng.randrange(len(data)):]
    elif action == "flip" and data:
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] = rng.randrange(256)
    elif action == "npy-header" and target.suffix == ".npz":
        data = bytearray(_npz_claiming(rng))
    else:
        data = bytearray()
    target.write_bytes(bytes(data))
    if target.name != "plan.json" and rng.random() < 0.5 and not target.suffix == ".so":
        # The attacker rehashes the data files it edited and reseals the plan: only validation can stop this.
        from tessel.runtime.artifact_files import file_hash

        plan = json.loads((directory / "plan.json").read_text())
        if isinstance(plan.get("hashes"), dict) and relative in plan["hashes"]:
            plan["hashes"][relative] = file_hash(target)
            _write_plan(directory, plan, reseal=True)
            return f"{relative}: {action}, rehashed"
    return f"{relative}: {action}"


def _write_plan(directory: Path, plan: Any, reseal: bool) -> None:
    try:
        from tessel.runtime.artifact_files import SELF_HASH, sealed_plan_bytes
    except ImportError:  # an older runtime without a sealed plan
        reseal = False
    if reseal and isinstance(plan, dict):
        plan.pop(SELF_HASH, None)
        (directory / "plan.json").write_bytes(sealed_plan_bytes(plan))
    else:
        (directory / "plan.json").write_text(json.dumps(plan))


def _json_slots(value: Any, path=()):
    """(container, key, path) for every slot of a JSON tree."""
    if isinstance(value, dict):
        for key in list(value):
            yield value, key, path + (key,)
            yield from _json_slots(value[key], path + (key,))
    elif isinstance(value, list):
        for index in range(len(value)):
            yield value, index, path + (index,)
            yield from _json_slots(value[index], path + (index,))


def _mutate_json(plan: Any, rng: random.Random, outside: Path) -> str:
    slots = list(_json_slots(plan))
    container, key, path = rng.choice(slots)
    old = container[key]
    where = "/".join(map(str, path))
    if isinstance(old, bool) or old is None:
        new: Any = rng.choice((0, "x", [], {}, True))
    elif isinstance(old, int):
        new = rng.choice((-1, 0, old + 1, old - 1, old * 2 + 64, 1 << 31, 1 << 62, 1 << 80, -(1 << 63), 1.5, "7", None))
    elif isinstance(old, float):
        new = rng.choice((-1.0, 0.0, 1e308, "nan", None))
    elif isinstance(old, str):
        new = rng.choice(("", "../" + old, "/" + old, str(outside / "victim.so"), "kernels/../../outside/victim.so",
                          old + "x", old.upper(), "float32[1099511627776]", "int64[-1]", "float32[2,", 7, None))
    elif isinstance(old, list):
        new = rng.choice(([], old + old[:1], old[::-1], old[1:], [None], {}))
    else:
        new = rng.choice(({}, [], None, "x"))
    if rng.random() < 0.15 and isinstance(container, dict):
        del container[key]
        return f"deleted {where}"
    container[key] = new
    return f"{where}: {_short(old)} -> {_short(new)}"


def _short(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _npz_claiming(rng: random.Random) -> bytes:
    """An .npz whose one array's header claims far more elements than the file holds."""
    import io
    import zipfile

    header = {"descr": "<f4", "fortran_order": False, "shape": (rng.choice((1 << 40, 1 << 20, 3)), 4)}
    body = io.BytesIO()
    np.lib.format.write_array_header_1_0(body, header)
    body.write(b"\0" * 64)
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        archive.writestr(rng.choice(("x", "ids", "w1", "table")) + ".npy", body.getvalue())
    return out.getvalue()


# ---- run inputs -------------------------------------------------------------------------------------------

def random_inputs(types: dict[str, tuple[tuple[int, ...], np.dtype]], rng: random.Random) -> tuple[dict[str, np.ndarray], str]:
    """Inputs for a run: mostly of the right names, shapes and dtypes, with edge values (indices out of range,
    NaN, infinities); sometimes an input missing, extra, empty, mistyped or misshapen. Returns (inputs, what)."""
    gen = np.random.default_rng(rng.randrange(1 << 32))
    inputs, notes = {}, []
    for name, (shape, dtype) in types.items():
        kind = rng.choice(("valid", "edge", "edge", "edge", "shape", "dtype", "missing"))
        if kind == "missing":
            notes.append(f"{name} missing")
            continue
        if kind == "shape":
            shape = rng.choice((tuple(0 for _ in shape), shape + (1,), shape[1:], tuple(d + 1 for d in shape)))
            notes.append(f"{name} shape {list(shape)}")
        if kind == "dtype":
            dtype = np.dtype(rng.choice(("float64", "int32", "int64", "float32", "bool")))
            notes.append(f"{name} dtype {dtype}")
        if np.issubdtype(dtype, np.integer):
            array = gen.integers(0, 3, size=shape).astype(dtype)
        else:
            array = gen.standard_normal(shape).astype(dtype)
        if kind == "edge" and array.size:
            flat = array.reshape(-1)
            pool = EDGE_INTS if np.issubdtype(dtype, np.integer) else EDGE_FLOATS
            for _ in range(rng.randint(1, 3)):
                value = rng.choice(pool)
                if np.issubdtype(dtype, np.integer):
                    info = np.iinfo(dtype)
                    value = min(max(value, info.min), info.max)
                at = rng.randrange(flat.size)
                flat[at] = value
                notes.append(f"{name}.flat[{at}] = {flat[at]}")
        inputs[name] = array
    if rng.random() < 0.05:
        inputs["unexpected"] = np.zeros(2, np.float32)
        notes.append("extra input")
    return inputs, "; ".join(notes) or "valid"


def write_npz(path: Path, inputs: dict[str, np.ndarray], rng: random.Random) -> str:
    """Save the inputs; now and then as a damaged file (a header claiming 2^40 elements, or truncated)."""
    np.savez(path, **inputs)
    roll = rng.random()
    if roll < 0.04:
        path.write_bytes(_npz_claiming(rng))
        return "npz header claims a huge array"
    if roll < 0.07:
        data = path.read_bytes()
        path.write_bytes(data[:rng.randrange(max(len(data), 1))])
        return "npz truncated"
    return ""


def copy_artifact(source: Path, destination: Path) -> None:
    """A private copy of an artifact, symlinks kept as links."""
    shutil.copytree(source, destination, symlinks=True)
