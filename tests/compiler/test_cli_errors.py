"""Every error path of the `tessel` command, driven as a user drives it (a process of its own): exit code 2
(130 for Ctrl-C), exactly one line on stderr, no traceback, and nothing left behind: no file, no temporary
directory, no process of its session."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import onnx
import pytest
from onnx import helper

from tessel.compiler.api import compile as compile_model
from tests.ir.helpers import F, model

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "tessel.compiler.cli"]
WITHOUT_ONNXRUNTIME = [sys.executable, "-c", "import sys; sys.modules['onnxruntime'] = None; "
                       "from tessel.compiler.cli import main; sys.exit(main(sys.argv[1:]))"]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model") / "add.onnx"
    onnx.save(model([helper.make_node("Add", ["x", "x"], ["y"], name="add")], [("x", F, [4, 8])], [("y", F, [4, 8])]),
              str(path))
    return path


@pytest.fixture(scope="module")
def artifact(model_path, kernel_cache, tmp_path_factory) -> Path:
    return compile_model(str(model_path), cache_dir=kernel_cache, keep_model=True).save(
        tmp_path_factory.mktemp("art") / "add")


def _session_processes(session: int) -> list[int]:
    """The processes still alive in the session `session` (workers started by the command keep its session)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[3]) == session and fields[0] != "Z":
            found.append(int(entry.name))
    return found


class Place:
    """A working directory and an empty TMPDIR for one command, to see what it leaves behind."""

    def __init__(self, root: Path, tessel_cache: Path):
        self.work, self.tmp = root / "work", root / "tmp"
        self.work.mkdir()
        self.tmp.mkdir()
        self.env = dict(os.environ, TMPDIR=str(self.tmp), TESSEL_CACHE_DIR=str(tessel_cache),
                        PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))

    def start(self, argv: list[str]) -> subprocess.Popen:
        # A session of its own: its processes are found, and a Ctrl-C can go to its process group as a terminal's does.
        # SIGINT as in a terminal: a test run started in the background (`pytest &` without job control) has it
        # ignored, which the command would inherit and rightly honour.
        return subprocess.Popen(argv, cwd=self.work, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))

    def refused(self, argv: list[str], expected: str, code: int = 2, files: tuple[str, ...] = ()) -> str:
        """Run `argv` to its end and check the refusal; its one stderr line."""
        process = self.start(argv)
        _, err = process.communicate(timeout=300)
        return self.check(process, err, expected, code, files)

    def check(self, process: subprocess.Popen, err: str, expected: str, code: int, files: tuple[str, ...]) -> str:
        assert process.returncode == code, err
        assert err.count("\n") == 1 and "Traceback" not in err and expected in err, err
        assert sorted(p.name for p in self.work.iterdir()) == sorted(files), "a file was left behind"
        assert not any(self.tmp.iterdir()), "a temporary file was left behind"
        deadline = time.monotonic() + 10
        while _session_processes(process.pid) and time.monotonic() < deadline:  # killed workers are being reaped
            time.sleep(0.1)
        assert not _session_processes(process.pid), "a process was left behind"
        return err


@pytest.fixture
def place(tmp_path, tessel_cache) -> Place:
    return Place(tmp_path, tessel_cache)


def test_outputs_into_a_missing_directory_is_refused_before_the_run(place, artifact):
    err = place.refused([*CLI, "run", str(artifact), "--outputs", "missing/out.npz"], "missing/out.npz: cannot write it")
    assert "No such file or directory" in err


def test_check_without_onnxruntime_is_one_line(place, artifact):
    err = place.refused([*WITHOUT_ONNXRUNTIME, "run", str(artifact), "--check"], "--check needs onnxruntime")
    assert "pip install onnxruntime" in err


@pytest.mark.parametrize("option, value, expected", [
    ("--repeat", "-3", "argument --repeat: -3 is below 0; give 0 or more"),
    ("--timeout", "0", "argument --timeout: 0 seconds: give a finite time above 0"),
    ("--input-value", "x=abc", "VALUE must be a number"),
    ("--input-value", "nosuch=1", "the model has no input 'nosuch'"),
])
def test_bad_run_options_are_one_line(place, artifact, option, value, expected):
    place.refused([*CLI, "run", str(artifact), option, value], expected)


def test_output_naming_an_empty_file_says_it_is_a_file(place, model_path):
    (place.work / "out").touch()
    place.refused([*CLI, "compile", str(model_path), "-o", "out"], "out: is a file, not a directory", files=("out",))
    assert (place.work / "out").read_bytes() == b""


def test_more_devices_than_cores_warns_that_workers_share_them(place, model_path):
    """Two workers on one core: a warning that they share it, and one that the placement leaves a device idle;
    the compile itself goes on."""
    process = place.start(["taskset", "-c", "0", *CLI, "compile", str(model_path), "-o", "out", "--devices", "2",
                           "--no-profile", "-q"])
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err
    lines = err.splitlines()
    assert len(lines) == 2 and "Traceback" not in err, err
    assert lines[0].startswith("tessel: warning: 2 devices on a machine with 1 core(s)") and "share the cores" in lines[0]
    assert "gives 1 of 2 devices no kernel to run" in lines[1] and "fewer --devices" in lines[1]


def _distinct_kernels_model(path: Path) -> None:
    """A model of several kernels that share nothing, so that a compile with an empty cache builds for a while."""
    nodes = [helper.make_node("MatMul", ["x", "x"], ["a"], name="mm"),
             helper.make_node("Softmax", ["a"], ["b"], name="sm", axis=1),
             helper.make_node("Transpose", ["b"], ["c"], name="tr", perm=[1, 0]),
             helper.make_node("ReduceMean", ["c"], ["d"], name="rm", axes=[1]),
             helper.make_node("MatMul", ["c", "b"], ["e"], name="mm2"),
             helper.make_node("ReduceMax", ["e"], ["f"], name="rx", axes=[0])]
    onnx.save(model(nodes, [("x", F, [8, 8])], [("d", F, [8, 1]), ("f", F, [1, 8])], opset=17), str(path))


def test_ctrl_c_during_compile_is_one_line_and_stops_the_build_workers(tmp_path):
    place = Place(tmp_path, tmp_path / "fresh-cache")  # an empty cache: the compile must build its kernels
    _distinct_kernels_model(place.work.parent / "many.onnx")
    process = place.start([*CLI, "compile", str(place.work.parent / "many.onnx"), "-o", "out", "--no-profile", "-q"])
    deadline = time.monotonic() + 120
    while len(_session_processes(process.pid)) < 2 and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)  # until a build worker runs beside the compiling process
    assert process.poll() is None, "the compile ended before a build worker started"
    os.killpg(process.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the foreground process group
    _, err = process.communicate(timeout=120)
    place.check(process, err, "tessel: interrupted (Ctrl-C)", 130, ())
    staging = list((tmp_path / "fresh-cache").rglob(".staging-*"))
    assert not staging, staging
