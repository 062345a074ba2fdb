"""The shared-memory all-reduce of local workers: two forked ranks, sums, means and maxima of several dtypes, a
tensor larger than a slice, identical bytes on both ranks (blocking, and started on the reducer thread between
blocking ones), and a peer that never comes."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from tessel.runtime.errors import PeerError
from tessel.runtime.shared_reduce import ALLREDUCE_ENV, SharedReduce, available, close_layout, create_layout

pytestmark = pytest.mark.skipif(not hasattr(os, "eventfd") or not hasattr(os, "fork"), reason="Linux only")


def _tensors(rank: int) -> list[tuple[np.ndarray, str]]:
    rng = np.random.default_rng(rank)
    return [(rng.standard_normal(1000).astype(np.float32), "sum"),
            (rng.standard_normal((3, 5)).astype(np.float64), "mean"),
            (rng.integers(-50, 50, 7).astype(np.int64), "sum"),
            (rng.standard_normal(9).astype(np.float32), "max"),
            (rng.standard_normal(2500).astype(np.float32), "mean"),  # 10 KB: three pieces of a 4 KB slice
            (np.zeros(0, np.float32), "sum")]


def _run_ranks(tmp_path, world: int, ranks: list[int], timeout_s: float, started: bool = False) -> dict[int, int]:
    """Fork `ranks`, each all-reducing `_tensors` and saving its results (or its error line); their exit codes.
    `started`: every other tensor's reduction is started on the reducer thread, waited for at the end."""
    layout = create_layout(world, slice_bytes=4096)
    children = {}
    for rank in ranks:
        pid = os.fork()
        if pid == 0:
            status = 1
            try:
                shared = SharedReduce.attach(json.dumps(layout), rank, timeout_s)
                arrays, waits = {}, []
                for k, (array, reduction) in enumerate(_tensors(rank)):
                    if started and k % 2 == 0:
                        waits.append(shared.start_all_reduce(array, reduction, f"t{k}"))
                    else:
                        shared.all_reduce(array, reduction, f"t{k}")
                    arrays[f"t{k}"] = array
                for wait in waits:
                    wait()
                shared.close()
                np.savez(tmp_path / f"rank{rank}.npz", **arrays)
                status = 0
            except PeerError as exc:
                (tmp_path / f"rank{rank}.txt").write_text(str(exc))
            finally:
                os._exit(status)
        children[rank] = pid
    close_layout(layout)
    return {rank: os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for rank, pid in children.items()}


@pytest.mark.parametrize("started", [False, True], ids=["blocking", "reducer-thread"])
def test_two_ranks_reduce_to_the_same_bytes(tmp_path, started):
    assert _run_ranks(tmp_path, 2, [0, 1], timeout_s=30, started=started) == {0: 0, 1: 0}
    results = [np.load(tmp_path / f"rank{r}.npz", allow_pickle=False) for r in range(2)]
    for k, ((a, reduction), (b, _)) in enumerate(zip(_tensors(0), _tensors(1))):
        expected = {"sum": a + b, "mean": (a + b) / 2, "max": np.maximum(a, b)}[reduction].astype(a.dtype)
        np.testing.assert_allclose(results[0][f"t{k}"], expected, rtol=1e-6)
        assert results[0][f"t{k}"].tobytes() == results[1][f"t{k}"].tobytes()


def test_a_missing_peer_fails_every_started_reduction_after_one_timeout(tmp_path):
    import time

    layout = create_layout(2, slice_bytes=4096)
    shared = SharedReduce(layout, 0, 0.3)
    waits = [shared.start_all_reduce(np.ones(8, np.float32), "sum", f"b{k}") for k in range(3)]
    started = time.perf_counter()
    for wait in waits:
        with pytest.raises(PeerError, match="tensor 'b0' failed .no answer from rank.s. 1"):
            wait()
    assert time.perf_counter() - started < 2.0  # one timeout, not three
    shared.close()


def test_a_missing_peer_fails_with_one_line(tmp_path):
    assert _run_ranks(tmp_path, 2, [0], timeout_s=0.5) == {0: 1}
    line = (tmp_path / "rank0.txt").read_text()
    assert line == "rank 0: all-reduce of tensor 't0' failed (no answer from rank(s) 1 within 0.5 s)"


def test_gloo_is_chosen_by_the_environment_and_a_wrong_choice_refused(monkeypatch):
    monkeypatch.setenv(ALLREDUCE_ENV, "gloo")
    assert not available()
    monkeypatch.setenv(ALLREDUCE_ENV, "nccl")
    with pytest.raises(ValueError, match="expected shm or gloo"):
        available()
