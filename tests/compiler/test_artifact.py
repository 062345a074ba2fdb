"""Saving and loading artifacts: --force replaces only a complete Tessel artifact; the published digest; weights
stored once (graph.json without tensor data, the model kept only with --keep-model)."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

from tessel.compiler.api import compile as compile_model
from tessel.compiler.artifact import check_destination, load
from tessel.compiler.cli import main
from tessel.compiler.program import PACKED_SUFFIX
from tessel.runtime.artifact_files import PLAN_FILE, artifact_digest, file_hash
from tessel.runtime.errors import ArtifactError
from tessel.runtime.signature import NAMESPACE, Signature
from tests.conftest import POSITIVE
from tests.ir.helpers import F, model


@pytest.fixture(scope="module")
def onnx_path(tmp_path_factory) -> Path:
    """A one-kernel model: x -> MatMul -> Relu -> y."""
    w = np.eye(4, dtype=np.float32)
    path = tmp_path_factory.mktemp("model") / "tiny.onnx"
    onnx.save(model([helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"), helper.make_node("Relu", ["h"], ["y"], name="r")],
                    [("x", F, [2, 4])], [("y", F, [2, 4])], [("w", w)]), str(path))
    return path


@pytest.fixture(scope="module")
def saved(onnx_path, tmp_path_factory, kernel_cache) -> Path:
    directory = tmp_path_factory.mktemp("saved") / "art"
    compile_model(str(onnx_path), cache_dir=kernel_cache).save(directory)
    return directory


def _tree(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def _refused(capsys, *argv: str) -> str:
    code = main(list(argv))
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("tessel: error: "), err
    return err


def test_force_refuses_a_project_directory_holding_a_plan_json(onnx_path, tmp_path, capsys):
    project = tmp_path / "project"
    (project / "src").mkdir(parents=True)
    (project / "src" / "main.py").write_text("print('hello')\n")
    (project / "README.md").write_text("# my project\n")
    (project / PLAN_FILE).write_text(json.dumps({"tasks": ["write code"]}))
    before = _tree(project)
    err = _refused(capsys, "compile", str(onnx_path), "-o", str(project), "--force")
    assert "replaces only a complete Tessel artifact" in err
    assert _tree(project) == before


def test_force_refuses_an_artifact_with_files_added(saved, onnx_path, tmp_path, capsys):
    directory = Path(shutil.copytree(saved, tmp_path / "art"))
    (directory / "notes.txt").write_text("mine\n")
    before = _tree(directory)
    err = _refused(capsys, "compile", str(onnx_path), "-o", str(directory), "--force")
    assert "notes.txt is not part of it" in err
    assert _tree(directory) == before


def test_force_refuses_an_artifact_whose_plan_was_edited(saved, tmp_path):
    directory = Path(shutil.copytree(saved, tmp_path / "art"))
    plan = json.loads((directory / PLAN_FILE).read_text())
    plan["target"] = "cuda"
    (directory / PLAN_FILE).write_text(json.dumps(plan))
    with pytest.raises(ArtifactError, match="not one .*plan_sha256"):
        check_destination(directory, overwrite=True)
    assert (directory / PLAN_FILE).exists()


def test_force_refuses_a_symlink_and_a_file(saved, tmp_path):
    link = tmp_path / "link"
    link.symlink_to(saved)
    with pytest.raises(ArtifactError, match="not a directory"):
        check_destination(link, overwrite=True)
    plain = tmp_path / "file"
    plain.write_text("data")
    with pytest.raises(ArtifactError, match="not a directory"):
        check_destination(plain, overwrite=True)
    assert plain.read_text() == "data" and (saved / PLAN_FILE).is_file()


def test_force_replaces_a_complete_artifact_and_compile_prints_its_digest(saved, onnx_path, tmp_path, capsys):
    directory = Path(shutil.copytree(saved, tmp_path / "art"))
    (directory / "reports" / "extra.md").write_text("reports are the artifact's own\n")
    assert check_destination(directory, overwrite=True)
    assert main(["compile", str(onnx_path), "-o", str(directory), "--force"]) == 0
    out = capsys.readouterr().out
    digest = artifact_digest(directory)
    assert f"artifact sha256 {digest}" in out
    assert not (directory / "reports" / "extra.md").exists()


def test_load_checks_the_published_digest(saved, tmp_path):
    artifact = load(saved, expect_sha256=artifact_digest(saved))
    assert artifact.sha256 == artifact_digest(saved)
    assert np.allclose(artifact.run({"x": np.ones((2, 4), np.float32)})["y"], 1.0)
    with pytest.raises(ArtifactError, match="not the expected"):
        load(saved, expect_sha256="f" * 64)
    with pytest.raises(ArtifactError, match="neither 64 hex digits"):
        load(saved, expect_sha256=str(tmp_path / "missing.sha256"))


def test_load_checks_a_detached_ssh_signature(saved, tmp_path):
    if shutil.which("ssh-keygen") is None:
        pytest.skip("no ssh-keygen")
    directory = Path(shutil.copytree(saved, tmp_path / "art"))
    key = tmp_path / "key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    subprocess.run(["ssh-keygen", "-q", "-Y", "sign", "-f", str(key), "-n", NAMESPACE, str(directory / PLAN_FILE)],
                   check=True, capture_output=True)
    signers = tmp_path / "allowed_signers"
    signers.write_text(f"builder@example.org {(tmp_path / 'key.pub').read_text().split(' ', 2)[0]} "
                       f"{(tmp_path / 'key.pub').read_text().split(' ', 2)[1]}\n")
    signature = Signature(directory / "plan.json.sig", signers, "builder@example.org")
    assert load(directory, signature=signature).sha256 == artifact_digest(directory)
    assert check_destination(directory, overwrite=True)  # the signature belongs to the artifact
    with pytest.raises(ArtifactError, match="not a valid signature .* by 'someone@else'"):
        load(directory, signature=Signature(signature.signature, signers, "someone@else"))
    plan = json.loads((directory / PLAN_FILE).read_text())
    (directory / PLAN_FILE).write_text(json.dumps(plan, indent=2))  # same content, other bytes: not what was signed
    with pytest.raises(ArtifactError, match="not a valid signature") as caught:
        load(directory, signature=signature)
    assert "\n" not in str(caught.value)


def test_help_states_the_trust_model(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "an artifact is native code" in out.lower() and "--expect-sha256" in out


# ---- weights stored once ------------------------------------------------------------------------------------
def _data_bytes(directory: Path) -> int:
    """Bytes of the files that hold the model's data: all but the kernels (native code) and the reports."""
    return sum(p.stat().st_size for p in directory.rglob("*")
               if p.is_file() and p.relative_to(directory).parts[0] not in ("kernels", "reports"))


def _assert_each_weight_once(directory: Path) -> None:
    """No weights file holds a weight beside its own packed copy, nor two files the same weight."""
    names = []
    for path in sorted(directory.glob("weights*.npz")):
        with np.load(path, allow_pickle=False) as weights:
            names += weights.files
    packed_from = {name.split(PACKED_SUFFIX)[0] for name in names if PACKED_SUFFIX in name}
    assert not packed_from & set(names) and len(names) == len(set(names))


def test_an_artifact_keeps_no_model_copy_and_no_tensor_data_in_graph_json(saved, onnx_path):
    assert not (saved / "model.onnx").exists()
    text = (saved / "graph.json").read_text()
    assert json.loads(text)["tensor_data"] is False and '"data"' not in text
    record = json.loads((saved / "reports" / "compile.json").read_text())["model"]
    assert record == {"kept": False, "path": str(onnx_path.resolve()), "sha256": file_hash(onnx_path)}


def test_keep_model_keeps_the_model_as_compiled_and_hashes_it(onnx_path, tmp_path, kernel_cache):
    directory = compile_model(str(onnx_path), cache_dir=kernel_cache, batch=3, keep_model=True).save(tmp_path / "art")
    kept = onnx.load(str(directory / "model.onnx"))
    assert kept.graph.input[0].type.tensor_type.shape.dim[0].dim_value == 3  # re-batched, as compiled
    assert "model.onnx" in json.loads((directory / PLAN_FILE).read_text())["hashes"]
    assert json.loads((directory / "reports" / "compile.json").read_text())["model"]["kept"] is True
    assert main(["compile", str(onnx_path), "-o", str(tmp_path / "cli"), "--keep-model"]) == 0
    assert (tmp_path / "cli" / "model.onnx").read_bytes() == onnx_path.read_bytes()


def test_a_real_models_artifact_holds_its_weights_once(tmp_path, kernel_cache):
    model = next(m for m in POSITIVE if m.name == "mtcnn_onet")
    directory = compile_model(model.path, input_shapes=model.input_shapes, cache_dir=kernel_cache).save(tmp_path / "a")
    _assert_each_weight_once(directory)
    # Kernels are native code, as large for a 1.5 MB model as for a 45 MB one: ResNet-18's test counts them too.
    assert _data_bytes(directory) <= 1.1 * model.path.stat().st_size


@pytest.mark.parametrize("devices", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_resnet18_artifact_is_at_most_1_1x_its_onnx_file(devices, tmp_path, kernel_cache):
    model = next(m for m in POSITIVE if m.name == "resnet18")
    directory = compile_model(model.path, input_shapes=model.input_shapes, devices=devices,
                              cache_dir=kernel_cache).save(tmp_path / "a")
    _assert_each_weight_once(directory)
    artifact_bytes = sum(p.stat().st_size for p in directory.rglob("*")
                         if p.is_file() and p.relative_to(directory).parts[0] != "reports")
    assert artifact_bytes <= 1.1 * model.path.stat().st_size
