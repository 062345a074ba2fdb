"""Op schemas: which ops Tessel accepts, their typed attributes and type inference.

Schemas for the default ONNX domain are built from ONNX's own operator
definitions at Tessel's canonical opset (`CANONICAL_OPSET`): the importer
rewrites older op versions into that form, so every IR node of the default
domain follows one definition. Shape and dtype inference delegates to ONNX's
reference inference (`onnx.shape_inference.infer_node_outputs`), fed with the
data of small constant inputs so shape-carrying inputs (Reshape, Expand, Pad,
Slice, ...) give static shapes; Tessel insists every output shape be static.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

import numpy as np
import onnx
from onnx import defs, helper
from onnx.shape_inference import InferenceError, infer_node_outputs

from .attributes import AttrSpec, Attributes, coerce
from .errors import InferenceFailure
from .grad_ops import GRAD_OPS
from .onnx_proto import ATTR_KIND, attribute_proto, tensor_proto, type_proto
from .op_traits import OpTraits, op_traits
from .optimizer_ops import OPTIMIZER_OPS
from .types import TensorType, dtype_from_onnx, onnx_type_name

if TYPE_CHECKING:
    from .graph import Graph

CANONICAL_OPSET = 21
# Inputs at most this large are handed to ONNX inference as data (shape tensors, axes, pads).
INFERENCE_DATA_LIMIT = 1 << 16

# Ops of the default domain Tessel does not take, with the reason shown to users.
_EXCLUDED = {
    "Loop": "loops over subgraphs are not supported",
    "Scan": "loops over subgraphs are not supported",
    **{op: "quantized ops are not supported" for op in (
        "ConvInteger", "MatMulInteger", "DynamicQuantizeLinear", "QuantizeLinear", "DequantizeLinear",
        "QLinearConv", "QLinearMatMul")},
    **{op: "random ops are not supported" for op in (
        "Bernoulli", "Multinomial", "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike")},
    **{op: "no kernel for this op yet" for op in (
        "DFT", "STFT", "DeformConv", "Det", "MaxUnpool", "RoiAlign", "MaxRoiPool", "TfIdfVectorizer", "Col2Im")},
    **{op: "optional values are not supported" for op in ("Optional", "OptionalGetElement", "OptionalHasElement")},
}
TESSEL_DOMAIN = "tessel"
# The op type of a Tessel-domain node that runs several ops as one kernel (passes/fuse.py makes them).
FUSED = "Fused"


@dataclass(frozen=True)
class OpSchema:
    """What an op takes and gives: arity, typed attributes, its type inference and its traits."""

    op_type: str
    domain: str
    since_version: int
    min_inputs: int
    max_inputs: int
    min_outputs: int
    max_outputs: int
    attributes: Mapping[str, AttrSpec]
    onnx_schema: defs.OpSchema | None = field(default=None, repr=False, compare=False)
    custom_infer: Callable[..., list[TensorType | None]] | None = field(default=None, repr=False, compare=False)

    @property
    def traits(self) -> OpTraits:
        """What kind of op this is: kernel, view, pattern, per-sample, side effects (ir/op_traits.py)."""
        return op_traits(self.op_type)

    def make_attributes(self, raw: Mapping[str, object], where: str) -> Attributes:
        """Validate raw attribute values against the schema and fill in defaults."""
        values = {}
        for name, value in raw.items():
            spec = self.attributes.get(name)
            if spec is None:
                raise ValueError(f"{where}: {self.op_type} has no attribute '{name}'")
            values[name] = coerce(spec, value)
        for spec in self.attributes.values():
            if spec.name not in values:
                if spec.required:
                    raise ValueError(f"{where}: {self.op_type} requires attribute '{spec.name}'")
                if spec.default is not None:
                    values[spec.name] = spec.default
        return Attributes(values)

    def infer(
        self,
        attrs: Attributes,
        input_types: Sequence[TensorType | None],
        input_data: Sequence[np.ndarray | None],
        num_outputs: int,
    ) -> list[TensorType | None]:
        """Static output types for these inputs; raise InferenceFailure when one is not static."""
        if not self.min_inputs <= len(input_types) <= self.max_inputs:
            raise InferenceFailure(
                f"{self.op_type} takes {self.min_inputs}..{self.max_inputs} inputs, got {len(input_types)}"
            )
        if self.custom_infer is not None:
            return self.custom_infer(attrs, input_types, input_data, num_outputs)
        return _onnx_infer(self, attrs, input_types, input_data, num_outputs)


def _onnx_infer(schema, attrs, input_types, input_data, num_outputs):
    in_names = [f"i{k}" if t is not None else "" for k, t in enumerate(input_types)]
    out_names = [f"o{k}" for k in range(num_outputs)]
    node = helper.make_node(schema.op_type, in_names, out_names, domain=schema.domain)
    node.attribute.extend(
        attribute_proto(name, schema.attributes[name].kind, value) for name, value in attrs.items()
    )
    types = {name: type_proto(t) for name, t in zip(in_names, input_types) if t is not None}
    data = {
        name: tensor_proto(name, array)
        for name, array in zip(in_names, input_data)
        if array is not None and array.size <= INFERENCE_DATA_LIMIT
    }
    opsets = [helper.make_opsetid("", CANONICAL_OPSET)]
    try:
        inferred = infer_node_outputs(schema.onnx_schema, node, types, data, opset_imports=opsets)
    except (InferenceError, RuntimeError, ValueError, onnx.checker.ValidationError) as exc:
        raise InferenceFailure(str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__) from exc
    result: list[TensorType | None] = []
    for name in out_names:
        proto = inferred.get(name)
        if proto is None or not proto.HasField("tensor_type"):
            raise InferenceFailure(f"output {out_names.index(name)} has no inferable tensor type")
        tensor = proto.tensor_type
        try:
            dtype = dtype_from_onnx(tensor.elem_type)
        except KeyError:
            raise InferenceFailure(f"output element type {onnx_type_name(tensor.elem_type)} is not supported") from None
        if not tensor.HasField("shape") or any(not d.HasField("dim_value") for d in tensor.shape.dim):
            raise InferenceFailure(f"output {out_names.index(name)} has no static shape (it depends on data known only at run time)")
        dims = tuple(d.dim_value for d in tensor.shape.dim)
        if any(d < 0 for d in dims):
            raise InferenceFailure(f"output {out_names.index(name)} would have negative dimensions {list(dims)}")
        result.append(TensorType(dtype, dims))
    if schema.op_type == "Reshape" and input_types[0] is not None and result[0].numel != input_types[0].numel:
        # ONNX's inference does not check this; a model exported at one batch size and run at
        # another fails here, at the node that hard-codes the batch.
        raise InferenceFailure(f"Reshape of {input_types[0].numel} elements {list(input_types[0].shape)} into "
                               f"{list(result[0].shape)} ({result[0].numel} elements)")
    return result


def _infer_if(attrs, input_types, input_data, num_outputs):
    then_branch: Graph = attrs["then_branch"]
    else_branch: Graph = attrs["else_branch"]
    if input_types[0].numel != 1:
        raise InferenceFailure(f"If condition must hold one element, has shape {list(input_types[0].shape)}")
    for branch in (then_branch, else_branch):
        if len(branch.outputs) != num_outputs:
            raise InferenceFailure(f"If branch '{branch.name}' returns {len(branch.outputs)} values, node has {num_outputs} outputs")
    result = []
    for k, (a, b) in enumerate(zip(then_branch.outputs, else_branch.outputs)):
        if a.type != b.type:
            raise InferenceFailure(
                f"If output {k} is {a.type} in then_branch but {b.type} in else_branch; "
                "a runtime If needs both branches to give the same static type"
            )
        result.append(a.type)
    return result


def _infer_unreachable(attrs, input_types, input_data, num_outputs):
    types = [TensorType.parse(text) for text in attrs["output_types"]]
    if len(types) != num_outputs:
        raise InferenceFailure(f"Unreachable declares {len(types)} output types for {num_outputs} outputs")
    return types


def _infer_fused(attrs, input_types, input_data, num_outputs):
    body: Graph = attrs["body"]
    if len(body.inputs) != len(input_types):
        raise InferenceFailure(f"Fused body '{body.name}' takes {len(body.inputs)} inputs, node has {len(input_types)}")
    for k, (param, given) in enumerate(zip(body.inputs, input_types)):
        if given != param.type:
            raise InferenceFailure(f"Fused input {k} is {given}, but body '{body.name}' expects {param.type}")
    if len(body.outputs) != num_outputs:
        raise InferenceFailure(f"Fused body '{body.name}' returns {len(body.outputs)} values, node has {num_outputs} outputs")
    return [v.type for v in body.outputs]


def _infer_send(attrs, input_types, input_data, num_outputs):
    if num_outputs:
        raise InferenceFailure("Send has no outputs")
    return []


def _infer_recv(attrs, input_types, input_data, num_outputs):
    if num_outputs != 1:
        raise InferenceFailure("Recv has exactly one output")
    return [TensorType.parse(attrs["type"])]


def _infer_all_reduce(attrs, input_types, input_data, num_outputs):
    if attrs["reduction"] not in ("sum", "mean", "max", "min"):
        raise InferenceFailure(f"AllReduce reduction '{attrs['reduction']}' is not sum, mean, max or min")
    return [input_types[0]]


def _ceil_pool_infer(op_type: str):
    """ONNX's inference for a pool, less the ceil-mode last window that would start in the end padding (ONNX's
    reference and onnxruntime drop it; onnx's shape inference keeps it)."""
    def infer(attrs, input_types, input_data, num_outputs):
        types = _onnx_infer(_default_domain_schemas()[op_type], attrs, input_types, input_data, num_outputs)
        if not attrs.get("ceil_mode") or attrs.get("auto_pad", "NOTSET") != "NOTSET":
            return types
        dims = input_types[0].shape[2:]
        spatial = len(dims)
        strides = list(attrs.get("strides") or [1] * spatial)
        pads = list(attrs.get("pads") or [0] * (2 * spatial))
        shape = list(types[0].shape)
        for axis, (size, stride, before) in enumerate(zip(dims, strides, pads)):
            if shape[2 + axis] > 1 and (shape[2 + axis] - 1) * stride >= size + before:
                shape[2 + axis] -= 1
        return [None if t is None else TensorType(t.dtype, tuple(shape)) for t in types]

    return infer


def _channel_checked_infer(op_type: str):
    """ONNX's inference for a Conv or ConvTranspose, after checking what it leaves unchecked: the weight's channels
    against the input's and the group, and the bias's length (onnxruntime rejects such a model; unchecked, Tessel
    would compile kernels that read past the weight)."""
    def infer(attrs, input_types, input_data, num_outputs):
        x, weight = input_types[0], input_types[1]
        bias = input_types[2] if len(input_types) > 2 else None
        if x is not None and weight is not None and len(x.shape) >= 3 and len(weight.shape) == len(x.shape):
            group = int(attrs.get("group", 1))
            if op_type == "Conv":
                in_channels, out_channels = weight.shape[1] * group, weight.shape[0]
                if out_channels % group:
                    raise InferenceFailure(f"weight {list(weight.shape)} has {out_channels} output channels, "
                                           f"not a multiple of group {group}")
            else:
                in_channels, out_channels = weight.shape[0], weight.shape[1] * group
                if in_channels % group:
                    raise InferenceFailure(f"weight {list(weight.shape)} has {in_channels} input channels, "
                                           f"not a multiple of group {group}")
            if x.shape[1] != in_channels:
                raise InferenceFailure(f"input {list(x.shape)} has {x.shape[1]} channels; weight {list(weight.shape)} "
                                       f"with group {group} takes {in_channels}")
            if bias is not None and tuple(bias.shape) != (out_channels,):
                raise InferenceFailure(f"bias {list(bias.shape)} is not one value per output channel "
                                       f"({out_channels})")
        return _onnx_infer(_default_domain_schemas()[op_type], attrs, input_types, input_data, num_outputs)

    return infer


_CUSTOM_INFER = {"If": _infer_if,
                 "MaxPool": _ceil_pool_infer("MaxPool"), "AveragePool": _ceil_pool_infer("AveragePool"),
                 "Conv": _channel_checked_infer("Conv"), "ConvTranspose": _channel_checked_infer("ConvTranspose")}

def _forward_schema(op_type: str) -> "OpSchema":
    """The default-domain schema a gradient op's inference checks its dy against (ir/grad_ops.py)."""
    return get_schema(op_type)


# Tessel's own ops. Unreachable stands for an If branch that cannot run with the
# bound input shapes: it has the other branch's output types and fails if run.
_TESSEL_SCHEMAS = {
    "Unreachable": OpSchema(
        "Unreachable", TESSEL_DOMAIN, 1, 0, 0, 1, 2**31 - 1,
        {"message": AttrSpec("message", "string", True), "output_types": AttrSpec("output_types", "strings", True)},
        None, _infer_unreachable,
    ),
    # Send and Recv move one tensor between devices (passes/partition.py): Send runs on `device`
    # and sends to `peer`; Recv runs on `device` and receives from `peer`; `tag` pairs them,
    # `tensor` names the value sent.
    "Send": OpSchema(
        "Send", TESSEL_DOMAIN, 1, 1, 1, 0, 0,
        {"device": AttrSpec("device", "int", True), "peer": AttrSpec("peer", "int", True),
         "tag": AttrSpec("tag", "int", True)}, None, _infer_send,
    ),
    "Recv": OpSchema(
        "Recv", TESSEL_DOMAIN, 1, 0, 0, 1, 1,
        {"device": AttrSpec("device", "int", True), "peer": AttrSpec("peer", "int", True),
         "tag": AttrSpec("tag", "int", True), "tensor": AttrSpec("tensor", "string", True),
         "type": AttrSpec("type", "string", True)}, None, _infer_recv,
    ),
    # AllReduce: the element-wise `reduction` of its input over every data-parallel worker (a training step's
    # gradients and loss, compiler/dp_training.py); runs as the runtime's AllReduce instruction. A gradients'
    # mean may be `compression`-encoded (passes/data_parallel.GradientCompression).
    "AllReduce": OpSchema(
        "AllReduce", TESSEL_DOMAIN, 1, 1, 1, 1, 1,
        {"reduction": AttrSpec("reduction", "string", True), "compression": AttrSpec("compression", "string", False),
         "topk_ratio": AttrSpec("topk_ratio", "float", False), "part_sizes": AttrSpec("part_sizes", "ints", False),
         "part_rows": AttrSpec("part_rows", "ints", False)}, None,
        _infer_all_reduce,
    ),
    # Fused is one kernel made of several ops (passes/fuse.py): `body` reads only its own inputs.
    FUSED: OpSchema(
        FUSED, TESSEL_DOMAIN, 1, 0, 2**31 - 1, 1, 2**31 - 1,
        {"body": AttrSpec("body", "graph", True)}, None, _infer_fused,
    ),
    # The gradient ops of reverse-mode autodiff (ir/grad_ops.py).
    **{op: OpSchema(op, TESSEL_DOMAIN, 1, arity, arity, outputs, outputs, attrs, None,
                    functools.partial(infer, _forward_schema))
       for op, (arity, outputs, attrs, infer) in GRAD_OPS.items()},
    # One parameter's optimizer update as one op (ir/optimizer_ops.py).
    **{op: OpSchema(op, TESSEL_DOMAIN, 1, min_in, max_in, min_out, max_out, attrs, None, infer)
       for op, (min_in, max_in, min_out, max_out, attrs, infer) in OPTIMIZER_OPS.items()},
}


def _attr_spec(attr: defs.OpSchema.Attribute) -> AttrSpec | None:
    kind = ATTR_KIND.get(int(attr.type))
    if kind is None:
        return None
    default = None
    if attr.default_value is not None and attr.default_value.type != 0:
        raw = helper.get_attribute_value(attr.default_value)
        if kind in ("int", "float", "string", "ints", "floats", "strings"):
            default = coerce(AttrSpec(attr.name, kind), raw)
    return AttrSpec(attr.name, kind, bool(attr.required), default)


def _is_tensor_op(schema: defs.OpSchema) -> bool:
    params = list(schema.inputs) + list(schema.outputs)
    constraints = {c.type_param_str: c.allowed_type_strs for c in schema.type_constraints}
    for param in params:
        allowed = constraints.get(param.type_str, [param.type_str])
        if not any(t.startswith("tensor(") for t in allowed):
            return False
    return True


def _arity(params, variadic_max: int = 2**31 - 1) -> tuple[int, int]:
    low = high = 0
    for p in params:
        option = p.option
        if option == defs.OpSchema.FormalParameterOption.Single:
            low += 1
            high += 1
        elif option == defs.OpSchema.FormalParameterOption.Optional:
            high += 1
        else:
            low += p.min_arity if hasattr(p, "min_arity") else 1
            high = variadic_max
    return low, high


@functools.lru_cache(maxsize=None)
def _default_domain_schemas() -> dict[str, OpSchema]:
    result = {}
    for op_type in {s.name for s in defs.get_all_schemas() if s.domain == ""}:
        try:
            onnx_schema = defs.get_schema(op_type, CANONICAL_OPSET, "")
        except defs.SchemaError:
            continue
        if onnx_schema.deprecated or op_type in _EXCLUDED or not _is_tensor_op(onnx_schema):
            continue
        specs = {name: spec for name, a in onnx_schema.attributes.items() if (spec := _attr_spec(a)) is not None}
        min_in, max_in = _arity(onnx_schema.inputs)
        min_out, max_out = _arity(onnx_schema.outputs)
        result[op_type] = OpSchema(
            op_type, "", onnx_schema.since_version, min_in, max_in, min_out, max_out, specs,
            onnx_schema, _CUSTOM_INFER.get(op_type),
        )
    return result


def get_schema(op_type: str, domain: str = "") -> OpSchema | None:
    """The schema of an op Tessel supports, or None."""
    if domain in ("", "ai.onnx"):
        return _default_domain_schemas().get(op_type)
    if domain == TESSEL_DOMAIN:
        return _TESSEL_SCHEMAS.get(op_type)
    return None


def unsupported_reason(op_type: str, domain: str) -> str:
    """Why an op is not supported, in a few words."""
    if domain not in ("", "ai.onnx"):
        return f"only the default ONNX domain is supported, not '{domain}'"
    return _EXCLUDED.get(op_type, f"not an op on tensors in ONNX opset {CANONICAL_OPSET}")


def _signature(schema: defs.OpSchema) -> tuple:
    params = lambda ps: tuple((p.name, p.option) for p in ps)  # noqa: E731
    attrs = tuple(sorted((name, int(a.type), bool(a.required)) for name, a in schema.attributes.items()))
    return params(schema.inputs), params(schema.outputs), attrs


def added_attributes(op_type: str, opset: int) -> dict[str, onnx.AttributeProto] | None:
    """The attributes the op's version at `opset` added to its canonical version, with their defaults, when that is
    all it changed (same inputs and outputs, same meaning); None when it changed more.

    Such a version imports as the canonical one where its node leaves the new attributes at their defaults
    (Cast-24's round_mode, SpaceToDepth-28's mode). A version that kept its form but gave a new meaning to
    some inputs is rewritten by ir/onnx_normalize.py (Mod-28's fmod=0 on floats).
    """
    canonical = get_schema(op_type)
    if canonical is None:
        return None
    newer = defs.get_schema(op_type, opset, "")
    new_inputs, new_outputs, new_attrs = _signature(newer)
    old_inputs, old_outputs, old_attrs = _signature(canonical.onnx_schema)
    added = set(new_attrs) - set(old_attrs)
    if (new_inputs, new_outputs) != (old_inputs, old_outputs) or not set(old_attrs) <= set(new_attrs):
        return None
    if any(required or not newer.attributes[name].default_value.type for name, _, required in added):
        return None
    return {name: newer.attributes[name].default_value for name, _, _ in added}
