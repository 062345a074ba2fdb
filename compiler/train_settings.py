"""The settings of a `tessel train` run: checked once from the flags, kept in RUN_DIR/run.json so that
`--resume RUN_DIR` continues with exactly the same model, data, loss, optimizer and schedule."""
from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path

from tessel.ir.errors import TesselError

from .options import PRECISIONS
from .train_metrics import HOST_LOSSES

MODEL_FILE = "model.onnx"  # the trained model a run writes into RUN_DIR
RUN_FILE = "run.json"
OPTIMIZERS = ("sgd", "adamw")
SCHEDULES = ("constant", "step:STEP_SIZE:GAMMA", "cosine", "cosine:MIN_LR")
PARALLEL = ("data", "pipeline", "ps", "auto")
DEFAULT_WEIGHT_DECAY = {"sgd": 0.0, "adamw": 0.01}  # torch.optim's defaults


class TrainSettingsError(TesselError):
    """A flag of `tessel train` is out of range or does not go with the others."""


@dataclass(frozen=True)
class RunSettings:
    """Everything a run is trained with (paths as given, made absolute)."""

    model: str
    data: str
    val: str | None
    loss: str
    label_smoothing: float
    optimizer: str
    lr: float
    momentum: float
    nesterov: bool
    weight_decay: float
    schedule: str
    warmup: int
    base_batch: int | None
    batch: int
    epochs: int
    seed: int
    trainable: str | None
    frozen: str | None
    devices: int
    # Settings added after runs were first written: a run.json without them trained on these.
    parallel: str = "data"
    micro_batches: int = 1
    pipeline_schedule: str = "gpipe"
    sync_batchnorm: bool = False
    compression: str = "none"      # gradient compression (data parallel and parameter servers)
    topk_ratio: float = 0.01
    precision: str = "fp32"

    def check(self, output_names: list[str]) -> "RunSettings":
        """Refuse settings that cannot train (one line each), the loss checked against the model's outputs;
        returns self."""
        loss_output(self.loss, output_names)
        if self.optimizer not in OPTIMIZERS:
            raise TrainSettingsError(f"unknown --optimizer '{self.optimizer}'; choose {' or '.join(OPTIMIZERS)}")
        if not self.lr > 0:
            raise TrainSettingsError(f"--lr {self.lr}: give a learning rate above 0")
        if self.optimizer != "sgd" and (self.momentum or self.nesterov):
            raise TrainSettingsError("--momentum and --nesterov are SGD's; AdamW takes its own moments")
        if self.nesterov and not self.momentum > 0:
            raise TrainSettingsError("--nesterov needs --momentum above 0 (as torch.optim.SGD)")
        if not 0 <= self.momentum < 1 or self.weight_decay < 0:
            raise TrainSettingsError("--momentum must lie in [0, 1) and --weight-decay must not be negative")
        if not 0 <= self.label_smoothing < 1:
            raise TrainSettingsError(f"--label-smoothing {self.label_smoothing}: give a value in [0, 1)")
        if self.label_smoothing and self.loss != "cross_entropy":
            raise TrainSettingsError("--label-smoothing goes with --loss cross_entropy only")
        if self.parallel == "pipeline":
            if self.sync_batchnorm:
                raise TrainSettingsError("--sync-batchnorm goes with data-parallel training: pipeline stages "
                                         "normalise per micro-batch")
            if self.devices < 2:
                raise TrainSettingsError("--parallel pipeline needs --devices 2 or more (one stage per worker)")
            if self.batch % self.micro_batches:
                raise TrainSettingsError(f"--batch {self.batch} is not a multiple of --micro-batches "
                                         f"{self.micro_batches}")
        elif self.micro_batches > 1 and self.parallel != "auto":
            raise TrainSettingsError("--micro-batches goes with --parallel pipeline or auto")
        elif self.batch % max(self.micro_batches, 1):
            raise TrainSettingsError(f"--batch {self.batch} is not a multiple of --micro-batches "
                                     f"{self.micro_batches}")
        elif self.batch % self.devices:
            raise TrainSettingsError(f"--batch {self.batch} is not a multiple of --devices {self.devices}: each "
                                     "worker trains on an equal share")
        if self.compression != "none" and (self.parallel == "pipeline" or self.devices < 2):
            raise TrainSettingsError("--compression goes with --parallel data or ps on --devices 2 or more")
        if not 0 < self.topk_ratio <= 1:
            raise TrainSettingsError(f"--topk-ratio {self.topk_ratio}: give a value in (0, 1]")
        if self.precision not in PRECISIONS:
            raise TrainSettingsError(f"--precision {self.precision}: use one of {', '.join(PRECISIONS)}")
        if self.precision != "fp32" and (self.parallel == "ps" or self.compression != "none"):
            raise TrainSettingsError("--precision fp64 trains on one worker, data-parallel or pipelined; parameter "
                                     "servers and --compression exchange float32")
        parse_schedule(self.schedule)
        return self

    def save(self, run_dir: Path) -> None:
        """Write RUN_DIR/run.json."""
        (run_dir / RUN_FILE).write_text(json.dumps(asdict(self), indent=2) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, run_dir: Path) -> "RunSettings":
        """Read RUN_DIR/run.json (written by the run that --resume continues)."""
        path = run_dir / RUN_FILE
        if not path.is_file():
            raise TrainSettingsError(f"{run_dir}: not a training run directory (no {RUN_FILE}); --resume takes "
                                     "the -o directory of an earlier 'tessel train'")
        try:
            values = json.loads(path.read_text(encoding="utf-8"))
            return cls(**{f.name: values[f.name] for f in fields(cls) if f.name in values or f.default is MISSING})
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise TrainSettingsError(f"{path}: damaged ({type(exc).__name__}: {exc}); start a new run") from None


def parse_schedule(text: str) -> tuple[str, tuple[float, ...]]:
    """'constant', 'step:STEP_SIZE:GAMMA', 'cosine' or 'cosine:MIN_LR' -> (kind, numbers)."""
    kind, *numbers = text.split(":")
    arity = {"constant": (0,), "step": (2,), "cosine": (0, 1)}
    try:
        values = tuple(float(n) for n in numbers)
    except ValueError:
        values = None
    if kind not in arity or values is None or len(values) not in arity[kind]:
        raise TrainSettingsError(f"bad --schedule '{text}'; give one of {', '.join(SCHEDULES)}")
    if kind == "step" and (values[0] < 1 or values[0] != int(values[0]) or not values[1] > 0):
        raise TrainSettingsError(f"bad --schedule '{text}': STEP_SIZE is a whole number of steps >= 1, GAMMA > 0")
    return kind, values


def loss_output(loss: str, output_names: list[str]) -> str | None:
    """The model output a loss names (output:K or an output's name); None for a built-in loss. An unknown name
    or an index past the outputs is refused."""
    if loss in HOST_LOSSES:
        return None
    if loss in output_names:
        return loss
    kind, _, index = loss.partition(":")
    if kind == "output" and index.isdigit() and int(index) < len(output_names):
        return output_names[int(index)]
    raise TrainSettingsError(f"unknown --loss '{loss}'; choose {', '.join(HOST_LOSSES)}, or output:K (K < "
                             f"{len(output_names)}) / an output's name ({', '.join(output_names)}) when the model "
                             "computes its own loss")


def loss_spec(settings: RunSettings):
    """The loss as compile_training takes it: its name, or a LossSpec when it carries label smoothing."""
    if not settings.label_smoothing:
        return settings.loss
    from tessel.passes.loss import LossSpec

    return LossSpec.parse(settings.loss, settings.label_smoothing)


def build_optimizer(settings: RunSettings, steps_per_epoch: int):
    """The tessel.optim optimizer the settings describe, its schedule counted in steps."""
    from tessel.compiler import optim

    lr = settings.lr
    if settings.base_batch:
        lr = optim.linear_scaling(settings.lr, settings.base_batch, settings.batch)
    kind, numbers = parse_schedule(settings.schedule)
    total = settings.epochs * steps_per_epoch
    if kind == "step":
        schedule = optim.step(int(numbers[0]), numbers[1])
    elif kind == "cosine":
        schedule = optim.cosine(total - settings.warmup, min_lr=numbers[0] if numbers else 0.0)
    else:
        schedule = optim.constant()
    if settings.warmup:  # from the base batch's rate when scaling it (Goyal et al.'s gradual warm-up)
        start = settings.base_batch / settings.batch if settings.base_batch else 1.0 / 3
        schedule = optim.warmup(settings.warmup, schedule, start_factor=min(start, 1.0))
    if settings.optimizer == "sgd":
        return optim.SGD(lr, momentum=settings.momentum, nesterov=settings.nesterov,
                         weight_decay=settings.weight_decay, schedule=schedule)
    return optim.AdamW(lr, weight_decay=settings.weight_decay, schedule=schedule)
