"""bench/gpu_tune.py without a GPU: the candidates it times and the table it records."""
from __future__ import annotations

import json

from bench.gpu_tune import candidates, record
from tessel.backends.cuda.conv import ConvShape, GemmConfig, heuristic_config


def test_candidates_start_with_the_heuristic_and_split_only_small_grids():
    small = ConvShape(1, 512, 7, 7, 512, (3, 3), (1, 1), (1, 1), (1, 1, 1, 1))  # M 512, N 49, K 4608
    found = candidates(small)
    assert found[0] == heuristic_config(*small.gemm)
    assert len(found) == len(set(found))
    assert any(c.split_k > 1 for c in found)
    large = ConvShape(16, 64, 56, 56, 64, (3, 3), (1, 1), (1, 1), (1, 1, 1, 1))  # N 50176: tiles enough
    assert all(c.split_k == 1 for c in candidates(large)[1:])


def test_record_keeps_the_fastest_correct_configuration(tmp_path):
    fast = GemmConfig(64, 64, 16, 4, 4, 1).to_json()
    report = {"device": "NVIDIA H100", "arch": "sm_90", "cases": [
        {"shape": "a", "torch_ms": 0.02, "best": {"config": fast, "ms": 0.01}},
        {"shape": "b", "torch_ms": 0.02, "best": None}]}
    path = tmp_path / "tune.json"
    path.write_text(json.dumps(report))
    table = tmp_path / "conv_configs.json"
    record(path, table)
    written = json.loads(table.read_text())["archs"]["sm_90"]
    assert written == {"a": {"config": fast, "ms": 0.01, "torch_ms": 0.02, "device": "NVIDIA H100"}}
