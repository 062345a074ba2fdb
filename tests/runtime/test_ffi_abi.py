"""The calling convention the native host program relies on, checked against the installed tvm_ffi."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from tessel.runtime import ffi_abi
from tessel.runtime.instructions import KernelCall
from tessel.runtime.memory import aligned_empty
from tessel.runtime.native_host import NativeHost


def _include() -> Path:
    import tvm_ffi

    return Path(tvm_ffi.__file__).parent / "include"


def _enum_value(header: Path, name: str) -> int:
    return int(re.search(rf"\b{name}\s*=\s*(\d+)", header.read_text()).group(1))


def test_type_indices_and_device_match_the_headers():
    c_api = _include() / "tvm" / "ffi" / "c_api.h"
    assert _enum_value(c_api, "kTVMFFINone") == ffi_abi.TYPE_INDEX_NONE
    assert _enum_value(c_api, "kTVMFFIDLTensorPtr") == ffi_abi.TYPE_INDEX_DLTENSOR_PTR
    assert _enum_value(_include() / "dlpack" / "dlpack.h", "kDLCPU") == ffi_abi.DEVICE_CPU


_LAYOUT_PROGRAM = r"""
#include <stddef.h>
#include <stdio.h>
#include <tvm/ffi/c_api.h>
int main(void) {
  printf("%zu %zu %zu %zu %zu %zu %zu %zu %zu %zu\n", sizeof(TVMFFIAny), offsetof(TVMFFIAny, v_int64),
         sizeof(DLTensor), offsetof(DLTensor, device), offsetof(DLTensor, ndim), offsetof(DLTensor, dtype),
         offsetof(DLTensor, shape), offsetof(DLTensor, strides), offsetof(DLTensor, byte_offset), sizeof(TVMFFIObject));
  printf("%zu %zu\n", offsetof(TVMFFIErrorCell, kind), offsetof(TVMFFIErrorCell, message));
  return 0;
}
"""


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
def test_struct_layouts_match_the_headers(tmp_path):
    """sizeof/offsetof from tvm_ffi's own headers, compiled here, against the layouts ffi_abi assumes."""
    source = tmp_path / "layout.c"
    source.write_text(_LAYOUT_PROGRAM)
    subprocess.run(["cc", "-I", str(_include()), str(source), "-o", str(tmp_path / "layout")], check=True)
    sizes, cell = [list(map(int, line.split())) for line in
                   subprocess.run([str(tmp_path / "layout")], check=True, capture_output=True, text=True).stdout.splitlines()]
    tensor = ffi_abi.DLTENSOR.fields
    assert sizes == [ffi_abi.ANY.itemsize, ffi_abi.ANY.fields["value"][1], ffi_abi.DLTENSOR.itemsize,
                     tensor["device_type"][1], tensor["ndim"][1], tensor["code"][1], tensor["shape"][1],
                     tensor["strides"][1], tensor["byte_offset"][1], ffi_abi.OBJECT_HEADER_BYTES]
    assert cell == [0, 16]  # kind, then message: two TVMFFIByteArray {data, size}


@pytest.fixture(scope="module")
def scale_kernel(tmp_path_factory):
    """y = 2x + 1 on float32[64, 16], its outer loop parallel (it calls back into TVM's thread pool)."""
    import tvm
    from tvm import te

    x = te.placeholder((64, 16), "float32", name="x")
    y = te.compute(x.shape, lambda i, j: x[i, j] * 2.0 + 1.0, name="y")
    schedule = tvm.s_tir.Schedule(te.create_prim_func([x, y]))
    schedule.parallel(schedule.get_loops(schedule.get_sblock("y"))[0])
    path = tmp_path_factory.mktemp("kernel") / "scale.so"
    tvm.compile(schedule.mod, target=tvm.target.Target({"kind": "llvm"})).export_library(str(path))
    return tvm.runtime.load_module(str(path))["main"], ffi_abi.kernel_entry(path)


def _host(buffers: dict[str, np.ndarray], entry: int) -> NativeHost:
    call = KernelCall(node="scale", op="Mul", kernel="scale", inputs=("x",), outputs=("y",))
    return NativeHost([[call]], buffers.__getitem__, {"scale": entry})


def test_a_kernel_called_through_the_native_host_program(scale_kernel):
    _, entry = scale_kernel
    buffers = {"x": aligned_empty((64, 16), np.float32), "y": aligned_empty((64, 16), np.float32)}
    buffers["x"][...] = np.arange(64 * 16, dtype=np.float32).reshape(64, 16)
    host = _host(buffers, entry)
    assert host.run(0) == 0
    np.testing.assert_array_equal(buffers["y"], buffers["x"] * 2 + 1)


def test_a_kernel_error_comes_back_as_tvm_ffi_raises_it(scale_kernel):
    import tvm

    function, entry = scale_kernel
    wrong = {"x": aligned_empty((64, 16), np.float64), "y": aligned_empty((64, 16), np.float32)}
    status = _host(wrong, entry).run(0)
    assert status == 1  # the first site: the call
    error = ffi_abi.take_raised_error()
    with pytest.raises(Exception) as python:
        function(tvm.runtime.from_dlpack(wrong["x"]), tvm.runtime.from_dlpack(wrong["y"]))
    assert type(error) is type(python.value) and str(error) == str(python.value)
    assert isinstance(ffi_abi.take_raised_error(), RuntimeError)  # taken: nothing raised any more
