"""`tessel train --launcher torchrun`: the same command on every rank torchrun starts.

Every rank joins the group first; ranks above 0 then follow rank 0's commands (runtime/rank_group.py) and do
nothing else, while rank 0 runs `tessel train` as usual with the ranks as its data-parallel workers. Under
`torchrun --max-restarts K` a failed group is started again with the same command line: a restarted rank 0 reads
it as `--resume RUN_DIR` and continues from the newest checkpoint in RUN_DIR.
"""
from __future__ import annotations

import argparse
import logging
from pathlib import Path

from tessel.ir.errors import TesselError
from tessel.runtime import rank_group

from .train_settings import RUN_FILE

LAUNCHERS = ("local", "torchrun")
# Seconds each transfer of a step may wait for a peer (a follower loads its kernels before its first step).
STEP_TIMEOUT_S = 120.0

_log = logging.getLogger("tessel.train")


class LauncherError(TesselError):
    """--launcher torchrun outside torchrun."""


def join_ranks() -> int:
    """Join the torchrun group; this rank's number. LauncherError when torchrun did not start this process."""
    if rank_group.torchrun_rank() is None:
        raise LauncherError("--launcher torchrun runs under torchrun: torchrun --nproc-per-node N -m tessel train "
                            "... --devices N --launcher torchrun")
    rank, world = rank_group.attach(STEP_TIMEOUT_S)
    if rank == 0:
        _log.info("torchrun: rank 0 of %d%s", world, " (restarted)" if rank_group.restarted() else "")
    return rank


def restarted_as_resume(args: argparse.Namespace, settings_flags) -> argparse.Namespace:
    """The command line of a run torchrun restarted, read as `--resume RUN_DIR` when RUN_DIR holds the run
    (else as given: the first launch failed before writing it). `settings_flags`: the flags --resume refuses."""
    if not rank_group.restarted() or args.resume or args.output is None \
            or not (Path(args.output) / RUN_FILE).is_file():
        return args
    resumed = argparse.Namespace(**vars(args))
    for name in settings_flags:
        if name != "epochs":
            setattr(resumed, name, None)
    resumed.model = resumed.data = None
    resumed.resume, resumed.force = args.output, False
    _log.info("torchrun restarted the group: resuming %s", args.output)
    return resumed
