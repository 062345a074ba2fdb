"""The schema of plan.json, checked before anything an artifact names is loaded.

plan.json drives native code: it says which libraries to load and where in the
arena each kernel reads and writes. A damaged or edited plan is refused with
one line before it reaches a kernel: every field has its type and range, every
name an instruction uses is a declared value or kernel, every path is a plain relative
path, every arena buffer lies inside the arena on an aligned offset, and no two
buffers live at the same step share bytes — except where the memory planner
lets them (a view shares its source's buffer; a kernel declaring an output
in place of an input may write over that input when it dies at that step).
Every value an instruction reads is written before it (an input, a weight or an
earlier instruction's output), and every output of the program by its end: an
emptied or reordered program would otherwise run and return whatever its
buffers held. Each worker's program is checked on its own, its peers and roots
against the number of workers.

A training artifact's "state" names its persistent values: held by every
worker (data-parallel replicas), outside the arena, never a per-run input or a weight, written only by
`Assign`s (each copying a value of the same type) or in place by a kernel that also reads it (an optimizer
update), once per run, after every read of the state's current value, and never read by an instruction that
runs at load.
"""
from __future__ import annotations

import re
from pathlib import PurePosixPath, PureWindowsPath
from typing import Any, Iterator, Mapping

from tessel.ir.types import TensorType

from .errors import ArtifactError
from .instructions import (Assign, BufferUse, Fail, Gather, If, Instruction, KernelCall, ProgramFormatError, Recv,
                           Scatter, Send, View, buffer_uses, json_type_name, program_from_json, reads_within,
                           sent_values, walk)
from .load_transforms import entry_problem

# No tensor or arena of a real model comes near 256 TiB; anything larger is damage, not a plan.
MAX_BYTES = 1 << 48
MAX_ALIGNMENT = 1 << 16
MAX_WORKERS = 1 << 16
_SHA256 = re.compile(r"[0-9a-f]{64}")


class _Invalid(Exception):
    """A field of the plan breaks the schema: where (a path in the JSON) and what."""

    def __init__(self, where: str, problem: str):
        super().__init__(f"{where}: {problem}")


def validate_plan(plan: Any, source: str) -> None:
    """Check the whole plan against the schema; raise ArtifactError (one line, naming `source`) on the first fault."""
    try:
        _check_plan(plan)
    except _Invalid as exc:
        raise ArtifactError(f"{source}: {exc}; the plan is damaged or was edited: recompile the model") from None
    except RecursionError:
        raise ArtifactError(f"{source}: instructions nested too deeply; the plan is damaged: recompile the model") from None


def plain_relative_path(text: Any, where: str = "path") -> str:
    """`text` if it is a plain relative POSIX path (no absolute, drive, `..`, `.`, empty part or backslash)."""
    if not isinstance(text, str) or not text:
        raise _Invalid(where, "must be a non-empty relative path")
    if "\\" in text or "\0" in text or PureWindowsPath(text).drive or PurePosixPath(text).is_absolute():
        raise _Invalid(where, f"{text!r} is not a plain relative path inside the artifact")
    if any(part in ("", ".", "..") for part in text.split("/")):
        raise _Invalid(where, f"{text!r} is not a plain relative path inside the artifact (no '..', '.' or empty parts)")
    return text


def path_problem(text: Any) -> str | None:
    """Why `text` is not a plain relative path inside the artifact, or None when it is one."""
    try:
        plain_relative_path(text)
    except _Invalid as exc:
        return str(exc)
    return None


# ---- field types ------------------------------------------------------------
def _dict(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise _Invalid(where, f"must be an object, not {json_type_name(value)}")
    return value


def _list(value: Any, where: str) -> list:
    if not isinstance(value, list):
        raise _Invalid(where, f"must be a list, not {json_type_name(value)}")
    return value


def _str(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise _Invalid(where, f"must be a string, not {json_type_name(value)}")
    return value


def _int(value: Any, where: str, low: int = 0, high: int = MAX_BYTES) -> int:
    # bool is an int in Python, never in a plan.
    if not isinstance(value, int) or isinstance(value, bool):
        raise _Invalid(where, f"must be an integer, not {json_type_name(value)}")
    if not low <= value <= high:
        raise _Invalid(where, f"{value} is out of range [{low}, {high}]")
    return value


def _field(parent: Mapping, key: str, where: str) -> Any:
    if key not in parent:
        raise _Invalid(where, f"missing field '{key}'")
    return parent[key]


def _names(value: Any, where: str, types: Mapping[str, TensorType]) -> list[str]:
    names = _list(value, where)
    for k, name in enumerate(names):
        _value_name(name, f"{where}[{k}]", types)
    return names


def _value_name(name: Any, where: str, types: Mapping[str, TensorType]) -> str:
    if _str(name, where) not in types:
        raise _Invalid(where, f"'{name}' is not a value of the plan")
    return name


# ---- the plan ---------------------------------------------------------------
def _check_plan(plan: Any) -> None:
    top = _dict(plan, "plan")
    _str(_field(top, "target", "plan"), "target")
    kernels = _dict(_field(top, "kernels", "plan"), "kernels")
    for key, entry in kernels.items():
        entry = _dict(entry, f"kernels['{key}']")
        plain_relative_path(_field(entry, "file", f"kernels['{key}']"), f"kernels['{key}'].file")
        _str(_field(entry, "op", f"kernels['{key}']"), f"kernels['{key}'].op")
        for k, spec in enumerate(_list(entry.get("signature", []), f"kernels['{key}'].signature")):
            _str(spec, f"kernels['{key}'].signature[{k}]")
        for k, alignment in enumerate(_list(entry.get("arg_alignment", []), f"kernels['{key}'].arg_alignment")):
            # The native host reads an input in place when its address is a multiple: a power of two.
            at = f"kernels['{key}'].arg_alignment[{k}]"
            if _int(alignment, at, 1, 4096) & (alignment - 1):
                raise _Invalid(at, f"{alignment} is not a power of two")
    hashes = _dict(_field(top, "hashes", "plan"), "hashes")
    for name, digest in hashes.items():
        plain_relative_path(name, f"hashes['{name}']")
        if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
            raise _Invalid(f"hashes['{name}']", "must be a sha256 as 64 lowercase hex digits")
    if "microbatches" in top:
        _int(top["microbatches"], "microbatches", 1, MAX_BYTES)
    if "placement" in top:
        _str(top["placement"], "placement")
    workers = _list(_field(top, "workers", "plan"), "workers")
    if not 1 <= len(workers) <= MAX_WORKERS:
        raise _Invalid("workers", f"{len(workers)} worker programs; expected 1 to {MAX_WORKERS}")
    held = _held_state(top, len(workers))
    for rank, section in enumerate(workers):
        _check_worker(_dict(section, f"workers[{rank}]"), f"workers[{rank}]", kernels, rank, len(workers), held[rank])
    if "state" in top:
        for rank, section in enumerate(workers):
            _check_state(top["state"], section, held[rank], f"workers[{rank}]")
    if "input_defaults" in top:
        _names(top["input_defaults"], "input_defaults", dict.fromkeys(workers[0]["inputs"]))


def parsed_instructions(section: Mapping[str, Any], where: str) -> list[Instruction]:
    """A worker section's instructions, typed; a malformed one is a schema fault naming its field."""
    try:
        return program_from_json(_field(section, "instructions", where), f"{where}.instructions")
    except ProgramFormatError as exc:
        raise _Invalid(exc.where, exc.message) from None


def _held_state(top: dict, workers: int) -> list[frozenset[str]]:
    """The persistent values each worker holds (none without "state"): every one the plan names (data-parallel
    replicas start from the same state file), or, under the state's "workers", a list per worker (pipeline stages),
    each value held by one worker."""
    if "state" not in top:
        return [frozenset()] * workers
    state = _dict(top["state"], "state")
    names = _list(_field(state, "names", "state"), "state.names")
    for k, name in enumerate(names):
        _str(name, f"state.names[{k}]")
    if "workers" not in state:
        return [frozenset(names)] * workers
    lists = _list(state["workers"], "state.workers")
    if len(lists) != workers:
        raise _Invalid("state.workers", f"{len(lists)} lists for {workers} workers")
    held = [frozenset(_list(names_held, f"state.workers[{rank}]")) for rank, names_held in enumerate(lists)]
    owners = [name for names_held in held for name in names_held]
    if sorted(owners) != sorted(names):
        raise _Invalid("state.workers", "must hold every state value once")
    return held


def _check_state(state: dict, section: dict, held: frozenset[str], where: str = "workers[0]") -> None:
    """The state this worker holds (`held`) are values of its program outside its inputs, weights and arena; the
    file a plain path; each update names a state value and, for one held here, the value of the same type that
    the program assigns to it."""
    types = {name: TensorType.parse(spec) for name, spec in section["values"].items()}
    names = set(state["names"])
    _names([name for name in state["names"] if name in held], "state.names", types)
    plain_relative_path(_field(state, "file", "state"), "state.file")
    updates = _dict(_field(state, "updates", "state"), "state.updates")
    assigned = {i.dst: i.src for i in parsed_instructions(section, where) if isinstance(i, Assign)}
    for name, source in updates.items():
        at = f"state.updates['{name}']"
        if name not in names:
            raise _Invalid(at, f"'{name}' is not a state value")
        if name not in held:
            continue
        _value_name(source, at, types)
        if assigned.get(name) != source:
            raise _Invalid(at, f"the program does not assign '{source}' to '{name}'")
    extra = sorted(set(assigned) - set(updates))
    if extra:
        raise _Invalid("state.updates", f"the program assigns '{extra[0]}' but the state lists no update for it")


def _check_worker(section: dict, where: str, kernels: Mapping, rank: int, workers: int,
                  state: frozenset[str] = frozenset()) -> None:
    """One worker's program: values, inputs, outputs, weights, memory plan and instructions."""
    values = _dict(_field(section, "values", where), f"{where}.values")
    types: dict[str, TensorType] = {}
    for name, spec in values.items():
        at = f"{where}.values['{name}']"
        try:
            types[name] = TensorType.parse(_str(spec, at))
        except (ValueError, OverflowError) as exc:
            raise _Invalid(at, str(exc).splitlines()[0]) from None
        if types[name].nbytes > MAX_BYTES:
            raise _Invalid(at, f"{spec} is {types[name].nbytes} bytes, more than {MAX_BYTES}")
    inputs = _names(_field(section, "inputs", where), f"{where}.inputs", types)
    outputs = _names(_field(section, "outputs", where), f"{where}.outputs", types)
    weights = _dict(_field(section, "weights", where), f"{where}.weights")
    plain_relative_path(_field(weights, "file", f"{where}.weights"), f"{where}.weights.file")
    weight_names = _names(_field(weights, "names", f"{where}.weights"), f"{where}.weights.names", types)
    _check_at_load(_dict(weights.get("at_load", {}), f"{where}.weights.at_load"), f"{where}.weights.at_load",
                   weight_names, types)
    instructions = parsed_instructions(section, where)
    _check_instructions(instructions, f"{where}.instructions", types, kernels, rank, workers)
    _check_assigns(instructions, f"{where}.instructions", types, state)
    _check_dataflow(instructions, f"{where}.instructions", inputs, outputs, weight_names, where, state)
    memory = _dict(_field(section, "memory", where), f"{where}.memory")
    elsewhere = {"inputs": inputs, "weights": weight_names, "memory.offsets": _dict(memory.get("offsets", {}), where)}
    for place, held in elsewhere.items():
        shared = sorted(state.intersection(held))
        if shared:
            raise _Invalid(f"{where}.{place}", f"'{shared[0]}' is persistent state, which lives apart")
    _check_arena(memory, f"{where}.memory", instructions, inputs, outputs, types)


def _check_at_load(at_load: Mapping[str, Any], where: str, weight_names: list[str],
                   types: Mapping[str, TensorType]) -> None:
    """Every weight transformed at load is a weight of the section, its transform one the loader knows."""
    for name, entry in at_load.items():
        if name not in weight_names:
            raise _Invalid(f"{where}['{name}']", "not one of the section's weights")
        problem = entry_problem(entry, types[name])
        if problem is not None:
            raise _Invalid(f"{where}['{name}']", problem)


def _check_instructions(instructions: list[Instruction], where: str, types: Mapping[str, TensorType],
                        kernels: Mapping, rank: int, workers: int) -> None:
    for index, instruction in enumerate(instructions):
        at = f"{where}[{index}]"
        for field, name in instruction.reads():
            _value_name(name, f"{at}.{field}", types)
        for name in instruction.writes():
            _value_name(name, f"{at}.writes", types)
        if isinstance(instruction, KernelCall):
            _check_kernel_call(instruction, at, types, kernels)
        elif isinstance(instruction, View):
            # A view is the same memory with another shape: it may not reach past its source.
            source, view = types[instruction.input], types[instruction.output]
            if view.nbytes > source.nbytes:
                raise _Invalid(at, f"a view of {view.spec()} over {source.spec()} reaches past its source")
        elif isinstance(instruction, If):
            for field, branch in instruction.branches():
                _check_instructions(list(branch.instructions), f"{at}.{field}.instructions", types, kernels, rank,
                                    workers)
                for k, name in enumerate(branch.results):
                    _value_name(name, f"{at}.{field}.results[{k}]", types)
                if len(branch.results) != len(instruction.outputs):
                    raise _Invalid(f"{at}.{field}.results",
                                   f"{len(branch.results)} results for {len(instruction.outputs)} outputs")
        elif isinstance(instruction, (Send, Recv)):
            _int(instruction.peer, f"{at}.peer", 0, workers - 1)
            if instruction.peer == rank:
                raise _Invalid(f"{at}.peer", f"worker {rank} cannot exchange a tensor with itself")
            _int(instruction.tag, f"{at}.tag", 0, 1 << 62)
        elif isinstance(instruction, (Scatter, Gather)):
            _check_collective(instruction, at, types, rank, workers)


def _check_assigns(instructions: list[Instruction], where: str, types: Mapping[str, TensorType],
                   state: frozenset[str]) -> None:
    """State is written only by top-level Assigns, each copying a value of the state's type, or in place by a
    top-level kernel call that also reads it; once per state value, and nothing reads the state (or a view of
    it) after that write."""
    assigned: set[str] = set()
    owner: dict[str, str] = {name: name for name in state}  # a state value or a view of one -> the state value
    for index, instruction in enumerate(instructions):
        at = f"{where}[{index}]"
        stale = sorted(name for name in reads_within(instruction) if owner.get(name) in assigned)
        if stale:
            raise _Invalid(at, f"reads '{stale[0]}' after the Assign of state '{owner[stale[0]]}'; an Assign comes "
                               "after every read of its state")
        if isinstance(instruction, Assign):
            if instruction.dst not in state:
                raise _Invalid(f"{at}.dst", f"'{instruction.dst}' is not a state value")
            if instruction.dst in assigned:
                raise _Invalid(f"{at}.dst", f"state '{instruction.dst}' is assigned twice")
            assigned.add(instruction.dst)
            if types[instruction.src] != types[instruction.dst]:
                raise _Invalid(at, f"assigns '{instruction.src}' ({types[instruction.src].spec()}) to state "
                                   f"'{instruction.dst}' ({types[instruction.dst].spec()})")
            continue
        if isinstance(instruction, View) and instruction.input in owner:
            owner[instruction.output] = owner[instruction.input]
        in_place: set[str] = set()
        if isinstance(instruction, KernelCall) and not instruction.pieces:
            # Read here, so not yet written: the stale check above refuses a second write.
            in_place = state.intersection(instruction.writes()).intersection(instruction.inputs)
        for inner in walk([instruction]):
            if isinstance(inner, Assign):
                raise _Invalid(at, "holds an Assign inside a branch; Assigns run at the top level")
            written = sorted(state.intersection(inner.writes()) - in_place)
            if written:
                raise _Invalid(at, f"writes state '{written[0]}' without reading it; only an Assign or an update "
                                   "in place may")
        assigned.update(in_place)


def _check_collective(instruction: Scatter | Gather, at: str, types: Mapping[str, TensorType], rank: int,
                      workers: int) -> None:
    """A scatter or gather: root and parts within the workers, the whole tensor on the root alone, its rows
    `parts` times the slice's."""
    _int(instruction.root, f"{at}.root", 0, workers - 1)
    _int(instruction.parts, f"{at}.parts", 1, workers)
    _int(instruction.tag, f"{at}.tag", 0, 1 << 62)
    slice_name, whole_field = (instruction.output, "source") if isinstance(instruction, Scatter) else \
        (instruction.input, "output")
    whole = getattr(instruction, whole_field)
    if (whole is not None) != (rank == instruction.root):
        raise _Invalid(f"{at}.{whole_field}", f"the whole tensor belongs on the root (worker {instruction.root}) "
                                              f"and only there; this is worker {rank}")
    part = types[slice_name]
    if whole is not None:
        full = types[whole]
        if not part.rank or full.dtype != part.dtype or full.shape != (part.shape[0] * instruction.parts,) + part.shape[1:]:
            raise _Invalid(at, f"'{whole}' ({full.spec()}) is not {instruction.parts} slices of '{slice_name}' "
                               f"({part.spec()}) on axis 0")


def _check_kernel_call(call: KernelCall, at: str, types: Mapping[str, TensorType], kernels: Mapping) -> None:
    for field, key in [("kernel", call.kernel)] + [(f"pieces[{k}].kernel", p.kernel) for k, p in enumerate(call.pieces)]:
        if key not in kernels:
            raise _Invalid(f"{at}.{field}", f"kernel '{key}' is not in the plan's kernels")
    for k, pair in enumerate(call.inplace):
        _names(list(pair), f"{at}.inplace[{k}]", types)
    for k, piece in enumerate(call.pieces):
        where = f"{at}.pieces[{k}]"
        start = _int(piece.start, f"{where}.start")
        stop = start + _int(piece.size, f"{where}.size", 1)
        # A piece is a slice of axis 0 of these values: on a GPU it is a raw pointer, so it must lie inside.
        for name in _names(list(piece.sliced), f"{where}.sliced", types):
            rows = types[name].shape[0] if types[name].rank else 0
            if stop > rows:
                raise _Invalid(where, f"rows [{start}, {stop}) of '{name}', which has {rows}")
    # TVM checks each call too, but as a traceback in the middle of a run; here it is one line before any.
    for key, arguments in kernel_calls(call, types):
        signature = kernels[key].get("signature")
        if arguments != signature:
            raise _Invalid(at, f"passes ({', '.join(arguments)}) to kernel '{key}', which takes "
                               f"({', '.join(signature) if signature is not None else 'no recorded signature'})")


def kernel_calls(call: KernelCall, types: Mapping[str, TensorType]) -> Iterator[tuple[str, list[str]]]:
    """(kernel, argument types: inputs then outputs) of each call a kernel call makes: the whole call,
    or each micro-batch piece on its rows of axis 0."""
    if not call.pieces:
        yield call.kernel, [types[name].spec() for name in call.inputs + call.outputs]
        return
    for piece in call.pieces:
        sliced = set(piece.sliced)
        yield piece.kernel, [TensorType(types[name].dtype, (piece.size,) + types[name].shape[1:]).spec()
                             if name in sliced else types[name].spec() for name in piece.inputs + call.outputs]


# ---- the dataflow -----------------------------------------------------------
def _check_dataflow(instructions: list[Instruction], where: str, inputs: list[str], outputs: list[str],
                    weights: list[str], section: str, state: frozenset[str] = frozenset()) -> None:
    """Each value read after it is written; each output written by the end (a worker program's own outputs).
    State holds a value before the first run, but is not a weight: an `init` instruction may not read it."""
    written = set(inputs) | set(weights) | state
    if _check_reads(instructions, where, written, set(weights), []):
        for k, name in enumerate(outputs):
            if name not in written:
                raise _Invalid(f"{section}.outputs[{k}]", f"output '{name}' is never written by any instruction")


def _check_reads(instructions: list[Instruction], where: str, written: set, constant: set | None, added: list) -> bool:
    """Walk the instructions in order: what each reads must be in `written`, then what it writes joins it (and
    `added`, when new). `constant` (top level only) holds what an `init` instruction may read: the runtime runs
    those at load, before any input. False when a `Fail` stops the walk: nothing after it runs."""
    for index, instruction in enumerate(instructions):
        at = f"{where}[{index}]"
        if isinstance(instruction, Fail):
            return False
        init = constant is not None and instruction.runs_at_load
        available = constant if init else written
        for field, name in instruction.reads():
            if name not in available:
                problem = "is neither a weight nor an earlier init instruction's output (init instructions run at " \
                          "load)" if init else "is read before any instruction writes it"
                raise _Invalid(f"{at}.{field}", f"'{name}' {problem}")
        if isinstance(instruction, If):
            for field, branch in instruction.branches():
                # A branch reads what is written outside; what it writes is its own and gone after it.
                inner: list[str] = []
                if _check_reads(list(branch.instructions), f"{at}.{field}.instructions", written, None, inner):
                    for k, name in enumerate(branch.results):
                        if name not in written:
                            raise _Invalid(f"{at}.{field}.results[{k}]", f"'{name}' is never written in the branch")
                written.difference_update(inner)
        for name in instruction.writes():
            if name not in written:
                written.add(name)
                added.append(name)
            if init:
                constant.add(name)
    return True


# ---- the arena --------------------------------------------------------------
def _check_arena(memory: dict, where: str, instructions: list[Instruction], inputs: list[str], outputs: list[str],
                 types: Mapping[str, TensorType]) -> None:
    """Offsets aligned and inside the arena; no two buffers live at once share a byte."""
    alignment = _int(_field(memory, "alignment", where), f"{where}.alignment", 1, MAX_ALIGNMENT)
    if alignment & (alignment - 1):
        raise _Invalid(f"{where}.alignment", f"{alignment} is not a power of two")
    arena = _int(_field(memory, "arena_bytes", where), f"{where}.arena_bytes")
    offsets = _dict(_field(memory, "offsets", where), f"{where}.offsets")
    for name, offset in offsets.items():
        at = f"{where}.offsets['{name}']"
        _value_name(name, at, types)
        _int(offset, at)
        if offset % alignment:
            raise _Invalid(at, f"{offset} is not a multiple of the alignment {alignment}")
        if offset + types[name].nbytes > arena:
            raise _Invalid(at, f"'{name}' ({types[name].nbytes} bytes at {offset}) ends past the arena of {arena} bytes")
    # The planner never needs more than every buffer side by side.
    most = sum(-(-types[name].nbytes // alignment) * alignment for name in offsets)
    if arena > most:
        raise _Invalid(f"{where}.arena_bytes", f"{arena} bytes for buffers that need at most {most}")
    _check_no_overlap(offsets, instructions, inputs, outputs, types, where)


def _check_no_overlap(offsets: Mapping[str, int], instructions: list[Instruction], inputs: list[str],
                      outputs: list[str], types: Mapping[str, TensorType], where: str) -> None:
    uses = list(buffer_uses(instructions))
    sent = sent_values(instructions)
    if sent:
        uses.append(BufferUse("", "", sent))  # sends complete asynchronously: sent buffers live to the end
    last = len(uses)
    root = {name: name for name in offsets}

    def find(name: str) -> str:
        while root[name] != name:
            root[name] = root[root[name]]
            name = root[name]
        return name

    first_write = {name: -1 for name in inputs if name in offsets}
    last_read = {name: last for name in outputs if name in offsets}
    allowed: dict[frozenset, int] = {}
    for t, (_, _, reads, writes, views, _) in enumerate(uses):
        for out, source in views:
            if out in root and source in root:
                root[find(out)] = find(source)
        for name in writes:
            if name in offsets:
                first_write.setdefault(name, t)
        for name in reads:
            if name in offsets:
                last_read[name] = max(last_read.get(name, t), t)
    for t, use in enumerate(uses):
        for out, source in use.inplace:
            if out in root and source in root:
                allowed[frozenset((find(out), find(source)))] = t
    groups: dict[str, list[str]] = {}
    for name in offsets:
        groups.setdefault(find(name), []).append(name)
    blocks = []
    for key, members in groups.items():
        if len({offsets[m] for m in members}) > 1:
            raise _Invalid(f"{where}.offsets", f"'{members[0]}' and its view '{members[1]}' have different offsets")
        start = min(first_write.get(m, last) for m in members)
        end = max(start, max(last_read.get(m, first_write.get(m, -1)) for m in members))
        size = max(types[m].nbytes for m in members)
        if size:
            blocks.append((start, end, offsets[members[0]], size, key))
    active: list[tuple[int, int, int, int, str]] = []
    for block in sorted(blocks):
        start, end, offset, size, key = block
        active = [a for a in active if a[1] >= start]
        for a_start, a_end, a_offset, a_size, a_key in active:
            if a_offset < offset + size and offset < a_offset + a_size:
                step = allowed.get(frozenset((key, a_key)))
                if step is not None and a_offset == offset and a_end == start == step:
                    continue  # an output written in place of an input that dies at this instruction
                raise _Invalid(f"{where}.offsets", f"'{a_key}' and '{key}' share arena bytes while both are live "
                                                   f"(instructions {max(a_start, start)} to {min(a_end, end)})")
        active.append(block)
