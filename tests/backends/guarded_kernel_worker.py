"""Build one kernel and run it on inputs against inaccessible pages (tests/backends/guard_pages.py).

`python -m tests.backends.guarded_kernel_worker` reads {name: kernel spec} as JSON from stdin and runs each kernel
twice, its arguments standard normal values in GuardedArrays against the page before them, then after them,
printing "ran NAME AT" after each run; a read outside an input kills it with SIGSEGV, and the last line printed
says which run did it. A child process, so that the test that runs it sees the fault as an exit status.
"""
from __future__ import annotations

import json
import sys

import numpy as np

from tessel.backends.kernel import ARG, KernelSpec, TensorType
from tessel.backends.lower import build
from tessel.backends.target import parse_target
from tessel.backends.tvm_env import tvm
from tests.backends.guard_pages import GuardedArray


def run_guarded(spec: KernelSpec, at: str) -> None:
    """Run `spec`'s kernel with every argument a GuardedArray placed `at` its guard page."""
    executable = build(spec, parse_target("llvm"))
    mod = tvm()
    rng = np.random.default_rng(0)
    guarded = [GuardedArray(tuple(TensorType.parse(i.type).shape), at)
               for i in spec.inputs if i is not None and i.role == ARG]
    views = [mod.runtime.from_dlpack(g.array) for g in guarded]
    for g, view in zip(guarded, views):
        g.array[...] = rng.standard_normal(g.array.shape)  # after from_dlpack: only a zero-copy view sees it
        if not np.array_equal(view.numpy(), g.array):
            raise RuntimeError("TVM copied a guarded array: the kernel would not read it against its guard page")
    outputs = [mod.runtime.tensor(np.zeros(TensorType.parse(t).shape, np.float32), mod.cpu()) for t in spec.outputs]
    executable.mod["main"](*views, *outputs)


if __name__ == "__main__":
    for name, doc in json.load(sys.stdin).items():
        for at in ("start", "end"):
            run_guarded(KernelSpec.from_json(doc), at)
            print("ran", name, at, flush=True)
