"""`tessel train ... --devices W --parallel ps --servers S`: train on W local workers with S parameter servers.

The parameters are sharded over the servers (balanced by bytes); each worker pulls the weights, runs the
compiled gradient step on its 1/W of every batch and pushes each shard's gradient to its server, which applies
the optimizer (compiler/ps_training.py, ps_server.py, ps_worker.py; runtime/ps_job.py). `--ps-mode sync` (BSP,
the default) trains exactly as data-parallel all-reduce does; `async` (Downpour) applies each push at once;
`ssp` (with `--staleness s`) lets a worker run at most s steps ahead of the slowest. `--compression 1bit|topk`
sends gradients (and the weights' changes) through a codec with error feedback; with SGD momentum the workers
then keep the momentum and push it instead, the servers applying plain SGD (compiler/ps_momentum.py). RUN_DIR gets model.onnx,
log.jsonl (the workers' mean loss per step, then one record with the validation metrics, the wall time and the
bytes on the wire) and ps/ (the compiled programs and the job). The ranks write a checkpoint at the end of every
epoch (or every --checkpoint-every N steps) into RUN_DIR/checkpoints/step_S (compiler/ps_checkpoint.py);
`--resume RUN_DIR` continues from the newest with the settings in RUN_DIR/ps/job.json.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from tessel.runtime.ps_compression import CODECS
from tessel.runtime.ps_job import HEADER_BYTES, LAYOUTS, MODES

from .train_data import LABELS, Dataset, as_step_labels
from .train_settings import MODEL_FILE, RunSettings, TrainSettingsError, build_optimizer, loss_spec

PS_DIR = "ps"


def add_ps_arguments(train) -> None:
    """The parameter-server flags of `tessel train` (`--parallel ps` is among train_settings.PARALLEL)."""
    train.add_argument("--servers", type=int, metavar="S", help="parameter servers (default 1)")
    train.add_argument("--ps-mode", choices=MODES, help="sync (BSP, default), async (Downpour) or ssp")
    train.add_argument("--staleness", type=int, metavar="S", help="ssp: most steps a worker may run ahead")
    train.add_argument("--compression", choices=CODECS,
                       help="gradient compression with error feedback, for --parallel data and ps (default none)")
    train.add_argument("--topk-ratio", type=float, help="top-k: share of elements sent (0.01)")
    train.add_argument("--ps-layout", choices=LAYOUTS,
                       help="standalone (servers in processes of their own, default) or colocated (server s runs in "
                            "worker s's process, MXNet's dist_sync local layout; needs --servers <= --devices)")


_PS_FLAGS = ("servers", "ps_mode", "staleness", "ps_layout")


def ps_mode(args: argparse.Namespace) -> tuple[str, int]:
    """(mode, staleness) from the flags: --staleness alone means ssp; a bad pairing is a one-line error. A resumed
    run takes its parameter-server settings from RUN_DIR/ps/job.json and refuses these flags."""
    if args.resume:
        given = [f"--{name.replace('_', '-')}" for name in _PS_FLAGS if getattr(args, name) is not None]
        if given:
            raise TrainSettingsError(f"--resume continues with the parameter-server settings in RUN_DIR/{PS_DIR}/"
                                     f"job.json; leave out {', '.join(given)}")
        return "", 0
    mode = args.ps_mode or ("ssp" if args.staleness is not None else "sync")
    if mode == "ssp" and (args.staleness is None or args.staleness < 0):
        raise TrainSettingsError("--ps-mode ssp needs --staleness S (S >= 0)")
    if mode != "ssp" and args.staleness is not None:
        raise TrainSettingsError(f"--staleness goes with --ps-mode ssp, not {mode}")
    if args.ps_layout == "colocated" and (args.servers or 1) > (args.devices or 1):
        raise TrainSettingsError(f"--ps-layout colocated runs each server in a worker's process: --servers "
                                 f"{args.servers} needs --devices {args.servers} or more")
    return mode, args.staleness or 0


def run_ps(settings: RunSettings, run_dir: Path, data: Dataset, val: Dataset | None, steps_per_epoch: int,
           first_output: str, args: argparse.Namespace) -> int:
    """Train the run on parameter servers; write model.onnx and log.jsonl; print one summary line."""
    from .ps_launch import run_job

    from .ps_training import evaluate_job, prepare_job
    from .train_log import LOG_FILE, RunLog, epoch_record, step_record
    from .train_metrics import ValidationTally
    from .trainer import export_state

    steps = settings.epochs * steps_per_epoch
    if args.max_steps is not None:
        steps = min(steps, args.max_steps)
    if args.resume:
        job = _resumed_job(run_dir, steps, steps_per_epoch)
    else:
        mode, staleness = ps_mode(args)
        arrays = {name: as_step_labels(a) if name == LABELS else a for name, a in data.arrays.items()}
        job = prepare_job(settings.model, loss_spec(settings), build_optimizer(settings, steps_per_epoch), arrays,
                          run_dir / PS_DIR, workers=settings.devices, servers=args.servers or 1,
                          batch=settings.batch, steps=steps, mode=mode, staleness=staleness, seed=settings.seed,
                          compression=settings.compression, topk_ratio=settings.topk_ratio,
                          layout=args.ps_layout or "standalone")
    job.run_dir = str(run_dir)
    job.checkpoint_every = args.checkpoint_every or steps_per_epoch
    job.write(run_dir / PS_DIR)
    settings.save(run_dir)
    result = run_job(run_dir / PS_DIR)
    mode, staleness = job.mode, job.staleness
    state = result.model
    seconds = max(report["seconds"] for report in result.reports)
    pushed = float(np.mean([report["bytes_pushed"] for report in result.reports])) / steps
    pulled = float(np.mean([report["bytes_pulled"] for report in result.reports])) / steps
    floats = sum(int(np.prod(shape)) for shape in job.shapes.values())
    record = epoch_record(settings.epochs, steps, seconds=seconds, ps_mode=mode, staleness=staleness,
                          servers=job.servers, compression=job.compression, push_bytes_per_step=pushed,
                          pull_bytes_per_step=pulled,
                          compression_ratio=(4 * floats + job.servers * HEADER_BYTES) / pushed)
    losses = np.mean([report["losses"] for report in result.reports], axis=0)
    record["loss"] = float(losses[-steps_per_epoch:].mean())
    if val is not None:
        tally = ValidationTally(settings.loss, settings.label_smoothing)
        outputs = evaluate_job(run_dir / PS_DIR, state, val.arrays, settings.batch)
        tally.add(outputs[first_output], val.arrays.get(LABELS), val.length)
        record.update(tally.result())
    (run_dir / LOG_FILE).unlink(missing_ok=True)  # a resumed run's workers report every step's loss again
    with RunLog(run_dir) as log:
        for step, loss in enumerate(losses, 1):
            log.write(step_record((step - 1) // steps_per_epoch + 1, step, float(loss)))
        log.write(record)
    export_state(Path(settings.model).read_bytes(), state, job.parameters, run_dir / MODEL_FILE)
    accuracy = f", val accuracy {100 * record['val_accuracy']:.2f}%" if "val_accuracy" in record else ""
    print(f"trained on parameter servers ({mode}{f' s={staleness}' if mode == 'ssp' else ''}, "
          f"{settings.devices} workers, {job.servers} servers, compression {job.compression}): {steps} steps in "
          f"{seconds:.1f} s{accuracy}, {pushed:.0f} B pushed per worker per step "
          f"({record['compression_ratio']:.1f}x fewer than float32), {run_dir / MODEL_FILE}")
    return 0


def _resumed_job(run_dir: Path, steps: int, steps_per_epoch: int):
    """The run's job, set to start from its newest checkpoint (from the beginning if it has none) and to end
    after `steps` steps; half-written checkpoints are removed. A run whose newest checkpoint has `steps` steps
    or more (a finished run: the ranks checkpoint after the last step) is a TrainSettingsError, before anything
    in RUN_DIR changes: nothing to do."""
    from tessel.runtime.ps_job import PSJob

    from .train_checkpoints import drop_after, mid_epoch_steps

    job = PSJob.read(run_dir / PS_DIR)
    done = mid_epoch_steps(run_dir)
    if done and done[-1] >= steps:
        raise TrainSettingsError(f"{run_dir}: already trained {done[-1]} step(s) of {steps}; nothing to do "
                                 "(give --epochs N or --max-steps N beyond them to train more)")
    drop_after(run_dir, steps, steps_per_epoch)
    job.start = done[-1] if done else 0
    job.steps = steps
    return job
