"""Embedding the nvcc-compiled GPU binary into an exported CUDA kernel library.

TVM compiles a kernel's CUDA C to a binary (through `tvm_callback_cuda_compile`)
only when its CUDA runtime can load, which needs the NVIDIA driver. On a
machine without one, `export_library` packs the CUDA *source* as the device
module, and that source cannot be launched on a GPU machine (the driver's
`cuModuleLoadData` takes PTX, cubin or fatbin, never C). Tessel compiles the
source with nvcc itself, so the exported library is made to carry that fatbin
instead: the import blob that `export_library` links into the library is
rewritten before it is compiled.

The blob (`__tvm_ffi__library_bin`, written by `ModulePackImportsToC`) is:
u64 byte count, the import tree (u64 n + n u64 row pointers, u64 m + m u64
child indices), then per module its type key as a string (u64 length +
bytes) and, for every key but `_lib`, u64 payload size + payload. A CUDA
payload is the format string, the function table, then the binary as a
string, last. Only the format and the binary are replaced; the function table
(names, argument types, launch tags) is kept byte for byte.
"""
from __future__ import annotations

import re
import struct
from pathlib import Path

_U64 = struct.Struct("<Q")
_BLOB = re.compile(r"(const unsigned char __tvm_ffi__library_bin\[)(\d+)(\] = \{)(.*?)(\};)", re.S)


class CudaBinaryError(RuntimeError):
    """The import blob is not laid out as this module expects (another TVM version?)."""


def _string(value: bytes) -> bytes:
    return _U64.pack(len(value)) + value


def _read_u64(blob: bytes, at: int) -> tuple[int, int]:
    if at + 8 > len(blob):
        raise CudaBinaryError("the import blob ends early")
    return _U64.unpack_from(blob, at)[0], at + 8


def _read_string(blob: bytes, at: int) -> tuple[bytes, int]:
    size, at = _read_u64(blob, at)
    if at + size > len(blob):
        raise CudaBinaryError("a string of the import blob runs past its end")
    return blob[at:at + size], at + size


def replace_cuda_binary(blob: bytes, source: bytes, binary: bytes, fmt: str = "fatbin") -> bytes:
    """The import blob with the CUDA module that carries `source` carrying `binary` (in `fmt`) instead."""
    total, at = _read_u64(blob, 0)
    if total != len(blob) - 8:
        raise CudaBinaryError(f"the import blob says {total} bytes but holds {len(blob) - 8}")
    for _ in range(2):  # row pointers, then child indices
        count, at = _read_u64(blob, at)
        at += 8 * count
    out = bytearray(blob[8:at])
    replaced = 0
    while at < len(blob):
        key, at = _read_string(blob, at)
        out += _string(key)
        if key == b"_lib":
            continue
        size, at = _read_u64(blob, at)
        payload = blob[at:at + size]
        at += size
        if key == b"cuda" and payload.endswith(source) and _U64.unpack_from(payload, len(payload) - len(source) - 8)[0] == len(source):
            _, after_format = _read_string(payload, 0)
            table = payload[after_format:len(payload) - len(source) - 8]
            payload = _string(fmt.encode()) + table + _string(binary)
            replaced += 1
        out += _U64.pack(len(payload)) + payload
    if replaced != 1:
        raise CudaBinaryError(f"expected one CUDA module holding the kernel's source, found {replaced}")
    return _U64.pack(len(out)) + bytes(out)


def _c_with_blob(c_source: str, blob: bytes) -> str:
    match = _BLOB.search(c_source)
    if match is None:
        raise CudaBinaryError("ModulePackImportsToC wrote no __tvm_ffi__library_bin array")
    body = ",".join(f"0x{b:02x}" for b in blob)
    return c_source[:match.start()] + f"{match.group(1)}{len(blob)}{match.group(3)}\n{body}\n{match.group(5)}" + c_source[match.end():]


def _blob_of(c_source: str) -> bytes:
    match = _BLOB.search(c_source)
    if match is None:
        raise CudaBinaryError("ModulePackImportsToC wrote no __tvm_ffi__library_bin array")
    return bytes(int(token, 16) for token in match.group(4).replace("\n", "").split(",") if token.strip())


def export_with_binary(executable, path: str | Path, source: str, binary: bytes, fmt: str = "fatbin") -> None:
    """`executable.export_library(path)`, with the CUDA module carrying `binary` instead of `source`."""
    from tvm.runtime import _ffi_api

    def pack_imports(module, is_system_lib: bool, prefix: str, workspace_dir: str) -> str:
        c_source = _ffi_api.ModulePackImportsToC(module, is_system_lib, prefix)
        patched = replace_cuda_binary(_blob_of(c_source), source.encode(), binary, fmt)
        target = Path(workspace_dir) / f"{prefix}devc.c"
        target.write_text(_c_with_blob(c_source, patched))
        return str(target)

    executable.export_library(str(path), fpack_imports=pack_imports)
