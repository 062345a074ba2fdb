"""Arrays that sit against an inaccessible page: a kernel that reads one element outside them faults.

A vectorized load whose bounds check TVM simplified away reads past its buffer without a wrong result (the lanes
it discards), so comparing outputs cannot catch it. These arrays can: the page just before (`at="start"`) or just
after (`at="end"`) the data is PROT_NONE, and a kernel run on a zero-copy view of them is a child process that
dies of SIGSEGV where it reads outside.
"""
from __future__ import annotations

import ctypes
import mmap

import numpy as np

PAGE = mmap.PAGESIZE
# TVM takes a DLPack array without copying it only at this alignment; an array `at="end"` must be a whole multiple of
# it to end right at its guard page.
ALIGNMENT = 64
PROT_NONE = 0


class GuardedArray:
    """A float32 array of `shape` against a PROT_NONE page before (at="start") or after (at="end") it."""

    def __init__(self, shape: tuple[int, ...], at: str):
        nbytes = int(np.prod(shape)) * 4
        if nbytes % ALIGNMENT:
            raise ValueError(f"{shape}: {nbytes} bytes, not a multiple of {ALIGNMENT}: it could not end at its guard")
        data_pages = -(-nbytes // PAGE)
        self._map = mmap.mmap(-1, (data_pages + 2) * PAGE)
        base = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        for page in (0, data_pages + 1):
            if libc.mprotect(base + page * PAGE, PAGE, PROT_NONE) != 0:
                raise OSError(ctypes.get_errno(), "mprotect failed")
        offset = PAGE if at == "start" else (data_pages + 1) * PAGE - nbytes
        self.array = np.frombuffer(self._map, np.float32, count=int(np.prod(shape)), offset=offset).reshape(shape)
