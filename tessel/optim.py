"""`tessel.optim`: the optimizers and learning-rate schedules of `tessel.compile_training` (compiler/optim.py)."""
from tessel.compiler.optim import (  # noqa: F401 - the public names of tessel.optim
    SGD, AdamW, Optimizer, OptimizerConfigError, Schedule, constant, cosine, linear_scaling,
    optimizer_from_json, schedule_from_json, schedule_to_json, step, warmup,
)

__all__ = ["SGD", "AdamW", "Optimizer", "OptimizerConfigError", "Schedule", "constant", "cosine",
           "linear_scaling", "optimizer_from_json", "schedule_from_json", "schedule_to_json", "step", "warmup"]
