"""Running an artifact needs only TVM's runtime library (TVM_USE_RUNTIME_LIB=1): its compiler is never loaded."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from tessel.compiler.api import compile
from tests.conftest import POSITIVE, run_onnxruntime

REPO = Path(__file__).resolve().parents[2]

RUN_IN_RUNTIME_ONLY_TVM = """
import json, sys
import numpy as np
from tessel.compiler.artifact import load
with np.load(sys.argv[2], allow_pickle=False) as data:
    feeds = {name: data[name] for name in data.files}
outputs = load(sys.argv[1]).run(feeds)
np.savez(sys.argv[3], **outputs)
import tvm
libraries = [line.split()[-1] for line in open("/proc/self/maps") if ".so" in line and "libtvm" in line]
print(json.dumps({"runtime_only": bool(tvm.base._RUNTIME_ONLY), "libraries": sorted(set(libraries)),
                  "modules": sorted(m for m in sys.modules if m.startswith(("tessel.passes", "tessel.compiler.api", "tessel.backends.kernel")))}))
"""


def test_a_corpus_artifact_runs_on_tvms_runtime_library_alone(tmp_path, kernel_cache):
    model = next(m for m in POSITIVE if m.name == "mtcnn_onet")
    artifact = compile(model.path, input_shapes=model.input_shapes, cache_dir=kernel_cache)
    artifact.save(tmp_path / "onet.tessel")
    feeds = model.make_inputs()
    np.savez(tmp_path / "in.npz", **feeds)
    env = {**os.environ, "TVM_USE_RUNTIME_LIB": "1"}
    done = subprocess.run([sys.executable, "-c", RUN_IN_RUNTIME_ONLY_TVM, str(tmp_path / "onet.tessel"),
                           str(tmp_path / "in.npz"), str(tmp_path / "out.npz")],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["runtime_only"]
    assert any("libtvm_runtime.so" in lib for lib in report["libraries"])
    assert not any("libtvm_compiler" in lib for lib in report["libraries"])
    assert report["modules"] == []  # no pass, no compile driver, no kernel lowering on the run path
    with np.load(tmp_path / "out.npz", allow_pickle=False) as data:
        outputs = [data[name] for name in data.files]
    for got, want in zip(outputs, run_onnxruntime(str(model.path), feeds)):
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4)
