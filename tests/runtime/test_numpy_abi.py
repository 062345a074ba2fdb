"""The numpy array fields the native host program reads hold where runtime/numpy_abi.py says."""
from __future__ import annotations

import numpy as np

from tessel.runtime import numpy_abi


def test_the_layout_holds_on_this_python():
    assert numpy_abi.layout_holds()


def test_data_pointer_and_contiguity_are_read_from_the_array_object():
    whole = np.zeros((6, 10), np.int64)
    for array in (whole, whole[1:4], whole[:, 2:], whole[::2], np.asfortranarray(whole), whole.reshape(-1)):
        data, flags = numpy_abi._fields(array)
        assert data == array.ctypes.data
        assert bool(flags & numpy_abi.C_CONTIGUOUS) == array.flags.c_contiguous
