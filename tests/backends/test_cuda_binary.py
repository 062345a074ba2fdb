"""The fatbin rewrite of a CUDA kernel library's import blob (backends/cuda/binary.py)."""
from __future__ import annotations

import struct

import pytest

from tessel.backends.cuda.binary import CudaBinaryError, replace_cuda_binary

U64 = struct.Struct("<Q")


def string(value: bytes) -> bytes:
    return U64.pack(len(value)) + value


def blob(payloads: list[tuple[bytes, bytes]]) -> bytes:
    """An import blob laid out as ModulePackImportsToC writes it: tree, then `_lib` and each module."""
    tree = U64.pack(3) + b"".join(U64.pack(v) for v in (0, len(payloads), len(payloads)))
    tree += U64.pack(len(payloads)) + b"".join(U64.pack(i + 1) for i in range(len(payloads)))
    body = tree + string(b"_lib")
    for key, payload in payloads:
        body += string(key) + U64.pack(len(payload)) + payload
    return U64.pack(len(body)) + body


def cuda_payload(fmt: bytes, table: bytes, data: bytes) -> bytes:
    return string(fmt) + table + string(data)


def test_the_cuda_module_carries_the_binary_and_keeps_its_function_table():
    table = U64.pack(1) + string(b"main_kernel") + string(b"main_kernel") + U64.pack(0) * 3
    source = b'extern "C" __global__ void main_kernel() {}'
    original = blob([(b"cuda", cuda_payload(b"cuda", table, source))])
    patched = replace_cuda_binary(original, source, b"\x50\xed\x55\xbaFATBIN")
    assert patched == blob([(b"cuda", cuda_payload(b"fatbin", table, b"\x50\xed\x55\xbaFATBIN"))])


def test_other_modules_pass_through_unchanged():
    table = U64.pack(0)
    source = b"__global__ void k() {}"
    original = blob([(b"metadata", b"opaque bytes"), (b"cuda", cuda_payload(b"cuda", table, source))])
    patched = replace_cuda_binary(original, source, b"BIN")
    assert patched == blob([(b"metadata", b"opaque bytes"), (b"cuda", cuda_payload(b"fatbin", table, b"BIN"))])


@pytest.mark.parametrize("damage", ["no_cuda_module", "wrong_length", "truncated"])
def test_an_unexpected_layout_is_refused(damage):
    source = b"__global__ void k() {}"
    original = blob([(b"cuda", cuda_payload(b"cuda", U64.pack(0), source))])
    if damage == "no_cuda_module":
        original = blob([(b"cuda", cuda_payload(b"cuda", U64.pack(0), b"other source"))])
    elif damage == "wrong_length":
        original = U64.pack(len(original)) + original[8:]
    else:
        original = original[:-5]
    with pytest.raises(CudaBinaryError):
        replace_cuda_binary(original, source, b"BIN")
