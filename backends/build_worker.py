"""A kernel-build worker process: reads one JSON request per line, builds, replies one line.

Run by `backends.builder` as `python -m backends.build_worker`. Every kernel is
compiled here, never in the compiling process, so a crash inside TVM (a deep
recursion, a segfault) ends this process only and the builder reports it.
Requests are {"key", "spec", "target", "cache"}; replies are {"key", "error": null or text}.
"""
from __future__ import annotations

import json
import sys

from .cache import KernelCache
from .kernel import KernelSpec, build
from .target import TargetSpec, parse_target


def build_one(spec_doc: dict, target_text: str, cache_root: str, key: str) -> str | None:
    """Build and cache one kernel; the error text when it fails."""
    target = parse_target(target_text)
    spec = KernelSpec.from_json(spec_doc)
    try:
        executable = build(spec, target)
        extra = _cuda_files(executable, target) if target.is_gpu else None
        KernelCache(cache_root).store(key, spec, executable, extra)
    except Exception as exc:  # noqa: BLE001 - reported per kernel, all at once
        return (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
    return None


def _cuda_files(executable, target: TargetSpec) -> dict[str, bytes]:
    """The CUDA source, kept beside the kernel for reading (the library itself carries the nvcc fatbin)."""
    from .schedules.gpu import cuda_source

    return {".cu": cuda_source(executable).encode()}


def main() -> int:
    """Serve build requests from stdin until it closes."""
    for line in sys.stdin:
        request = json.loads(line)
        error = build_one(request["spec"], request["target"], request["cache"], request["key"])
        sys.stdout.write(json.dumps({"key": request["key"], "error": error}) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
