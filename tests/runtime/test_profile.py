"""Kernel timing: a placed compile measures its kernels into the profile database of the cache root."""
from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from tessel.compiler.api import compile
from tessel.runtime.profile_db import ProfileDB


def _two_kernels(path):
    graph = helper.make_graph([helper.make_node("Exp", ["x"], ["h"]), helper.make_node("Tanh", ["h"], ["y"])], "two",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), str(path))


def test_kernels_profiles_and_link_share_one_cache_root(tmp_path, monkeypatch):
    model, root = tmp_path / "two.onnx", tmp_path / "cache"
    _two_kernels(model)
    monkeypatch.setenv("TESSEL_CACHE_DIR", str(root))
    artifact = compile(str(model), devices=2, placement="pipeline", skip_passes=["fuse"])
    artifact.save(tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "out", "two.onnx"]  # nothing beside the root
    assert sorted(p.name for p in root.iterdir()) == ["kernels", "profiles.json"]
    assert list((root / "kernels").glob("*.so"))
    db = ProfileDB()
    assert sum(1 for name in db.entries if "@" in name) == 2  # both kernels measured, at one thread count
