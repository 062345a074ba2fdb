"""Held sends: a pipeline stage waits for a send only before it overwrites the sent bytes, in the next run.

The end-to-end tests run both stages of a micro-batched pipeline in this process, one after the other, through a
comm that behaves like gloo where it matters: a send's bytes are read when the receiver takes them or when the
sender waits, whichever comes first. A stage that overwrote a sent buffer too early would deliver wrong values.
"""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from tessel.compiler.api import compile
from tessel.runtime.executor import Executor
from tessel.runtime.held_sends import HeldSends, byte_range, wait_points
from tessel.runtime.instructions import KernelCall, Send, View

MICROBATCHES = 4


class BufferedComm:
    """Both ranks' comm, in one process: a send's bytes are copied when its receiver takes them or its sender
    waits for it, whichever comes first (gloo reads them at some point in between)."""

    def __init__(self):
        self.queues: dict[tuple[int, int, int], list[dict]] = {}
        self.waited_late = 0  # sends still untaken when the sender moved on to its next run

    def rank_view(self, rank: int) -> "RankComm":
        return RankComm(self, rank)


class RankComm:
    def __init__(self, shared: BufferedComm, rank: int):
        self.shared, self.rank, self.timeout_s = shared, rank, 1.0

    def start_send(self, array, peer, tag, name):
        message = {"live": array}
        self.shared.queues.setdefault((self.rank, peer, tag), []).append(message)

        def wait():
            if "copy" not in message:
                message["copy"] = message["live"].copy()
                self.shared.waited_late += 1

        return wait

    def send(self, array, peer, tag, name):
        self.shared.queues.setdefault((self.rank, peer, tag), []).append({"copy": array.copy()})

    def wait_sends(self):
        pass

    def _take(self, peer, tag, name):
        queue = self.shared.queues.get((peer, self.rank, tag))
        assert queue, f"rank {self.rank} receives '{name}' that rank {peer} has not sent"
        message = queue.pop(0)
        message.setdefault("copy", message["live"].copy())
        return message["copy"]

    def recv(self, array, peer, tag, name):
        array[...] = self._take(peer, tag, name).reshape(array.shape)

    def start_recv(self, array, peer, tag, name):
        def wait():
            array[...] = self._take(peer, tag, name).reshape(array.shape)

        return wait


def _mlp(batch: int = 8, width: int = 64):
    """Four MatMul+Relu layers, cut into two stages."""
    rng = np.random.default_rng(0)
    nodes, weights, x = [], [], "x"
    for k in range(4):
        weights.append((rng.standard_normal((width, width)) * 0.3).astype(np.float32))
        nodes += [helper.make_node("MatMul", [x, f"w{k}"], [f"m{k}"]), helper.make_node("Relu", [f"m{k}"], [f"r{k}"])]
        x = f"r{k}"
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, width])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, [batch, width])],
                              [numpy_helper.from_array(w, f"w{k}") for k, w in enumerate(weights)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.fixture(scope="module")
def pipeline(kernel_cache, tmp_path_factory):
    """The MLP as two stages of 4 micro-batches (saved), and the model."""
    model = _mlp()
    # Layers 0-1 on stage 0, 2-3 on stage 1 (on estimates alone, a model this small would not be cut).
    artifact = compile(model, devices=2, placement="list", microbatches=MICROBATCHES, profile=False,
                       pins=("_[02]$=0", "_[46]$=1"), cache_dir=kernel_cache)
    assert [len(worker["instructions"]) > 1 for worker in artifact.plan["workers"]] == [True, True]
    return artifact.save(tmp_path_factory.mktemp("held") / "mlp"), model


@pytest.mark.parametrize("host", ["native", "python"])
def test_stage_0_runs_every_micro_batch_before_stage_1_takes_any_and_outputs_equal_onnxruntime(pipeline, host):
    directory, model = pipeline
    comm = BufferedComm()
    first, second = [Executor(directory, threads=1, worker=rank, comm=comm.rank_view(rank), host=host)
                     for rank in range(2)]
    first.poison()
    second.poison()
    rng = np.random.default_rng(1)
    for _ in range(2):  # twice: the second batch's first sends follow the first batch's last
        x = rng.standard_normal((8, 64)).astype(np.float32)
        parts = np.split(x, MICROBATCHES)
        waits = [first.start({"x": part}) for part in parts]  # stage 0 runs ahead of stage 1 by a whole batch
        for _ in parts:
            second.start({})
        got = np.concatenate([wait()["r3"] for wait in waits])
        want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    # The sends were still in flight when stage 0 went on: it waited for them only before their bytes were reused.
    assert comm.waited_late > 0
    for executor in (first, second):
        executor.finish_sends()


def test_stage_0_waits_at_the_producer_of_the_sent_value_not_at_the_run_start(pipeline):
    """The plan keeps the sent value's bytes for it over the whole run: only its producer writes them."""
    directory, _ = pipeline
    executor = Executor(directory, threads=1, worker=0, comm=BufferedComm().rank_view(0))
    sends = [i for i in executor.run_instructions if isinstance(i, Send)]
    assert sends
    points = executor._send_waits
    assert not points.before_inputs and not points.at_end
    (index, names), = points.before.items()
    assert names == (sends[0].tensor,) and index > 0
    assert sends[0].tensor in executor.run_instructions[index].writes()


# ---- wait points on hand-made programs -------------------------------------------------------------------
def _call(node, inputs, outputs):
    return KernelCall(node=node, op="Relu", kernel="k", inputs=tuple(inputs), outputs=tuple(outputs))


def test_wait_points_find_the_first_write_of_overlapping_bytes():
    arena = np.zeros(64, np.uint8)
    buffers = {"x": arena[0:16], "a": arena[16:32], "b": arena[32:48], "c": arena[16:48], "v": arena[32:48],
               "y": arena[48:64], "z": arena[0:8]}
    program = [_call("p", ["x"], ["a"]), _call("q", ["a"], ["b"]), View(node="w", op="Reshape", input="b", output="v"),
               Send(node="s", op="Send", tensor="v", peer=1, tag=0), _call("r", ["v"], ["c"]),
               Send(node="t", op="Send", tensor="y", peer=1, tag=1), Send(node="u", op="Send", tensor="z", peer=1, tag=2)]
    points = wait_points(program, ["v", "y", "z"], ["x"], buffers.__getitem__)
    # v's bytes are b's: first written by q (the view writes nothing); y is never written; z lies in the input.
    assert points.before == {1: ("v",)}
    assert points.at_end == ("y",)
    assert points.before_inputs == ("z",)


def test_held_sends_wait_once_each():
    held, calls = HeldSends(), []
    held.hold("a", lambda: calls.append("a1"))
    held.hold("a", lambda: calls.append("a2"))
    held.hold("b", lambda: calls.append("b"))
    held.wait(["a", "missing"])
    held.wait(["a"])
    assert calls == ["a1", "a2"]
    held.wait_all()
    assert calls == ["a1", "a2", "b"]
    assert byte_range(np.zeros(4, np.float32))[1] - byte_range(np.zeros(4, np.float32))[0] == 16
