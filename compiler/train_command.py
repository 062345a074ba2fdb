"""`tessel train MODEL.onnx --data train.npz -o RUN_DIR`: train an ONNX model with one compiled step per batch.

The .npz files hold one array per model input (by name) and `labels`. Each epoch visits the full batches of
the data in an order drawn from (seed, epoch) (the last partial batch is left out: the step is compiled for
one batch size), then evaluates --val, writes a line to RUN_DIR/log.jsonl (a line per step too) and saves a
checkpoint (with --checkpoint-every N, one every N steps inside the epoch too). At the end RUN_DIR holds
model.onnx (the trained model, for any ONNX runtime) and training_curves.png/.svg. `--resume RUN_DIR`
continues a run from its newest checkpoint with the settings in
RUN_DIR/run.json: shuffling and dropout masks depend only on (seed, epoch/step), so a run killed mid-epoch and
resumed ends with the weights an uninterrupted run ends with.
"""
from __future__ import annotations

import argparse
import itertools
import logging
import shutil
import time
from dataclasses import replace
from pathlib import Path

from tessel.ir.errors import TesselError
from tessel.passes.pipeline_schedule import SCHEDULES as PIPELINE_SCHEDULES

from .arg_types import count_from
from .options import PRECISIONS
from .ps_command import add_ps_arguments, ps_mode, run_ps
from .dp_training import compression_summary
from .train_checkpoints import (completed_epochs, drop_after, drop_superseded, latest_checkpoint, prune,
                                save_checkpoint, save_step_checkpoint)
from .train_launch import LAUNCHERS, join_ranks, restarted_as_resume
from .train_data import (LABELS, Dataset, as_step_labels, check_class_labels, feeds, input_shapes, load_dataset,
                         model_inputs, model_outputs)
from .train_log import RunLog, epoch_record, keep_until, read_log, step_record, step_records
from .train_metrics import ValidationTally
from .train_progress import TrainProgress
from .train_settings import (DEFAULT_WEIGHT_DECAY, MODEL_FILE, OPTIMIZERS, PARALLEL, RUN_FILE, SCHEDULES,
                             RunSettings, TrainSettingsError, build_optimizer, loss_output, loss_spec)

CURVES = "training_curves"
DEFAULT_KEEP_CHECKPOINTS = 2

_log = logging.getLogger("tessel.train")


class RunDirError(TesselError):
    """RUN_DIR cannot be used as asked (exists without --force, or --resume finds nothing to continue)."""


def add_train_parser(commands, parents) -> None:
    """Register `tessel train` among the CLI's subcommands (`parents`: the options every command takes)."""
    train = commands.add_parser("train", parents=parents, help="train a model: one compiled step per batch")
    train.add_argument("model", nargs="?", help="path of an .onnx model (not with --resume)")
    train.add_argument("--data", metavar="TRAIN.npz", help="training data: the model's inputs by name and 'labels'")
    train.add_argument("--val", metavar="VAL.npz", help="validation data, evaluated after each epoch")
    train.add_argument("--loss", help="cross_entropy (labels: int64 class indices), mse, l1, bce_with_logits, "
                                      "or output:K / an output's name when the model computes its own loss")
    train.add_argument("--label-smoothing", type=float, metavar="EPS", help="for cross_entropy (default 0)")
    train.add_argument("--optimizer", help=f"{' or '.join(OPTIMIZERS)} (default sgd)")
    train.add_argument("--lr", type=float, help="learning rate (required for a new run)")
    train.add_argument("--momentum", type=float, help="SGD momentum (default 0)")
    train.add_argument("--nesterov", action="store_true", default=None, help="SGD with Nesterov momentum")
    train.add_argument("--weight-decay", type=float, metavar="WD",
                       help="L2 penalty for sgd, decoupled decay for adamw (defaults: sgd 0, adamw 0.01)")
    train.add_argument("--schedule", metavar="SCHEDULE",
                       help=f"learning rate schedule: {', '.join(SCHEDULES)} (default constant)")
    train.add_argument("--warmup", type=count_from(0), metavar="STEPS", help="linear warm-up over STEPS steps")
    train.add_argument("--base-batch", type=count_from(1), metavar="N",
                       help="--lr was tuned for batch N: scale it by batch/N (linear scaling rule, Goyal et al.)")
    train.add_argument("--batch", type=count_from(1), metavar="N", help="samples per step (default 64)")
    train.add_argument("--epochs", type=count_from(1), metavar="N",
                       help="epochs to train (default 10; with --resume: the new total)")
    train.add_argument("--seed", type=int, help="seed of the shuffling and the dropout masks (default 0)")
    train.add_argument("--trainable", metavar="REGEX", help="train only the initializers whose name matches")
    train.add_argument("--frozen", metavar="REGEX", help="keep the initializers whose name matches constant")
    train.add_argument("--devices", type=count_from(1), metavar="N",
                       help="train on N local workers: data-parallel, each on batch/N samples (default 1)")
    train.add_argument("--launcher", choices=LAUNCHERS, default="local",
                       help="local: start the --devices workers here (default); torchrun: this is one of the "
                            "ranks torchrun started, rank 0 trains and the others follow it")
    train.add_argument("--parallel", choices=PARALLEL,
                       help="with --devices N > 1: 'data' (default), 'pipeline' (N stages, one per worker) or "
                            "'ps' (N workers and --servers parameter servers) or 'auto' (the best predicted step of "
                            "data and pipeline: RUN_DIR/reports/parallel_auto.md)")
    train.add_argument("--micro-batches", type=count_from(1), metavar="M",
                       help="pipeline: micro-batches per step (default 1; auto: up to 4 per stage)")
    train.add_argument("--pipeline-schedule", choices=PIPELINE_SCHEDULES,
                       help="pipeline: gpipe (all forwards, then all backwards; default) or 1f1b")
    train.add_argument("--sync-batchnorm", action="store_true", default=None,
                       help="with --devices N > 1: BatchNormalization normalises with the whole batch's statistics, "
                            "all-reduced (as torch.nn.SyncBatchNorm), not each worker's slice's")
    train.add_argument("--precision", choices=PRECISIONS,
                       help="fp32 (default) or fp64: the step computes the model's float32 tensors in float64")
    train.add_argument("-o", "--output", metavar="RUN_DIR", help="run directory to write")
    train.add_argument("--force", action="store_true", help="replace an existing run directory")
    train.add_argument("--resume", metavar="RUN_DIR", help="continue that run from its last checkpoint")
    train.add_argument("--max-steps", type=count_from(1), metavar="N",
                       help="stop after N steps in all, even mid-epoch (resume later with --resume)")
    train.add_argument("--checkpoint-every", type=count_from(1), metavar="N",
                       help="also save a checkpoint every N steps inside an epoch (the newest one is kept)")
    train.add_argument("--keep-checkpoints", type=count_from(0), default=DEFAULT_KEEP_CHECKPOINTS, metavar="K",
                       help=f"keep the newest K epoch checkpoints, 0 for all (default {DEFAULT_KEEP_CHECKPOINTS})")
    add_ps_arguments(train)
    train.set_defaults(run=run_train)


# The flags that make up a run's settings: a new run takes them (else their defaults), --resume takes them from
# RUN_DIR/run.json and refuses them on the command line (except --epochs, the new total).
_DEFAULTS = {"val": None, "loss": None, "label_smoothing": 0.0, "optimizer": "sgd", "lr": None, "momentum": 0.0,
             "nesterov": False, "weight_decay": None, "schedule": "constant", "warmup": 0, "base_batch": None,
             "batch": 64, "epochs": 10, "seed": 0, "trainable": None, "frozen": None,
             "devices": 1, "parallel": "data", "micro_batches": 1, "pipeline_schedule": "gpipe",
             "sync_batchnorm": False, "compression": "none", "topk_ratio": 0.01, "precision": "fp32"}


def run_train(args: argparse.Namespace) -> int:
    """The `tessel train` command."""
    if args.launcher == "torchrun" and args.parallel == "auto":
        raise TrainSettingsError("--parallel auto compares its alternatives on local workers; under torchrun give "
                                 "--parallel data or pipeline")
    if args.launcher == "torchrun":
        if join_ranks() != 0:
            from tessel.runtime.rank_group import follow

            return follow()
        args = restarted_as_resume(args, _DEFAULTS)
    if args.resume:
        run_dir, settings = _resumed_settings(args)
    else:
        run_dir, settings = _new_settings(args)
    inputs = model_inputs(settings.model)
    declared = model_outputs(settings.model)
    outputs = list(declared)
    settings.check(outputs)
    model_loss = loss_output(settings.loss, outputs)
    data = load_dataset(settings.data, inputs, model_loss is None, "--data")
    val = load_dataset(settings.val, inputs, model_loss is None, "--val") if settings.val else None
    _check_labels(settings, data, val, _class_count(declared[outputs[0]]))
    if data.length < settings.batch:
        raise RunDirError(f"{settings.data}: {data.length} samples, fewer than --batch {settings.batch}")
    steps_per_epoch = data.length // settings.batch
    if settings.parallel == "ps":
        ps_mode(args)  # its flags refused before RUN_DIR is touched
    if not args.resume:
        _prepare_run_dir(run_dir, args.force)
    checkpointed = completed_epochs(run_dir)[-1:] if args.resume else []
    if checkpointed and checkpointed[0] >= settings.epochs:
        raise RunDirError(f"{run_dir}: already trained {checkpointed[0]} epoch(s) of {settings.epochs}; "
                          "give --epochs N to train more")
    if settings.parallel == "ps":
        return run_ps(settings, run_dir, data, val, steps_per_epoch, model_loss or outputs[0], args)
    from .parallel_auto import ParameterServerChosen

    try:
        trainer, loaded_from = _trainer(settings, run_dir, data, inputs, steps_per_epoch, bool(args.resume))
    except ParameterServerChosen as chosen:  # --parallel auto: the parameter server is predicted fastest
        chosen.write_reports(run_dir / "reports")
        args.servers = chosen.servers
        return run_ps(replace(settings, parallel="ps"), run_dir, data, val, steps_per_epoch,
                      model_loss or outputs[0], args)
    settings.save(run_dir)
    finished = _train_epochs(trainer, settings, run_dir, data, val, loaded_from, steps_per_epoch,
                             model_loss or outputs[0], args)
    if settings.parallel == "auto":
        from .parallel_auto import record_run

        record_run(run_dir, trainer, [settings.batch / r["samples_per_s"] for r in step_records(read_log(run_dir))])
    prune(run_dir, args.keep_checkpoints)  # the checkpoint a resumed run started from, too, once past it
    drop_superseded(run_dir, steps_per_epoch)
    trainer.export_onnx(str(run_dir / MODEL_FILE))
    trainer.close()
    from .plots.training_curves import write_training_curves

    write_training_curves(run_dir / CURVES, read_log(run_dir), f"{Path(settings.model).name}: training",
                          settings.loss)
    done = "trained" if finished else f"stopped after step {trainer.steps_done} (--max-steps)"
    if settings.compression != "none":
        print(compression_summary(trainer.step_artifact.directory) or "gradients compressed "
              f"({settings.compression})")
    print(f"{done}: {trainer.steps_done} steps, {run_dir / MODEL_FILE}, {run_dir / CURVES}.png")
    return 0


def _new_settings(args) -> tuple[Path, RunSettings]:
    for flag in ("model", "data", "loss", "lr", "output"):
        if getattr(args, flag) is None:
            name = "MODEL.onnx" if flag == "model" else "-o RUN_DIR" if flag == "output" else f"--{flag}"
            raise RunDirError(f"a new run needs {name} (or --resume RUN_DIR to continue one)")
    values = {name: default if getattr(args, name) is None else getattr(args, name)
              for name, default in _DEFAULTS.items()}
    if values["weight_decay"] is None:
        values["weight_decay"] = DEFAULT_WEIGHT_DECAY.get(values["optimizer"], 0.0)
    values["val"] = _absolute(values["val"])
    return Path(args.output), RunSettings(model=_absolute(args.model), data=_absolute(args.data), **values)


def _resumed_settings(args) -> tuple[Path, RunSettings]:
    given = [f"--{name.replace('_', '-')}" for name in _DEFAULTS if name != "epochs" and getattr(args, name) is not None]
    given += ["MODEL.onnx"] * (args.model is not None) + ["--data"] * (args.data is not None)
    if given:
        raise RunDirError(f"--resume continues with the settings in RUN_DIR/{RUN_FILE}; leave out "
                          f"{', '.join(given)} (only --epochs may change)")
    if args.output is not None and Path(args.output).resolve() != Path(args.resume).resolve():
        raise RunDirError("--resume RUN_DIR writes into RUN_DIR; leave out -o or give the same directory")
    run_dir = Path(args.resume)
    settings = RunSettings.load(run_dir)
    if args.epochs is not None:
        settings = replace(settings, epochs=args.epochs)
    return run_dir, settings


def _absolute(path: str | None) -> str | None:
    return None if path is None else str(Path(path).absolute())


def _class_count(logits_shape: tuple[int | None, ...]) -> int | None:
    return logits_shape[1] if len(logits_shape) >= 2 else None


def _check_labels(settings: RunSettings, data: Dataset, val: Dataset | None, classes: int | None) -> None:
    if settings.loss != "cross_entropy":
        return
    for path, dataset in ((settings.data, data), (settings.val, val)):
        if dataset is not None:
            check_class_labels(path, dataset.arrays[LABELS], classes)


def _prepare_run_dir(run_dir: Path, force: bool) -> None:
    """An absent or empty RUN_DIR is used; an earlier run's is replaced with --force; anything else is refused."""
    if run_dir.is_dir() and any(run_dir.iterdir()):
        if not force:
            raise RunDirError(f"{run_dir}: already exists; pass --force to replace it or --resume {run_dir} "
                              "to continue it")
        if not (run_dir / RUN_FILE).is_file():
            raise RunDirError(f"{run_dir}: --force replaces only a training run directory (with {RUN_FILE}) and "
                              "this is not one; remove it yourself or choose another")
        shutil.rmtree(run_dir)
    elif run_dir.exists() and not run_dir.is_dir():
        raise RunDirError(f"{run_dir}: is a file, not a directory; choose another -o")
    run_dir.mkdir(parents=True, exist_ok=True)


def _trainer(settings: RunSettings, run_dir: Path, data: Dataset, inputs, steps_per_epoch: int, resumed: bool):
    """(trainer, the checkpoint it was loaded from or None): the latest checkpoint's trainer (epoch end or
    mid-epoch) when resuming, else a fresh compile."""
    import tessel

    latest = latest_checkpoint(run_dir, steps_per_epoch) if resumed else None
    drop_after(run_dir, latest[1] if latest else 0, steps_per_epoch)
    if latest:
        path, steps = latest
        trainer = tessel.load_training(str(path))
        if trainer.steps_done != steps:
            raise RunDirError(f"{run_dir}: checkpoint {path.name} holds {trainer.steps_done} steps, not {steps} "
                              f"({steps_per_epoch} per epoch): the data or --batch changed since")
        _log.info("resuming %s from %s (step %d)", run_dir, path.name, trainer.steps_done)
    else:
        if resumed:
            _log.info("resuming %s: no checkpoint yet, starting from the beginning", run_dir)
        _log.info("compiling the training step of %s (batch %d)", settings.model, settings.batch)
        trainer = tessel.compile_training(
            settings.model, loss=loss_spec(settings), optimizer=build_optimizer(settings, steps_per_epoch),
            input_shapes=input_shapes(inputs, data, settings.batch), trainable=settings.trainable,
            frozen=settings.frozen, seed=settings.seed, devices=settings.devices, parallel=settings.parallel,
            micro_batches=settings.micro_batches, schedule=settings.pipeline_schedule,
            sync_batchnorm=settings.sync_batchnorm, compression=settings.compression, topk_ratio=settings.topk_ratio,
            precision=settings.precision,
            auto_ps=settings.parallel == "auto")
    keep_until(run_dir, trainer.steps_done)
    return trainer, latest[0] if latest else None


def _train_epochs(trainer, settings: RunSettings, run_dir: Path, data: Dataset, val: Dataset | None,
                  loaded_from: Path | None, steps_per_epoch: int, first_output: str, args) -> bool:
    """Train from the trainer's step to the end of epoch settings.epochs (a resumed epoch skips the batches
    it did: the order depends only on (seed, epoch)); False when --max-steps stopped the run first."""
    progress = TrainProgress(settings.epochs, steps_per_epoch, settings.batch)
    start_epoch, done_in_epoch = divmod(trainer.steps_done, steps_per_epoch)
    # A resumed epoch's mean loss counts the steps before the checkpoint too (their log lines were kept).
    resumed_losses = [r["loss"] for r in step_records(read_log(run_dir)) if r["epoch"] == start_epoch + 1]
    with RunLog(run_dir) as log:
        for epoch in range(start_epoch + 1, settings.epochs + 1):
            started = time.perf_counter()
            losses = resumed_losses if epoch == start_epoch + 1 else []
            before = len(losses)
            batches = enumerate(data.batches(settings.batch, settings.seed, epoch), 1)
            for index, batch in itertools.islice(batches, done_in_epoch if epoch == start_epoch + 1 else 0, None):
                if args.max_steps is not None and trainer.steps_done >= args.max_steps:
                    return False
                lr = trainer.optimizer.lr_at(trainer.steps_done)
                step_started = time.perf_counter()
                loss = _step(trainer, batch, epoch)
                seconds = time.perf_counter() - step_started
                losses.append(loss)
                log.write(step_record(epoch, trainer.steps_done, loss, lr=lr, samples_per_s=settings.batch / seconds))
                progress.step(epoch, index, loss, seconds)
                if args.checkpoint_every and index % args.checkpoint_every == 0 and index < steps_per_epoch:
                    save_step_checkpoint(trainer, run_dir, spare=loaded_from)
            seconds = time.perf_counter() - started
            record = epoch_record(epoch, trainer.steps_done, loss=sum(losses) / len(losses), lr=lr,
                                  samples_per_s=(len(losses) - before) * settings.batch / seconds, seconds=seconds)
            if val is not None:
                record.update(validate(trainer, val, settings, first_output))
            log.write(record)
            progress.epoch(record)
            save_checkpoint(trainer, run_dir, epoch, args.keep_checkpoints, spare=loaded_from)
    return True


def _step(trainer, batch: dict, epoch: int) -> float:
    """One training step; Ctrl-C says where the run stopped and how to continue it."""
    try:
        return trainer.step(feeds(batch), as_step_labels(batch[LABELS]) if LABELS in batch else None)
    except KeyboardInterrupt:
        raise KeyboardInterrupt(f"interrupted in epoch {epoch} at step {trainer.steps_done}; continue with "
                                "'tessel train --resume RUN_DIR' (from the last checkpoint)") from None


def validate(trainer, val: Dataset, settings: RunSettings, output: str) -> dict[str, float]:
    """val_loss (and val_accuracy for cross-entropy) of the current weights over every validation sample."""
    tally = ValidationTally(settings.loss, settings.label_smoothing)
    for chunk, valid in val.chunks(settings.batch):
        outputs = trainer.evaluate(feeds(chunk))
        tally.add(outputs[output], chunk.get(LABELS), valid)
    return tally.result()

