"""ONNX import: `from_onnx` turns an ONNX model into a static, verified Tessel graph.

The importer reads nodes in dependency order, brings each to canonical form
(`onnx_normalize`), infers its static output types, and folds it when all its
inputs are constants and its outputs are small: this is what turns
shape-computing subgraphs (Shape → Gather → Concat → Reshape, Range,
ConstantOfShape, ...) into constants so that every tensor has a static shape.
An If whose condition is known at compile time is replaced by its branch; one
with a runtime condition stays an If node holding two subgraphs.
"""
from __future__ import annotations

import heapq
import os
import warnings
from collections import ChainMap, Counter
from typing import Any, Mapping, Sequence

import numpy as np
import onnx
from google.protobuf.message import DecodeError
from onnx import defs, external_data_helper, helper, numpy_helper

from .attributes import Attributes
from .bfloat16_boundary import BFLOAT16_REASON, bfloat16_boundary_names, touches
from .errors import ModelImportError, ModelLoadError, ShapeBindingError, TesselError, UnsupportedModelError
from .evaluate import evaluate
from .graph import Graph, Value
from .onnx_normalize import RENAMED, ImportProblem, RawNode, normalize
from .onnx_functions import expand, function_body, has_function, plain_function_body
from .onnx_proto import type_proto
from .schema import CANONICAL_OPSET, TESSEL_DOMAIN, InferenceFailure, added_attributes, get_schema, unsupported_reason
from .shape_operands import shape_operand_positions
from .types import TensorType, dtype_from_onnx, dtype_to_onnx, numpy_dtype, onnx_type_name
from .verify import verify

MIN_OPSET = 7
# A node whose inputs are all constants is folded when its outputs hold at most this many elements.
FOLD_LIMIT = 1 << 16
# A node over an empty input (its result known from shapes alone) is folded up to this many output elements.
EMPTY_FOLD_LIMIT = 1 << 24

InputShapes = Mapping[str, Sequence[int]]
InputValues = Mapping[str, Any]


def load_model(model_or_path: "onnx.ModelProto | bytes | str | os.PathLike") -> onnx.ModelProto:
    """Read an ONNX model from a path, bytes or a ModelProto; raise ModelLoadError when it is not one."""
    if isinstance(model_or_path, onnx.ModelProto):
        return model_or_path
    if isinstance(model_or_path, (bytes, bytearray)):
        return _parse(bytes(model_or_path), "model bytes")
    path = os.fspath(model_or_path)
    if not os.path.exists(path):
        raise ModelLoadError(f"{path}: no such file; give the path of an .onnx model")
    if os.path.isdir(path):
        raise ModelLoadError(f"{path}: is a directory, not an .onnx model file")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot read: {exc.strerror}") from exc
    model = _parse(data, path)
    external = [t for t in all_initializers(model.graph) if external_data_helper.uses_external_data(t)]
    if external:
        check_external_data(external, os.path.dirname(os.path.abspath(path)), path)
        try:
            onnx.load_external_data_for_model(model, os.path.dirname(os.path.abspath(path)))
        except (OSError, ValueError, onnx.checker.ValidationError) as exc:
            raise ModelLoadError(f"{path}: cannot load external tensor data: {exc}") from exc
    return model


def check_external_data(tensors: Sequence[onnx.TensorProto], base_dir: str, where: str) -> None:
    """Raise ModelLoadError unless each tensor's external data is a file inside `base_dir` holding exactly the
    tensor's bytes, all of which fit in memory — checked from file sizes before anything is read."""
    total = 0
    for tensor in tensors:
        info = {entry.key: entry.value for entry in tensor.external_data}
        name = f"{where}: tensor '{tensor.name}'"
        location = info.get("location", "")
        parts = location.replace("\\", "/").split("/")
        if not location or os.path.isabs(location) or any(part in ("", ".", "..") for part in parts):
            raise ModelLoadError(f"{name}: external data location {location!r} is not a plain relative path "
                                 "beside the model; the model is damaged or unsafe")
        file = os.path.join(base_dir, location)
        if not os.path.realpath(file).startswith(os.path.realpath(base_dir) + os.sep) or not os.path.isfile(file):
            raise ModelLoadError(f"{name}: external data file '{location}' is missing or outside the model's directory; "
                                 "keep the data files beside the model")
        try:
            offset, length = int(info.get("offset", 0)), info.get("length")
            length = int(length) if length is not None else None
            itemsize = numpy_dtype(dtype_from_onnx(tensor.data_type)).itemsize
        except (ValueError, KeyError):
            raise ModelLoadError(f"{name}: external data has a malformed offset, length or element type") from None
        expected = int(np.prod([int(d) for d in tensor.dims], dtype=object)) * itemsize
        available = os.path.getsize(file) - offset
        length = available if length is None else length
        if offset < 0 or length < 0 or length > available or length != expected or min(tensor.dims, default=0) < 0:
            raise ModelLoadError(f"{name}: external data claims {length} bytes at offset {offset} of '{location}' "
                                 f"({max(available, 0)} there), the tensor needs {expected}; the data file is damaged or not this model's")
        total += expected
    if total > physical_memory():
        raise ModelLoadError(f"{where}: external tensor data takes {_size(total)}, more than this machine's memory "
                             f"({_size(physical_memory())})")


def _parse(data: bytes, where: str) -> onnx.ModelProto:
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError) as exc:
        raise ModelLoadError(
            f"{where}: not a valid ONNX model (protobuf decoding failed: {exc}); the file may be truncated or corrupt"
        ) from exc
    if not data or not model.HasField("graph") or not model.opset_import:
        raise ModelLoadError(f"{where}: not an ONNX model (no graph or no opset_import); check the file is an .onnx model")
    return model


def onnx_subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    """The graphs held in a node's attributes."""
    graphs: list[onnx.GraphProto] = []
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            graphs.append(attr.g)
        elif attr.type == onnx.AttributeProto.GRAPHS:
            graphs.extend(attr.graphs)
    return graphs


def with_batch(model: onnx.ModelProto, batch: int) -> onnx.ModelProto:
    """A copy of the model whose inputs take `batch` on axis 0 (declared 1, symbolic, or anything).

    Shapes inside are re-inferred at import; a model that hard-codes its batch
    (e.g. a Reshape to [1, -1]) then fails to import with the node that does.
    """
    if batch < 1:
        raise ShapeBindingError(f"--batch {batch}: must be at least 1")
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    initializers = {t.name for t in copy.graph.initializer}
    batched = 0
    for vi in copy.graph.input:
        dims = vi.type.tensor_type.shape.dim
        if vi.name in initializers or not vi.type.tensor_type.HasField("shape") or not dims:
            continue
        dims[0].Clear()
        dims[0].dim_value = batch
        batched += 1
    if not batched:
        raise ShapeBindingError(f"--batch {batch}: the model has no input with a batch axis")
    del copy.graph.value_info[:]
    _unpin_reshape_batch(copy.graph)
    return copy


def bind_input_values(model: onnx.ModelProto, values: InputValues) -> onnx.ModelProto:
    """A copy of the model whose inputs named in `values` are initializers holding those values (cast to each
    input's element type and checked as `from_onnx(input_values=...)` does): the model as compiled with them."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    graph = copy.graph
    by_name = {vi.name: vi for vi in graph.input}
    unknown = sorted(set(values) - set(by_name))
    if unknown:
        raise ShapeBindingError(f"input value given for {', '.join(map(repr, unknown))}, but the model's inputs are "
                                f"{', '.join(repr(vi.name) for vi in graph.input) or 'none'}")
    arrays = {name: _input_value(by_name[name], value, None) for name, value in values.items()}
    kept = [t for t in graph.initializer if t.name not in arrays]  # a default the value replaces
    del graph.initializer[:]
    graph.initializer.extend(kept + [numpy_helper.from_array(array, name) for name, array in arrays.items()])
    if model.ir_version >= 4:  # before IR 4 every initializer is also listed among the inputs
        inputs = [vi for vi in graph.input if vi.name not in arrays]
        del graph.input[:]
        graph.input.extend(inputs)
    return copy


def _unpin_reshape_batch(graph: onnx.GraphProto) -> None:
    """Exporters often write Reshape(x, [1, ...]) for a batch of one: the leading 1 becomes -1.

    At batch 1 that is the same reshape (the -1 resolves to 1); at another batch the
    -1 takes the batch, and a reshape that really meant 1 fails at import with the
    node named. Only shapes without another -1 are touched; each rewritten node gets
    its own copy of the shape.
    """
    from onnx import numpy_helper

    constants = {t.name: t for t in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            constants[node.output[0]] = node.attribute[0].t
    for index, node in enumerate(graph.node):
        if node.op_type != "Reshape" or len(node.input) < 2 or node.input[1] not in constants:
            continue
        shape = numpy_helper.to_array(constants[node.input[1]]).astype(np.int64)
        if shape.ndim != 1 or not shape.size or shape[0] != 1 or (shape == -1).any():
            continue
        unpinned = shape.copy()
        unpinned[0] = -1
        name = f"{node.input[1]}__batch_{index}"
        graph.initializer.append(numpy_helper.from_array(unpinned, name))
        node.input[1] = name


def walk_onnx_nodes(graph: onnx.GraphProto):
    """Every node of an ONNX graph and, depth first, of its subgraphs."""
    for node in graph.node:
        yield node
        for sub in onnx_subgraphs(node):
            yield from walk_onnx_nodes(sub)


def all_initializers(graph: onnx.GraphProto):
    """Every initializer of an ONNX graph and of its subgraphs."""
    yield from graph.initializer
    for node in graph.node:
        for sub in onnx_subgraphs(node):
            yield from all_initializers(sub)


def default_opset(model: onnx.ModelProto) -> int | None:
    """The model's version of the default ONNX domain, or None when it imports none."""
    for entry in model.opset_import:
        if entry.domain in ("", "ai.onnx"):
            return entry.version
    return None


def find_unsupported(model: onnx.ModelProto) -> list[tuple[str, str, int, str, str]]:
    """Every unsupported op of the model as (op, domain, node count, first node name, reason), in order of appearance."""
    opset = default_opset(model)
    counts: Counter = Counter()
    first: dict[tuple[str, str], tuple[str, str]] = {}
    bfloat16 = bfloat16_boundary_names(model.graph)
    for index, node in enumerate(walk_onnx_nodes(model.graph)):
        reason = _unsupported_reason(node, opset) or (BFLOAT16_REASON if touches(node, bfloat16) else None)
        if reason is None:
            continue
        key = (node.op_type, node.domain)
        counts[key] += 1
        first.setdefault(key, (node.name or f"#{index}", reason))
    return [(op, domain, counts[(op, domain)], name, reason) for (op, domain), (name, reason) in first.items()]


def _unsupported_reason(node: onnx.NodeProto, opset: int | None) -> str | None:
    """None when the node's op is supported at this opset; else why not.

    A version newer than the canonical opset is supported when it only added attributes that the node leaves
    at their defaults, or when ONNX defines it as a function (imported as its body, whose ops must be supported;
    a body that depends on the input types is checked when it is imported).
    """
    op_type, domain = node.op_type, node.domain
    if domain not in ("", "ai.onnx"):
        return unsupported_reason(op_type, domain)
    if opset is None:
        return "the model does not import the default ONNX domain"
    try:
        version = defs.get_schema(op_type, opset, "").since_version
    except defs.SchemaError:
        return f"not an ONNX op at opset {opset}"
    if version > CANONICAL_OPSET and expands_to_function(node, opset):
        body = plain_function_body(op_type, opset)
        for inner in body.node if body is not None else ():
            reason = _unsupported_reason(inner, opset)
            if reason is not None:
                return f"its function body uses {inner.op_type}: {reason}"
        return None
    if version > CANONICAL_OPSET:
        added = added_attributes(op_type, opset)
        if added is None:
            return f"op version {version} changed its inputs or attributes after opset {CANONICAL_OPSET}"
        for attr in node.attribute:
            if attr.name in added and helper.get_attribute_value(attr) != helper.get_attribute_value(added[attr.name]):
                return (f"attribute '{attr.name}' (added in op version {version}) is set to "
                        f"{helper.get_attribute_value(attr)!r}; only its default is supported")
    if get_schema(op_type) is None and op_type not in RENAMED:
        return unsupported_reason(op_type, domain)
    return None


def expands_to_function(node: onnx.NodeProto, opset: int) -> bool:
    """Whether the node imports as its ONNX function body: its op's version at `opset` is newer than the
    canonical opset, defined as a function, and not just the canonical version with new attributes left at
    their defaults."""
    if node.domain not in ("", "ai.onnx") or not has_function(node.op_type, opset):
        return False
    if defs.get_schema(node.op_type, opset, "").since_version <= CANONICAL_OPSET:
        return False
    added = added_attributes(node.op_type, opset)
    return added is None or any(
        a.name in added and helper.get_attribute_value(a) != helper.get_attribute_value(added[a.name])
        for a in node.attribute)


def newest_opset() -> int:
    """The newest default-domain opset Tessel reads: the newest the installed onnx package defines."""
    return defs.onnx_opset_version()


def check_versions(model: onnx.ModelProto) -> None:
    """Raise ModelImportError when the model's IR version or default opset is outside what Tessel reads."""
    if model.ir_version > onnx.IR_VERSION:
        raise ModelImportError(f"model has ONNX IR version {model.ir_version}; the newest Tessel reads is {onnx.IR_VERSION} "
                               "— save the model with an older onnx package")
    opset = default_opset(model)
    if opset is None:
        return
    if opset < MIN_OPSET:
        raise ModelImportError(
            f"model imports ONNX opset {opset}; Tessel reads opset {MIN_OPSET} and newer — convert it with onnx.version_converter"
        )
    if opset > newest_opset():
        raise ModelImportError(f"model imports ONNX opset {opset}; the newest Tessel reads is {newest_opset()} "
                               f"(opsets {MIN_OPSET}-{newest_opset()}) — export the model at an older opset")


def check_unique_names(proto: onnx.GraphProto, outer: frozenset[str] = frozenset()) -> None:
    """Raise ModelImportError unless every value is defined once (ONNX's single static assignment) and node names
    are unique, in `proto` and its subgraphs.

    As in onnx.checker, a node output may not reuse a name of an enclosing graph either;
    an initializer may share its name with a graph input (it is then the input's default).
    """
    graph = f"graph '{proto.name or 'main'}'"
    defined: dict[str, str] = {}

    def define(name: str, what: str, shadowing_outer: bool) -> None:
        first = defined.get(name) or ("a value of an enclosing graph" if shadowing_outer and name in outer else None)
        if first is not None:
            raise ModelImportError(f"{graph}: value '{name}' is defined twice ({first} and {what}); ONNX requires every "
                                   "name to be defined once — fix the exporter or rename one of them")
        defined[name] = what

    for vi in proto.input:
        define(vi.name, f"graph input '{vi.name}'", shadowing_outer=False)
    inputs = set(defined)
    initializers: set[str] = set()
    for tensor in proto.initializer:
        if tensor.name in initializers:
            raise ModelImportError(f"{graph}: two initializers are named '{tensor.name}'; rename one of them")
        initializers.add(tensor.name)
        if tensor.name not in inputs:
            define(tensor.name, f"initializer '{tensor.name}'", shadowing_outer=False)
    node_names: dict[str, int] = {}
    for index, node in enumerate(proto.node):
        label = f"output of node '{node.name or f'#{index}'}' ({node.op_type})"
        if node.name:
            if node.name in node_names:
                raise ModelImportError(f"{graph}: two nodes are named '{node.name}' (nodes #{node_names[node.name]} and "
                                       f"#{index}); node names must be unique — rename one of them")
            node_names[node.name] = index
        for name in node.output:
            if name:
                define(name, label, shadowing_outer=True)
    scope = outer | frozenset(defined)
    for node in proto.node:
        for sub in onnx_subgraphs(node):
            check_unique_names(sub, scope)


def input_defaults(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """Initializers that are also graph inputs, by name: defaults the caller may override.

    As in onnxruntime, only from ONNX IR version 4 on: before it, exporters listed every
    initializer among the inputs, and those are constants.
    """
    if model.ir_version < 4:
        return {}
    inputs = {vi.name for vi in model.graph.input}
    return {t.name: _tensor_array(t, f"initializer '{t.name}'") for t in model.graph.initializer if t.name in inputs}


def from_onnx(model_or_path: "onnx.ModelProto | bytes | str | os.PathLike", input_shapes: InputShapes | None = None,
              *, training: bool = False, input_values: InputValues | None = None) -> Graph:
    """Import an ONNX model as a verified Tessel graph in which every tensor has a static shape.

    `input_shapes` binds symbolic input dimensions (dim_param, or a dim_value of -1), e.g. {"x": (1, 3, 640, 640)};
    a declared size of 0 takes the bound size too (exporters write 0 for "unknown").
    `input_values` gives the values of inputs known when compiling, e.g. {"shape": np.array([1, -1])}: each
    becomes a constant (cast to the input's declared element type), so the nodes it feeds fold, and it is no
    longer an input of the graph. Inputs that decide shapes (Reshape's shape, Reduce axes, ...) need one.
    `training` imports for passes/training_mode.py: float initializers stay constants under their own
    names (listed in `graph.initializers`) that no node is folded with, so gradients can reach them, and
    BatchNormalization in training mode is accepted.
    Raises a TesselError subclass (ModelLoadError, ModelImportError,
    ShapeBindingError, UnsupportedModelError, VerificationError) on bad input.
    """
    model = load_model(model_or_path)
    importer = _Importer(CANONICAL_OPSET, training)
    try:
        graph = importer.import_model(model, dict(input_shapes or {}), dict(input_values or {}))
    except TesselError:
        raise
    except RecursionError as exc:
        raise ModelImportError(f"{importer.where}: subgraphs nest too deeply") from exc
    except MemoryError:
        raise ModelImportError(f"{importer.where}: not enough memory to import the model") from None
    except Exception as exc:  # a malformed model must never surface as a Python error
        detail = (str(exc).strip().splitlines() or [""])[0]
        raise ModelImportError(f"{importer.where}: malformed model ({type(exc).__name__}: {detail})") from exc
    verify(graph)
    return graph


class _Context:
    """What normalization rewrites may ask of the importer, bound to one graph."""

    def __init__(self, importer: "_Importer", graph: Graph):
        self.importer = importer
        self.graph = graph

    def constant(self, array: np.ndarray, name: str) -> Value:
        return self.graph.add_constant(name, np.asarray(array))

    def emit(self, op_type: str, inputs: list[Value | None], attrs: dict[str, Any], name: str) -> Value:
        raw = RawNode(name, op_type, attrs, list(inputs), [self.graph.unique_name(f"{name}_out")])
        return self.importer.emit(self.graph, raw)[0]


class _Importer:
    def __init__(self, opset: int, training: bool = False):
        self.opset = opset
        self.where = "model"
        self.training = training
        # Float initializers kept unfolded in a training import (Value ids).
        self.kept: set[int] = set()

    # ---- graphs -----------------------------------------------------------
    def import_model(self, model: onnx.ModelProto, input_shapes: dict[str, Sequence[int]],
                     input_values: dict[str, Any]) -> Graph:
        check_versions(model)
        unsupported = find_unsupported(model)
        if unsupported:
            raise UnsupportedModelError(unsupported)
        opset = default_opset(model)
        self.opset = opset or CANONICAL_OPSET
        proto = model.graph
        if proto.sparse_initializer:
            raise ModelImportError(f"graph '{proto.name}': sparse initializers are not supported")
        check_unique_names(proto)
        graph = Graph(proto.name or "main")
        defaults = input_defaults(model)
        frozen = {t.name for t in proto.initializer} - set(defaults)
        real_inputs = [vi for vi in proto.input if vi.name not in frozen]
        for given, what in ((input_shapes, "input shape"), (input_values, "input value")):
            unknown = sorted(set(given) - {vi.name for vi in real_inputs})
            if unknown:
                names = ", ".join(repr(vi.name) for vi in real_inputs) or "none"
                raise ShapeBindingError(f"{what} given for {', '.join(map(repr, unknown))}, but the model's inputs are {names}")
        scope: dict[str, Value] = {}
        for vi in real_inputs:
            self.where = f"input '{vi.name}'"
            if vi.name in input_values:
                scope[vi.name] = graph.add_constant(vi.name, _input_value(vi, input_values[vi.name], input_shapes.get(vi.name)))
            elif vi.name in defaults:
                scope[vi.name] = graph.add_input(vi.name, _default_input_type(vi, defaults[vi.name], input_shapes.get(vi.name)))
            else:
                scope[vi.name] = graph.add_input(vi.name, _input_type(vi, input_shapes.get(vi.name)))
        self._add_initializers(proto, graph, scope, skip=set(defaults))
        self._import_body(proto, graph, scope)
        self._bind_outputs(proto, graph, scope)
        _drop_unused_constants(graph)
        if self.training:
            graph.initializers = frozenset(v.name for v in graph.constants if id(v) in self.kept)
        return graph

    def _add_initializers(self, proto: onnx.GraphProto, graph: Graph, scope, skip: set[str] = frozenset()) -> None:
        for tensor in proto.initializer:
            if tensor.name in skip:
                continue
            self.where = f"initializer '{tensor.name}'"
            scope[tensor.name] = graph.add_constant(tensor.name, _tensor_array(tensor, self.where))
            if self.training and scope[tensor.name].type.dtype.startswith("float"):
                self.kept.add(id(scope[tensor.name]))

    def _import_body(self, proto: onnx.GraphProto, graph: Graph, scope) -> None:
        read = {name for node in proto.node for name in node.input} | {vi.name for vi in proto.output}
        for index, node in _sorted_nodes(proto, scope):
            name = node.name or f"{node.op_type}_{index}"
            self.where = f"node '{name}' ({node.op_type})"
            self._import_node(node, name, graph, scope, read)

    def _bind_outputs(self, proto: onnx.GraphProto, graph: Graph, scope) -> None:
        outputs: list[Value] = []
        for vi in proto.output:
            value = scope.get(vi.name)
            if value is None:
                raise ModelImportError(f"graph '{graph.name}': output '{vi.name}' is not produced by any node, input or initializer")
            # A branch returning a value of the enclosing graph (which the ONNX checker rejects) returns an Identity
            # of it: the outer value then has a use, and no pass removes its producer.
            if value.name != vi.name or value.graph is not graph:
                value = self._name_output(graph, value, vi.name, outputs)
            outputs.append(value)
        graph.outputs = outputs

    @staticmethod
    def _name_output(graph: Graph, value: Value, name: str, taken: list[Value]) -> Value:
        """Make the graph return `value` under `name`, renaming it or adding an Identity."""
        renamable = value.graph is graph and not value.is_graph_input and all(v is not value for v in taken)
        if renamable and graph.lookup(name) is None:
            graph.rename_value(value, name)
            return value
        node = graph.add_node("Identity", [value], Attributes(), [value.type], output_names=[name])
        return node.outputs[0]

    # ---- nodes ------------------------------------------------------------
    def _import_node(self, proto: onnx.NodeProto, name: str, graph: Graph, scope, read_names) -> None:
        attrs = {a.name: _attribute_value(a, self.where) for a in proto.attribute}
        if proto.op_type == "Constant":
            scope[proto.output[0]] = graph.add_constant(proto.output[0], _constant_value(attrs, self.where))
            return
        inputs = [scope[n] if n else None for n in proto.input]
        version = defs.get_schema(proto.op_type, self.opset, "").since_version
        if expands_to_function(proto, self.opset):
            self._import_function(proto, name, graph, scope, read_names)
            return
        if version > CANONICAL_OPSET:
            for added in added_attributes(proto.op_type, self.opset) or ():
                attrs.pop(added, None)  # at its default (find_unsupported checked): the canonical form
        raw = RawNode(name, proto.op_type, attrs, inputs, list(proto.output), {"used_names": read_names, "training": self.training})
        try:
            raw = normalize(raw, version, _Context(self, graph))
        except (ImportProblem, KeyError, ValueError, TypeError, AttributeError) as exc:
            raise ModelImportError(f"{self.where}: cannot convert op version {version} to opset {CANONICAL_OPSET}: {exc}") from exc
        if raw.op_type == "If":
            values = self._import_if(raw, graph, scope)
        else:
            values = self.emit(graph, raw)
        for out_name, value in zip(raw.outputs, values):
            if out_name:
                scope[out_name] = value

    def _import_function(self, proto: onnx.NodeProto, name: str, graph: Graph, scope, read_names) -> None:
        """Import a node as the nodes of its ONNX function body (ir/onnx_functions.py)."""
        where = self.where
        types = [type_proto(scope[n].type) if n else onnx.TypeProto() for n in proto.input]
        try:
            body = function_body(proto, self.opset, types)
        except (ValueError, RuntimeError, onnx.defs.SchemaError) as exc:
            raise ModelImportError(f"{where}: cannot build its ONNX function body: {exc}") from exc
        unsupported = [(n.op_type, n.domain, 1, f"{name}/{n.name or n.op_type}", reason) for n in body.node
                       if (reason := _unsupported_reason(n, self.opset)) is not None]
        if unsupported:
            raise UnsupportedModelError(unsupported)
        try:
            nodes = expand(proto, body, self.opset, name)
        except ValueError as exc:
            raise ModelImportError(f"{where}: {exc}") from exc
        read = set(read_names) | {n for node in nodes for n in node.input}
        for node in nodes:
            self.where = f"{where}, function body node '{node.name}' ({node.op_type})"
            self._import_node(node, node.name, graph, scope, read)
        self.where = where

    def _import_if(self, raw: RawNode, graph: Graph, scope) -> list[Value | None]:
        if not {"then_branch", "else_branch"} <= set(raw.attrs) or len(raw.inputs) != 1:
            raise ModelImportError(f"{self.where}: If needs one condition input and then_branch and else_branch graphs")
        condition = raw.inputs[0]
        if condition is not None and condition.is_constant and condition.const.size == 1:
            branch = raw.attrs["then_branch" if bool(condition.const.reshape(-1)[0]) else "else_branch"]
            where = self.where
            inner = ChainMap({}, scope)
            self._add_initializers(branch, graph, inner)
            self._import_body(branch, graph, inner)
            self.where = where
            return [inner.get(vi.name) if out else None for out, vi in zip(raw.outputs, branch.output)]
        branches: dict[str, Graph] = {}
        failures: dict[str, ModelImportError] = {}
        for key in ("then_branch", "else_branch"):
            try:
                branches[key] = self._import_subgraph(raw.attrs[key], f"{raw.name}_{key}", graph, scope)
            except ModelImportError as exc:
                failures[key] = exc
        if len(failures) == 2:
            raise failures["then_branch"]
        for key, exc in failures.items():
            # Specialising to the bound input shapes made this branch invalid: taking it
            # would fail in onnxruntime too, so it becomes an explicit run-time failure.
            other = branches["else_branch" if key == "then_branch" else "then_branch"]
            branches[key] = _unreachable_branch(f"{raw.name}_{key}", graph, other, f"If '{raw.name}' took its {key}, which cannot run with the bound input shapes: {exc}")
        raw.attrs.update(branches)
        return self.emit(graph, raw)

    def _import_subgraph(self, proto: onnx.GraphProto, name: str, parent: Graph, scope) -> Graph:
        where = self.where
        sub = Graph(name, parent=parent)
        inner = ChainMap({}, scope)
        self._add_initializers(proto, sub, inner)
        try:
            self._import_body(proto, sub, inner)
        except ModelImportError:
            sub.release_uses()  # the partly imported branch is dropped
            raise
        self._bind_outputs(proto, sub, inner)
        _drop_unused_constants(sub)
        self.where = where
        return sub

    def emit(self, graph: Graph, raw: RawNode) -> list[Value | None]:
        """Add a canonical node to `graph` (or fold it to constants); return its output values."""
        schema = get_schema(raw.op_type)
        if schema is None:
            raise ModelImportError(f"{self.where}: op {raw.op_type} is not supported")
        try:
            attrs = schema.make_attributes(raw.attrs, self.where)
        except (ValueError, TypeError) as exc:
            raise ModelImportError(str(exc) if str(exc).startswith(self.where) else f"{self.where}: {exc}") from exc
        if raw.op_type == "Concat" and any(v is not None and v.type.numel for v in raw.inputs):
            # Empty parts add nothing; kernels need not handle them.
            raw.inputs = [v for v in raw.inputs if v is not None and v.type.numel]
        types = [v.type if v is not None else None for v in raw.inputs]
        data = [v.const if v is not None else None for v in raw.inputs]
        try:
            out_types = schema.infer(attrs, types, data, len(raw.outputs))
        except InferenceFailure as exc:
            raise ModelImportError(
                f"{self.where}: cannot infer a static output type ({exc}); inputs are "
                + ", ".join(str(t) if t is not None else "-" for t in types) + _run_time_shape_operands(raw)
            ) from exc
        out_types = [t if name else None for t, name in zip(out_types, raw.outputs)]
        self._check_sizes(out_types)
        folded = self._fold(schema, attrs, raw, out_types)
        if folded is not None:
            return [graph.add_constant(name, array) if name else None for name, array in zip(raw.outputs, folded)]
        node = graph.add_node(raw.op_type, raw.inputs, attrs, out_types, name=raw.name, output_names=raw.outputs)
        return list(node.outputs)

    def _check_sizes(self, out_types: Sequence[TensorType | None]) -> None:
        """Raise ModelImportError when an output could never be allocated (a Tile or ConstantOfShape gone wild)."""
        limit = physical_memory()
        for index, t in enumerate(out_types):
            if t is not None and t.nbytes > limit:
                raise ModelImportError(f"{self.where}: output {index} would be {t} ({_size(t.nbytes)}), more than this "
                                       f"machine's memory ({_size(limit)}); check the shapes or repeats it is given")

    def _fold(self, schema, attrs, raw: RawNode, out_types) -> list[np.ndarray | None] | None:
        """Output arrays when the node can be computed now, else None.

        That is when its inputs are constants, or empty (an empty tensor holds no data, so a
        reduction or MatMul over an empty axis has a result known from the shapes alone),
        and when every output is empty.
        """
        if raw.op_type == "Shape":
            shape = np.asarray(raw.inputs[0].type.shape, np.int64)
            return [shape[slice(attrs.get("start", 0), attrs.get("end"))]]
        if raw.op_type == "Size":
            return [np.asarray(raw.inputs[0].type.numel, np.int64)]
        has_graph = any(isinstance(v, Graph) for v in attrs.values())
        if not has_graph and all(t is None or t.numel == 0 for t in out_types):
            return [np.empty(t.shape, numpy_dtype(t.dtype)) if t is not None else None for t in out_types]
        over_empty = any(v is not None and not v.is_constant and v.type.numel == 0 for v in raw.inputs)
        inputs_known = all(v is None or v.is_constant or v.type.numel == 0 for v in raw.inputs)
        numel = sum(t.numel for t in out_types if t is not None)
        if not (inputs_known and schema.traits.deterministic and not has_graph):
            return None
        if any(v is not None and id(v) in self.kept for v in raw.inputs):
            return None  # a training import keeps the path from each initializer for its gradient
        if not over_empty and numel > FOLD_LIMIT:
            return None
        if over_empty and numel > EMPTY_FOLD_LIMIT:
            raise ModelImportError(f"{self.where}: computes {numel} elements over an empty input at compile time, "
                                   f"more than {EMPTY_FOLD_LIMIT}; give the input a non-empty shape")
        inputs = [None if v is None else v.const if v.is_constant else np.empty(v.type.shape, numpy_dtype(v.type.dtype))
                  for v in raw.inputs]
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # numpy's "mean of empty slice" and the like
                arrays = evaluate(schema, attrs, inputs, len(raw.outputs))
        except Exception as exc:  # the reference evaluator lacks a few cases; the node then runs at run time
            if over_empty:
                detail = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                raise ModelImportError(f"{self.where}: undefined over an empty input "
                                       f"({', '.join(str(v.type) for v in raw.inputs if v is not None)}): {detail}") from exc
            return None
        if over_empty and raw.op_type == "ReduceMean":
            arrays = [np.zeros_like(a) for a in arrays]  # onnxruntime's mean of nothing is 0 (the reference says NaN)
        result = []
        for array, out_type in zip(arrays, out_types):
            if out_type is None:
                result.append(None)
                continue
            if tuple(array.shape) != out_type.shape:
                raise ModelImportError(f"{self.where}: folded value has shape {list(array.shape)}, inference said {out_type}")
            result.append(array.astype(numpy_dtype(out_type.dtype), copy=False))
        return result


def physical_memory() -> int:
    """Bytes of memory this machine has: no tensor larger can ever be allocated."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 48


def _size(nbytes: int) -> str:
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def _unreachable_branch(name: str, parent: Graph, model: Graph, message: str) -> Graph:
    """A branch with the output types of `model` that fails with `message` if it ever runs."""
    branch = Graph(name, parent=parent)
    types = [v.type for v in model.outputs]
    schema = get_schema("Unreachable", TESSEL_DOMAIN)
    attrs = schema.make_attributes({"message": message, "output_types": [t.spec() for t in types]}, name)
    node = branch.add_node("Unreachable", [], attrs, types, name=f"{name}_unreachable", domain=TESSEL_DOMAIN)
    branch.outputs = list(node.outputs)
    return branch


def _drop_unused_constants(graph: Graph) -> None:
    for value in list(graph.constants):
        if not value.uses and not value.is_graph_output:
            graph.remove_constant(value)


def _sorted_nodes(proto: onnx.GraphProto, scope) -> list[tuple[int, onnx.NodeProto]]:
    """The graph's nodes in dependency order (stable), checking every read name is defined."""
    producer: dict[str, int] = {}
    for index, node in enumerate(proto.node):
        for name in node.output:
            if name:
                producer[name] = index
    defined = set(scope) | {t.name for t in proto.initializer} | {vi.name for vi in proto.input}
    needs: list[set[int]] = []
    for index, node in enumerate(proto.node):
        deps = set()
        node_name = node.name or f"{node.op_type}_{index}"
        for name in list(node.input) + sorted(_free_names(node)):
            if not name:
                continue
            if name in producer:
                deps.add(producer[name])
            elif name not in defined:
                raise ModelImportError(f"node '{node_name}' ({node.op_type}) reads '{name}', which no node, input or initializer defines")
        needs.append(deps)
    readers: dict[int, list[int]] = {}
    for index, deps in enumerate(needs):
        for dep in deps:
            readers.setdefault(dep, []).append(index)
    pending = [len(d) for d in needs]
    ready = [i for i, n in enumerate(pending) if n == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        index = heapq.heappop(ready)
        order.append(index)
        for reader in readers.get(index, []):
            pending[reader] -= 1
            if pending[reader] == 0:
                heapq.heappush(ready, reader)
    if len(order) != len(proto.node):
        stuck = [proto.node[i].name or f"{proto.node[i].op_type}_{i}" for i, n in enumerate(pending) if n > 0]
        raise ModelImportError(f"graph '{proto.name or 'main'}' has a cycle through nodes {', '.join(map(repr, stuck[:6]))}")
    return [(i, proto.node[i]) for i in order]


def _free_names(node: onnx.NodeProto) -> set[str]:
    """Names a node's subgraphs read from enclosing scopes."""
    free: set[str] = set()
    for sub in onnx_subgraphs(node):
        local = {t.name for t in sub.initializer} | {vi.name for vi in sub.input}
        for inner in sub.node:
            local.update(inner.output)
        for inner in sub.node:
            free.update(n for n in inner.input if n and n not in local)
            free.update(n for n in _free_names(inner) if n not in local)
        free.update(vi.name for vi in sub.output if vi.name not in local)
    return free


def declared_shape(tensor: onnx.TypeProto.Tensor) -> list[int | str | None]:
    """An ONNX tensor type's dimensions: a size, a symbol (dim_param), or None where unknown.

    A negative dim_value is unknown too: Paddle2ONNX and others write -1 for a dynamic axis.
    """
    return [(d.dim_value if d.dim_value >= 0 else None) if d.HasField("dim_value") else (d.dim_param or None)
            for d in tensor.shape.dim]


def _fits(declared: int | str | None, size: int) -> bool:
    """Whether an axis declared `declared` takes `size`: a symbol, an unknown and a 0 ("unknown" to some
    exporters) take any size."""
    return not isinstance(declared, int) or declared in (0, size)


def _tensor_input(vi: onnx.ValueInfoProto) -> tuple[str, onnx.TypeProto.Tensor]:
    """A graph input's Tessel element type and ONNX tensor type; ModelImportError when it is not a tensor Tessel takes."""
    if not vi.type.HasField("tensor_type"):
        raise ModelImportError(f"input '{vi.name}' is not a tensor (sequence, map or optional inputs are not supported)")
    tensor = vi.type.tensor_type
    try:
        return dtype_from_onnx(tensor.elem_type), tensor
    except KeyError:
        raise ModelImportError(f"input '{vi.name}' has element type {onnx_type_name(tensor.elem_type)}, "
                               "which Tessel does not support") from None


def _input_type(vi: onnx.ValueInfoProto, bound: Sequence[int] | None) -> TensorType:
    name = vi.name
    dtype, tensor = _tensor_input(vi)
    declared = declared_shape(tensor)
    has_shape = tensor.HasField("shape")
    if bound is not None:
        bound = _check_bound_shape(name, bound)
        if has_shape and len(bound) != len(declared):
            raise ShapeBindingError(f"input '{name}' has rank {len(declared)} in the model, but the given shape {_dims(bound)} has rank {len(bound)}")
        for axis, (want, have) in enumerate(zip(declared, bound)):
            if not _fits(want, have):
                raise ShapeBindingError(f"input '{name}' axis {axis} is {want} in the model, but the given shape {_dims(bound)} says {have}")
        return TensorType(dtype, tuple(bound))
    if not has_shape:
        raise ShapeBindingError(f"input '{name}' has no shape in the model; give one with --input-shape {name}=DxDx...")
    for axis, dim in enumerate(declared):
        if not isinstance(dim, int):
            hint = "x".join(str(d) if isinstance(d, int) else "N" for d in declared)
            label = f"symbolic ('{dim}')" if dim else "unknown"
            raise ShapeBindingError(
                f"input '{name}' axis {axis} is {label}; give its size: --input-shape {name}={hint} with each N a size"
            )
    return TensorType(dtype, tuple(declared))


def _input_value(vi: onnx.ValueInfoProto, value: Any, bound: Sequence[int] | None) -> np.ndarray:
    """The value given for a graph input, as a constant of the input's element type and declared shape.

    A single number given for an input of rank one or more fills its shape of ones (TopK's k is [1]).
    """
    name = vi.name
    dtype, tensor = _tensor_input(vi)
    target = np.dtype(numpy_dtype(dtype))
    array = np.asarray(value)
    if array.dtype.kind not in "biuf" and array.dtype != target:
        raise ShapeBindingError(f"input value for '{name}' must be numbers, got {array.dtype} {value!r}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # NaN or infinity cast to an integer: refused below
        converted = array.astype(target)
    if target.kind in "biu" and not np.array_equal(converted, array):
        raise ShapeBindingError(f"input value for '{name}' ({_brief(array)}) does not fit the input's element type {dtype}")
    declared = declared_shape(tensor)
    if tensor.HasField("shape") and converted.ndim != len(declared) and converted.size == 1:
        converted = converted.reshape((1,) * len(declared))
    shape_ok = not tensor.HasField("shape") or (
        converted.ndim == len(declared) and all(_fits(d, n) for d, n in zip(declared, converted.shape)))
    if not shape_ok:
        want = _dims(tuple(d if isinstance(d, int) else "N" for d in declared))
        raise ShapeBindingError(f"input value for '{name}' has shape {_dims(converted.shape)}; the model declares {want}")
    if bound is not None and _check_bound_shape(name, bound) != converted.shape:
        raise ShapeBindingError(f"input '{name}': the given shape {_dims(tuple(bound))} differs from its given value's "
                                f"shape {_dims(converted.shape)}; give one of the two")
    return converted


def _brief(array: np.ndarray) -> str:
    text = np.array2string(array.reshape(-1)[:8], separator=",")
    return text if array.size <= 8 else text[:-1] + ",...]"


def _run_time_shape_operands(raw: RawNode) -> str:
    """A hint naming the graph inputs among a node's shape operands, whose values are known only at run time."""
    positions = shape_operand_positions(raw.op_type, CANONICAL_OPSET)
    names = [raw.inputs[k].name for k in positions
             if k < len(raw.inputs) and raw.inputs[k] is not None and raw.inputs[k].is_graph_input]
    if not names:
        return ""
    flags = " ".join(f"--input-value {n}=..." for n in names)
    return (f"; {', '.join(map(repr, names))} decide{'s' if len(names) == 1 else ''} its output shape but "
            f"{'is a graph input' if len(names) == 1 else 'are graph inputs'}: give the value when compiling ({flags}, "
            "or input_values=)")


def _default_input_type(vi: onnx.ValueInfoProto, default: np.ndarray, bound: Sequence[int] | None) -> TensorType:
    """The type of a graph input whose initializer is its default: the default's, which the declared type must admit."""
    value_type = TensorType.of(default)
    tensor = vi.type.tensor_type
    declared = [d if isinstance(d, int) else None for d in declared_shape(tensor)]
    admits = (vi.type.HasField("tensor_type") and tensor.elem_type == dtype_to_onnx(value_type.dtype)
              and (not tensor.HasField("shape") or (len(declared) == value_type.rank
                                                    and all(d in (None, v) for d, v in zip(declared, value_type.shape)))))
    if not admits:
        raise ModelImportError(f"input '{vi.name}': its initializer (its default value) is {value_type}, which the "
                               "declared input type does not admit; make the two agree")
    if bound is not None and _check_bound_shape(vi.name, bound) != value_type.shape:
        raise ShapeBindingError(f"input '{vi.name}' has a default (its initializer) of shape {_dims(value_type.shape)}; "
                                f"the given shape {_dims(tuple(bound))} differs")
    return value_type


def _check_bound_shape(name: str, shape: Sequence[int]) -> tuple[int, ...]:
    try:
        dims = tuple(int(d) for d in shape)
    except (TypeError, ValueError):
        raise ShapeBindingError(f"input shape for '{name}' must be a sequence of integers, got {shape!r}") from None
    if any(d < 0 for d in dims):
        raise ShapeBindingError(f"input shape for '{name}' has a negative dimension: {_dims(dims)}")
    return dims


def _dims(shape: Sequence[int]) -> str:
    return "x".join(str(d) for d in shape) or "(scalar)"


def _tensor_array(tensor: onnx.TensorProto, where: str) -> np.ndarray:
    try:
        dtype_from_onnx(tensor.data_type)
    except KeyError:
        raise ModelImportError(f"{where}: element type {onnx_type_name(tensor.data_type)} is not supported") from None
    if external_data_helper.uses_external_data(tensor):
        raise ModelImportError(f"{where}: tensor data lives in an external file that was not loaded; import from the model's path")
    try:
        return numpy_helper.to_array(tensor)
    except (ValueError, TypeError) as exc:
        raise ModelImportError(f"{where}: tensor data does not match its shape or type ({exc})") from exc


def _attribute_value(attr: onnx.AttributeProto, where: str) -> Any:
    if attr.ref_attr_name:
        raise ModelImportError(f"{where}: attribute '{attr.name}' refers to a function attribute; functions are not supported")
    if attr.type == onnx.AttributeProto.TENSOR:
        return _tensor_array(attr.t, f"{where}, attribute '{attr.name}'")
    if attr.type == onnx.AttributeProto.GRAPH:
        return attr.g
    if attr.type in (onnx.AttributeProto.GRAPHS, onnx.AttributeProto.TENSORS, onnx.AttributeProto.SPARSE_TENSOR,
                     onnx.AttributeProto.SPARSE_TENSORS, onnx.AttributeProto.TYPE_PROTO, onnx.AttributeProto.TYPE_PROTOS):
        raise ModelImportError(f"{where}: attribute '{attr.name}' has a kind Tessel does not support")
    value = helper.get_attribute_value(attr)
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, list) and value and isinstance(value[0], bytes):
        return [v.decode("utf-8", "replace") for v in value]
    return value


def _constant_value(attrs: dict[str, Any], where: str) -> np.ndarray:
    if len(attrs) != 1:
        raise ModelImportError(f"{where}: a Constant needs exactly one value attribute, has {sorted(attrs) or 'none'}")
    (name, value), = attrs.items()
    converters = {
        "value": lambda v: v,
        "value_float": lambda v: np.asarray(v, np.float32),
        "value_floats": lambda v: np.asarray(v, np.float32),
        "value_int": lambda v: np.asarray(v, np.int64),
        "value_ints": lambda v: np.asarray(v, np.int64),
    }
    if name not in converters or (name == "value" and not isinstance(value, np.ndarray)):
        raise ModelImportError(f"{where}: Constant attribute '{name}' is not supported (strings and sparse tensors are not)")
    return converters[name](value)
