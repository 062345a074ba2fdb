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
    (["--devices", "3"], "--batch 8 is not a multiple of --devices 3"),
    (["--parallel", "pipeline"], "--parallel pipeline needs --devices 2 or more"),
    (["--devices", "2", "--parallel", "pipeline", "--micro-batches", "3"],
     "--batch 8 is not a multiple of --micro-batches 3"),
    (["--micro-batches", "2"], "--micro-batches goes with --parallel pipeline"),
    (["--devices", "2", "--parallel", "auto", "--micro-batches", "3"], "--batch 8 is not a multiple of --micro-batches 3"),
    (["--parallel", "auto", "--launcher", "torchrun"], "--parallel auto compares its alternatives on local workers"),
    (["--devices", "2", "--parallel", "pipeline", "--sync-batchnorm"], "--sync-batchnorm goes with data-parallel"),
    (["--devices", "2", "--parallel", "ps", "--ps-mode", "ssp"], "--ps-mode ssp needs --staleness S"),
    (["--devices", "2", "--parallel", "ps", "--precision", "fp64"], "--precision fp64 trains on one worker"),
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


class FakeTrainer:
    """The Trainer's interface on the tiny classifier, in numpy (softmax regression, plain SGD): the command's
    loop, log, checkpoints, resume and outputs are tested without compiling anything."""

    def __init__(self, model, optimizer, weights=None, steps_done=0, source=None):
        import onnx
        from onnx import numpy_helper

        self.model, self.optimizer, self.steps_done = str(model), optimizer, steps_done
        self.source = source  # like the real one, a loaded trainer's save copies files of its checkpoint
        proto = onnx.load(self.model)
        self.weights = weights or {i.name: numpy_helper.to_array(i).copy() for i in proto.graph.initializer}

    def evaluate(self, inputs):
        return {"logits": inputs["x"] @ self.weights["W"].T + self.weights["b"]}

    def step(self, inputs, labels):
        logits = self.evaluate(inputs)["logits"]
        probs = np.exp(logits - logits.max(1, keepdims=True))
        probs /= probs.sum(1, keepdims=True)
        loss = float(-np.log(probs[np.arange(len(labels)), labels]).mean())
        probs[np.arange(len(labels)), labels] -= 1
        lr = self.optimizer.lr_at(self.steps_done)
        self.weights["W"] -= lr * probs.T @ inputs["x"] / len(labels)
        self.weights["b"] -= lr * probs.mean(0)
        self.steps_done += 1
        return loss

    def save(self, directory):
        import json
        from pathlib import Path

        assert self.source is None or Path(self.source).is_dir(), "the checkpoint it was loaded from is gone"
        Path(directory).mkdir(parents=True)
        np.savez(Path(directory) / "state.npz", **self.weights)
        (Path(directory) / "training.json").write_text(json.dumps({"steps": self.steps_done, "model": self.model}))

    def close(self):
        """No workers to stop."""

    def export_onnx(self, path):
        import onnx
        from onnx import numpy_helper

        proto = onnx.load(self.model)
        for init in proto.graph.initializer:
            init.CopyFrom(numpy_helper.from_array(self.weights[init.name], init.name))
        onnx.save(proto, path)


@pytest.fixture
def fake_trainer(monkeypatch):
    import json
    from pathlib import Path

    import tessel

    compiled = []

    def compile_training(model, loss, optimizer, input_shapes, trainable, frozen, seed, devices, parallel,
                         micro_batches, schedule,
                         sync_batchnorm, compression, topk_ratio, precision="fp32", auto_ps=False):
        assert loss == "cross_entropy" and input_shapes == {"x": (8, 4)}
        compiled.append((model, devices, parallel, micro_batches, schedule, precision))
        return FakeTrainer(model, optimizer)

    def load_training(directory):
        meta = json.loads((Path(directory) / "training.json").read_text())
        with np.load(Path(directory) / "state.npz") as state:
            weights = {name: state[name].copy() for name in state.files}
        from tessel import optim

        return FakeTrainer(meta["model"], optim.SGD(0.5), weights, meta["steps"], directory)

    monkeypatch.setattr(tessel, "compile_training", compile_training, raising=False)
    monkeypatch.setattr(tessel, "load_training", load_training, raising=False)
    return compiled


def _final_weights(run_dir):
    import onnx
    from onnx import numpy_helper

    return {i.name: numpy_helper.to_array(i) for i in onnx.load(str(run_dir / "model.onnx")).graph.initializer}


def test_a_run_writes_log_checkpoints_model_and_curves(capsys, files, tmp_path, fake_trainer):
    from tessel.compiler.train_log import read_log

    val = write_data(tmp_path / "val.npz", samples=13)
    assert main([str(a) for a in _train(files, "--lr", "0.5", "--epochs", "3", "--val", val)]) == 0
    run = files["run"]
    assert "trained: 15 steps" in capsys.readouterr().out  # 40 // 8 = 5 steps per epoch
    records = read_log(run)
    steps = [r for r in records if r["kind"] == "step"]
    epochs = [r for r in records if r["kind"] == "epoch"]
    assert [r["step"] for r in steps] == list(range(1, 16)) and all(r["lr"] == 0.5 for r in steps)
    assert [(r["epoch"], r["step"]) for r in epochs] == [(1, 5), (2, 10), (3, 15)]
    assert all(0 <= r["val_accuracy"] <= 1 and r["val_loss"] > 0 and r["samples_per_s"] > 0 for r in epochs)
    assert epochs[-1]["loss"] < epochs[0]["loss"]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["epoch_2", "epoch_3"]  # the newest two
    assert {p.name for p in run.iterdir()} >= {"model.onnx", "log.jsonl", "run.json", "training_curves.png",
                                               "training_curves.svg"}


def test_a_run_stopped_mid_epoch_and_resumed_ends_with_the_same_weights(capsys, files, tmp_path, fake_trainer):
    whole = dict(files, run=tmp_path / "whole")
    assert main([str(a) for a in _train(whole, "--lr", "0.5", "--epochs", "5")]) == 0
    assert main([str(a) for a in _train(files, "--lr", "0.5", "--epochs", "5", "--max-steps", "12")]) == 0
    assert "stopped after step 12 (--max-steps)" in capsys.readouterr().out
    # From epoch 2's checkpoint (step 10), kept while epochs 3 to 5 are saved, then removed (the newest two stay).
    assert main(["train", "--resume", str(files["run"])]) == 0
    assert "resuming" in capsys.readouterr().err
    got, want = _final_weights(files["run"]), _final_weights(whole["run"])
    assert all(np.array_equal(got[name], want[name]) for name in want)
    from tessel.compiler.train_log import read_log

    assert [r["step"] for r in read_log(files["run"]) if r["kind"] == "step"] == list(range(1, 26))
    assert sorted(p.name for p in (files["run"] / "checkpoints").iterdir()) == ["epoch_4", "epoch_5"]


def test_a_run_resumes_from_its_newest_mid_epoch_checkpoint(capsys, files, tmp_path, fake_trainer):
    from tessel.compiler.train_log import epoch_records, read_log

    whole = dict(files, run=tmp_path / "whole")
    assert main([str(a) for a in _train(whole, "--lr", "0.5", "--epochs", "3")]) == 0
    argv = _train(files, "--lr", "0.5", "--epochs", "3", "--checkpoint-every", "2", "--max-steps", "9")
    assert main([str(a) for a in argv]) == 0
    assert sorted(p.name for p in (files["run"] / "checkpoints").iterdir()) == ["epoch_1", "step_9"]
    capsys.readouterr()
    assert main(["train", "--resume", str(files["run"])]) == 0
    assert "from step_9 (step 9)" in capsys.readouterr().err
    got, want = _final_weights(files["run"]), _final_weights(whole["run"])
    assert all(np.array_equal(got[name], want[name]) for name in want)
    assert [r["step"] for r in read_log(files["run"]) if r["kind"] == "step"] == list(range(1, 16))
    assert [r["loss"] for r in epoch_records(read_log(files["run"]))] == \
        [r["loss"] for r in epoch_records(read_log(whole["run"]))]
    assert sorted(p.name for p in (files["run"] / "checkpoints").iterdir()) == ["epoch_2", "epoch_3"]


def test_resume_of_a_finished_run_asks_for_more_epochs(capsys, files, fake_trainer):
    assert main([str(a) for a in _train(files, "--epochs", "1")]) == 0
    capsys.readouterr()
    _refused(capsys, ["train", "--resume", files["run"]], "already trained 1 epoch(s) of 1; give --epochs N")
    assert main(["train", "--resume", str(files["run"]), "--epochs", "2"]) == 0
    assert len(fake_trainer) == 1  # the second epoch continued from the checkpoint, nothing recompiled


def test_pipeline_flags_reach_the_compile_and_the_run_file(files, fake_trainer):
    import json

    assert main([str(a) for a in _train(files, "--epochs", "1", "--devices", "2", "--parallel", "pipeline",
                                        "--micro-batches", "4", "--pipeline-schedule", "1f1b")]) == 0
    assert fake_trainer[0][1:] == (2, "pipeline", 4, "1f1b", "fp32")
    run = json.loads((files["run"] / "run.json").read_text())
    assert (run["parallel"], run["micro_batches"], run["pipeline_schedule"]) == ("pipeline", 4, "1f1b")


def test_precision_reaches_the_compile_and_the_run_file(files, fake_trainer):
    import json

    assert main([str(a) for a in _train(files, "--epochs", "1", "--precision", "fp64")]) == 0
    assert fake_trainer[0][-1] == "fp64"
    assert json.loads((files["run"] / "run.json").read_text())["precision"] == "fp64"


def test_ops_without_a_gradient_rule_are_named_in_one_line(capsys, files, tmp_path):
    import onnx
    from onnx import helper

    from tests.ir.helpers import F, model

    weights = [("W", np.full((3, 4), 0.1, np.float32))]
    nodes = [helper.make_node("MatMul", ["x", "Wt"], ["h"], name="fc"),
             helper.make_node("Transpose", ["W"], ["Wt"], name="t"),
             helper.make_node("Sin", ["h"], ["s"], name="sin"), helper.make_node("Cosh", ["s"], ["logits"], name="cosh")]
    onnx.save(model(nodes, [("x", F, ["N", 4])], [("logits", F, ["N", 3])], weights), str(tmp_path / "sin.onnx"))
    files["model"] = tmp_path / "sin.onnx"
    _refused(capsys, _train(files, "-q"), "no gradient rule for 2 op type(s): Cosh, Sin")


def test_sync_batchnorm_is_a_setting_of_the_run(capsys, files, fake_trainer):
    import json

    assert main([str(a) for a in _train(files, "--epochs", "1", "--devices", "2", "--sync-batchnorm")]) == 0
    assert json.loads((files["run"] / "run.json").read_text())["sync_batchnorm"] is True
    capsys.readouterr()
    _refused(capsys, ["train", "--resume", files["run"], "--sync-batchnorm"], "leave out --sync-batchnorm")


def test_devices_train_data_parallel_like_one_device(capsys, files, tmp_path):
    import json

    one = dict(files, run=tmp_path / "one")
    assert main([str(a) for a in _train(one, "--epochs", "1", "--momentum", "0.9")]) == 0
    assert main([str(a) for a in _train(files, "--epochs", "1", "--momentum", "0.9", "--devices", "2")]) == 0
    assert json.loads((files["run"] / "run.json").read_text())["devices"] == 2
    want, got = _final_weights(one["run"]), _final_weights(files["run"])
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-4, atol=1e-6)
