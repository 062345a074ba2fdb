"""A kernel-build worker process: reads one JSON request per line, builds, replies one line.

Run by `backends.builder` as `python -m backends.build_worker TARGET CACHE_DIR`.
Requests are {"key": ..., "spec": ...}; replies are {"key": ..., "error": null or text}.
"""
from __future__ import annotations

import json
import sys

from .builder import _build_one


def main(argv: list[str]) -> int:
    target, cache_root = argv
    for line in sys.stdin:
        request = json.loads(line)
        error = _build_one(request["spec"], target, cache_root, request["key"])
        sys.stdout.write(json.dumps({"key": request["key"], "error": error}) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
