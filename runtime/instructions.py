"""The instruction program: what one worker runs, as typed instructions with a JSON form.

An artifact holds one program per worker (plan.json's "workers"). Each
instruction comes from one graph node (`node`, `op`) and names the values it
reads and writes; the compiler emits them (compiler/program.py, placement),
the memory planner, the packager, the plan checks, the reports and the
executor dispatch on their type. This module alone knows their JSON form:
`to_json` writes an instruction as an object with a "kind"; `from_json` reads
one back, checking every field's type, and fails with `ProgramFormatError`
naming the field.

Collectives (scatter, gather, all-reduce) run on every worker of the group;
the root of a scatter holds the whole tensor, every worker its slice of axis 0.
`Assign` copies a value into a persistent state buffer (plan.json's "state"),
which keeps it for the next run: it comes after every read of the state's
current value. An optimizer update's kernel call may instead write the state
it reads in place (its outputs named as the state values).
"""
from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass
from typing import Any, ClassVar, Iterable, Iterator, Mapping, NamedTuple

# The version of plan.json's layout and of the instructions in it; an artifact of another version is refused.
FORMAT_VERSION = 3


class ProgramFormatError(ValueError):
    """An instruction's JSON does not have the form of its kind; `where` names the field."""

    def __init__(self, where: str, message: str):
        super().__init__(f"{where}: {message}")
        self.where = where
        self.message = message


@dataclass(frozen=True)
class Instruction:
    """One step of a worker's program, from graph node `node` (ONNX op `op`)."""

    node: str
    op: str

    KIND: ClassVar[str] = ""
    # Fields that hold value names (a name, a tuple of names, or pairs of names): what `renamed` rewrites.
    VALUE_FIELDS: ClassVar[tuple[str, ...]] = ()

    def reads(self) -> Iterator[tuple[str, str]]:
        """(field, value name) of each value the instruction reads before it runs."""
        return iter(())

    def writes(self) -> tuple[str, ...]:
        """The values the instruction writes."""
        return ()

    @property
    def runs_at_load(self) -> bool:
        """Whether the runtime runs it once at load (it reads only weights) rather than on every run."""
        return False

    def renamed(self, names: Mapping[str, str]) -> Instruction:
        """The instruction with each value name in `names` replaced by its mapping."""
        return dataclasses.replace(self, **{field: _rename(getattr(self, field), names) for field in self.VALUE_FIELDS})

    def to_json(self) -> dict[str, Any]:
        """The instruction as a JSON-ready object with its "kind" (fields at their defaults left out)."""
        return {"kind": self.KIND, **_fields_json(self, omit_defaults=True)}


def _rename(value: Any, names: Mapping[str, str]) -> Any:
    if value is None:
        return None
    if isinstance(value, str):
        return names.get(value, value)
    return tuple(_rename(item, names) for item in value)


def _fields_json(obj: Any, omit_defaults: bool = False) -> dict[str, Any]:
    return {field.name: _to_json(getattr(obj, field.name)) for field in dataclasses.fields(obj)
            if not (omit_defaults and getattr(obj, field.name) == field.default)}


def _to_json(value: Any) -> Any:
    if isinstance(value, Instruction):
        return value.to_json()
    if dataclasses.is_dataclass(value):
        return _fields_json(value)
    if isinstance(value, tuple):
        return [_to_json(item) for item in value]
    return value


@dataclass(frozen=True)
class Piece:
    """One micro-batch of a kernel call: `kernel` on rows [start, start + size) of axis 0 of the `sliced` values."""

    kernel: str
    inputs: tuple[str, ...]
    start: int
    size: int
    algorithm: str
    sliced: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class KernelCall(Instruction):
    """Call compiled kernel `kernel` on `inputs`, writing `outputs`; with `pieces`, as micro-batches of axis 0.

    `inplace` pairs (output, input) whose buffers may coincide; `init` calls read only weights and run at load.
    """

    kernel: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    inplace: tuple[tuple[str, str], ...] = ()
    pieces: tuple[Piece, ...] = ()
    algorithm: str | None = None
    init: bool = False

    KIND = "kernel"
    VALUE_FIELDS = ("inputs", "outputs", "inplace")

    def reads(self) -> Iterator[tuple[str, str]]:
        yield from ((f"inputs[{k}]", name) for k, name in enumerate(self.inputs))
        for p, piece in enumerate(self.pieces):
            # A piece may read the call's own output, written by the pieces before it (a sum over micro-batches):
            # not a read of an earlier value.
            yield from ((f"pieces[{p}].inputs[{k}]", name) for k, name in enumerate(piece.inputs)
                        if name not in self.outputs)

    def writes(self) -> tuple[str, ...]:
        return self.outputs

    @property
    def runs_at_load(self) -> bool:
        return self.init

    def kernel_keys(self) -> tuple[str, ...]:
        """Every kernel the call runs (each piece's, when it has pieces)."""
        return (self.kernel, *(piece.kernel for piece in self.pieces))

    def renamed(self, names: Mapping[str, str]) -> Instruction:
        pieces = tuple(dataclasses.replace(p, inputs=_rename(p.inputs, names), sliced=_rename(p.sliced, names))
                       for p in self.pieces)
        return dataclasses.replace(super().renamed(names), pieces=pieces)


@dataclass(frozen=True, kw_only=True)
class View(Instruction):
    """`output` is `input`'s memory under another shape (Reshape, Flatten, Squeeze, ...): no copy."""

    input: str
    output: str
    init: bool = False

    KIND = "view"
    VALUE_FIELDS = ("input", "output")

    def reads(self) -> Iterator[tuple[str, str]]:
        yield "input", self.input

    def writes(self) -> tuple[str, ...]:
        return (self.output,)

    @property
    def runs_at_load(self) -> bool:
        return self.init


@dataclass(frozen=True)
class Branch:
    """The instructions of one branch of an `If` and the values it returns."""

    instructions: tuple[Instruction, ...]
    results: tuple[str, ...]

    def renamed(self, names: Mapping[str, str]) -> Branch:
        """The branch with value names replaced."""
        return Branch(tuple(i.renamed(names) for i in self.instructions), _rename(self.results, names))


@dataclass(frozen=True, kw_only=True)
class If(Instruction):
    """Run `then_branch` when the scalar `condition` is true, else `else_branch`; copy its results to `outputs`."""

    condition: str
    then_branch: Branch
    else_branch: Branch
    outputs: tuple[str, ...]

    KIND = "if"
    VALUE_FIELDS = ("condition", "outputs")

    def reads(self) -> Iterator[tuple[str, str]]:
        yield "condition", self.condition

    def writes(self) -> tuple[str, ...]:
        return self.outputs

    def branches(self) -> tuple[tuple[str, Branch], ...]:
        """(field name, branch) of both branches."""
        return ("then_branch", self.then_branch), ("else_branch", self.else_branch)

    def renamed(self, names: Mapping[str, str]) -> Instruction:
        return dataclasses.replace(super().renamed(names), then_branch=self.then_branch.renamed(names),
                                   else_branch=self.else_branch.renamed(names))


@dataclass(frozen=True, kw_only=True)
class Send(Instruction):
    """Send `tensor` to worker `peer` under `tag` (asynchronous: runtime/held_sends.py says when it is waited for)."""

    tensor: str
    peer: int
    tag: int

    KIND = "send"
    VALUE_FIELDS = ("tensor",)

    def reads(self) -> Iterator[tuple[str, str]]:
        yield "tensor", self.tensor


@dataclass(frozen=True, kw_only=True)
class Recv(Instruction):
    """Receive `output` from worker `peer` under `tag`."""

    output: str
    peer: int
    tag: int

    KIND = "recv"
    VALUE_FIELDS = ("output",)

    def writes(self) -> tuple[str, ...]:
        return (self.output,)


@dataclass(frozen=True, kw_only=True)
class Scatter(Instruction):
    """Split `source` (held by worker `root` only) on axis 0 into `parts` equal slices: worker r gets slice r
    in `output`. Tags `tag`, `tag` + 1, ... go to workers 1, 2, ..."""

    output: str
    root: int
    parts: int
    tag: int
    source: str | None = None

    KIND = "scatter"
    VALUE_FIELDS = ("output", "source")

    def reads(self) -> Iterator[tuple[str, str]]:
        if self.source is not None:
            yield "source", self.source

    def writes(self) -> tuple[str, ...]:
        return (self.output,)


@dataclass(frozen=True, kw_only=True)
class Gather(Instruction):
    """Concatenate every worker's `input` on axis 0, in worker order, into `output` on worker `root` only."""

    input: str
    root: int
    parts: int
    tag: int
    output: str | None = None

    KIND = "gather"
    VALUE_FIELDS = ("input", "output")

    def reads(self) -> Iterator[tuple[str, str]]:
        yield "input", self.input

    def writes(self) -> tuple[str, ...]:
        return () if self.output is None else (self.output,)


@dataclass(frozen=True, kw_only=True)
class AllReduce(Instruction):
    """Replace `tensor` on every worker by the element-wise `reduction` (sum, mean, max, min) over all workers;
    with an `output` (a value of the same type), write the result there and leave `tensor` as it is. A mean
    with a `compression` (runtime/ps_compression.CODECS) exchanges each worker's encoded tensor instead, with
    error feedback: `part_sizes` and `part_rows` are the element counts and leading dimensions of the tensors
    flattened into it (1-bit's segments), `topk_ratio` top-k's share of elements sent."""

    tensor: str
    reduction: str = "sum"
    output: str | None = None
    compression: str = "none"
    topk_ratio: float = 0.01
    part_sizes: tuple[int, ...] = ()
    part_rows: tuple[int, ...] = ()

    KIND = "all_reduce"
    VALUE_FIELDS = ("tensor", "output")
    REDUCTIONS: ClassVar[tuple[str, ...]] = ("sum", "mean", "max", "min")

    def reads(self) -> Iterator[tuple[str, str]]:
        yield "tensor", self.tensor

    def writes(self) -> tuple[str, ...]:
        return (self.output or self.tensor,)


@dataclass(frozen=True, kw_only=True)
class Fail(Instruction):
    """Stop the run with `message` (a branch the compiler proved cannot run)."""

    message: str

    KIND = "fail"


@dataclass(frozen=True, kw_only=True)
class Assign(Instruction):
    """Copy `src` into the persistent state buffer `dst` (same type): `dst`'s value in the next run.

    State buffers live outside the arena and across runs (plan.json's "state"). An Assign comes after every
    instruction that reads the state's current value (directly or through a view), and as early as that
    allows, so that `src`'s buffer is free again.
    """

    src: str
    dst: str

    KIND = "assign"
    VALUE_FIELDS = ("src", "dst")

    def reads(self) -> Iterator[tuple[str, str]]:
        yield "src", self.src

    def writes(self) -> tuple[str, ...]:
        return (self.dst,)


KINDS: dict[str, type[Instruction]] = {cls.KIND: cls for cls in (KernelCall, View, If, Send, Recv, Scatter, Gather,
                                                                  AllReduce, Fail, Assign)}


# ---- reading JSON -----------------------------------------------------------
def from_json(doc: Any, where: str = "instruction") -> Instruction:
    """The instruction `doc` describes; ProgramFormatError naming the field when it is not well formed."""
    if not isinstance(doc, dict):
        raise ProgramFormatError(where, f"must be an object, not {json_type_name(doc)}")
    kind = doc.get("kind")
    if kind not in KINDS:
        raise ProgramFormatError(f"{where}.kind", f"unknown instruction kind {kind!r}; expected one of {', '.join(KINDS)}")
    cls = KINDS[kind]
    instruction = cls(**_decode_fields(cls, doc, where, skip=("kind",)))
    if isinstance(instruction, AllReduce) and instruction.reduction not in AllReduce.REDUCTIONS:
        raise ProgramFormatError(f"{where}.reduction", f"{instruction.reduction!r} is not one of "
                                                       f"{', '.join(AllReduce.REDUCTIONS)}")
    return instruction


def program_from_json(docs: Any, where: str = "instructions") -> list[Instruction]:
    """A list of instructions from its JSON."""
    if not isinstance(docs, list):
        raise ProgramFormatError(where, f"must be a list, not {json_type_name(docs)}")
    return [from_json(doc, f"{where}[{k}]") for k, doc in enumerate(docs)]


def program_to_json(instructions: Iterable[Instruction]) -> list[dict[str, Any]]:
    """The JSON of a list of instructions."""
    return [instruction.to_json() for instruction in instructions]


_HINTS: dict[type, dict[str, Any]] = {}


def _decode_fields(cls: type, doc: dict, where: str, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    hints = _HINTS.setdefault(cls, typing.get_type_hints(cls))
    fields = {field.name: field for field in dataclasses.fields(cls)}
    unknown = sorted(set(doc) - set(fields) - set(skip))
    if unknown:
        raise ProgramFormatError(f"{where}.{unknown[0]}", f"unknown field for {getattr(cls, 'KIND', None) or cls.__name__}")
    values = {}
    for name, field in fields.items():
        if name not in doc:
            if field.default is dataclasses.MISSING:
                raise ProgramFormatError(where, f"missing field '{name}'")
            continue
        values[name] = _decode(hints[name], doc[name], f"{where}.{name}")
    return values


def _decode(hint: Any, value: Any, where: str) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        return _decode(next(a for a in args if a is not type(None)), value, where)
    if origin is tuple:
        if not isinstance(value, list):
            raise ProgramFormatError(where, f"must be a list, not {json_type_name(value)}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_decode(args[0], item, f"{where}[{k}]") for k, item in enumerate(value))
        if len(value) != len(args):
            raise ProgramFormatError(where, f"must be a list of {len(args)}")
        return tuple(_decode(a, item, f"{where}[{k}]") for k, (a, item) in enumerate(zip(args, value)))
    if hint is Instruction:
        return from_json(value, where)
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise ProgramFormatError(where, f"must be an object, not {json_type_name(value)}")
        return hint(**_decode_fields(hint, value, where))
    if hint is bool:
        if not isinstance(value, bool):
            raise ProgramFormatError(where, f"must be a boolean, not {json_type_name(value)}")
        return value
    if hint is int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise ProgramFormatError(where, f"must be an integer, not {json_type_name(value)}")
        return value
    if hint is float:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ProgramFormatError(where, f"must be a number, not {json_type_name(value)}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ProgramFormatError(where, f"must be a string, not {json_type_name(value)}")
        return value
    raise TypeError(f"no JSON decoding for {hint!r}")


def json_type_name(value: Any) -> str:
    """How a JSON value's type reads in an error message ("an object", "a list", ...)."""
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null",
            float: "a number", int: "an integer"}.get(type(value), type(value).__name__)


# ---- walking ----------------------------------------------------------------
def walk(instructions: Iterable[Instruction]) -> Iterator[Instruction]:
    """Every instruction, those inside `If` branches included (a branch's after its `If`)."""
    for instruction in instructions:
        yield instruction
        if isinstance(instruction, If):
            for _, branch in instruction.branches():
                yield from walk(branch.instructions)


def reads_within(instruction: Instruction) -> set[str]:
    """Every value the instruction reads, with what its branches read and return."""
    names = set()
    for inner in walk([instruction]):
        names.update(name for _, name in inner.reads())
        if isinstance(inner, If):
            names.update(inner.then_branch.results + inner.else_branch.results)
    return names


def kernel_keys(instructions: Iterable[Instruction]) -> Iterator[str]:
    """The key of every kernel the instructions call, branches included."""
    for instruction in walk(instructions):
        if isinstance(instruction, KernelCall):
            yield from instruction.kernel_keys()


def kernel_call_count(instructions: Iterable[Instruction]) -> int:
    """Kernel calls one run makes at most (an `If` counts its costlier branch)."""
    total = 0
    for instruction in instructions:
        if isinstance(instruction, KernelCall):
            total += 1
        elif isinstance(instruction, If):
            total += max(kernel_call_count(b.instructions) for _, b in instruction.branches())
    return total


def sent_values(instructions: Iterable[Instruction]) -> tuple[str, ...]:
    """The values sent to other workers without waiting (a Send's tensor, a scatter root's whole tensor, a
    gather's slice off the root): their buffers stay untouched until the run's end, when the sends complete."""
    sent = []
    for instruction in walk(instructions):
        if isinstance(instruction, Send):
            sent.append(instruction.tensor)
        elif isinstance(instruction, Scatter) and instruction.source is not None:
            sent.append(instruction.source)
        elif isinstance(instruction, Gather) and instruction.output is None:
            sent.append(instruction.input)
    return tuple(sent)


class BufferUse(NamedTuple):
    """What one executed instruction does to buffers: values read and written, views ((output, input): the
    output is the input's buffer, reshaped) and in-place candidates ((output, input): the output may be
    written over the input when the input dies there)."""

    node: str
    op: str
    reads: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()
    views: tuple[tuple[str, str], ...] = ()
    inplace: tuple[tuple[str, str], ...] = ()


def buffer_uses(instructions: Iterable[Instruction]) -> Iterator[BufferUse]:
    """The instructions one run executes, in order, as buffer uses: the memory planner's timeline and the plan
    check's. `If` branches are flattened (its condition, the then-branch, the else-branch, then the copy of
    the taken branch's results: only one runs, so this is conservative); `init` instructions run at load,
    outside the arena, and are left out."""
    for instruction in instructions:
        if instruction.runs_at_load:
            continue
        name, op, reads = instruction.node, instruction.op, tuple(n for _, n in instruction.reads())
        if isinstance(instruction, If):
            yield BufferUse(name, op, reads)
            for _, branch in instruction.branches():
                yield from buffer_uses(branch.instructions)
            results = instruction.then_branch.results + instruction.else_branch.results
            yield BufferUse(f"{name}/results", op, results, instruction.outputs)
        elif isinstance(instruction, View):
            yield BufferUse(name, op, reads, instruction.writes(), views=((instruction.output, instruction.input),))
        elif isinstance(instruction, KernelCall):
            yield BufferUse(name, op, reads, instruction.writes(), inplace=instruction.inplace)
        else:
            yield BufferUse(name, op, reads, instruction.writes())
