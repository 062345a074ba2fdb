"""A whole batch against what each worker takes (runtime/batch_io.py): a data-parallel step's inputs are split
among the workers, a pipeline's go to rank 0 alone."""
import numpy as np
import pytest

from tessel.runtime.batch_io import batch_input_types, worker_feeds
from tessel.runtime.errors import InputError


def _worker(inputs: dict[str, str]) -> dict:
    return {"inputs": list(inputs), "outputs": [], "values": dict(inputs)}


def test_inputs_every_worker_takes_are_split_along_the_batch_and_scalars_go_whole():
    replica = {"x": "float32[2,3]", "labels": "int64[2]", "lr": "float32[]"}
    plan = {"workers": [_worker(replica), _worker(replica)]}
    assert {n: t.spec() for n, t in batch_input_types(plan).items()} == \
        {"x": "float32[4,3]", "labels": "int64[4]", "lr": "float32[]"}
    x, labels, lr = np.arange(12, dtype=np.float32).reshape(4, 3), np.arange(4), np.float32(0.1)
    feeds = worker_feeds(plan, {"x": x, "labels": labels, "lr": lr})
    for rank, feed in enumerate(feeds):
        np.testing.assert_array_equal(feed["x"], x[2 * rank:2 * rank + 2])
        np.testing.assert_array_equal(feed["labels"], labels[2 * rank:2 * rank + 2])
        assert feed["lr"] == lr


def test_a_pipeline_takes_its_inputs_on_rank_0_alone():
    plan = {"workers": [_worker({"x": "float32[2,3]"}), _worker({})], "microbatches": 2}
    assert batch_input_types(plan)["x"].spec() == "float32[4,3]"
    x = np.ones((4, 3), np.float32)
    feeds = worker_feeds(plan, {"x": x})
    assert feeds[0]["x"] is x and feeds[1] == {}


def test_a_batch_that_does_not_split_evenly_is_refused_in_one_line():
    replica = {"x": "float32[2,3]"}
    plan = {"workers": [_worker(replica), _worker(replica)]}
    with pytest.raises(InputError, match="input 'x' has 5 rows, which do not split evenly among 2 workers"):
        worker_feeds(plan, {"x": np.ones((5, 3), np.float32)})
