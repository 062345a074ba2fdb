"""Model inputs for a run: read from the user's .npz, or random for runs and measurements made without data."""
from __future__ import annotations

import zipfile
from typing import Mapping, Sequence

import numpy as np
from numpy.lib import format as npy_format

from tessel.ir.types import TensorType, numpy_dtype

from .errors import InputError

_HEADER_READERS = {(1, 0): npy_format.read_array_header_1_0, (2, 0): npy_format.read_array_header_2_0}


def random_input(t: TensorType, rng: np.random.Generator, shape: Sequence[int] | None = None) -> np.ndarray:
    """Standard-normal values for a floating-point input, zeros otherwise (indices, flags, sizes)."""
    shape = tuple(t.shape if shape is None else shape)
    dtype = numpy_dtype(t.dtype)
    if np.issubdtype(dtype, np.floating):
        return rng.standard_normal(shape).astype(dtype)
    return np.zeros(shape, dtype)


def read_npz_inputs(path: str, expected: Mapping[str, TensorType], optional: Sequence[str] = ()) -> dict[str, np.ndarray]:
    """The arrays of the .npz at `path` by name, each checked against the model's input type in `expected`
    (the inputs named in `optional` have defaults and may be left out).

    Every array's .npy header is checked (names, dtype, shape) before any array is read, so a file whose
    header claims an array larger than memory is refused at once instead of being allocated.
    """
    try:
        headers = _npz_headers(path)
        _check_headers(path, headers, expected, optional)
        with np.load(path, allow_pickle=False) as data:
            return {name: data[name] for name in data.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise InputError(f"{path}: cannot read inputs as .npz ({exc})") from exc


def _npz_headers(path: str) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """(shape, dtype) of each array in an .npz, from the headers alone."""
    headers = {}
    with zipfile.ZipFile(path) as archive:
        for member in archive.namelist():
            name = member[:-len(".npy")] if member.endswith(".npy") else member
            with archive.open(member) as stream:
                version = npy_format.read_magic(stream)
                if version not in _HEADER_READERS:
                    raise InputError(f"{path}: array '{name}' is in .npy format {version[0]}.{version[1]}; "
                                     "save the inputs with numpy.savez")
                shape, _, dtype = _HEADER_READERS[version](stream)
            if name in headers:
                raise InputError(f"{path}: holds array '{name}' twice; save each input once")
            headers[name] = (tuple(shape), dtype)
    return headers


def _check_headers(path: str, headers: Mapping[str, tuple[tuple[int, ...], np.dtype]],
                   expected: Mapping[str, TensorType], optional: Sequence[str] = ()) -> None:
    if not set(expected) - set(optional) <= set(headers) <= set(expected):
        raise InputError(f"{path}: inputs do not match the model: it takes {', '.join(sorted(expected)) or 'none'}, "
                         f"the file holds {', '.join(sorted(headers)) or 'none'}")
    for name, t in expected.items():
        if name not in headers:
            continue
        shape, dtype = headers[name]
        want = np.dtype(numpy_dtype(t.dtype))
        if shape != tuple(t.shape) or dtype != want:
            raise InputError(f"{path}: input '{name}' is {dtype}[{','.join(map(str, shape))}], "
                             f"the model takes {want}[{','.join(map(str, t.shape))}]")
