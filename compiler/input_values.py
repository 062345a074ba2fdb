"""`--input-value NAME=VALUE`.

On `tessel run` and `tessel bench`: one value for a whole input (a sample rate, a flag, a length), broadcast to
the input's shape and dtype. Random inputs are fine for data; control inputs need a value the model expects.
On `tessel compile` and `tessel inspect`: the input's value known when compiling (NAME=1,2,3 a 1-D array,
NAME=5 one number); the input becomes a constant (Reshape's shape, Reduce axes, TopK's k, ...)."""
from __future__ import annotations

import logging
from typing import Iterator, Mapping, Sequence

import numpy as np

from tessel.ir.types import TensorType, numpy_dtype
from tessel.runtime.errors import InputError

Number = bool | int | float
_log = logging.getLogger("tessel")


def parse_input_values(items: Sequence[str]) -> dict[str, Number]:
    """Read NAME=VALUE items (VALUE an integer, a number or true/false) into {name: value}; InputError, one line,
    on a malformed or repeated item."""
    return {name: _number(text, item) for name, text, item in _named_items(items, "NAME=VALUE, e.g. sr=16000")}


def parse_compile_values(items: Sequence[str]) -> dict[str, np.ndarray]:
    """Read NAME=VALUE items (VALUE a number, true/false, or numbers separated by commas) into {name: array}: 0-d
    for one number, 1-D for a list; the importer casts each to its input's element type. InputError, one line, on
    a malformed or repeated item."""
    values: dict[str, np.ndarray] = {}
    for name, text, item in _named_items(items, "NAME=VALUE or NAME=V1,V2,..., e.g. shape=1,-1"):
        numbers = [_number(part.strip(), item) for part in text.split(",")]
        values[name] = np.asarray(numbers) if "," in text else np.asarray(numbers[0])
    return values


def _named_items(items: Sequence[str], expected: str) -> Iterator[tuple[str, str, str]]:
    """(name, value text, item) of each NAME=VALUE item, in order; InputError, one line, on a malformed or
    repeated one (raised when the iteration reaches it, so the caller's own checks of earlier items come first)."""
    seen: set[str] = set()
    for item in items:
        name, sep, text = item.rpartition("=")
        if not sep or not name or not text:
            raise InputError(f"bad --input-value '{item}': expected {expected}")
        if name in seen:
            raise InputError(f"--input-value gives '{name}' twice")
        seen.add(name)
        yield name, text, item


def _number(text: str, item: str) -> Number:
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        raise InputError(f"bad --input-value '{item}': VALUE must be a number or true/false") from None


def with_input_values(inputs: Mapping[str, np.ndarray], values: Mapping[str, Number],
                      types: Mapping[str, TensorType]) -> dict[str, np.ndarray]:
    """`inputs` with each input named in `values` replaced by that value in its shape and dtype (`types`, the
    model's input types); InputError, one line, for a name the model lacks or a value its dtype cannot hold."""
    result = dict(inputs)
    for name, value in values.items():
        if name not in types:
            raise InputError(f"--input-value {name}: the model has no input '{name}'; "
                             f"its inputs are {', '.join(sorted(types)) or 'none'}")
        dtype = np.dtype(numpy_dtype(types[name].dtype))
        result[name] = np.full(tuple(types[name].shape), _fit(name, value, dtype), dtype)
    return result


def _fit(name: str, value: Number, dtype: np.dtype) -> Number:
    """`value` as `dtype` holds it, refusing what would change it (a fraction or an out-of-range integer)."""
    if dtype == np.bool_:
        if value not in (0, 1):
            raise InputError(f"--input-value {name}={value}: the input is bool; give true or false")
        return bool(value)
    if np.issubdtype(dtype, np.integer):
        if float(value) != int(value):
            raise InputError(f"--input-value {name}={value}: the input is {dtype}; give an integer")
        info = np.iinfo(dtype)
        if not info.min <= int(value) <= info.max:
            raise InputError(f"--input-value {name}={value}: out of the range of {dtype} [{info.min}, {info.max}]")
        return int(value)
    return value


def run_inputs(path: str | None, artifact, values: dict) -> tuple[dict[str, np.ndarray], list[str]]:
    """A run's inputs (`tessel run`, `tessel bench`): from --inputs, else random, with the --input-value ones set; and the names of those made
    up at random (a failure they cause is explained in their terms)."""
    from tessel.runtime.inputs import random_input, read_npz_inputs

    types = artifact.batch_input_types()
    if path is None:
        rng = np.random.default_rng(0)
        guessed = sorted(set(types) - set(values))
        inputs = {name: random_input(t, rng) for name, t in types.items()}
    else:
        inputs, guessed = read_npz_inputs(path, types, artifact.plan.get("input_defaults", ())), []
    inputs = with_input_values(inputs, values, types)
    for name, array in inputs.items():
        source = "--input-value" if name in values else "random" if name in guessed else path
        _log.debug("input %s: %s[%s] from %s", name, array.dtype, ",".join(map(str, array.shape)), source)
    return inputs, guessed
