"""A build worker that dies by SIGSEGV on every Concat kernel (a stand-in for a crash inside TVM)."""
from __future__ import annotations

import os
import signal
import sys

from tessel.backends import build_worker


def build_or_crash(spec: dict, target: str, cache: str, key: str) -> str | None:
    """build_worker.build_one, except that a Concat kills the process as a crash inside TVM would."""
    if spec["op_type"] == "Concat":
        os.kill(os.getpid(), signal.SIGSEGV)
    return build_worker.build_one(spec, target, cache, key)


if __name__ == "__main__":
    sys.exit(build_worker.main(build_or_crash))
