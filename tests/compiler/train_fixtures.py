"""A tiny classifier (x[N, 4] -> logits[N, 3], one Gemm) and matching .npz data for the `tessel train` tests; what
the kill-and-resume tests read of a run (its trained weights, its checkpoints, its ranks' processes); that a
finished parameter-server run is not resumed."""
from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from tessel.compiler.ps_command import PS_DIR, _resumed_job
from tessel.compiler.train_checkpoints import mid_epoch_steps
from tessel.compiler.train_settings import TrainSettingsError
from tessel.runtime.ps_job import JOB_FILE
from tests.ir.helpers import F, model


def write_classifier(path: Path) -> Path:
    """logits = x @ W^T + b with a free batch axis; W and b are initializers (the trainable parameters)."""
    rng = np.random.default_rng(0)
    weights = [("W", rng.standard_normal((3, 4)).astype(np.float32) * 0.1), ("b", np.zeros(3, np.float32))]
    graph = model([helper.make_node("Gemm", ["x", "W", "b"], ["logits"], name="fc", transB=1)],
                  [("x", F, ["N", 4])], [("logits", F, ["N", 3])], weights)
    onnx.save(graph, str(path))
    return path


def write_data(path: Path, samples: int = 40, **overrides) -> Path:
    """x float32 [samples, 4] and labels int64 [samples] (a separable rule), with `overrides` replacing arrays
    (None removes one)."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((samples, 4)).astype(np.float32)
    arrays = {"x": x, "labels": (x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 1).astype(np.int64)}
    arrays.update(overrides)
    np.savez(path, **{name: array for name, array in arrays.items() if array is not None})
    return path


def trained_weights(run: Path) -> dict[str, np.ndarray]:
    """The weights of the model.onnx a `tessel train` run wrote, by initializer name."""
    return {i.name: numpy_helper.to_array(i) for i in onnx.load(str(run / "model.onnx")).graph.initializer}


def wait_for_step_checkpoint(run: Path, process: subprocess.Popen, timeout_s: float = 300) -> None:
    """Wait until the run has a mid-epoch checkpoint, failing if `process` ends first or it takes `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not list((run / "checkpoints").glob("step_*")):
        assert process.poll() is None and time.monotonic() < deadline, "no mid-epoch checkpoint came"
        time.sleep(0.02)


def ranked_children(pid: int, module: bytes | None = None) -> dict[int, int]:
    """The child processes of `pid` (only those whose command line names `module`, if given) by their RANK
    environment variable: rank -> pid."""
    found = {}
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        try:
            command = Path(f"/proc/{child}/cmdline").read_bytes()
            environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        except FileNotFoundError:
            continue
        rank = [int(v.split(b"=")[1]) for v in environ if v.startswith(b"RANK=")]
        if rank and (module is None or module in command):
            found[rank[0]] = int(child)
    return found


def assert_resume_refused(directory: Path, run_dir: Path, steps: int) -> None:
    """`tessel train --resume` of the finished job (compiled in `directory`, run in `run_dir`) says in one line
    that it has nothing to do, and removes nothing."""
    assert mid_epoch_steps(run_dir) == [steps]
    (run_dir / PS_DIR).mkdir(exist_ok=True)
    shutil.copy(directory / JOB_FILE, run_dir / PS_DIR)  # where tessel train --resume reads the job
    with pytest.raises(TrainSettingsError, match=f"already trained {steps} step\\(s\\) of {steps}; nothing to do") \
            as refused:
        _resumed_job(run_dir, steps, steps_per_epoch=3)
    assert "\n" not in str(refused.value)
    assert mid_epoch_steps(run_dir) == [steps]
