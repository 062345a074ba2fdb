"""bench/train_distributed.py's per-worker phases: the bars beside the kernels count the time any one is in flight."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from bench.train_distributed import phase_seconds
from tessel.compiler.step_timeline import ALLREDUCE, BACKWARD, Bar


def test_overlapping_all_reduces_count_once_and_kernels_add_up():
    bars = [Bar(0, BACKWARD, 0.0, 1.0, "g1"), Bar(0, BACKWARD, 1.0, 3.0, "g2"),
            Bar(0, ALLREDUCE, 0.5, 2.0, "ar1", comm=True), Bar(0, ALLREDUCE, 1.5, 2.5, "ar2", comm=True),
            Bar(0, ALLREDUCE, 2.8, 3.2, "ar3", comm=True)]
    (split,) = phase_seconds(SimpleNamespace(step_s=3.2, busy_s=[3.0], bars=bars))
    assert split["step"] == 3.2 and split[BACKWARD] == pytest.approx(3.0)
    assert split[ALLREDUCE] == pytest.approx(2.0 + 0.4)  # 0.5-2.5 and 2.8-3.2


def test_a_transfers_host_overhead_adds_to_its_time_on_the_link():
    bars = [Bar(0, ALLREDUCE, 0.0, 0.1, "ar1"), Bar(0, ALLREDUCE, 0.1, 0.6, "ar1", comm=True),
            Bar(0, ALLREDUCE, 0.3, 0.8, "ar2", comm=True)]
    (split,) = phase_seconds(SimpleNamespace(step_s=1.0, busy_s=[0.1], bars=bars))
    assert split[ALLREDUCE] == pytest.approx(0.1 + 0.7)  # the host's 0.1 s, then the link busy 0.1-0.8
