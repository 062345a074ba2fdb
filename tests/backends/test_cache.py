"""The kernel cache keeps each entry's hashes and checks them on use; a damaged entry is rebuilt, reported once."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from tessel.backends.builder import build_kernels
from tessel.backends.cache import KernelCache, cache_root
from tessel.backends.kernel import ARG, KernelInput, KernelSpec
from tessel.backends.target import parse_target
from tessel.compiler.api import load

TARGET = parse_target("llvm")
REPO = Path(__file__).resolve().parents[2]


def _relu(n: int = 5) -> KernelSpec:
    return KernelSpec("Relu", (), (KernelInput(f"float32[{n}]", ARG),), (f"float32[{n}]",))


def _built(tmp_path: Path) -> tuple[KernelCache, dict[str, KernelSpec], str]:
    cache, spec = KernelCache(tmp_path), _relu()
    key = spec.key(TARGET)
    build_kernels({key: spec}, TARGET, cache)
    assert cache.damage(key) is None
    return cache, {key: spec}, key


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3])


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _drop_hashes(path: Path) -> None:
    path.write_text(json.dumps(json.loads(path.read_text())["spec"]))


@pytest.mark.parametrize("damage, expected", [
    (lambda cache, key: _truncate(cache.library(key)), "bytes, the entry recorded"),
    (lambda cache, key: _flip_a_byte(cache.library(key)), "sha256 mismatch"),
    (lambda cache, key: cache.library(key).unlink(), "cannot be read"),
    (lambda cache, key: _drop_hashes(cache.root / f"{key}.json"), "records no hashes"),
], ids=["truncated", "edited", "library-missing", "no-hashes"])
def test_a_damaged_entry_is_rebuilt_and_reported_once(tmp_path, damage, expected):
    cache, specs, key = _built(tmp_path)
    damage(cache, key)
    assert expected in cache.damage(key)
    warnings: list[str] = []
    stats = build_kernels(specs, TARGET, cache, warn=warnings.append)
    assert (stats.cached, stats.compiled, stats.rebuilt) == (0, 1, 1)
    assert len(warnings) == 1 and f"kernel {key} (Relu, 1 input)" in warnings[0] and expected in warnings[0]
    assert cache.damage(key) is None
    assert build_kernels(specs, TARGET, cache, warn=warnings.append).cached == 1
    assert len(warnings) == 1


def test_a_store_that_fails_midway_leaves_no_entry_and_no_staging(tmp_path):
    class FailingExecutable:
        def export_library(self, path):
            Path(path).write_bytes(b"\x7fELF half")
            raise OSError("disk full")

    cache, spec = KernelCache(tmp_path), _relu()
    with pytest.raises(OSError):
        cache.store(spec.key(TARGET), spec, FailingExecutable())
    assert list(tmp_path.iterdir()) == []


def test_an_entry_records_the_size_and_sha256_of_its_files(tmp_path):
    cache, _, key = _built(tmp_path)
    record = json.loads((tmp_path / f"{key}.json").read_text())
    library = cache.library(key)
    assert record["files"] == {library.name: {"bytes": library.stat().st_size,
                                              "sha256": hashlib.sha256(library.read_bytes()).hexdigest()}}
    assert record["spec"] == _relu().to_json()


def test_tessel_compile_rebuilds_a_truncated_cached_library_and_the_artifact_runs(tmp_path):
    model = tmp_path / "relu.onnx"
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "relu",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 4])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), str(model))
    cache_dir = tmp_path / "cache"
    env = dict(os.environ, TESSEL_CACHE_DIR=str(cache_dir))

    def compile_to(name: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "tessel.compiler.cli", "compile", str(model), "-o", str(tmp_path / name), "-q"],
                              capture_output=True, text=True, timeout=300, cwd=REPO, env=env)

    first = compile_to("a")
    assert first.returncode == 0, first.stderr
    (library,) = (cache_dir / "kernels").glob("*.so")
    _truncate(library)
    second = compile_to("b")
    assert second.returncode == 0, second.stderr
    assert second.stderr.count("tessel: warning:") == 1 and second.stderr.count("\n") == 1
    assert "1 damaged kernel cache entry" in second.stderr and "rebuilt" in second.stderr
    assert "(0 from cache)" in second.stdout
    third = compile_to("c")
    assert third.returncode == 0 and third.stderr == "" and "(1 from cache)" in third.stdout
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    np.testing.assert_array_equal(load(tmp_path / "b").run({"x": x})["y"], np.maximum(x, 0))


def test_one_cache_root_holds_the_kernels(tmp_path, monkeypatch):
    monkeypatch.setenv("TESSEL_CACHE_DIR", str(tmp_path / "cache"))
    assert cache_root() == tmp_path / "cache" and KernelCache().root == tmp_path / "cache" / "kernels"
    monkeypatch.delenv("TESSEL_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert KernelCache().root == tmp_path / "xdg" / "tessel" / "kernels"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_root() == Path.home() / ".cache" / "tessel"
