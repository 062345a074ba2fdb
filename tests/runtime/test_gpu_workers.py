"""Multi-GPU workers without a GPU: the backend and GPU count a cuda artifact's workers need, its 2-device compile
(nvcc), and TorchComm's device-buffer path (DLPack views of TVM memory) over gloo on TVM's cpu device."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper

from tessel import IMPORT_ROOT
from tessel.backends.cache import KernelCache
from tessel.compiler.api import compile
from tessel.compiler.cli import main as cli_main
from tessel.compiler.memory import plan_program_memory
from tessel.compiler.packaging import write_artifact
from tessel.compiler.program import Program
from tessel.runtime.gpu_workers import (NotEnoughGpus, check_gpus, comm_backend, prepare_worker,
                                        transfer_order_problem)
from tessel.runtime.instructions import AllReduce, Gather, Recv, Scatter, Send, program_to_json
from tessel.runtime.launch import free_port


def test_a_cuda_artifact_exchanges_over_nccl_and_a_cpu_one_over_gloo():
    assert comm_backend("cuda:sm_90") == "nccl"
    assert comm_backend("cuda:sm_80+tf32") == "nccl"
    assert comm_backend("llvm") == "gloo"
    assert prepare_worker([{"target": "llvm", "workers": [{}, {}]}], 0, 2) == ("gloo", 0)


def test_fewer_gpus_than_workers_is_one_clear_line():
    with pytest.raises(NotEnoughGpus, match=r"^this cuda artifact runs 2 workers, one GPU each: it needs 2 GPUs, "
                                            r"this machine has 1$"):
        check_gpus("cuda:sm_90", 2, available=1)
    check_gpus("cuda:sm_90", 2, available=2)
    check_gpus("llvm", 8, available=0)  # CPU workers need no GPU


def _two_matmuls():
    """x @ w @ w with the same kernel twice (one nvcc build), the second pinned to device 1."""
    eye = helper.make_tensor("w", TensorProto.FLOAT, [8, 8], np.eye(8, dtype=np.float32).ravel())
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["h"], name="first"),
                               helper.make_node("MatMul", ["h", "w"], ["y"], name="second")], "two_matmuls",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])], [eye])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_a_two_device_cuda_compile_sends_between_cuda_workers_and_refuses_to_run_without_two_gpus(
        kernel_cache, tmp_path, capsys):
    artifact = compile(_two_matmuls(), target="cuda:sm_80", devices=2, placement="list", pins=["second=1"],
                       cache_dir=kernel_cache, profile=False)
    plan = artifact.plan
    assert plan["target"] == "cuda:sm_80"
    ops = [[i["op"] for i in worker["instructions"]] for worker in plan["workers"]]
    assert ops == [["MatMul", "Send", "Recv"], ["Recv", "MatMul", "Send"]]
    assert all(entry["file"].endswith(".so") for entry in plan["kernels"].values())
    assert transfer_order_problem(plan["workers"]) is None
    # This machine has no GPU: `tessel run` stops before any worker starts, with one line and exit status 2.
    assert cli_main(["run", str(artifact.directory)]) == 2
    assert "it needs 2 GPUs, this machine has 0" in capsys.readouterr().err


def test_nccl_pairs_need_the_same_transfer_order_on_both_sides():
    sends = [Send("s_a", "Send", tensor="a", peer=1, tag=0), Send("s_b", "Send", tensor="b", peer=1, tag=1)]
    receives = [Recv("r_b", "Recv", output="b", peer=0, tag=1), Recv("r_a", "Recv", output="a", peer=0, tag=0)]
    workers = [{"instructions": program_to_json(sends)}, {"instructions": program_to_json(receives)}]
    assert transfer_order_problem(workers) == "worker 0 sends worker 1 tags [0, 1] but worker 1 receives tags [1, 0] in that order"
    workers[1]["instructions"] = program_to_json(receives[::-1])
    assert transfer_order_problem(workers) is None


# Each rank checks every device-buffer result against the same exchange on numpy arrays (the gloo host path).
_RANK_SCRIPT = textwrap.dedent("""
    import os, sys
    import numpy as np
    from tessel.backends.tvm_env import tvm
    from tessel.runtime.comm import TorchComm, join_group
    from tessel.runtime.device_memory import DeviceMemory

    rank = int(os.environ["RANK"])
    join_group(rank, 2, 30.0)
    comm = TorchComm(rank, 30.0)
    memory = DeviceMemory(tvm().cpu(0), 1024)
    values = np.arange(12, dtype=np.float32).reshape(3, 4) * (rank + 1)
    counts = np.arange(6, dtype=np.int32) * (rank + 2)
    view, host = memory.at(64, (3, 4), np.float32), values.copy()
    memory.write(view, values)
    # send/recv: rank 0's tensor lands in rank 1's view, both ways (blocking and started).
    if rank == 0:
        comm.send(view, 1, 1, "v"); comm.send(host, 1, 2, "h"); comm.wait_sends()
    else:
        comm.recv(view, 0, 1, "v"); comm.start_recv(host, 0, 2, "h")()
    assert np.array_equal(memory.read(view), host), (memory.read(view), host)
    # all-reduce mean (sum then divide): floats and integers (truncated), blocking and started.
    comm.all_reduce(view, "mean", "v"); comm.all_reduce(host, "mean", "h")
    assert np.array_equal(memory.read(view), host), (memory.read(view), host)
    ints = memory.at(256, (6,), np.int32)
    memory.write(ints, counts)
    host_ints = counts.copy()
    comm.start_all_reduce(ints, "mean", "i")(); comm.start_all_reduce(host_ints, "mean", "hi")()
    assert np.array_equal(memory.read(ints), host_ints), (memory.read(ints), host_ints)
    comm.all_reduce(view, "max", "m"); comm.all_reduce(host, "max", "hm")
    assert np.array_equal(memory.read(view), host)
    # The executor on device memory: collectives, and a model output sent by another worker.
    from tessel.runtime.executor import Executor
    outputs = []
    for memory_device in ("cpu", None):
        executor = Executor(os.environ["ARTIFACT"], worker=rank, comm=comm, memory_device=memory_device, host="python")
        outputs.append(executor.run({"x": np.arange(12, dtype=np.float32).reshape(4, 3)} if rank == 0 else {}))
    assert type(executor._memory).__name__ == "HostMemory"
    assert outputs[0].keys() == outputs[1].keys() and all(np.array_equal(outputs[0][k], outputs[1][k]) for k in outputs[1])
    print("rank", rank, "ok", host.sum(), host_ints.tolist(), {k: float(v.sum()) for k, v in outputs[0].items()}, flush=True)
    # Leave the group together, as runtime/worker.py does: a rank that exits while gloo's threads still serve its
    # peer aborts ("terminate called without an active exception"), about one run in six.
    import torch.distributed as dist
    dist.barrier()
    dist.destroy_process_group()
""")


def _collectives_artifact(directory: Path) -> None:
    """Two workers with no kernel: scatter x, mean-reduce the halves, gather them as y; worker 1 sends its half
    back as output z."""
    programs = []
    for rank in range(2):
        root = rank == 0
        instructions = [Scatter("scatter_x", "Scatter", output="part", root=0, parts=2, tag=1 << 20,
                                source="x" if root else None),
                        AllReduce("reduce", "AllReduce", tensor="part", reduction="mean"),
                        Gather("gather_y", "Gather", input="part", root=0, parts=2, tag=1 << 21,
                               output="y" if root else None),
                        Recv("recv_z", "Recv", output="z", peer=1, tag=7) if root else
                        Send("send_z", "Send", tensor="part", peer=0, tag=7)]
        values = {"part": "float32[2,3]", **({"x": "float32[4,3]", "y": "float32[4,3]", "z": "float32[2,3]"}
                                            if root else {})}
        programs.append(Program(instructions, {}, values, {}, ["x"] if root else [], ["y", "z"] if root else []))
    write_artifact(directory, programs, [plan_program_memory(p, "llvm") for p in programs], "llvm",
                   KernelCache(directory / "cache"))


def test_torch_comm_and_executor_on_device_views_equal_the_numpy_path_over_gloo(tmp_path):
    (tmp_path / "collectives").mkdir()
    _collectives_artifact(tmp_path / "collectives")
    # Two ranks in one launch (each imports torch and TVM: seconds); TVM's runtime library is enough.
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "PYTHONPATH": str(IMPORT_ROOT), "TVM_USE_RUNTIME_LIB": "1", "ARTIFACT": str(tmp_path / "collectives")}
    ranks = [subprocess.Popen([sys.executable, "-c", _RANK_SCRIPT], env={**env, "RANK": str(rank)}, cwd=IMPORT_ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in range(2)]
    outputs = [p.communicate(timeout=120)[0] for p in ranks]
    assert [p.returncode for p in ranks] == [0, 0], outputs
    # Rank 0 sent its tensor: both hold (1 + 1) / 2 times it, then the max of equal tensors.
    expected_ints = ((np.arange(6) * 2 + np.arange(6) * 3) // 2).tolist()
    # x's halves averaged: y is that mean twice, z once.
    mean = np.arange(12, dtype=np.float32).reshape(2, 2, 3).mean(0).sum()
    assert f"rank 0 ok 66.0 {expected_ints} {{'y': {2 * mean}, 'z': {mean}}}" in outputs[0], outputs[0]
    assert f"rank 1 ok 66.0 {expected_ints} {{}}" in outputs[1], outputs[1]


def test_a_compressed_all_reduce_on_device_memory_is_refused_at_load(tmp_path):
    from tessel.runtime.errors import ArtifactError
    from tessel.runtime.executor import Executor

    reduce = AllReduce("reduce", "AllReduce", tensor="g", reduction="mean", compression="topk", part_sizes=(6,),
                       part_rows=(2,))
    program = Program([reduce], {}, {"g": "float32[2,3]"}, {}, ["g"], ["g"])
    write_artifact(tmp_path, [program, program], [plan_program_memory(program, "llvm")] * 2, "llvm",
                   KernelCache(tmp_path / "cache"))
    with pytest.raises(ArtifactError, match=r"all-reduce 'g' is compressed \(topk\), which runs on host memory only"):
        Executor(tmp_path, worker=0, comm=object(), memory_device="cpu", host="python")
