"""Turning a graph into an executable program: ordered instructions, kernel specs and weights.

Each node becomes one instruction (runtime/instructions.py): a kernel call, a
view (ops that only reinterpret a buffer's shape: Reshape, Flatten, Squeeze,
Unsqueeze, Identity, Dropout), an `If` holding the instructions of both
branches, a Send/Recv, or a `Fail` for a branch that cannot run.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from tessel.backends.kernel import (ALGORITHM, ARG, ARG_ALIGNMENT, ARG_BLOCKS, BF16, DATA, DEFAULT_ALIGNMENT,
                                    NUMPY_ALIGNMENT, PRECISION, RESULT_BLOCKS, KernelInput, KernelMember, KernelSpec)
from tessel.backends.lowering import LoweringError, static_inputs, supports
from tessel.backends.cpu.algorithms import ALGORITHM_OPS, BACKWARD_OPS, default_algorithm
from tessel.backends.cpu.packing import plan_packing
from tessel.backends.micro_batch import BATCH_SUMMING, BATCHED_INPUTS, accumulating, resize_batch
from tessel.ir.graph import Graph, Node, Value
from tessel.ir.op_traits import op_traits
from tessel.ir.schema import FUSED, TESSEL_DOMAIN
from tessel.ir.types import TensorType
from tessel.passes.conv_layout import DEFAULT_ALGORITHM, blocked_type, blocked_values
from tessel.passes.fuse import is_kernel, kernel_members
from tessel.passes.inplace import inplace_pairs
from tessel.passes.partition import HOME_DEVICE, node_device
from tessel.runtime.instructions import AllReduce, Branch, Fail, If, Instruction, KernelCall, Piece, Recv, Send, View

# Packed copies of constant weights are stored under the weight's name plus this suffix and their shape.
PACKED_SUFFIX = "::packed"


@dataclass
class Program:
    """Instructions to run, the kernels they call (by key), the values they touch and the weights they read."""

    instructions: list[Instruction]
    kernels: dict[str, KernelSpec]
    values: dict[str, str]
    weights: dict[str, np.ndarray]
    inputs: list[str]
    outputs: list[str]
    unsupported: list[str] = field(default_factory=list)
    # Values computed from weights alone (instructions marked `init`): computed once at load, kept with the weights.
    init_values: list[str] = field(default_factory=list)
    # Values whose buffers hold NCHW[16]c (passes/conv_layout.py): name → channel block.
    blocked: dict[str, int] = field(default_factory=dict)
    # Persistent values (compiler/state_program.py): buffers outside the arena that keep their values across runs.
    state: list[str] = field(default_factory=list)
    # The nodes (fused members included) whose products run in bf16 (precision "bf16"): name → op type.
    bf16_nodes: dict[str, str] = field(default_factory=dict)
    # Weights the artifact stores in their own form, transformed at load (runtime/load_transforms.py): name → (the
    # plan's entry, the stored array). `weights` holds them transformed, as the kernels read them.
    at_load: dict[str, tuple[dict, np.ndarray]] = field(default_factory=dict)


# A layer's configuration: (algorithm, micro-batch size) pieces, run in order over the batch.
Pieces = tuple[tuple[str, int], ...]


def run_time_weights(node: Node) -> set[str]:
    """The names of the values a kernel node's backward convolutions read as weights (run-time kernel arguments
    that micro-batches do not slice): every input but their batched ones (backends/micro_batch.py)."""
    members, outer = kernel_members(node)
    names = set()
    for member in members:
        for k, value in enumerate(member.inputs):
            if member.op_type in BATCHED_INPUTS and value is not None and k not in BATCHED_INPUTS[member.op_type]:
                names.add(outer.get(id(value), value).name)
    return names


class ProgramBuilder:
    """Turns nodes into instructions and kernel specs; collects the values they touch and the weights they read."""

    def __init__(self, target, choices: Mapping[str, Pieces] | None = None, blocked: Mapping[str, int] | None = None,
                 precision: str = "fp32"):
        self.target = target
        # "bf16": the convs the bf16 kernels take run in bf16 (backends/cpu/packing.py); everything else as typed.
        self.precision = precision
        self.bf16_nodes: dict[str, str] = {}
        self.choices = choices or {}
        # Values kept in NCHW[16]c between conv kernels (passes/conv_layout.py): their buffers hold that layout.
        self.blocked = blocked or {}
        self.algorithm: str | None = None
        self.kernels: dict[str, KernelSpec] = {}
        self.values: dict[str, str] = {}
        self.weights: dict[str, np.ndarray] = {}
        self.at_load: dict[str, tuple[dict, np.ndarray]] = {}
        self.unsupported: dict[str, str] = {}
        # (node, algorithm) → its whole-batch spec: every micro-batch size resizes the same one (packing its
        # weights once).
        self._candidates: dict[tuple[int, str], tuple[Node, tuple[KernelSpec, list[str]] | None]] = {}
        # The model inputs and the views of them, and the values the model outputs are (views of): the caller's
        # arrays and the run's fresh output arrays, which the runtime reads and writes in place when they are as
        # aligned as the kernels taking them assume (NUMPY_ALIGNMENT, numpy's own, on a CPU).
        self.input_aliases: set[str] = set()
        self.output_aliases: set[str] = set()

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

    def instructions(self, graph: Graph) -> list[Instruction]:
        """One instruction per node of `graph`, in order."""
        return [self.instruction(node) for node in graph.nodes]

    def instruction(self, node: Node) -> Instruction:
        """The instruction running `node` (a `Fail` when no kernel can: see `unsupported`)."""
        where = {"node": node.name, "op": node.op_type}
        if node.domain == TESSEL_DOMAIN and node.op_type == "Send":
            return Send(**where, tensor=self.read(node.inputs[0]), peer=node.attrs["peer"], tag=node.attrs["tag"])
        if node.domain == TESSEL_DOMAIN and node.op_type == "Recv":
            return Recv(**where, output=self.write(node.outputs[0]), peer=node.attrs["peer"], tag=node.attrs["tag"])
        if node.domain == TESSEL_DOMAIN and node.op_type == "AllReduce":
            compressed = {key: tuple(node.attrs[key]) if key.startswith("part_") else node.attrs[key]
                          for key in ("compression", "topk_ratio", "part_sizes", "part_rows") if key in node.attrs}
            return AllReduce(**where, tensor=self.read(node.inputs[0]), reduction=node.attrs["reduction"],
                             output=self.write(node.outputs[0]), **compressed)
        if node.domain == TESSEL_DOMAIN and node.op_type == "Unreachable":
            for out in node.outputs:
                self.write(out)
            return Fail(**where, message=node.attrs["message"])
        if node.op_type == "If":
            return self._if(node, where)
        if op_traits(node.op_type).view and not is_kernel(node):
            if node.inputs[0].name in self.input_aliases:
                self.input_aliases.add(node.outputs[0].name)
            return View(**where, input=self.read(node.inputs[0]), output=self.write(node.outputs[0]))
        if node.name in self.choices:
            return self._pieces_call(node, where, self.choices[node.name])
        made = self._spec(node)
        if made is None:
            return Fail(**where, message=f"no kernel for {node.op_type}")
        spec, args = made
        key = spec.key(self.target)
        self.kernels[key] = spec
        outs = tuple(self.write(v) for v in node.outputs if v is not None)
        return KernelCall(**where, kernel=key, inputs=tuple(args), outputs=outs, inplace=self._inplace(node, args, outs))

    def _inplace(self, node: Node, args, outs) -> tuple[tuple[str, str], ...]:
        # Writing over an input element by element needs both in the same layout.
        pairs = [(node.outputs[o].name, node.inputs[k].name) for o, k in inplace_pairs(node)]
        return tuple((out, source) for out, source in pairs if source in args and out in outs
                     and self.blocked.get(source) == self.blocked.get(out))

    def candidate(self, node: Node, algorithm: str, size: int, first: bool = False) -> tuple[KernelSpec, list[str]]:
        """The kernel running `node` with `algorithm` on a micro-batch of `size`, and its argument names.

        A batch-summing op's micro-batch adds its partial result to the output (an extra argument, the output
        itself) unless it is the `first` piece, which writes it."""
        if (id(node), algorithm) not in self._candidates:
            self.algorithm = algorithm
            try:
                self._candidates[(id(node), algorithm)] = (node, self._spec(node))
            finally:
                self.algorithm = None
        made = self._candidates[(id(node), algorithm)][1]
        if made is None:
            raise LoweringError(f"node '{node.name}' ({node.op_type}) has no kernel")
        spec, args = made
        # A batch-summing op's output has no batch axis: its first input has.
        batch = (node.inputs[0] if node.op_type in BATCH_SUMMING else node.outputs[0]).type.shape[0]
        if size == batch:
            return spec, args
        spec = resize_batch(spec, self._batched_args(node, args), size)
        if node.op_type in BATCH_SUMMING and not first:
            return accumulating(spec), args + [node.outputs[0].name]
        return spec, args

    def _batched_args(self, node: Node, args: Sequence[str]) -> frozenset[int]:
        """The arguments sliced with the batch: every one but weights (a backward conv's run-time weights too) and
        the node's outputs (a batch-summing piece reads its output, whole: the sum so far)."""
        unbatched = run_time_weights(node) | {v.name for v in node.outputs if v is not None}
        return frozenset(k for k, name in enumerate(args) if name not in self.weights and name not in unbatched)

    def _pieces_call(self, node: Node, where: dict[str, str], pieces: Pieces) -> KernelCall:
        """A kernel call running its batch as micro-batches, each a slice of axis 0 with its own kernel."""
        outs = tuple(self.write(v) for v in node.outputs if v is not None)
        runs, start = [], 0
        for algorithm, size in pieces:
            spec, args = self.candidate(node, algorithm, size, first=start == 0)
            key = spec.key(self.target)
            self.kernels[key] = spec
            # Weights are whole in every piece; activations are sliced on axis 0, and outputs unless they sum
            # over the batch (each piece after the first reads the output and adds to it).
            sliced = tuple(args[k] for k in sorted(self._batched_args(node, args)))
            sliced += () if node.op_type in BATCH_SUMMING else outs
            runs.append(Piece(key, tuple(args), start, size, algorithm, sliced))
            start += size
        first = runs[0]
        return KernelCall(**where, kernel=first.kernel, inputs=first.inputs, outputs=outs,
                          inplace=self._inplace(node, first.inputs, outs), pieces=tuple(runs) if len(runs) > 1 else (),
                          algorithm=first.algorithm)

    def _if(self, node: Node, where: dict[str, str]) -> If:
        branches = {}
        for key in ("then_branch", "else_branch"):
            branch: Graph = node.attrs[key]
            branches[key] = Branch(tuple(self.instructions(branch)), tuple(self.read(v) for v in branch.outputs))
        return If(**where, condition=self.read(node.inputs[0]), **branches,
                  outputs=tuple(self.write(v) for v in node.outputs if v is not None))

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
        outputs = [v for v in node.outputs if v is not None]
        spec = self._with_blocks(made[0], made[1], outputs)
        return self._with_alignment(spec, made[1] + [v.name for v in outputs]), made[1]

    def _with_alignment(self, spec: KernelSpec, arguments: list[str]) -> KernelSpec:
        """The spec of a CPU kernel taking a model input or output (or a view of one) among its `arguments` (inputs,
        then outputs) assuming NUMPY_ALIGNMENT of those (ARG_ALIGNMENT); every other spec unchanged."""
        relaxed = self.input_aliases | self.output_aliases
        if self.target.kind != "llvm" or not relaxed.intersection(arguments):
            return spec
        alignment = tuple(NUMPY_ALIGNMENT if name in relaxed else DEFAULT_ALIGNMENT for name in arguments)
        return dataclasses.replace(spec, attrs=spec.attrs + ((ARG_ALIGNMENT, alignment),))

    def _with_blocks(self, spec: KernelSpec, args: list[str], outputs: list[Value]) -> KernelSpec:
        """The spec with its blocked arguments and results marked (as a fused kernel: its members
        keep their NCHW types; backends/lower.py converts at the kernel's edges)."""
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
            made = self._member_spec(member, inputs, locate, outer)
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

    def _member_spec(self, node: Node, inputs: list[Value | None], locate,
                     outer: Mapping[int, Value] | None = None) -> tuple[KernelSpec, tuple] | None:
        """The spec of one op whose inputs are `inputs` (outer values), and per input where it comes from; `outer`:
        for a member of a fused kernel, the body's parameters (by id) → the values they stand for."""
        if node.domain not in ("", TESSEL_DOMAIN) or not supports(node.op_type):  # Tessel ops with a lowering: kernels
            self.unsupported.setdefault(node.op_type, node.name)
            return None
        attrs = tuple((name, v) for name, v in node.attrs.items() if not isinstance(v, Graph))
        algorithm = (self.algorithm if self.algorithm is not None
                     else self._default_algorithm(node, attrs, inputs, outer or {}))
        if algorithm is not None and node.op_type in ALGORITHM_OPS + BACKWARD_OPS:
            attrs += ((ALGORITHM, algorithm),)
        packing = None
        if self.target.kind == "llvm":
            packing = plan_packing(node.op_type, dict(attrs), [v.type if v is not None else None for v in inputs],
                                   [v.const if v is not None else None for v in inputs], self.precision)
        if packing is not None:
            attrs += packing.attrs
            if dict(packing.attrs).get(PRECISION) == BF16:
                self.bf16_nodes[node.name] = node.op_type
        static = static_inputs(node.op_type)
        specs: list[KernelInput | None] = []
        sources: list = []
        for index, value in enumerate(inputs):
            source = None
            if value is None:
                specs.append(None)
            elif packing is not None and index in packing.arrays:
                packed = self._packed(value, packing.arrays[index], packing.at_load.get(index))
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

    def _default_algorithm(self, node: Node, attrs, inputs: list[Value | None],
                           outer: Mapping[int, Value]) -> str | None:
        """The algorithm an op runs without selection where it is not the default (backends/cpu/algorithms.py).

        In bf16 a conv keeps only Winograd's default: its float32 products do a quarter of a direct conv's
        multiply-adds, more than bf16's doubled rate makes up. Measured in ResNet-18 on an AMD Zen 4 (per kernel in
        the program, `bench/layer_compare.py`): its 56² × 64 convs 0.35 ms in Winograd against 0.53-0.54 in bf16, its
        28² × 128 ones 0.38 against 0.52. Every other conv the bf16 kernels take runs them."""
        if self.target.kind != "llvm" or not inputs or inputs[0] is None:
            return None
        algorithm = default_algorithm(node.op_type, dict(attrs), [v.type if v is not None else None for v in inputs],
                                      [v.const if v is not None else None for v in inputs], self.target.kind,
                                      self._reads_blocks(node, inputs[0], outer),
                                      outer.get(id(inputs[0]), inputs[0]).name in self.blocked,
                                      self._computed_in_kernel(node, inputs[0], outer))
        return None if self.precision == BF16 and node.op_type == "Conv" and algorithm != "winograd" else algorithm

    @staticmethod
    def _computed_in_kernel(node: Node, value: Value, outer: Mapping[int, Value]) -> bool:
        """Whether `value`, an input of `node`, is computed inside `node`'s kernel (by another member of its fused
        group) rather than passed to it as an argument."""
        value = outer.get(id(value), value)
        return bool(outer) and value.producer is not None and value.producer.graph is node.graph

    def _reads_blocks(self, node: Node, value: Value, outer: Mapping[int, Value]) -> bool:
        """Whether every activation `value` is computed from inside `node`'s kernel (its fused group, when it is a
        member of one: `outer` maps the group body's parameters to the values they stand for) is kept in
        NCHW[16]c."""
        stack, seen, sources = [value], set(), []
        while stack:
            current = stack.pop()
            current = outer.get(id(current), current)
            if id(current) in seen or current.is_constant:
                continue
            seen.add(id(current))
            producer = current.producer
            if outer and producer is not None and producer.graph is node.graph:
                stack.extend(v for v in producer.inputs if v is not None)
            else:
                sources.append(current)
        return bool(sources) and all(source.name in self.blocked for source in sources)

    def _packed(self, value: Value, array: np.ndarray, at_load: dict | None = None) -> Value:
        """A stand-in constant value for the packed copy of constant `value` (a weight once read); with `at_load`
        (a plan entry of runtime/load_transforms.py), the artifact stores `value` itself, transformed at load."""
        name = f"{value.name}{PACKED_SUFFIX}{'x'.join(map(str, array.shape))}"
        if at_load is not None:
            self.at_load[name] = (at_load, value.const)
        stand_in = Value(name, TensorType.of(array), value.graph)
        stand_in.const = array
        return stand_in


def build_program(graph: Graph, target, device: int | None = None, placement: Mapping[str, int] | None = None,
                  choices: Mapping[str, Pieces] | None = None, blocked_layout: bool = True,
                  precision: str = "fp32") -> Program:
    """The program that runs `graph` on `target` (kernels still to be compiled).

    `blocked_layout` keeps values between conv kernels in NCHW[16]c (passes/conv_layout.py).
    `precision` "bf16" runs the convs the bf16 kernels take in bf16 (Program.bf16_nodes lists them).

    `choices` (node name → (algorithm, micro-batch size) pieces, from algorithm
    selection) runs those nodes' batches as slices, each with its own kernel.

    With a `placement` (node name → device, after passes/partition.py inserted
    Send/Recv), the program of one `device`: its nodes only; model inputs and
    outputs belong to device 0.
    """
    builder = ProgramBuilder(target, choices, _blocked(graph, target, choices) if blocked_layout else {}, precision)
    home = device in (None, HOME_DEVICE)
    inputs = [builder.write(v) for v in graph.inputs] if home else []
    builder.input_aliases.update(inputs)
    if home:
        builder.output_aliases.update(_viewed_values(graph.outputs))
    if placement is None:
        instructions = builder.instructions(graph)
    else:
        instructions = [builder.instruction(node) for node in graph.nodes if node_device(node, placement) == device]
    outputs = [builder.read(v) for v in graph.outputs] if home else []
    instructions, init_values = _marked_init(instructions, builder.weights)
    unsupported = [f"{op} (first node '{name}')" for op, name in builder.unsupported.items()]
    return Program(instructions, builder.kernels, builder.values, builder.weights, inputs, outputs, unsupported, init_values,
                   _used(builder), bf16_nodes=builder.bf16_nodes, at_load=builder.at_load)


def selection_builder(graph: Graph, target, precision: str = "fp32") -> ProgramBuilder:
    """A builder for algorithm selection's candidates of `graph`: their kernels get the specs (hence the profile
    database keys) that build_program's own get, the relaxed alignment of those touching a model input or output
    included, so the kernel timed is the kernel run."""
    builder = ProgramBuilder(target, precision=precision)
    builder.input_aliases.update(v.name for v in graph.inputs)
    builder.output_aliases.update(_viewed_values(graph.outputs))
    return builder


def stage_program(graph: Graph, target, nodes: set[str], inputs: list[Value], outputs: list[Value],
                  blocked_layout: bool = True, precision: str = "fp32") -> Program:
    """The program running only `nodes` of `graph` (in order), fed `inputs` and returning `outputs`:
    one side of a cut (hybrid placement)."""
    edges = {v.name for v in inputs} | {v.name for v in outputs}
    blocked = {name: block for name, block in _blocked(graph, target, None).items()
               if name not in edges} if blocked_layout else {}
    builder = ProgramBuilder(target, blocked=blocked, precision=precision)
    program_inputs = [builder.write(v) for v in inputs]
    instructions = [builder.instruction(node) for node in graph.nodes if node.name in nodes]
    program_outputs = [builder.read(v) for v in outputs]
    instructions, init_values = _marked_init(instructions, builder.weights)
    unsupported = [f"{op} (first node '{name}')" for op, name in builder.unsupported.items()]
    return Program(instructions, builder.kernels, builder.values, builder.weights, program_inputs, program_outputs,
                   unsupported, init_values, _used(builder), bf16_nodes=builder.bf16_nodes, at_load=builder.at_load)


def renamed_program(program: Program, names: Mapping[str, str]) -> Program:
    """The program with the values in `names` renamed (in its instructions, values, inputs and outputs)."""
    def rename(name: str) -> str:
        return names.get(name, name)

    return Program([i.renamed(names) for i in program.instructions], program.kernels,
                   {rename(n): spec for n, spec in program.values.items()}, program.weights,
                   [rename(n) for n in program.inputs], [rename(n) for n in program.outputs], program.unsupported,
                   program.init_values, {rename(n): b for n, b in program.blocked.items()}, at_load=program.at_load)


def joined_programs(first: Program, second: Program, inputs: list[str], outputs: list[str]) -> Program:
    """One program running `first`'s instructions then `second`'s (which reads what `first` wrote)."""
    clash = sorted(n for n in set(first.values) & set(second.values) if first.values[n] != second.values[n])
    if clash:
        raise ValueError(f"value '{clash[0]}' is {first.values[clash[0]]} in one part and "
                         f"{second.values[clash[0]]} in the other")
    return Program(first.instructions + second.instructions, {**first.kernels, **second.kernels},
                   {**first.values, **second.values}, {**first.weights, **second.weights}, inputs, outputs,
                   first.unsupported + second.unsupported, first.init_values + second.init_values,
                   {**first.blocked, **second.blocked}, at_load={**first.at_load, **second.at_load})


def _viewed_values(values: Sequence[Value]) -> set[str]:
    """The names of `values` and of the values each is a view of (through view ops that are not kernels)."""
    names = set()
    for value in values:
        while value is not None and value.name not in names:
            names.add(value.name)
            producer = value.producer
            if producer is None or not op_traits(producer.op_type).view or is_kernel(producer):
                break
            value = producer.inputs[0]
    return names


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


def _marked_init(instructions: list[Instruction], weights) -> tuple[list[Instruction], list[str]]:
    """The instructions with those at top level that read only weights (or values made from them) marked
    `init`, and the values those make.

    Their results do not change from run to run (a weight transposed, a ConstantOfShape
    too large to fold at compile time), so the runtime computes them once, at load.
    """
    constant = set(weights)
    made: list[str] = []
    marked = []
    for instruction in instructions:
        if (isinstance(instruction, KernelCall) and op_traits(instruction.op).deterministic
                or isinstance(instruction, View)) and all(name in constant for _, name in instruction.reads()):
            instruction = dataclasses.replace(instruction, init=True)
            constant.update(instruction.writes())
            made.extend(instruction.writes())
        marked.append(instruction)
    return marked, made
