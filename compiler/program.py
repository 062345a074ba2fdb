"""Turning a graph into an executable program: ordered steps, kernel specs and weights.

Each node becomes one step: a kernel call, a view (ops that only reinterpret
a buffer's shape: Reshape, Flatten, Squeeze, Unsqueeze, Identity, Dropout), an
`if` holding the steps of both branches, or a `fail` for a branch that cannot
run. The program is plain data (JSON-ready): the runtime executes it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from tessel.backends.kernel import ARG, ARG_BLOCKS, DATA, RESULT_BLOCKS, KernelInput, KernelMember, KernelSpec
from tessel.backends.lowering import LoweringError, static_inputs, supports
from tessel.backends.algorithms import ALGORITHM_OPS, resize_batch
from tessel.backends.lowering.packing import ALGORITHM, plan_packing
from tessel.ir.graph import Graph, Node, Value
from tessel.ir.op_traits import op_traits
from tessel.ir.schema import FUSED, TESSEL_DOMAIN
from tessel.ir.types import TensorType
from tessel.passes.conv_layout import DEFAULT_ALGORITHM, blocked_type, blocked_values
from tessel.passes.fuse import is_kernel
from tessel.passes.inplace import inplace_inputs
from tessel.passes.partition import HOME_DEVICE, node_device

# Packed copies of constant weights are stored under the weight's name plus this suffix and their shape.
PACKED_SUFFIX = "::packed"


@dataclass
class Program:
    """Steps to run, the kernels they call (by key), the values they touch and the weights they read."""

    steps: list[dict[str, Any]]
    kernels: dict[str, KernelSpec]
    values: dict[str, str]
    weights: dict[str, np.ndarray]
    inputs: list[str]
    outputs: list[str]
    unsupported: list[str] = field(default_factory=list)
    # Values computed from weights alone (steps marked "init"): computed once at load, kept with the weights.
    init_values: list[str] = field(default_factory=list)
    # Values whose buffers hold NCHW[16]c (passes/conv_layout.py): name → channel block.
    blocked: dict[str, int] = field(default_factory=dict)


# A layer's configuration: (algorithm, micro-batch size) pieces, run in order over the batch.
Pieces = tuple[tuple[str, int], ...]


class ProgramBuilder:
    """Turns nodes into steps and kernel specs; collects the values they touch and the weights they read."""

    def __init__(self, target, choices: Mapping[str, Pieces] | None = None, blocked: Mapping[str, int] | None = None):
        self.target = target
        self.choices = choices or {}
        # Values kept in NCHW[16]c between conv kernels (passes/conv_layout.py): their buffers hold that layout.
        self.blocked = blocked or {}
        self.algorithm: str | None = None
        self.kernels: dict[str, KernelSpec] = {}
        self.values: dict[str, str] = {}
        self.weights: dict[str, np.ndarray] = {}
        self.unsupported: dict[str, str] = {}

    def read(self, value: Value) -> str:
        """Note that `value` is read at run time; constants become weights."""
        self.write(value)
        if value.is_constant:
            self.weights[value.name] = value.const
        return value.name

    def write(self, value: Value) -> str:
        """Record the type of `value`'s buffer (NCHW[16]c where it is kept blocked)."""
        block = self.blocked.get(value.name)
        self.values[value.name] = (blocked_type(value.type, block) if block else value.type).spec()
        return value.name

    def steps(self, graph: Graph) -> list[dict[str, Any]]:
        return [self.step(node) for node in graph.nodes]

    def step(self, node: Node) -> dict[str, Any]:
        where = {"node": node.name, "op": node.op_type}
        if node.domain == TESSEL_DOMAIN and node.op_type == "Send":
            return {"kind": "send", **where, "tensor": self.read(node.inputs[0]), "to": node.attrs["peer"],
                    "tag": node.attrs["tag"]}
        if node.domain == TESSEL_DOMAIN and node.op_type == "Recv":
            return {"kind": "recv", **where, "output": self.write(node.outputs[0]), "from": node.attrs["peer"],
                    "tag": node.attrs["tag"]}
        if node.domain == TESSEL_DOMAIN and node.op_type == "Unreachable":
            for out in node.outputs:
                self.write(out)
            return {"kind": "fail", **where, "message": node.attrs["message"]}
        if node.op_type == "If":
            return self._if_step(node, where)
        if op_traits(node.op_type).view and not is_kernel(node):
            return {"kind": "view", **where, "input": self.read(node.inputs[0]), "output": self.write(node.outputs[0])}
        if node.name in self.choices:
            return self._pieces_step(node, where, self.choices[node.name])
        made = self._spec(node)
        if made is None:
            return {"kind": "missing", **where}
        spec, args = made
        key = spec.key(self.target)
        self.kernels[key] = spec
        outs = [self.write(v) for v in node.outputs if v is not None]
        step = {"kind": "kernel", **where, "kernel": key, "inputs": args, "outputs": outs}
        return self._with_inplace(node, step, args, outs)

    def _with_inplace(self, node: Node, step: dict[str, Any], args: list[str], outs: list[str]) -> dict[str, Any]:
        # Writing over an input element by element needs both in the same layout.
        inplace = [[outs[0], node.inputs[k].name] for k in inplace_inputs(node) if node.inputs[k].name in args
                   and self.blocked.get(node.inputs[k].name) == self.blocked.get(outs[0])]
        if inplace:
            step["inplace"] = inplace
        return step

    def candidate(self, node: Node, algorithm: str, size: int) -> tuple[KernelSpec, list[str]]:
        """The kernel running `node` with `algorithm` on a micro-batch of `size`, and its argument names."""
        self.algorithm = algorithm
        try:
            made = self._spec(node)
        finally:
            self.algorithm = None
        if made is None:
            raise LoweringError(f"node '{node.name}' ({node.op_type}) has no kernel")
        spec, args = made
        batch = node.outputs[0].type.shape[0]
        if size == batch:
            return spec, args
        batched = frozenset(k for k, name in enumerate(args) if name not in self.weights)
        return resize_batch(spec, batched, size), args

    def _pieces_step(self, node: Node, where: dict[str, Any], pieces: Pieces) -> dict[str, Any]:
        """A kernel step running its batch as micro-batches, each a slice of axis 0 with its own kernel."""
        outs = [self.write(v) for v in node.outputs if v is not None]
        runs, start = [], 0
        for algorithm, size in pieces:
            spec, args = self.candidate(node, algorithm, size)
            key = spec.key(self.target)
            self.kernels[key] = spec
            runs.append({"kernel": key, "inputs": args, "start": start, "size": size, "algorithm": algorithm})
            start += size
        step = {"kind": "kernel", **where, "kernel": runs[0]["kernel"], "inputs": runs[0]["inputs"], "outputs": outs,
                "algorithm": runs[0]["algorithm"]}
        if len(runs) > 1:
            # Weights are whole in every piece; activations are sliced on axis 0.
            step["pieces"] = [{**run, "sliced": [name for name in run["inputs"] if name not in self.weights] + outs}
                              for run in runs]
        return self._with_inplace(node, step, runs[0]["inputs"], outs)

    def _if_step(self, node: Node, where: dict[str, Any]) -> dict[str, Any]:
        branches = {}
        for key in ("then_branch", "else_branch"):
            branch: Graph = node.attrs[key]
            branches[key] = {"steps": self.steps(branch), "results": [self.read(v) for v in branch.outputs]}
        return {
            "kind": "if", **where, "condition": self.read(node.inputs[0]),
            "then": branches["then_branch"], "else": branches["else_branch"],
            "outputs": [self.write(v) for v in node.outputs if v is not None],
        }

    def _spec(self, node: Node) -> tuple[KernelSpec, list[str]] | None:
        """The node's kernel spec and the value names of its runtime arguments."""
        if node.domain == TESSEL_DOMAIN and node.op_type == FUSED:
            made = self._fused_spec(node)
        else:
            args: list[str] = []

            def locate(value: Value):
                args.append(self.read(value))
                return ("arg", len(args) - 1, 0)

            member = self._member_spec(node, list(node.inputs), locate)
            made = (member[0], args) if member is not None else None
        if made is None:
            return None
        return self._with_blocks(made[0], made[1], [v for v in node.outputs if v is not None]), made[1]

    def _with_blocks(self, spec: KernelSpec, args: list[str], outputs: list[Value]) -> KernelSpec:
        """The spec with its blocked arguments and results marked (as a fused kernel: its members
        keep their NCHW types; backends/kernel.py converts at the kernel's edges)."""
        arg_blocks = tuple(self.blocked.get(name, 0) for name in args)
        result_blocks = tuple(self.blocked.get(v.name, 0) for v in outputs)
        if not any(arg_blocks) and not any(result_blocks):
            return spec
        members, results = spec.members(), spec.result_refs()
        attrs = ((ARG_BLOCKS, arg_blocks), (RESULT_BLOCKS, result_blocks))
        inputs = tuple(KernelInput(self.values[name], ARG) for name in args)
        types = tuple((blocked_type(v.type, b) if b else v.type).spec() for v, b in zip(outputs, result_blocks))
        return KernelSpec(FUSED, attrs, inputs, types, members, results)

    def _fused_spec(self, node: Node) -> tuple[KernelSpec, list[str]] | None:
        """One kernel for a fused group: each body op a member reading kernel arguments or earlier members."""
        body: Graph = node.attrs["body"]
        outer = {id(param): value for param, value in zip(body.inputs, node.inputs)}
        produced: dict[int, tuple[int, int]] = {}
        args: list[str] = []
        members = []

        def locate(value: Value):
            if id(value) in produced:
                return ("member", *produced[id(value)])
            return ("arg", self._arg(args, value), 0)

        for m, member in enumerate(body.nodes):
            inputs = [outer.get(id(v), v) if v is not None else None for v in member.inputs]
            made = self._member_spec(member, inputs, locate)
            if made is None:
                return None
            members.append(KernelMember(*made))
            for k, out in enumerate(member.outputs):
                if out is not None:
                    produced[id(out)] = (m, k)
        arg_inputs = tuple(KernelInput(self.values[name], ARG) for name in args)
        outputs = tuple(v.type.spec() for v in body.outputs)
        results = tuple(produced[id(v)] for v in body.outputs)
        return KernelSpec(FUSED, (), arg_inputs, outputs, tuple(members), results), args

    def _arg(self, args: list[str], value: Value) -> int:
        """The kernel argument index of `value` (added once)."""
        name = self.read(value)
        if name not in args:
            args.append(name)
        return args.index(name)

    def _member_spec(self, node: Node, inputs: list[Value | None], locate) -> tuple[KernelSpec, tuple] | None:
        """The spec of one op whose inputs are `inputs` (outer values), and per input where it comes from."""
        if node.domain or not supports(node.op_type):
            self.unsupported.setdefault(node.op_type, node.name)
            return None
        attrs = tuple((name, v) for name, v in node.attrs.items() if not isinstance(v, Graph))
        if self.algorithm is not None and node.op_type in ALGORITHM_OPS:
            attrs += ((ALGORITHM, self.algorithm),)
        packing = None
        if self.target.kind == "llvm":
            packing = plan_packing(node.op_type, dict(attrs), [v.type if v is not None else None for v in inputs],
                                   [v.const if v is not None else None for v in inputs])
        if packing is not None:
            attrs += packing.attrs
        static = static_inputs(node.op_type)
        specs: list[KernelInput | None] = []
        sources: list = []
        for index, value in enumerate(inputs):
            source = None
            if value is None:
                specs.append(None)
            elif packing is not None and index in packing.arrays:
                packed = self._packed(value, packing.arrays[index])
                specs.append(KernelInput(packed.type.spec(), ARG))
                source = locate(packed)
            elif index in static:
                if not value.is_constant:
                    raise LoweringError(f"node '{node.name}' ({node.op_type}): input {index} must be a compile-time constant")
                specs.append(KernelInput(value.type.spec(), DATA, value.const))
            elif value.is_constant and value.type.numel == 1:
                specs.append(KernelInput(value.type.spec(), DATA, value.const))
            else:
                specs.append(KernelInput(value.type.spec(), ARG))
                source = locate(value)
            sources.append(source)
        outputs = tuple(v.type.spec() if v is not None else None for v in node.outputs)
        return KernelSpec(node.op_type, attrs, tuple(specs), outputs), tuple(sources)

    def _packed(self, value: Value, array: np.ndarray) -> Value:
        """A stand-in constant value for the packed copy of constant `value` (a weight once read)."""
        name = f"{value.name}{PACKED_SUFFIX}{'x'.join(map(str, array.shape))}"
        stand_in = Value(name, TensorType.of(array), value.graph)
        stand_in.const = array
        return stand_in


def build_program(graph: Graph, target, device: int | None = None, placement: Mapping[str, int] | None = None,
                  choices: Mapping[str, Pieces] | None = None, blocked_layout: bool = True) -> Program:
    """The program that runs `graph` on `target` (kernels still to be compiled).

    `blocked_layout` keeps values between conv kernels in NCHW[16]c (passes/conv_layout.py).

    `choices` (node name → (algorithm, micro-batch size) pieces, from algorithm
    selection) runs those nodes' batches as slices, each with its own kernel.

    With a `placement` (node name → device, after passes/partition.py inserted
    Send/Recv), the program of one `device`: its nodes only; model inputs and
    outputs belong to device 0.
    """
    builder = ProgramBuilder(target, choices, _blocked(graph, target, choices) if blocked_layout else {})
    home = device in (None, HOME_DEVICE)
    inputs = [builder.write(v) for v in graph.inputs] if home else []
    if placement is None:
        steps = builder.steps(graph)
    else:
        steps = [builder.step(node) for node in graph.nodes if node_device(node, placement) == device]
    outputs = [builder.read(v) for v in graph.outputs] if home else []
    init_values = _mark_init_steps(steps, builder.weights)
    unsupported = [f"{op} (first node '{name}')" for op, name in builder.unsupported.items()]
    return Program(steps, builder.kernels, builder.values, builder.weights, inputs, outputs, unsupported, init_values,
                   _used(builder))


def stage_program(graph: Graph, target, nodes: set[str], inputs: list[Value], outputs: list[Value],
                  blocked_layout: bool = True) -> Program:
    """The program running only `nodes` of `graph` (in order), fed `inputs` and returning `outputs`:
    one side of a cut (hybrid placement)."""
    edges = {v.name for v in inputs} | {v.name for v in outputs}
    blocked = {name: block for name, block in _blocked(graph, target, None).items()
               if name not in edges} if blocked_layout else {}
    builder = ProgramBuilder(target, blocked=blocked)
    program_inputs = [builder.write(v) for v in inputs]
    steps = [builder.step(node) for node in graph.nodes if node.name in nodes]
    program_outputs = [builder.read(v) for v in outputs]
    init_values = _mark_init_steps(steps, builder.weights)
    unsupported = [f"{op} (first node '{name}')" for op, name in builder.unsupported.items()]
    return Program(steps, builder.kernels, builder.values, builder.weights, program_inputs, program_outputs,
                   unsupported, init_values, _used(builder))


def _used(builder: ProgramBuilder) -> dict[str, int]:
    """The blocked values this program touches."""
    return {name: block for name, block in builder.blocked.items() if name in builder.values}


def _blocked(graph: Graph, target, choices: Mapping[str, Pieces] | None) -> dict[str, int]:
    """The values kept in NCHW[16]c between conv kernels (CPU kernels only)."""
    if target.kind != "llvm":
        return {}
    choices = choices or {}

    def algorithms(node: Node) -> set[str]:
        return {algorithm for algorithm, _ in choices[node.name]} if node.name in choices else {DEFAULT_ALGORITHM}

    return blocked_values(graph, algorithms)


def _mark_init_steps(steps: list[dict[str, Any]], weights) -> list[str]:
    """Mark the top-level steps that read only weights (or values made from them) as "init" steps.

    Their results do not change from run to run (a weight transposed, a ConstantOfShape
    too large to fold at compile time), so the runtime computes them once, at load.
    """
    constant = set(weights)
    made: list[str] = []
    for step in steps:
        if step["kind"] == "kernel" and op_traits(step["op"]).deterministic and all(n in constant for n in step["inputs"]):
            outputs = step["outputs"]
        elif step["kind"] == "view" and step["input"] in constant:
            outputs = [step["output"]]
        else:
            continue
        step["init"] = True
        constant.update(outputs)
        made.extend(outputs)
    return made
