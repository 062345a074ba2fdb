"""`tessel run` and `tessel compile` against careless or hostile files: links, read-only places, lying .npz headers,
existing outputs, NaN outputs and a reference that cannot run. Each refusal is one line and exit code 2."""
from __future__ import annotations

import errno
import os
import zipfile

import numpy as np
import onnx
import pytest
from numpy.lib import format as npy_format
from onnx import helper

from tessel.compiler.api import compile as compile_model
from tessel.compiler.cli import main
from tessel.compiler.reference_check import compare
from tests.ir.helpers import F, model


def _add_model():
    return model([helper.make_node("Add", ["x", "x"], ["y"], name="add")], [("x", F, [4, 8])], [("y", F, [4, 8])])


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "add.onnx"
    onnx.save(_add_model(), str(path))
    return path


@pytest.fixture(scope="module")
def artifact(model_path, kernel_cache, tmp_path_factory):
    """A single-device artifact of y = x + x, compiled once for the module."""
    return compile_model(str(model_path), cache_dir=kernel_cache).save(tmp_path_factory.mktemp("art") / "add")


@pytest.fixture(scope="module")
def pipeline_artifact(model_path, kernel_cache, tmp_path_factory):
    """A two-worker pipeline artifact: its runs with --repeat add measured times to reports/placement.*."""
    compiled = compile_model(str(model_path), cache_dir=kernel_cache, devices=2, placement="pipeline",
                             microbatches=2, profile=False)
    return compiled.save(tmp_path_factory.mktemp("art") / "add2")


@pytest.fixture
def read_only(monkeypatch):
    """Make directories read-only for the test: by their mode, and, for root (whom modes do not stop), by making
    the calls that create files or ask about write access there fail as a read-only file system does."""
    directories = []
    real_open, real_mkdir, real_access = os.open, os.mkdir, os.access

    def inside(path, dir_fd=None) -> bool:
        base = os.readlink(f"/proc/self/fd/{dir_fd}") if dir_fd is not None else os.getcwd()
        full = os.path.realpath(os.path.join(base, os.fsdecode(path)))
        return any(full == d or full.startswith(d + os.sep) for d in directories)

    def fake_open(path, flags, mode=0o777, *, dir_fd=None):
        if flags & (os.O_CREAT | os.O_WRONLY | os.O_RDWR) and inside(path, dir_fd):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fsdecode(path))
        return real_open(path, flags, mode, dir_fd=dir_fd)

    def fake_mkdir(path, mode=0o777, *, dir_fd=None):
        if inside(path, dir_fd):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fsdecode(path))
        return real_mkdir(path, mode, dir_fd=dir_fd)

    def fake_access(path, mode, *, dir_fd=None, **options):
        if mode & os.W_OK and inside(path, dir_fd):
            return False
        return real_access(path, mode, dir_fd=dir_fd, **options)

    if os.geteuid() == 0:
        monkeypatch.setattr(os, "open", fake_open)
        monkeypatch.setattr(os, "mkdir", fake_mkdir)
        monkeypatch.setattr(os, "access", fake_access)

    def make(directory):
        directories.append(os.path.realpath(directory))
        for root, dirs, _ in os.walk(directory):
            for d in dirs:
                os.chmod(os.path.join(root, d), 0o555)
        os.chmod(directory, 0o555)
        return directory

    yield make
    for directory in directories:
        for root, dirs, _ in os.walk(directory):
            os.chmod(root, 0o755)


def _one_line_error(capsys, expected: str) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("tessel: error: "), err
    assert "Traceback" not in err and expected in err, err
    return err


def _inputs(tmp_path, x):
    path = tmp_path / "in.npz"
    np.savez(path, x=np.asarray(x, np.float32))
    return str(path)


def test_outputs_name_without_npz_suffix_needs_force(artifact, tmp_path, capsys):
    existing = tmp_path / "res.npz"
    np.savez(existing, y=np.zeros(1))
    before = existing.read_bytes()
    inputs = _inputs(tmp_path, np.ones((4, 8)))
    assert main(["run", str(artifact), "--inputs", inputs, "--outputs", str(tmp_path / "res")]) == 2
    _one_line_error(capsys, "res.npz: already exists")
    assert existing.read_bytes() == before
    assert main(["run", str(artifact), "--inputs", inputs, "--outputs", str(tmp_path / "res"), "--force"]) == 0
    with np.load(existing) as saved:
        np.testing.assert_array_equal(saved["y"], np.full((4, 8), 2, np.float32))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.npz", "res.npz"]  # no temporary file left


def test_outputs_through_a_symlink_are_refused_even_with_force(artifact, tmp_path, capsys):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    target = elsewhere / "precious.npz"
    target.write_bytes(b"precious")
    outputs = tmp_path / "out"
    outputs.mkdir()
    (outputs / "res.npz").symlink_to(target)
    assert main(["run", str(artifact), "--outputs", str(outputs / "res.npz"), "--force"]) == 2
    _one_line_error(capsys, "is a symbolic link")
    assert target.read_bytes() == b"precious" and (outputs / "res.npz").is_symlink()


def test_outputs_into_a_read_only_directory(artifact, tmp_path, capsys, read_only):
    (tmp_path / "locked").mkdir()
    locked = read_only(tmp_path / "locked")
    assert main(["run", str(artifact), "--outputs", str(locked / "res")]) == 2
    _one_line_error(capsys, "res.npz: cannot write it")
    assert not any(locked.iterdir())


def test_compile_into_a_read_only_directory_refuses_before_compiling(model_path, tmp_path, capsys, read_only):
    (tmp_path / "locked").mkdir()
    locked = read_only(tmp_path / "locked")
    assert main(["compile", str(model_path), "-o", str(locked / "out")]) == 2
    _one_line_error(capsys, "is not writable")
    assert not any(locked.iterdir())


def _npz_with_header(path, name: str, shape, descr="<f4", payload=b"\0" * 64):
    """An .npz whose array header claims `shape`, followed by only a few bytes of data."""
    with zipfile.ZipFile(path, "w") as archive, archive.open(f"{name}.npy", "w") as member:
        npy_format.write_array_header_1_0(member, {"descr": descr, "fortran_order": False, "shape": tuple(shape)})
        member.write(payload)
    return str(path)


@pytest.mark.parametrize("shape, descr, name, expected", [
    ((2 ** 40,), "<f4", "x", "input 'x' is float32[1099511627776], the model takes float32[4,8]"),
    ((2 ** 20, 2 ** 20), "<f4", "x", "input 'x' is float32[1048576,1048576]"),
    ((4, 8), "<f8", "x", "input 'x' is float64[4,8], the model takes float32[4,8]"),
    ((4, 8), "<f4", "z", "it takes x, the file holds z"),
], ids=["2^40 floats", "2^40 as a matrix", "wrong dtype", "wrong name"])
def test_inputs_are_checked_from_the_npz_header_before_loading(artifact, tmp_path, capsys, shape, descr, name, expected):
    path = _npz_with_header(tmp_path / "lying.npz", name, shape, descr)
    assert main(["run", str(artifact), "--inputs", path, "--outputs", str(tmp_path / "res")]) == 2
    _one_line_error(capsys, expected)
    assert not (tmp_path / "res.npz").exists()


@pytest.mark.parametrize("content", [b"not a zip at all", b"PK\x03\x04truncated"], ids=["text", "truncated zip"])
def test_inputs_that_are_no_npz(artifact, tmp_path, capsys, content):
    path = tmp_path / "bad.npz"
    path.write_bytes(content)
    assert main(["run", str(artifact), "--inputs", str(path)]) == 2
    _one_line_error(capsys, "cannot read inputs as .npz")


def test_inputs_whose_data_is_shorter_than_the_header(artifact, tmp_path, capsys):
    path = _npz_with_header(tmp_path / "short.npz", "x", (4, 8), payload=b"\0" * 8)
    assert main(["run", str(artifact), "--inputs", path]) == 2
    _one_line_error(capsys, "cannot read inputs as .npz")


def test_check_counts_nan_at_the_same_positions_as_equal(artifact, tmp_path, capsys):
    inputs = _inputs(tmp_path, np.full((4, 8), np.nan))
    assert main(["run", str(artifact), "--inputs", inputs, "--check"]) == 0
    out = capsys.readouterr().out
    assert "check: ok (max error 0" in out and "MISMATCH" not in out


def test_compare_reports_nan_mismatches_by_position():
    want = np.array([[1.0, np.nan], [np.inf, -np.inf]], np.float32)
    assert compare(want.copy(), want).ok
    got = want.copy()
    got[0, 0] = np.nan
    result = compare(got, want)
    assert not result.ok and result.nan_mismatches == 1 and result.first_nan_mismatch == (0, 0)
    assert result.max_error == 0.0
    assert not compare(np.array([np.inf]), np.array([-np.inf])).ok
    assert not compare(np.zeros((2, 2)), np.zeros((4,))).ok
    assert compare(np.array([1.0, 2.0]), np.array([1.0, 2.0001])).ok


def test_check_when_onnxruntime_rejects_the_model(artifact, tmp_path, capsys, monkeypatch):
    import onnxruntime
    from onnxruntime.capi.onnxruntime_pybind11_state import InvalidGraph

    def reject(*args, **kwargs):
        raise InvalidGraph("[ONNXRuntimeError] : 10 : INVALID_GRAPH : This is an invalid model.\nIn Node 'add'")

    monkeypatch.setattr(onnxruntime, "InferenceSession", reject)
    inputs = _inputs(tmp_path, np.ones((4, 8)))
    assert main(["run", str(artifact), "--inputs", inputs, "--check", "--outputs", str(tmp_path / "res")]) == 2
    _one_line_error(capsys, "onnxruntime cannot run")
    assert (tmp_path / "res.npz").is_file()  # the run's outputs were saved before the comparison


def test_repeat_never_writes_a_report_through_a_symlink(pipeline_artifact, tmp_path, capsys):
    outside = tmp_path / "outside.md"
    outside.write_text("not Tessel's\n")
    report = pipeline_artifact / "reports" / "placement.md"
    saved = report.read_text()
    report.unlink()
    report.symlink_to(outside)
    try:
        assert main(["run", str(pipeline_artifact), "--repeat", "2", "--outputs", str(tmp_path / "res")]) == 0
    finally:
        report.unlink()
        report.write_text(saved)
    err = capsys.readouterr().err
    assert "Traceback" not in err and [line for line in err.splitlines() if line.startswith("note:")] == [
        f"note: measured times not added to the reports: {report}: is a symbolic link; refusing to write through it "
        "(remove the link or choose another path)"]
    assert outside.read_text() == "not Tessel's\n"
    assert (tmp_path / "res.npz").is_file()


def test_repeat_on_a_read_only_artifact_keeps_the_outputs(pipeline_artifact, tmp_path, capsys, read_only):
    reports = pipeline_artifact / "reports"
    before = {p.name: p.read_bytes() for p in reports.iterdir()}
    read_only(reports)
    assert main(["run", str(pipeline_artifact), "--repeat", "2", "--outputs", str(tmp_path / "res")]) == 0
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    notes = [line for line in captured.err.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "measured times not added" in notes[0] and "cannot write it" in notes[0]
    assert "time per batch over 2 streamed runs" in captured.out
    assert {p.name: p.read_bytes() for p in reports.iterdir()} == before
    with np.load(tmp_path / "res.npz") as saved:
        assert saved["y"].shape == (4, 8)


def test_report_never_prints_a_file_a_link_points_to(pipeline_artifact, tmp_path, capsys):
    outside = tmp_path / "secret.txt"
    outside.write_text("SECRET KEY\n")
    report = pipeline_artifact / "reports" / "placement.md"
    saved = report.read_text()
    report.unlink()
    report.symlink_to(outside)
    try:
        assert main(["report", str(pipeline_artifact)]) == 0
    finally:
        report.unlink()
        report.write_text(saved)
    captured = capsys.readouterr()
    assert "SECRET" not in captured.out and "# Memory" in captured.out
    assert captured.err.count("\n") == 1 and "placement.md: is a symbolic link; refusing to read" in captured.err
