"""The schema of plan.json, checked before anything an artifact names is loaded.

plan.json drives native code: it says which libraries to load and where in the
arena each kernel reads and writes. A damaged or edited plan is refused with
one line before it reaches a kernel: every field has its type and range, every
name a step uses is a declared value or kernel, every path is a plain relative
path, every arena buffer lies inside the arena on an aligned offset, and no two
buffers live at the same step share bytes — except where the memory planner
lets them (a view shares its source's buffer; a kernel declaring an output
in place of an input may write over that input when it dies at that step).
Every value a step reads is written before it (an input, a weight or an earlier
step's output), and every output of the program by its end: an emptied or
reordered step list would otherwise run and return whatever its buffers held.
"""
from __future__ import annotations

import re
from pathlib import PurePosixPath, PureWindowsPath
from typing import Any, Iterator, Mapping

from tessel.ir.types import TensorType

from .errors import ArtifactError

# No tensor or arena of a real model comes near 256 TiB; anything larger is damage, not a plan.
MAX_BYTES = 1 << 48
MAX_ALIGNMENT = 1 << 16
MAX_DEVICES = 1 << 16
STEP_KINDS = ("kernel", "view", "if", "send", "recv", "fail")
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
        raise ArtifactError(f"{source}: steps nested too deeply; the plan is damaged: recompile the model") from None


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
        raise _Invalid(where, f"must be an object, not {_kind(value)}")
    return value


def _list(value: Any, where: str) -> list:
    if not isinstance(value, list):
        raise _Invalid(where, f"must be a list, not {_kind(value)}")
    return value


def _str(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise _Invalid(where, f"must be a string, not {_kind(value)}")
    return value


def _int(value: Any, where: str, low: int = 0, high: int = MAX_BYTES) -> int:
    # bool is an int in Python, never in a plan.
    if not isinstance(value, int) or isinstance(value, bool):
        raise _Invalid(where, f"must be an integer, not {_kind(value)}")
    if not low <= value <= high:
        raise _Invalid(where, f"{value} is out of range [{low}, {high}]")
    return value


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null",
            float: "a number", int: "an integer"}.get(type(value), type(value).__name__)


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
    hashes = _dict(_field(top, "hashes", "plan"), "hashes")
    for name, digest in hashes.items():
        plain_relative_path(name, f"hashes['{name}']")
        if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
            raise _Invalid(f"hashes['{name}']", "must be a sha256 as 64 lowercase hex digits")
    for key in ("data_parallel", "microbatches"):
        if key in top:
            _int(top[key], key, 1, MAX_DEVICES)
    if "hybrid" in top:
        _int(_field(_dict(top["hybrid"], "hybrid"), "replicas", "hybrid"), "hybrid.replicas", 1, MAX_DEVICES)
    sections = [("", top)]
    if "devices" in top:
        devices = _list(top["devices"], "devices")
        if not 1 <= len(devices) <= MAX_DEVICES:
            raise _Invalid("devices", f"{len(devices)} device programs; expected 1 to {MAX_DEVICES}")
        sections += [(f"devices[{d}].", _dict(section, f"devices[{d}]")) for d, section in enumerate(devices)]
    workers = max(len(sections) - 1, int(top.get("data_parallel", 1)), int(top.get("hybrid", {}).get("replicas", 1)))
    for prefix, section in sections:
        _check_section(section, prefix, kernels, workers)
    if "input_defaults" in top:
        _names(top["input_defaults"], "input_defaults", dict.fromkeys(top["inputs"]))


def _check_section(section: dict, prefix: str, kernels: Mapping, workers: int) -> None:
    """One device's program: values, inputs, outputs, weights, memory plan and steps."""
    where = prefix.rstrip(".") or "plan"
    values = _dict(_field(section, "values", where), f"{prefix}values")
    types: dict[str, TensorType] = {}
    for name, spec in values.items():
        at = f"{prefix}values['{name}']"
        try:
            types[name] = TensorType.parse(_str(spec, at))
        except (ValueError, OverflowError) as exc:
            raise _Invalid(at, str(exc).splitlines()[0]) from None
        if types[name].nbytes > MAX_BYTES:
            raise _Invalid(at, f"{spec} is {types[name].nbytes} bytes, more than {MAX_BYTES}")
    _names(_field(section, "inputs", where), f"{prefix}inputs", types)
    _names(_field(section, "outputs", where), f"{prefix}outputs", types)
    weights = _dict(_field(section, "weights", where), f"{prefix}weights")
    plain_relative_path(_field(weights, "file", f"{prefix}weights"), f"{prefix}weights.file")
    _names(_field(weights, "names", f"{prefix}weights"), f"{prefix}weights.names", types)
    steps = _list(_field(section, "steps", where), f"{prefix}steps")
    _check_steps(steps, f"{prefix}steps", types, kernels, workers)
    _check_dataflow(section, prefix)
    _check_arena(_dict(_field(section, "memory", where), f"{prefix}memory"), f"{prefix}memory", section, types)


def _check_steps(steps: list, where: str, types: Mapping[str, TensorType], kernels: Mapping, workers: int) -> None:
    for index, step in enumerate(steps):
        at = f"{where}[{index}]"
        step = _dict(step, at)
        kind = _str(_field(step, "kind", at), f"{at}.kind")
        if kind not in STEP_KINDS:
            raise _Invalid(f"{at}.kind", f"unknown step kind {kind!r}; expected one of {', '.join(STEP_KINDS)}")
        _str(_field(step, "node", at), f"{at}.node")
        _str(_field(step, "op", at), f"{at}.op")
        if "init" in step and not isinstance(step["init"], bool):
            raise _Invalid(f"{at}.init", f"must be a boolean, not {_kind(step['init'])}")
        if kind == "kernel":
            _check_kernel_step(step, at, types, kernels)
        elif kind == "view":
            _check_view_step(step, at, types)
        elif kind == "if":
            _value_name(_field(step, "condition", at), f"{at}.condition", types)
            outputs = _names(_field(step, "outputs", at), f"{at}.outputs", types)
            for branch in ("then", "else"):
                body = _dict(_field(step, branch, at), f"{at}.{branch}")
                _check_steps(_list(_field(body, "steps", f"{at}.{branch}"), f"{at}.{branch}.steps"),
                             f"{at}.{branch}.steps", types, kernels, workers)
                results = _names(_field(body, "results", f"{at}.{branch}"), f"{at}.{branch}.results", types)
                if len(results) != len(outputs):
                    raise _Invalid(f"{at}.{branch}.results", f"{len(results)} results for {len(outputs)} outputs")
        elif kind in ("send", "recv"):
            _value_name(_field(step, "tensor" if kind == "send" else "output", at),
                        f"{at}.{'tensor' if kind == 'send' else 'output'}", types)
            peer = "to" if kind == "send" else "from"
            _int(_field(step, peer, at), f"{at}.{peer}", 0, workers - 1)
            _int(_field(step, "tag", at), f"{at}.tag", 0, 1 << 62)
        else:
            _str(_field(step, "message", at), f"{at}.message")


def _check_kernel_step(step: dict, at: str, types: Mapping[str, TensorType], kernels: Mapping) -> None:
    _kernel_key(_field(step, "kernel", at), f"{at}.kernel", kernels)
    _names(_field(step, "inputs", at), f"{at}.inputs", types)
    _names(_field(step, "outputs", at), f"{at}.outputs", types)
    for k, pair in enumerate(_list(step.get("inplace", []), f"{at}.inplace")):
        pair = _list(pair, f"{at}.inplace[{k}]")
        if len(pair) != 2:
            raise _Invalid(f"{at}.inplace[{k}]", "must be an [output, input] pair")
        _names(pair, f"{at}.inplace[{k}]", types)
    for k, piece in enumerate(_list(step.get("pieces", []), f"{at}.pieces")):
        where = f"{at}.pieces[{k}]"
        piece = _dict(piece, where)
        _kernel_key(_field(piece, "kernel", where), f"{where}.kernel", kernels)
        _names(_field(piece, "inputs", where), f"{where}.inputs", types)
        start = _int(_field(piece, "start", where), f"{where}.start")
        stop = start + _int(_field(piece, "size", where), f"{where}.size", 1)
        # A piece is a slice of axis 0 of these values: on a GPU it is a raw pointer, so it must lie inside.
        for name in _names(_field(piece, "sliced", where), f"{where}.sliced", types):
            rows = types[name].shape[0] if types[name].rank else 0
            if stop > rows:
                raise _Invalid(where, f"rows [{start}, {stop}) of '{name}', which has {rows}")
    # TVM checks each call too, but as a traceback in the middle of a run; here it is one line before any.
    for key, arguments in kernel_calls(step, types):
        signature = kernels[key].get("signature")
        if arguments != signature:
            raise _Invalid(at, f"passes ({', '.join(arguments)}) to kernel '{key}', which takes "
                               f"({', '.join(signature) if signature is not None else 'no recorded signature'})")


def kernel_calls(step: Mapping[str, Any], types: Mapping[str, TensorType]) -> Iterator[tuple[str, list[str]]]:
    """(kernel, argument types: inputs then outputs) of each call a kernel step makes: the whole step,
    or each micro-batch piece on its rows of axis 0."""
    if "pieces" not in step:
        yield step["kernel"], [types[name].spec() for name in step["inputs"] + step["outputs"]]
        return
    for piece in step["pieces"]:
        sliced = set(piece["sliced"])
        yield piece["kernel"], [TensorType(types[name].dtype, (piece["size"],) + types[name].shape[1:]).spec()
                                if name in sliced else types[name].spec() for name in piece["inputs"] + step["outputs"]]


def all_steps(steps: list) -> Iterator[Mapping[str, Any]]:
    """Every step, those inside `if` branches included."""
    for step in steps:
        yield step
        if step["kind"] == "if":
            yield from all_steps(step["then"]["steps"])
            yield from all_steps(step["else"]["steps"])


def _check_view_step(step: dict, at: str, types: Mapping[str, TensorType]) -> None:
    source = types[_value_name(_field(step, "input", at), f"{at}.input", types)]
    view = types[_value_name(_field(step, "output", at), f"{at}.output", types)]
    # A view is the same memory with another shape: it may not reach past its source.
    if view.nbytes > source.nbytes:
        raise _Invalid(at, f"a view of {view.spec()} over {source.spec()} reaches past its source")


def _kernel_key(key: Any, where: str, kernels: Mapping) -> str:
    if _str(key, where) not in kernels:
        raise _Invalid(where, f"kernel '{key}' is not in the plan's kernels")
    return key


# ---- the dataflow -----------------------------------------------------------
def _check_dataflow(section: dict, prefix: str) -> None:
    """Each value read after it is written; each output written by the end (a device program's own outputs)."""
    weights = set(section["weights"]["names"])
    written = set(section["inputs"]) | weights
    if _check_reads(section["steps"], f"{prefix}steps", written, weights, []):
        for k, name in enumerate(section["outputs"]):
            if name not in written:
                raise _Invalid(f"{prefix}outputs[{k}]", f"output '{name}' is never written by any step")


def _check_reads(steps: list, where: str, written: set, constant: set | None, added: list) -> bool:
    """Walk `steps` in order: what each reads must be in `written`, then what it writes joins it (and `added`,
    when new). `constant` (top level only) holds what an "init" step may read: the runtime runs those at load,
    before any input. False when a `fail` step stops the walk: nothing after it runs."""
    for index, step in enumerate(steps):
        at = f"{where}[{index}]"
        kind = step["kind"]
        if kind == "fail":
            return False
        init = constant is not None and step.get("init", False)
        available = constant if init else written
        for field, name in _reads(step):
            if name not in available:
                problem = "is neither a weight nor an earlier init step's output (init steps run at load)" if init \
                    else "is read before any step writes it"
                raise _Invalid(f"{at}.{field}", f"'{name}' {problem}")
        if kind == "if":
            for branch in ("then", "else"):
                # A branch reads what is written outside; what it writes is its own and gone after it.
                inner: list[str] = []
                if _check_reads(step[branch]["steps"], f"{at}.{branch}.steps", written, None, inner):
                    for k, name in enumerate(step[branch]["results"]):
                        if name not in written:
                            raise _Invalid(f"{at}.{branch}.results[{k}]", f"'{name}' is never written in the branch")
                written.difference_update(inner)
        for name in _writes(step):
            if name not in written:
                written.add(name)
                added.append(name)
            if init:
                constant.add(name)
    return True


def _reads(step: Mapping[str, Any]) -> Iterator[tuple[str, str]]:
    """(field, value name) of each value a step reads before it runs (an `if`: its condition)."""
    kind = step["kind"]
    if kind == "kernel":
        yield from ((f"inputs[{k}]", name) for k, name in enumerate(step["inputs"]))
        for p, piece in enumerate(step.get("pieces", ())):
            yield from ((f"pieces[{p}].inputs[{k}]", name) for k, name in enumerate(piece["inputs"]))
    elif kind == "view":
        yield "input", step["input"]
    elif kind == "send":
        yield "tensor", step["tensor"]
    elif kind == "if":
        yield "condition", step["condition"]


def _writes(step: Mapping[str, Any]) -> list[str]:
    """The values a step writes."""
    kind = step["kind"]
    if kind in ("kernel", "if"):
        return step["outputs"]
    if kind in ("view", "recv"):
        return [step["output"]]
    return []


# ---- the arena --------------------------------------------------------------
def _check_arena(memory: dict, where: str, section: dict, types: Mapping[str, TensorType]) -> None:
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
    _check_no_overlap(offsets, section, types, where)


def _check_no_overlap(offsets: Mapping[str, int], section: dict, types: Mapping[str, TensorType], where: str) -> None:
    uses = list(_timeline(section["steps"]))
    sent = tuple(s["tensor"] for s in section["steps"] if s["kind"] == "send")
    if sent:
        uses.append((sent, (), (), ()))  # sends complete asynchronously: sent buffers live to the end
    last = len(uses)
    root = {name: name for name in offsets}

    def find(name: str) -> str:
        while root[name] != name:
            root[name] = root[root[name]]
            name = root[name]
        return name

    first_write = {name: -1 for name in section["inputs"] if name in offsets}
    last_read = {name: last for name in section["outputs"] if name in offsets}
    allowed: dict[frozenset, int] = {}
    for t, (reads, writes, views, inplace) in enumerate(uses):
        for out, source in views:
            if out in root and source in root:
                root[find(out)] = find(source)
        for name in writes:
            if name in offsets:
                first_write.setdefault(name, t)
        for name in reads:
            if name in offsets:
                last_read[name] = max(last_read.get(name, t), t)
    for t, (_, _, _, inplace) in enumerate(uses):
        for out, source in inplace:
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
                    continue  # an output written in place of an input that dies at this step
                raise _Invalid(f"{where}.offsets", f"'{a_key}' and '{key}' share arena bytes while both are live "
                                                   f"(steps {max(a_start, start)} to {min(a_end, end)})")
        active.append(block)


def _timeline(steps: list) -> Iterator[tuple[tuple, tuple, tuple, tuple]]:
    """(reads, writes, views, in-place pairs) of each executed step, `if` branches flattened, as the planner sees them."""
    for step in steps:
        kind = step["kind"]
        if step.get("init"):
            continue  # computed once at load, outside the arena
        if kind == "kernel":
            yield tuple(step["inputs"]), tuple(step["outputs"]), (), tuple(tuple(p) for p in step.get("inplace", ()))
        elif kind == "view":
            yield (step["input"],), (step["output"],), ((step["output"], step["input"]),), ()
        elif kind == "send":
            yield (step["tensor"],), (), (), ()
        elif kind == "recv":
            yield (), (step["output"],), (), ()
        elif kind == "if":
            yield (step["condition"],), (), (), ()
            for branch in ("then", "else"):
                yield from _timeline(step[branch]["steps"])
            yield tuple(step["then"]["results"]) + tuple(step["else"]["results"]), tuple(step["outputs"]), (), ()
        else:
            yield (), (), (), ()
