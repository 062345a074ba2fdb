"""The synchronous server's sum (compiler/ps_server.RankOrderSum): the same bits whatever order pushes arrive in.
That a whole server fed pushes in different orders ends with the same weights: tests/compiler/test_ps_training.py."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from tessel.compiler.ps_server import RankOrderSum
from tessel.runtime.ps_compression import ErrorFeedback, Float32, OneBit

WORKERS, SIZE = 4, 4096


def _gradients() -> list[np.ndarray]:
    """Gradients whose blocks of 8 have very different magnitudes from worker to worker, so that float32 sums in
    different orders differ (1-bit's reconstruction values too: one pair per block)."""
    rng = np.random.default_rng(0)
    return [(rng.standard_normal(SIZE) * np.repeat(10.0 ** rng.integers(-4, 5, SIZE // 8), 8)).astype(np.float32)
            for _ in range(WORKERS)]


def _messages(codec) -> list[np.ndarray]:
    return [ErrorFeedback(codec, SIZE).encode(gradient.copy()) for gradient in _gradients()]


@pytest.mark.parametrize("codec", [Float32(), OneBit([8] * (SIZE // 8))], ids=["none", "1bit"])
def test_the_mean_is_the_rank_order_sum_whatever_order_pushes_arrive_in(codec):
    messages = _messages(codec)
    decoded = [codec.decode(message, SIZE) for message in messages]
    expected = np.zeros(SIZE, np.float32)
    for vector in decoded:  # worker 0's first
        expected += vector
    expected /= np.float32(WORKERS)
    arrival = np.zeros(SIZE, np.float32)
    for vector in reversed(decoded):
        arrival += vector
    assert not np.array_equal(arrival / np.float32(WORKERS), expected)  # the order matters to float32
    total = RankOrderSum(codec, SIZE, WORKERS)
    for order in itertools.permutations(range(WORKERS)):
        results = [total.add(worker, messages[worker]) for worker in order]
        assert all(result is None for result in results[:-1])
        np.testing.assert_array_equal(results[-1], expected)
        total.clear()


def test_a_second_push_in_one_clock_is_refused():
    messages = _messages(Float32())
    total = RankOrderSum(Float32(), SIZE, WORKERS)
    total.add(1, messages[1])
    with pytest.raises(ValueError, match="worker 1 pushed twice"):
        total.add(1, messages[1])
    total.add(0, messages[0])
    with pytest.raises(ValueError, match="worker 0 pushed twice"):
        total.add(0, messages[0])


def test_a_push_from_a_worker_the_job_does_not_have_is_refused():
    total = RankOrderSum(Float32(), SIZE, WORKERS)
    message = _messages(Float32())[0]
    for worker in (-1, WORKERS):
        with pytest.raises(ValueError, match=f"worker {worker}: this job has workers 0 to {WORKERS - 1}"):
            total.add(worker, message)
