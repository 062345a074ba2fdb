"""Saving and loading artifacts: --force replaces only a complete Tessel artifact; the published digest."""
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
from tessel.runtime.artifact_files import PLAN_FILE, artifact_digest
from tessel.runtime.errors import ArtifactError
from tessel.runtime.signature import NAMESPACE, Signature
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
