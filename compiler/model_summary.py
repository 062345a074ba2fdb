"""`tessel inspect`: what a model is made of and what running it costs."""
from __future__ import annotations

import math
import os
from collections import Counter
from typing import Any, Mapping, Sequence

import onnx

from tessel import ir
from tessel.ir.analysis import constant_stats, max_live_bytes, op_histogram, total_bytes_moved, total_flops
from tessel.ir.errors import ModelImportError
from tessel.ir.onnx_import import all_initializers, declared_shape, default_opset, find_unsupported, walk_onnx_nodes
from tessel.ir.shape_operands import shape_deciding_inputs
from tessel.ir.types import dtype_from_onnx, onnx_type_name


def _tensor_stats(tensors) -> dict[str, int]:
    """Count, elements and bytes of ONNX TensorProtos (read from their dims, not their data)."""
    count = elements = nbytes = 0
    for tensor in tensors:
        numel = math.prod(tensor.dims)
        count += 1
        elements += numel
        nbytes += numel * onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
    return {"tensors": count, "elements": elements, "bytes": nbytes}


def _constant_node_tensors(graph: onnx.GraphProto):
    for node in walk_onnx_nodes(graph):
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            yield from (a.t for a in node.attribute if a.type == onnx.AttributeProto.TENSOR)


def _declared(vi: onnx.ValueInfoProto) -> dict[str, Any]:
    if not vi.type.HasField("tensor_type"):
        return {"name": vi.name, "dtype": vi.type.WhichOneof("value") or "unknown", "shape": []}
    tensor = vi.type.tensor_type
    try:
        dtype = dtype_from_onnx(tensor.elem_type)
    except KeyError:
        dtype = onnx_type_name(tensor.elem_type)
    shape = ["?" if d is None else d for d in declared_shape(tensor)]
    return {"name": vi.name, "dtype": dtype, "shape": shape}


def summarize(path: str | os.PathLike, input_shapes: Mapping[str, Sequence[int]] | None = None,
              input_values: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The inspect report as a dict with stable keys.

    `shape_inputs` names the inputs whose values decide shapes, with the operands they reach: they need a
    value when compiling (`input_values`). While one lacks it and the import fails, `import_error` says why
    and the import-dependent fields are None.

    Parameters are the model's initializers; tensors held by Constant nodes are
    counted apart (some exporters store weights that way). When the model imports, inputs and
    outputs carry static shapes and the report adds FLOPs and the activation
    memory lower bound; when it uses unsupported ops, `unsupported` lists them
    and the import-dependent fields are None.
    """
    model = ir.load_model(path)
    initializer_names = {t.name for t in model.graph.initializer}
    report: dict[str, Any] = {
        "model": os.fspath(path),
        "opset": default_opset(model),
        "producer": model.producer_name or None,
        "inputs": [_declared(vi) for vi in model.graph.input if vi.name not in initializer_names],
        "outputs": [_declared(vi) for vi in model.graph.output],
        "parameters": _tensor_stats(all_initializers(model.graph)),
        "constant_nodes": _tensor_stats(_constant_node_tensors(model.graph)),
        "shape_inputs": shape_deciding_inputs(model),
        "import_error": None,
        "onnx_nodes": sum(1 for _ in walk_onnx_nodes(model.graph)),
        "unsupported": [
            {"op": op, "domain": domain or "ai.onnx", "count": n, "first_node": first, "reason": reason}
            for op, domain, n, first, reason in find_unsupported(model)
        ],
        "ops": None,
        "nodes": None,
        "constants": None,
        "flops": None,
        "bytes_moved": None,
        "activation_memory_lower_bound": None,
    }
    if report["unsupported"]:
        report["ops"] = _onnx_ops(model)
        return report
    try:
        graph = ir.from_onnx(model, input_shapes, input_values=input_values)
    except ModelImportError as exc:
        if not set(report["shape_inputs"]) - set(input_values or {}):
            raise
        report.update(import_error=str(exc), ops=_onnx_ops(model))
        return report
    constants = constant_stats(graph)
    live = max_live_bytes(graph)
    report.update(
        inputs=[{"name": v.name, "dtype": v.type.dtype, "shape": list(v.type.shape)} for v in graph.inputs],
        outputs=[{"name": v.name, "dtype": v.type.dtype, "shape": list(v.type.shape)} for v in graph.outputs],
        ops=dict(sorted(op_histogram(graph).items())),
        nodes=sum(1 for _ in graph.walk_nodes()),
        constants={"tensors": constants.count, "elements": constants.elements, "bytes": constants.bytes},
        flops=total_flops(graph),
        bytes_moved=total_bytes_moved(graph),
        activation_memory_lower_bound={"bytes": live.peak_bytes, "peak_node": live.peak_node},
    )
    return report


def _onnx_ops(model: onnx.ModelProto) -> dict[str, int]:
    """How many nodes of each op the ONNX model holds, subgraphs included."""
    return dict(sorted(Counter(n.op_type if not n.domain else f"{n.domain}::{n.op_type}"
                               for n in walk_onnx_nodes(model.graph)).items()))


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    raise AssertionError("unreachable")


def format_summary(report: Mapping[str, Any]) -> str:
    """The inspect report as text for a person."""
    def tensor(t):
        return f"  {t['name']}: {t['dtype']}[{','.join(str(d) for d in t['shape'])}]"

    params = report["parameters"]
    lines = [f"model: {report['model']} (opset {report['opset']}, {report['onnx_nodes']} ONNX nodes)", "inputs:"]
    lines += [tensor(t) for t in report["inputs"]]
    lines += ["outputs:"] + [tensor(t) for t in report["outputs"]]
    if report["shape_inputs"]:
        lines.append("inputs that decide shapes (give their values when compiling: --input-value NAME=V1,V2,...):")
        lines += [f"  {name}: {', '.join(uses)}" for name, uses in report["shape_inputs"].items()]
    lines.append(f"parameters: {params['elements']:,} elements in {params['tensors']} initializers ({_bytes(params['bytes'])})")
    held = report["constant_nodes"]
    if held["tensors"]:
        lines.append(f"constant nodes: {held['elements']:,} elements in {held['tensors']} Constant nodes ({_bytes(held['bytes'])})")
    if report["nodes"] is not None:
        constants = report["constants"]
        live = report["activation_memory_lower_bound"]
        lines.append(f"imported graph: {report['nodes']} nodes, {constants['tensors']} constants ({_bytes(constants['bytes'])})")
        lines.append(f"FLOPs: {report['flops']:,} ({report['flops'] / 1e9:.3f} GFLOP)")
        lines.append(f"bytes moved: {_bytes(report['bytes_moved'])} (each node reads its inputs and writes its outputs once)")
        lines.append(f"activation memory lower bound: {_bytes(live['bytes'])} (max live bytes in topological order, peak at '{live['peak_node']}')")
    if report["import_error"]:
        lines.append(f"not imported: {report['import_error']}")
    lines.append("ops:")
    width = max((len(op) for op in report["ops"]), default=0)
    lines += [f"  {op:<{width}}  {count}" for op, count in sorted(report["ops"].items(), key=lambda kv: (-kv[1], kv[0]))]
    if report["unsupported"]:
        lines.append("unsupported ops:")
        lines += [f"  {u['op']} (domain {u['domain']}): {u['count']} node(s), first '{u['first_node']}': {u['reason']}" for u in report["unsupported"]]
    else:
        lines.append("unsupported ops: none")
    return "\n".join(lines)
