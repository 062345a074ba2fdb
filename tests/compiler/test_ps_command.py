"""The parameter-server flags of `tessel train` (compiler/ps_command.py): which mode they select, what is refused."""
from __future__ import annotations

import argparse

import pytest

from tessel.compiler.ps_command import add_ps_arguments, ps_mode
from tessel.compiler.train_settings import TrainSettingsError


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--resume")
    parser.add_argument("--devices", type=int)
    add_ps_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("argv, want", [((), ("sync", 0)), (("--ps-mode", "async"), ("async", 0)),
                                        (("--staleness", "2"), ("ssp", 2)),
                                        (("--ps-mode", "ssp", "--staleness", "0"), ("ssp", 0))])
def test_the_flags_select_a_consistency_model(argv, want):
    assert ps_mode(_args(*argv)) == want


@pytest.mark.parametrize("argv, message", [
    (("--ps-mode", "ssp"), "--ps-mode ssp needs --staleness S"),
    (("--ps-mode", "async", "--staleness", "1"), "--staleness goes with --ps-mode ssp, not async"),
    (("--resume", "run", "--servers", "2"), "--resume continues with the parameter-server settings in "
                                            "RUN_DIR/ps/job.json; leave out --servers"),
    (("--ps-layout", "colocated", "--servers", "3", "--devices", "2"), "--servers 3 needs --devices 3 or more"),
])
def test_bad_pairings_are_refused_in_one_line(argv, message):
    with pytest.raises(TrainSettingsError, match=message):
        ps_mode(_args(*argv))
