"""Every example runs."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tessel.compiler.corpus import models_dir

ROOT = Path(__file__).resolve().parents[2]


def test_compile_and_run_example(tmp_path, tessel_cache):
    env = dict(os.environ, TESSEL_CACHE_DIR=str(tessel_cache), PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "compile_and_run.py"), str(models_dir() / "resnet18.onnx"),
         str(tmp_path / "resnet18")],
        capture_output=True, text=True, timeout=900, env=env,
    )
    assert done.returncode == 0, done.stderr
    assert "top-5 classes" in done.stdout and "reloaded run matches: True" in done.stdout
