"""Which weights a parameter-server job's result calls its model (compiler/ps_launch.model_parameters). That a
1-bit job's workers write theirs and its model is them: the slow test in tests/compiler/test_ps_checkpoint.py."""
from __future__ import annotations

import numpy as np
import pytest

from tessel.compiler.ps_launch import model_parameters
from tessel.runtime.ps_job import PSJob


def _job(compression: str, compress_pulls: bool = True) -> PSJob:
    return PSJob(workers=2, servers=1, mode="sync", staleness=0, steps=1, batch=2, seed=0, compression=compression,
                 topk_ratio=0.01, optimizer={}, data_inputs=["x"], label_input=None, loss_output="loss",
                 model_outputs=["y"], parameters=["w"], gradients={"w": "w__grad"}, shards=[["w"]], scalars=[],
                 eval_inputs=["w"], shapes={"w": [2, 3]}, compress_pulls=compress_pulls)


@pytest.mark.parametrize("compression", ["1bit", "topk"])
def test_with_compressed_pulls_the_model_is_the_weights_the_workers_hold(tmp_path, compression):
    workers = {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}
    np.savez(tmp_path / "weights.npz", **workers)
    model = model_parameters(_job(compression), tmp_path, {"w": workers["w"] + 1})
    np.testing.assert_array_equal(model["w"], workers["w"])


@pytest.mark.parametrize("job", [_job("none"), _job("1bit", compress_pulls=False)], ids=["float32", "1bit pushes"])
def test_with_exact_pulls_the_model_is_the_servers_weights(tmp_path, job):
    servers = {"w": np.ones((2, 3), np.float32)}
    assert model_parameters(job, tmp_path, servers) is servers  # and no weights.npz is read
