"""The 1-bit codec's native loops (runtime/onebit_kernels.py) refuse arrays they would read out of bounds; what
they compute is checked against numpy through the codec (tests/runtime/test_ps_compression.py)."""
from __future__ import annotations

import numpy as np
import pytest

from tessel.runtime.onebit_kernels import pack_signs, segment_sums, unpack_values


def test_sums_count_and_add_each_segments_non_negative_and_all_elements():
    vector = np.array([1, -2, 0, 3, -1, -1, 2], np.float32)
    counts, ups, alls = segment_sums(vector, np.array([0, 3, 3, 7]))
    assert counts.tolist() == [2, 0, 2] and ups.tolist() == [1, 0, 5] and alls.tolist() == [-1, 0, 3]


@pytest.mark.parametrize("call, message", [
    (lambda v, b, m, o: segment_sums(v, np.array([0, 9])), "do not fit a vector of 8"),
    (lambda v, b, m, o: segment_sums(v, np.array([0, 100, 8])), "do not fit a vector of 8"),
    (lambda v, b, m, o: segment_sums(v, np.array([0, -5, 8])), "do not fit a vector of 8"),
    (lambda v, b, m, o: pack_signs(v, np.array([0, 8]), m, b[:0]), "with 0 bytes of sign bits"),
    (lambda v, b, m, o: pack_signs(v.astype(np.float64), np.array([0, 8]), m, b),
     "contiguous float32 array, not float64"),
    (lambda v, b, m, o: unpack_values(b, np.array([0, 4, 8]), m, o, add=True), "2 values for 2 segments"),
    (lambda v, b, m, o: unpack_values(b, np.array([0, 8]), m, o[::2], add=False), "do not fit a vector of 4"),
])
def test_arrays_that_do_not_fit_are_refused(call, message):
    vector, out = np.ones(8, np.float32), np.ones(8, np.float32)
    bits, means = np.zeros(1, np.uint8), np.ones(2, np.float32)
    with pytest.raises(ValueError, match=message):
        call(vector, bits, means, out)
