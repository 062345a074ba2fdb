"""An InferenceSession attached to a torchrun job (runtime/rank_session.py, runtime/rank_group.py): rank 0 opens
sessions and runs them across calls, the other rank follows; on 127.0.0.1 with 2 ranks."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tessel.compiler.api import compile
from tessel.runtime.launch import free_port

from .test_session import _expected, _mlp

ROOT = Path(__file__).resolve().parents[2]

# The job: rank 1 serves; rank 0 opens two sessions one after the other, runs each several times, saves outputs.
JOB = """
import sys
import numpy as np
from tessel.runtime import rank_group
if rank_group.follower():
    sys.exit(rank_group.follow_sessions(timeout_s=20.0))
import tessel
outputs = {}
for session_index in range(2):
    with tessel.InferenceSession(sys.argv[1], timeout=20.0) as session:
        assert session.worker_pids == []
        for call in range(3):
            x = np.random.default_rng(10 * session_index + call).standard_normal((16, 256)).astype(np.float32)
            outputs[f"s{session_index}c{call}"] = session.run(None, {"x": x})[0]
np.savez(sys.argv[2], **outputs)
"""


@pytest.fixture(scope="module")
def pipeline(kernel_cache, tmp_path_factory):
    """The 4-layer MLP as a two-stage pipeline of 2 micro-batches, saved; and its weights."""
    model, weights = _mlp()
    artifact = compile(model, devices=2, placement="pipeline", microbatches=2, profile=False, cache_dir=kernel_cache)
    return artifact.save(tmp_path_factory.mktemp("rank_session") / "mlp"), weights


@pytest.mark.slow  # torchrun starts two ranks that import torch and TVM: 40-70 s on a loaded 2-core machine
def test_a_session_on_rank_0_drives_the_other_torchrun_rank_across_calls_and_sessions(pipeline, tmp_path):
    directory, weights = pipeline
    script = tmp_path / "job.py"
    script.write_text(JOB)
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(script), str(directory),
               str(tmp_path / "out.npz")]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    with np.load(tmp_path / "out.npz") as saved:
        for session_index in range(2):
            for call in range(3):
                x = np.random.default_rng(10 * session_index + call).standard_normal((16, 256)).astype(np.float32)
                np.testing.assert_allclose(saved[f"s{session_index}c{call}"], _expected(x, weights), rtol=1e-4,
                                           atol=1e-4)

