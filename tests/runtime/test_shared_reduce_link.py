"""The shared-memory all-reduce's α-β calibration (runtime/shared_reduce_link.py): two local processes measure it,
the fit is stored per worker count and read back."""
from __future__ import annotations

import os

import pytest

from tessel.runtime.shared_reduce import available
from tessel.runtime.shared_reduce_link import (calibrate_shared_reduce, describe, load_shared_reduce_link,
                                               shared_reduce_link_path)

pytestmark = pytest.mark.skipif(not hasattr(os, "eventfd") or not available(), reason="shared memory all-reduce")


def test_two_workers_measure_store_and_load_the_fit(tmp_path, monkeypatch):
    monkeypatch.setenv("TESSEL_CACHE_DIR", str(tmp_path))
    assert load_shared_reduce_link(2) is None
    fit, path = calibrate_shared_reduce(2, repeat=2)
    assert path == shared_reduce_link_path() and path.parent == tmp_path
    link = load_shared_reduce_link(2)
    assert link.measured and (link.alpha, link.beta) == (fit.alpha, fit.beta) and fit.beta > 0
    assert load_shared_reduce_link(4) is None  # another worker count is not this one's
    assert describe(fit).startswith("alpha ")


def test_buckets_are_priced_by_the_shared_memory_all_reduce_once_calibrated(tmp_path, monkeypatch):
    from tessel.passes.machine import Link
    from tessel.runtime.shared_reduce import ALLREDUCE_ENV
    from tessel.runtime.shared_reduce_link import allreduce_link, shared_reduce_link_path

    monkeypatch.setenv("TESSEL_CACHE_DIR", str(tmp_path))
    gloo = Link(60e-6, 1e-9)
    assert allreduce_link(gloo, 2) is gloo  # not calibrated yet
    shared_reduce_link_path().write_text('{"2": {"alpha_s": 7e-05, "beta_s_per_byte": 6e-10}}')
    assert (allreduce_link(gloo, 2).alpha, allreduce_link(gloo, 2).beta) == (7e-05, 6e-10)
    assert allreduce_link(gloo, 4) is gloo
    monkeypatch.setenv(ALLREDUCE_ENV, "gloo")
    assert allreduce_link(gloo, 2) is gloo
