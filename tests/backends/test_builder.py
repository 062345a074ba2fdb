"""Kernels build in worker processes: a crash there is one error line naming the kernel, and nothing is left."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from tessel.backends import builder
from tessel.backends.builder import KernelBuildError, build_kernels, stop_build_workers
from tessel.backends.cache import KernelCache
from tessel.backends.kernel import ARG, KernelInput, KernelSpec
from tessel.backends.target import parse_target

TARGET = parse_target("llvm")
CRASHING_WORKER = "tests.backends.crashing_worker"
REPO = Path(__file__).resolve().parents[2]


def _relu(n: int = 6) -> KernelSpec:
    return KernelSpec("Relu", (), (KernelInput(f"float32[{n}]", ARG),), (f"float32[{n}]",))


def _concat(count: int) -> KernelSpec:
    return KernelSpec("Concat", (("axis", 1),), tuple(KernelInput("float32[1,2]", ARG) for _ in range(count)),
                      (f"float32[1,{2 * count}]",))


def _children() -> list[int]:
    """Process ids whose parent is this process."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == os.getpid():
            found.append(int(entry.name))
    return found


def _processes_running(module: str) -> list[int]:
    """Process ids whose command line names `module`."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if module.encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def test_kernels_compile_in_workers_and_the_workers_stop(tmp_path):
    cache = KernelCache(tmp_path)
    specs = {spec.key(TARGET): spec for spec in (_relu(6), _relu(7))}
    stats = build_kernels(specs, TARGET, cache, jobs=2)
    assert (stats.kernels, stats.cached, stats.compiled, stats.rebuilt) == (2, 0, 2, 0)
    assert all(cache.damage(key) is None for key in specs)
    assert build_kernels(specs, TARGET, cache).cached == 2
    stop_build_workers()
    assert _children() == []
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{k}{s}" for k in specs for s in (".json", ".so"))


def test_a_crash_in_a_worker_is_one_line_naming_the_kernel_and_the_others_build(tmp_path, monkeypatch):
    monkeypatch.setattr(builder, "WORKER_MODULE", CRASHING_WORKER)
    stop_build_workers()  # workers started before run the real module
    cache = KernelCache(tmp_path)
    concat, relu = _concat(3), _relu()
    specs = {concat.key(TARGET): concat, relu.key(TARGET): relu}
    with pytest.raises(KernelBuildError) as caught:
        build_kernels(specs, TARGET, cache, jobs=1)
    message = str(caught.value)
    assert "\n" not in message
    assert message == (f"1 kernel(s) failed to build: kernel {concat.key(TARGET)} (Concat, 3 inputs): "
                       "TVM crashed while compiling it (SIGSEGV: Segmentation fault)")
    assert cache.damage(relu.key(TARGET)) is None and not cache.has(concat.key(TARGET))
    stop_build_workers()
    assert _children() == []
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".staging-")]


def _concat_model(path: Path, count: int) -> None:
    names = [f"x{i}" for i in range(count)]
    graph = helper.make_graph(
        [helper.make_node("Concat", names, ["y"], axis=1)], "concat",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 2]) for n in names],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2 * count])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), str(path))


def test_tessel_compile_exits_2_with_one_line_and_leaves_nothing_when_tvm_crashes(tmp_path):
    model, scratch, output = tmp_path / "concat.onnx", tmp_path / "tmp", tmp_path / "out"
    _concat_model(model, 3)
    scratch.mkdir()
    script = (f"import sys; from tessel.backends import builder; builder.WORKER_MODULE = {CRASHING_WORKER!r}; "
              "from tessel.compiler.cli import main; sys.exit(main(sys.argv[1:]))")
    env = dict(os.environ, TMPDIR=str(scratch), TESSEL_CACHE_DIR=str(tmp_path / "cache"))
    result = subprocess.run([sys.executable, "-c", script, "compile", str(model), "-o", str(output), "-q"],
                            capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1
    assert result.stderr.startswith("tessel: error: 1 kernel(s) failed to build: kernel concat-")
    assert "(Concat, 3 inputs): TVM crashed while compiling it (SIGSEGV" in result.stderr
    assert not output.exists()
    assert list(scratch.iterdir()) == []
    assert _processes_running(CRASHING_WORKER) == []
