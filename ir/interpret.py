"""Run a graph on numpy arrays, node by node, with ONNX's reference implementation of each op.

For checking, not speed: gradient rules are verified against finite differences with it. Fed float64
arrays it computes in float64 whatever the graph's types say: every float32 tensor (constants, op
results such as Cast or ConstantOfShape) is then held as float64, so differences of tiny steps stay exact.
"""
from __future__ import annotations

import math
import threading
from typing import Mapping, Sequence

import numpy as np

from onnx import helper
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import RuntimeContextError

from .attributes import Attributes
from .evaluate import evaluate
from .grad_ops import REFERENCE as GRAD_REFERENCE
from .graph import Graph, Node
from .onnx_proto import attribute_proto
from .optimizer_ops import REFERENCE as OPTIMIZER_REFERENCE
from .schema import CANONICAL_OPSET, FUSED, TESSEL_DOMAIN, OpSchema, get_schema

# The data-parallel replicas the interpreting thread stands for (`interpret_replicas`): its `group` and `rank`.
_replica = threading.local()


def _all_reduce(attrs: Attributes, inputs: list[np.ndarray]) -> list[np.ndarray]:
    """AllReduce over the replicas `interpret_replicas` runs together; a plain `interpret` is one worker, whose
    reduction is its input."""
    group = getattr(_replica, "group", None)
    return [inputs[0] if group is None else group.reduce(_replica.rank, attrs["reduction"], inputs[0])]


# Numpy references of the Tessel-domain ops, by op type.
REFERENCE = {**GRAD_REFERENCE, **OPTIMIZER_REFERENCE, "AllReduce": _all_reduce}


def interpret(graph: Graph, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The value of every graph output, by name, for the graph inputs in `feeds` (by name)."""
    missing = [v.name for v in graph.inputs if v.name not in feeds]
    if missing:
        raise ValueError(f"interpret: no feed for graph input(s) {', '.join(missing)}")
    wide = any(np.asarray(a).dtype == np.float64 for a in feeds.values())
    env: dict[int, np.ndarray] = {id(v): _held(np.asarray(feeds[v.name]), wide) for v in graph.inputs}
    _run(graph, env, wide)
    return {v.name: env[id(v)] for v in graph.outputs}


def interpret_replicas(graph: Graph, feeds: Sequence[Mapping[str, np.ndarray]],
                       timeout_s: float = 600.0) -> list[dict[str, np.ndarray]]:
    """`interpret` of a data-parallel replica's graph once per element of `feeds`, concurrently, each thread one
    replica: their AllReduce nodes meet (the replicas run the same graph, so the reductions come in the same
    order) and add up the replicas' inputs in rank order, as every worker of a real all-reduce gets the same sum."""
    group = _ReplicaGroup(len(feeds), timeout_s)
    results: list = [None] * len(feeds)

    def replica(rank: int) -> None:
        _replica.group, _replica.rank = group, rank
        try:
            results[rank] = interpret(graph, feeds[rank])
        except BaseException as exc:  # noqa: BLE001 - raised below; aborting the barrier stops the other replicas
            group.barrier.abort()
            results[rank] = exc

    threads = [threading.Thread(target=replica, args=(rank,), name=f"replica{rank}") for rank in range(len(feeds))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:  # the replica that failed first, not those its abort stopped
        raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
    return results


class _ReplicaGroup:
    """Where the replicas of `interpret_replicas` exchange their AllReduce inputs."""

    def __init__(self, count: int, timeout_s: float):
        self.count = count
        self.barrier = threading.Barrier(count, timeout=timeout_s)
        self.slots: list[np.ndarray | None] = [None] * count

    def reduce(self, rank: int, reduction: str, value: np.ndarray) -> np.ndarray:
        """The `reduction` (sum, mean, max, min) of every replica's `value`, once all have given theirs."""
        self.slots[rank] = value
        self.barrier.wait()
        parts = list(self.slots)
        self.barrier.wait()  # every replica has read the slots before any writes its next value
        if reduction in ("max", "min"):
            return (np.maximum if reduction == "max" else np.minimum).reduce(parts)
        total = sum(parts[1:], parts[0])
        return total / self.count if reduction == "mean" else total


def _held(array: np.ndarray, wide: bool) -> np.ndarray:
    """The array as the interpreter keeps it: float32 widened to float64 in float64 mode."""
    return array.astype(np.float64) if wide and array.dtype == np.float32 else array


def _run(graph: Graph, env: dict[int, np.ndarray], wide: bool) -> None:
    """Evaluate the constants and nodes of `graph` into `env` (values of enclosing graphs already there)."""
    for value in graph.constants:
        env[id(value)] = _held(value.const, wide)
    for node in graph.nodes:
        inputs = [env[id(v)] if v is not None else None for v in node.inputs]
        results = _evaluate_node(node, inputs, env, wide)
        for out, result in zip(node.outputs, results):
            if out is not None:
                env[id(out)] = _held(np.asarray(result), wide)


def _evaluate_node(node: Node, inputs: list[np.ndarray | None], env: dict[int, np.ndarray], wide: bool) -> list[np.ndarray]:
    if node.domain == TESSEL_DOMAIN:
        if node.op_type == FUSED:
            return _run_body(node.attrs["body"], inputs, env, wide)
        if node.op_type not in REFERENCE:
            raise NotImplementedError(f"interpret: no numpy reference for tessel op {node.op_type}")
        return list(REFERENCE[node.op_type](node.attrs, inputs))
    if node.op_type == "If":
        branch = node.attrs["then_branch"] if bool(np.asarray(inputs[0]).reshape(-1)[0]) else node.attrs["else_branch"]
        return _run_body(branch, [], env, wide)
    if node.op_type in _OVERRIDES:
        return [_OVERRIDES[node.op_type](node.attrs, inputs).astype(inputs[0].dtype)]
    schema = get_schema(node.op_type, node.domain)
    try:
        return evaluate(schema, node.attrs, inputs, len(node.outputs))
    except RuntimeContextError:
        # Ops defined by a function of their input types (Gelu, LayerNormalization, ...) need typed inputs.
        feeds = {f"i{k}": a for k, a in enumerate(inputs) if a is not None}
        return _typed_evaluator(schema, node.attrs, inputs, len(node.outputs)).run(None, feeds)


def _run_body(body: Graph, inputs: list[np.ndarray | None], env: dict[int, np.ndarray], wide: bool) -> list[np.ndarray]:
    """Run a subgraph (a Fused body on its own inputs, an If branch on captured values) and return its outputs."""
    inner = dict(env)  # a branch reads the enclosing graphs' values; its own never leak out
    for value, array in zip(body.inputs, inputs):
        inner[id(value)] = array
    _run(body, inner, wide)
    return [inner[id(out)] for out in body.outputs]


_erf = np.vectorize(math.erf, otypes=[np.float64])


def _gelu(attrs: Attributes, inputs: list[np.ndarray]) -> np.ndarray:
    x = inputs[0].astype(np.float64)
    if attrs.get("approximate", "none") == "tanh":
        return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))


def _conv_transpose(attrs: Attributes, inputs: list[np.ndarray | None]) -> np.ndarray:
    """ConvTranspose as the adjoint of Conv: each input element adds its filter-weighted taps to the output."""
    x, w = inputs[0].astype(np.float64), inputs[1].astype(np.float64)
    bias = inputs[2] if len(inputs) > 2 else None
    rank, group = x.ndim - 2, attrs.get("group", 1)
    kernel = tuple(w.shape[2:])
    strides = tuple(attrs.get("strides") or (1,) * rank)
    dilations = tuple(attrs.get("dilations") or (1,) * rank)
    extra = tuple(attrs.get("output_padding") or (0,) * rank)
    full = [(i - 1) * s + (k - 1) * d + 1 + e for i, s, k, d, e in zip(x.shape[2:], strides, kernel, dilations, extra)]
    auto_pad = attrs.get("auto_pad", "NOTSET")
    if attrs.get("output_shape") or auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        out = list(attrs.get("output_shape") or [i * s for i, s in zip(x.shape[2:], strides)])
        totals = [f - o for f, o in zip(full, out)]
        begins = [t // 2 if auto_pad == "SAME_UPPER" else t - t // 2 for t in totals]
    else:
        pads = tuple(attrs.get("pads") or (0,) * (2 * rank))
        begins = list(pads[:rank])
        out = [f - b - a for f, b, a in zip(full, pads[:rank], pads[rank:])]
    n, channels = x.shape[:2]
    per_group_in, per_group_out = channels // group, w.shape[1]
    buffer = np.zeros((n, group, per_group_out, *[max(f, b + o) for f, b, o in zip(full, begins, out)]))
    xg = x.reshape(n, group, per_group_in, *x.shape[2:])
    wg = w.reshape(group, per_group_in, per_group_out, *kernel)
    for tap in np.ndindex(*kernel):
        window = tuple(slice(k * d, k * d + (i - 1) * s + 1, s)
                       for k, d, i, s in zip(tap, dilations, x.shape[2:], strides))
        buffer[(slice(None),) * 3 + window] += np.einsum("ngc...,gco->ngo...", xg, wg[(Ellipsis, *tap)])
    y = buffer[(slice(None),) * 3 + tuple(slice(b, b + o) for b, o in zip(begins, out))]
    y = y.reshape(n, group * per_group_out, *out)
    if bias is not None:
        y = y + bias.reshape(-1, *[1] * rank)
    return y


def _lrn(attrs: Attributes, inputs: list[np.ndarray]) -> np.ndarray:
    x = inputs[0].astype(np.float64)
    size = attrs["size"]
    alpha, beta, bias = attrs.get("alpha", 1e-4), attrs.get("beta", 0.75), attrs.get("bias", 1.0)
    square_sum = np.zeros_like(x)
    for c in range(x.shape[1]):
        square_sum[:, c] = np.sum(x[:, max(0, c - (size - 1) // 2):c + size // 2 + 1] ** 2, axis=1)
    return x / (bias + alpha / size * square_sum) ** beta


# Ops computed here rather than by onnx.reference: it computes Erf (and Gelu through it) in float32 whatever the
# input type, gets grouped ConvTranspose and output_shape wrong, and windows LRN over the batch axis.
_OVERRIDES = {
    "LRN": _lrn,
    "Erf": lambda attrs, inputs: _erf(inputs[0].astype(np.float64)),
    "Gelu": _gelu,
    "ConvTranspose": _conv_transpose,
}

# Typed evaluators built so far (building one takes milliseconds; finite differences run a graph many times).
_TYPED_EVALUATORS: dict[tuple, ReferenceEvaluator] = {}
_TYPED_EVALUATORS_MAX = 256


def _typed_evaluator(schema: OpSchema, attrs: Attributes, inputs: list[np.ndarray | None], num_outputs: int) -> ReferenceEvaluator:
    """A reference evaluator of one op as a model whose inputs have the types of `inputs`."""
    signature = tuple((a.dtype.str, a.shape) if a is not None else None for a in inputs)
    attrs_key = tuple(sorted((name, (v.dtype.str, v.shape, v.tobytes()) if isinstance(v, np.ndarray) else v)
                             for name, v in attrs.items()))
    key = (schema.op_type, schema.domain, attrs_key, signature, num_outputs)
    if key not in _TYPED_EVALUATORS:
        if len(_TYPED_EVALUATORS) >= _TYPED_EVALUATORS_MAX:
            _TYPED_EVALUATORS.clear()
        in_names = [f"i{k}" if a is not None else "" for k, a in enumerate(inputs)]
        node = helper.make_node(schema.op_type, in_names, [f"o{k}" for k in range(num_outputs)], domain=schema.domain)
        node.attribute.extend(attribute_proto(n, schema.attributes[n].kind, v) for n, v in attrs.items())
        typed = [helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(a.dtype), list(a.shape))
                 for name, a in zip(in_names, inputs) if a is not None]
        outputs = [helper.make_tensor_value_info(f"o{k}", 0, None) for k in range(num_outputs)]
        model = helper.make_model(helper.make_graph([node], schema.op_type, typed, outputs),
                                  opset_imports=[helper.make_opsetid("", CANONICAL_OPSET)])
        _TYPED_EVALUATORS[key] = ReferenceEvaluator(model)
    return _TYPED_EVALUATORS[key]
