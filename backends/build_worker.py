"""A kernel-build worker process: reads one JSON request per line, builds, replies one line.

Run by `tessel.backends.builder` as `python -m tessel.backends.build_worker`. Every kernel is
compiled here, never in the compiling process, so a crash inside TVM (a deep
recursion, a segfault) ends this process only and the builder reports it.
Requests are {"key", "spec", "target", "cache"}; replies are {"key", "error": null or text}.
"""
from __future__ import annotations

import json
import signal
import sys
from typing import Callable

from .cache import KernelCache
from .kernel import KernelSpec
from .lower import build
from .target import parse_target


def build_one(spec_doc: dict, target_text: str, cache_root: str, key: str) -> str | None:
    """Build and cache one kernel; the error text when it fails."""
    target = parse_target(target_text)
    spec = KernelSpec.from_json(spec_doc)
    try:
        executable = build(spec, target)
        # A CUDA kernel's source is kept beside it for reading (the library itself carries the nvcc fatbin).
        extra = {".cu": executable.source.encode()} if target.is_gpu else None
        KernelCache(cache_root).store(key, spec, executable, extra)
    except Exception as exc:  # noqa: BLE001 - reported per kernel, all at once
        return (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
    return None


def main(handle: Callable[[dict, str, str, str], str | None] = build_one) -> int:
    """Serve build requests from stdin until it closes, each by `handle` (build_one; a test passes another)."""
    for line in sys.stdin:
        request = json.loads(line)
        error = handle(request["spec"], request["target"], request["cache"], request["key"])
        sys.stdout.write(json.dumps({"key": request["key"], "error": error}) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    # Ctrl-C reaches the whole foreground process group: the compiling process reports it once and stops its
    # workers, which would otherwise each print a KeyboardInterrupt traceback. A worker whose parent is gone
    # sees stdin close and leaves.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(main())
