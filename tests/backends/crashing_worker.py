"""A build worker that dies by SIGSEGV on every Concat kernel (a stand-in for a crash inside TVM)."""
from __future__ import annotations

import json
import os
import signal
import sys

from backends.build_worker import build_one


def main() -> int:
    """Serve requests like backends.build_worker, crashing on Concat."""
    for line in sys.stdin:
        request = json.loads(line)
        if request["spec"]["op_type"] == "Concat":
            os.kill(os.getpid(), signal.SIGSEGV)
        error = build_one(request["spec"], request["target"], request["cache"], request["key"])
        sys.stdout.write(json.dumps({"key": request["key"], "error": error}) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
