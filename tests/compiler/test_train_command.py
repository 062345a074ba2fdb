"""`tessel train`'s refusals: each bad input is one line on stderr and exit code 2, found before anything is
compiled or written."""
from __future__ import annotations

import numpy as np
import pytest

from tessel.compiler.cli import main
from tests.compiler.train_fixtures import write_classifier, write_data


@pytest.fixture
def files(tmp_path):
    return {"model": write_classifier(tmp_path / "clf.onnx"), "data": write_data(tmp_path / "train.npz"),
            "run": tmp_path / "run"}


def _refused(capsys, argv, expected):
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:  # argparse's own refusals
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and expected in err and "Traceback" not in err, err
    return err


def _train(files, *extra):
    return ["train", files["model"], "--data", files["data"], "--loss", "cross_entropy", "--lr", "0.1",
            "--batch", "8", "-o", files["run"], *extra]


@pytest.mark.parametrize("extra, expected", [
    (["--optimizer", "lamb"], "unknown --optimizer 'lamb'; choose sgd or adamw"),
    (["--loss", "hinge"], "unknown --loss 'hinge'"),
    (["--loss", "output:3"], "unknown --loss 'output:3'"),
    (["--optimizer", "adamw", "--momentum", "0.9"], "--momentum and --nesterov are SGD's"),
    (["--nesterov"], "--nesterov needs --momentum above 0"),
    (["--schedule", "cosine:a"], "bad --schedule 'cosine:a'"),
    (["--schedule", "step:0:0.1"], "STEP_SIZE is a whole number of steps"),
    (["--label-smoothing", "0.1", "--loss", "mse"], "--label-smoothing goes with --loss cross_entropy only"),
    (["--lr", "0"], "--lr 0.0: give a learning rate above 0"),
    (["--batch", "41"], "40 samples, fewer than --batch 41"),
    (["--batch", "0"], "0 is below 1"),
])
def test_bad_settings_are_one_line(capsys, files, extra, expected):
    _refused(capsys, _train(files, *extra), expected)
    assert not files["run"].exists()


@pytest.mark.parametrize("overrides, expected", [
    ({"labels": None}, "missing key(s) labels; --data needs x, labels (it has x)"),
    ({"x": np.zeros((40, 5), np.float32)}, "'x' has samples of shape (5,), the model takes [N, 4]"),
    ({"x": np.zeros((40, 4), np.float64)}, "'x' is float64, the model takes float32"),
    ({"labels": np.zeros(39, np.int64)}, "every array needs the same number of samples on axis 0"),
    ({"labels": np.zeros(40, np.float32)}, "cross_entropy needs 'labels' as class indices, int64"),
    ({"labels": np.full(40, -1, np.int64)}, "'labels' are class indices and must be [0, 3) (the model's classes)"),
    ({"labels": np.full(40, 3, np.int64)}, "found 3..3"),
])
def test_data_that_does_not_fit_the_model_is_one_line(capsys, files, tmp_path, overrides, expected):
    files["data"] = write_data(tmp_path / "bad.npz", **overrides)
    _refused(capsys, _train(files), expected)


def test_bad_validation_data_names_its_flag(capsys, files, tmp_path):
    val = write_data(tmp_path / "val.npz", labels=None)
    _refused(capsys, _train(files, "--val", val), "--val needs x, labels")


def test_a_missing_or_unreadable_file_is_one_line(capsys, files, tmp_path):
    files["data"] = tmp_path / "absent.npz"
    _refused(capsys, _train(files), "absent.npz: no such file (given as --data)")
    (tmp_path / "text.npz").write_text("not a zip")
    files["data"] = tmp_path / "text.npz"
    _refused(capsys, _train(files), "not a readable .npz file")
    files["model"] = tmp_path / "text.npz"
    _refused(capsys, _train(files), "not an ONNX model")


def test_a_new_run_needs_model_data_loss_lr_and_output(capsys, files):
    _refused(capsys, ["train", files["model"], "--data", files["data"], "--lr", "0.1", "-o", files["run"]],
             "a new run needs --loss")
    _refused(capsys, ["train", "--data", files["data"]], "a new run needs MODEL.onnx")


def test_an_existing_run_dir_needs_force_or_resume(capsys, files):
    files["run"].mkdir()
    (files["run"] / "notes.txt").write_text("mine")
    _refused(capsys, _train(files), "already exists; pass --force to replace it or --resume")
    _refused(capsys, _train(files, "--force"), "--force replaces only a training run directory")
    assert (files["run"] / "notes.txt").read_text() == "mine"


def test_resume_takes_the_settings_of_the_run(capsys, files):
    _refused(capsys, ["train", "--resume", files["run"]], "not a training run directory (no run.json)")
    _refused(capsys, ["train", "--resume", files["run"], "--lr", "0.5"],
             "--resume continues with the settings in RUN_DIR/run.json; leave out --lr")
