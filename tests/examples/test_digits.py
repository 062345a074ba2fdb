"""The digits example end to end: data and CNN prepared by examples/digits/prepare.py, trained by `tessel train`,
the exported model >= 97% accurate on the test digits in onnxruntime; a run stopped mid-epoch and resumed ends
with the weights of the uninterrupted one."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "digits"
EPOCHS = 5
STOP_AT_STEP = 100  # mid-epoch 3 (44 steps per epoch at batch 32)


def _run(argv: list[str], env: dict) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=1200, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def digits(tmp_path_factory, tessel_cache):
    data = tmp_path_factory.mktemp("digits")
    env = dict(os.environ, TESSEL_CACHE_DIR=str(tessel_cache), PYTHONPATH=str(ROOT))
    _run([str(EXAMPLE / "prepare.py"), str(data)], env)
    return data, env


def _train(data: Path, run: Path, env: dict, *extra: str) -> subprocess.CompletedProcess:
    return _run(["-m", "tessel.compiler.cli", "train", str(data / "cnn.onnx"), "--data", str(data / "train.npz"),
                 "--val", str(data / "test.npz"), "--loss", "cross_entropy", "--optimizer", "sgd", "--lr", "0.05",
                 "--momentum", "0.9", "--batch", "32", "--epochs", str(EPOCHS), "-o", str(run), *extra], env)


def _weights(model: Path) -> dict[str, np.ndarray]:
    return {init.name: numpy_helper.to_array(init) for init in onnx.load(str(model)).graph.initializer}


@pytest.fixture(scope="module")
def trained(digits, tmp_path_factory):
    data, env = digits
    run = tmp_path_factory.mktemp("runs") / "whole"
    _train(data, run, env)
    return run


def test_the_trained_cnn_reaches_97_percent_in_onnxruntime(digits, trained):
    data, env = digits
    done = _run([str(EXAMPLE / "evaluate.py"), str(trained / "model.onnx"), str(data / "test.npz")], env)
    accuracy = float(done.stdout.split("test accuracy:")[1].strip().rstrip("%"))
    assert accuracy >= 97.0, done.stdout
    assert {"log.jsonl", "run.json", "training_curves.png", "training_curves.svg"} <= {p.name for p in trained.iterdir()}


@pytest.mark.slow  # a second compile and 2.5 more epochs; tests/compiler/test_train_command.py covers the logic
def test_a_run_stopped_mid_epoch_and_resumed_ends_with_the_same_weights(digits, trained, tmp_path):
    data, env = digits
    run = tmp_path / "stopped"
    _train(data, run, env, "--max-steps", str(STOP_AT_STEP))
    done = _run(["-m", "tessel.compiler.cli", "train", "--resume", str(run)], env)
    assert "resuming" in done.stderr and "from epoch 2" in done.stderr
    got, want = _weights(run / "model.onnx"), _weights(trained / "model.onnx")
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
