"""Loading an artifact refuses foreign native code and damaged plans with one line, before any library loads.

Every attack edits a copy of one small compiled artifact. Where the attacker would also recompute
plan.json's own hash, `reseal` does so: the checks behind the hash must still hold. The "foreign"
library writes a marker file from its constructor, so a test sees whether it was ever loaded.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
from onnx import helper

from tessel.compiler.api import compile as compile_model
from tessel.compiler.cli import main
from tessel.runtime.artifact_files import PLAN_FILE, SELF_HASH, artifact_digest, file_hash, read_plan, sealed_plan_bytes
from tessel.runtime.errors import ArtifactError
from tessel.runtime.memory import HostMemory
from tessel.runtime.plan_schema import validate_plan
from tests.ir.helpers import F, model

Plan = dict[str, Any]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory, kernel_cache) -> Path:
    """x -> MatMul -> h -> Softmax -> s -> MatMul -> y: two kernels, and arena buffers that share bytes over time."""
    w = (np.arange(16, dtype=np.float32).reshape(4, 4) / 10)
    onnx_model = model([helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
                        helper.make_node("Softmax", ["h"], ["s"], name="sm", axis=-1),
                        helper.make_node("MatMul", ["s", "w"], ["y"], name="mm2")],
                       [("x", F, [2, 4])], [("y", F, [2, 4])], [("w", w)])
    directory = tmp_path_factory.mktemp("artifact") / "art"
    compile_model(onnx_model, cache_dir=kernel_cache, keep_model=True).save(directory)  # model.onnx is hashed too
    return directory


@pytest.fixture(scope="module")
def foreign_library(tmp_path_factory) -> tuple[Path, Path]:
    """A shared library whose constructor writes a marker file: (library, marker)."""
    if shutil.which("cc") is None:
        pytest.skip("no C compiler to build the foreign library")
    root = tmp_path_factory.mktemp("foreign")
    marker = root / "LOADED"
    source = root / "evil.c"
    source.write_text('#include <stdio.h>\n__attribute__((constructor)) static void run(void) {\n'
                      f'  FILE *f = fopen("{marker}", "w"); if (f) {{ fputs("loaded", f); fclose(f); }}\n}}\n')
    library = root / "evil.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    return library, marker


@pytest.fixture
def artifact(compiled, tmp_path) -> Path:
    """A fresh copy of the compiled artifact to damage."""
    return Path(shutil.copytree(compiled, tmp_path / "art"))


def edit(directory: Path, change: Callable[[Plan], None]) -> None:
    """Change plan.json as a careless user would: its own hash left as it was."""
    plan = json.loads((directory / PLAN_FILE).read_text())
    change(plan)
    (directory / PLAN_FILE).write_text(json.dumps(plan, indent=1))


def reseal(directory: Path, change: Callable[[Plan], None]) -> None:
    """Change plan.json as an attacker would: its own hash recomputed to match."""
    plan = json.loads((directory / PLAN_FILE).read_text())
    change(plan)
    plan.pop(SELF_HASH)
    (directory / PLAN_FILE).write_bytes(sealed_plan_bytes(plan))


def first(plan: dict) -> list:
    """The instructions of worker 0 (the only one of these artifacts)."""
    return plan["workers"][0]["instructions"]


def kernel_entry(plan: Plan) -> dict[str, str]:
    return next(iter(plan["kernels"].values()))


def run_refused(directory: Path, capsys, marker: Path | None = None, *extra: str) -> str:
    """`tessel run` on the artifact: exit 2, one line on stderr, and no foreign library loaded; returns the line."""
    code = main(["run", str(directory), *extra])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line and not line.startswith("no --inputs given")]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("tessel: error: "), err
    assert "Traceback" not in err
    if marker is not None:
        assert not marker.exists(), "the foreign library was loaded"
    return lines[0]


def test_the_compiled_artifact_runs_and_validates(compiled, capsys):
    plan = read_plan(compiled)
    assert plan[SELF_HASH] and set(plan["hashes"]) >= {"weights.npz", "model.onnx", "graph.json", kernel_entry(plan)["file"]}
    assert main(["run", str(compiled)]) == 0


# ---- hashes -----------------------------------------------------------------
def test_removed_hash_entry_of_a_kernel_is_refused(artifact, foreign_library, capsys):
    library, marker = foreign_library

    def swap(plan: Plan) -> None:
        path = kernel_entry(plan)["file"]
        shutil.copyfile(library, artifact / path)  # the foreign code in place of the kernel
        del plan["hashes"][path]

    reseal(artifact, swap)
    assert "lists no hash" in run_refused(artifact, capsys, marker)


def test_removed_hash_entry_of_the_weights_is_refused(artifact, capsys):
    reseal(artifact, lambda plan: plan["hashes"].pop("weights.npz"))
    assert "weights.npz" in run_refused(artifact, capsys)


def test_replaced_kernel_library_is_refused(artifact, foreign_library, capsys):
    library, marker = foreign_library
    shutil.copyfile(library, artifact / kernel_entry(read_plan(artifact))["file"])
    assert "does not match its hash" in run_refused(artifact, capsys, marker)


def test_edited_plan_is_refused_by_its_own_hash(artifact, capsys):
    edit(artifact, lambda plan: plan["workers"][0]["memory"]["offsets"].update(s=0))
    assert SELF_HASH in run_refused(artifact, capsys)


# ---- paths ------------------------------------------------------------------
@pytest.mark.parametrize("where", ["absolute", "parent", "dot-dot inside"])
def test_kernel_path_outside_the_artifact_is_refused(artifact, foreign_library, capsys, where):
    library, marker = foreign_library
    outside = artifact.parent / "evil.so"
    shutil.copyfile(library, outside)
    path = {"absolute": str(outside), "parent": "../evil.so", "dot-dot inside": "kernels/../../evil.so"}[where]

    def point(plan: Plan) -> None:
        kernel_entry(plan)["file"] = path
        plan["hashes"][path] = file_hash(outside)

    reseal(artifact, point)
    assert "not a plain relative path" in run_refused(artifact, capsys, marker)


def test_kernel_symlink_out_of_the_artifact_is_refused(artifact, foreign_library, capsys):
    library, marker = foreign_library

    def link(plan: Plan) -> None:
        path = kernel_entry(plan)["file"]
        (artifact / path).unlink()
        (artifact / path).symlink_to(library)
        plan["hashes"][path] = file_hash(library)

    reseal(artifact, link)
    assert "leads outside the artifact" in run_refused(artifact, capsys, marker)


def test_weights_symlink_out_of_the_artifact_is_refused(artifact, tmp_path, capsys):
    outside = tmp_path / "other.npz"
    shutil.copyfile(artifact / "weights.npz", outside)
    (artifact / "weights.npz").unlink()
    (artifact / "weights.npz").symlink_to(outside)
    assert "leads outside the artifact" in run_refused(artifact, capsys)


def test_absolute_weights_path_is_refused(artifact, capsys):
    outside = str(artifact.parent / "weights.npz")
    shutil.copyfile(artifact / "weights.npz", outside)

    def point(plan: Plan) -> None:
        plan["workers"][0]["weights"]["file"] = outside
        plan["hashes"][outside] = file_hash(Path(outside))

    reseal(artifact, point)
    assert "not a plain relative path" in run_refused(artifact, capsys)


def test_plan_json_symlink_out_of_the_artifact_is_refused(artifact, tmp_path, capsys):
    outside = tmp_path / "plan.json"
    shutil.copyfile(artifact / PLAN_FILE, outside)
    (artifact / PLAN_FILE).unlink()
    (artifact / PLAN_FILE).symlink_to(outside)
    assert "leads outside the artifact" in run_refused(artifact, capsys)


@pytest.mark.parametrize("damage", ["other shape", "missing array", "not a zip", "truncated"])
def test_weights_that_do_not_match_the_plan_are_refused_even_with_the_hash_recomputed(artifact, capsys, damage):
    path = artifact / "weights.npz"
    with np.load(path) as original:
        arrays = dict(original)
    name = next(iter(arrays))
    if damage == "other shape":
        np.savez(path, **{**arrays, name: np.zeros((1 << 20,), np.float32)})
    elif damage == "missing array":
        np.savez(path, **{"other": arrays[name]})
    elif damage == "not a zip":
        path.write_bytes(b"not an archive")
    else:
        path.write_bytes(path.read_bytes()[:100])
    reseal(artifact, lambda plan: plan["hashes"].update({"weights.npz": file_hash(path)}))
    assert "weights.npz" in run_refused(artifact, capsys)


# ---- the arena and the schema -------------------------------------------------
def test_one_edited_offset_is_refused_even_with_the_hash_recomputed(artifact, capsys):
    reseal(artifact, lambda plan: plan["workers"][0]["memory"]["offsets"].update(s=plan["workers"][0]["memory"]["offsets"]["h"]))
    assert "share arena bytes while both are live" in run_refused(artifact, capsys)


@pytest.mark.parametrize("change, expected", [
    (lambda plan: plan["workers"][0]["memory"].update(arena_bytes="128"), "arena_bytes: must be an integer"),
    (lambda plan: plan["workers"][0]["memory"]["offsets"].update(s=64.0), "must be an integer"),
    (lambda plan: plan["workers"][0]["memory"]["offsets"].update(s=True), "must be an integer"),
    (lambda plan: plan["workers"][0].update(instructions={"kind": "kernel"}), "instructions: must be a list"),
    (lambda plan: plan["workers"][0]["values"].update(h="float32[two,4]"), "values['h']"),
    (lambda plan: plan["workers"][0]["instructions"][0].update(kind="load_library"), "unknown instruction kind"),
    (lambda plan: plan["workers"][0]["instructions"][0].update(inputs=["nowhere"]), "'nowhere' is not a value"),
    (lambda plan: plan["workers"][0]["instructions"][0].update(kernel="other"), "not in the plan's kernels"),
    (lambda plan: first(plan)[0]["inputs"].append(first(plan)[0]["inputs"][0]), "which takes"),
    (lambda plan: first(plan)[1].update(kernel=first(plan)[0]["kernel"]), "which takes"),
    (lambda plan: plan["workers"][0].pop("memory"), "missing field 'memory'"),
    (lambda plan: plan.update(kernels=[]), "kernels: must be an object"),
    (lambda plan: plan["hashes"].update({"weights.npz": "00"}), "64 lowercase hex"),
    (lambda plan: plan["workers"][0]["memory"]["offsets"].update(s=-64), "out of range"),
    (lambda plan: plan["workers"][0]["memory"]["offsets"].update(s=2 ** 70), "out of range"),
    (lambda plan: plan["workers"][0]["memory"]["offsets"].update(s=1 << 40), "ends past the arena"),
    (lambda plan: plan["workers"][0]["memory"]["offsets"].update(s=8), "not a multiple of the alignment"),
    (lambda plan: plan["workers"][0]["memory"].update(arena_bytes=1 << 60), "out of range"),
    (lambda plan: plan["workers"][0]["memory"].update(arena_bytes=1 << 40), "need at most"),
    (lambda plan: plan["workers"][0]["values"].update(h="float32[4294967296,4294967296]"), "more than"),
    (lambda plan: kernel_entry(plan).update(arg_alignment=[16, 3]), "3 is not a power of two"),
    (lambda plan: kernel_entry(plan).update(arg_alignment=[0]), "out of range"),
], ids=["arena-string", "offset-float", "offset-bool", "steps-object", "bad-type", "unknown-kind", "unknown-value",
        "unknown-kernel", "extra-argument", "other-kernel", "no-memory", "kernels-list", "short-hash", "negative-offset", "huge-offset",
        "offset-past-arena", "misaligned-offset", "huge-arena", "arena-beyond-buffers", "huge-value", "odd-alignment",
        "zero-alignment"])
def test_damaged_plan_is_refused_with_one_line(artifact, foreign_library, capsys, change, expected):
    library, marker = foreign_library
    # The kernel is the foreign library: a plan that got as far as loading kernels would run its constructor.
    shutil.copyfile(library, artifact / kernel_entry(read_plan(artifact))["file"])
    reseal(artifact, change)
    line = run_refused(artifact, capsys, marker)
    assert expected in line and "recompile the model" in line


@pytest.mark.parametrize("text", ["[]", "{", "null", "[" * 100000, '{"format": "tessel.artifact", "format_version": 2}'])
def test_plan_json_that_is_not_a_plan_is_refused(artifact, capsys, text):
    (artifact / PLAN_FILE).write_text(text)
    run_refused(artifact, capsys)


def test_validator_allows_views_and_in_place_outputs():
    kernels = {"k": {"file": "kernels/k.so", "op": "Relu", "signature": ["float32[16]", "float32[16]"]},
               "m": {"file": "kernels/m.so", "op": "Relu", "signature": ["float32[4,4]", "float32[16]"]}}
    worker = {"inputs": ["x"], "outputs": ["z"], "weights": {"file": "weights.npz", "names": []},
              "values": {"x": "float32[16]", "y": "float32[16]", "v": "float32[4,4]", "z": "float32[16]"},
              "instructions": [{"kind": "kernel", "node": "a", "op": "Relu", "kernel": "k", "inputs": ["x"],
                                "outputs": ["y"], "inplace": [["y", "x"]]},
                               {"kind": "view", "node": "b", "op": "Reshape", "input": "y", "output": "v"},
                               {"kind": "kernel", "node": "c", "op": "Relu", "kernel": "m", "inputs": ["v"], "outputs": ["z"]}],
              "memory": {"alignment": 64, "arena_bytes": 128, "offsets": {"x": 0, "y": 0, "v": 0, "z": 64}}}
    plan = {"target": "llvm", "kernels": kernels, "hashes": {}, "workers": [worker]}
    validate_plan(plan, "plan.json")
    worker["instructions"][0].pop("inplace")
    with pytest.raises(ArtifactError, match="share arena bytes"):
        validate_plan(plan, "plan.json")
    worker["instructions"][0]["inplace"] = [["y", "x"]]
    worker["memory"]["offsets"]["v"] = 64
    with pytest.raises(ArtifactError, match="different offsets"):
        validate_plan(plan, "plan.json")


@pytest.mark.parametrize("change, expected", [
    (lambda plan: plan["workers"][0].update(instructions=[]), "outputs[0]: output 'y' is never written by any instruction"),
    (lambda plan: plan["workers"][0]["instructions"].reverse(),
     "instructions[0].inputs[0]: 's' is read before any instruction writes it"),
    (lambda plan: plan["workers"][0]["instructions"].pop(), "output 'y' is never written"),
], ids=["emptied", "reversed", "last-dropped"])
def test_instructions_out_of_dataflow_order_are_refused_even_with_the_hash_recomputed(artifact, capsys, change, expected):
    reseal(artifact, change)
    line = run_refused(artifact, capsys)
    assert expected in line and "recompile the model" in line


def test_validator_follows_the_dataflow_through_branches_receives_and_init_instructions():
    kernels = {"k": {"file": "kernels/k.so", "op": "Relu", "signature": ["float32[4]", "float32[4]"]}}
    kernel = {"kind": "kernel", "op": "Relu", "kernel": "k"}
    empty = {"inputs": [], "outputs": [], "weights": {"file": "weights.npz", "names": []}, "values": {},
             "instructions": [], "memory": {"alignment": 64, "arena_bytes": 0, "offsets": {}}}
    worker = {"inputs": ["c", "x"], "outputs": ["z"], "weights": {"file": "weights.npz", "names": ["w"]},
              "values": {name: "float32[4]" for name in ("x", "w", "u", "r", "t", "e", "z")} | {"c": "bool[]"},
              "instructions": [
                  {**kernel, "node": "a", "inputs": ["w"], "outputs": ["u"], "init": True},
                  {"kind": "recv", "node": "b", "op": "Recv", "output": "r", "peer": 1, "tag": 1},
                  {"kind": "if", "node": "i", "op": "If", "condition": "c", "outputs": ["z"],
                   "then_branch": {"instructions": [{**kernel, "node": "t", "inputs": ["r"], "outputs": ["t"]}],
                                   "results": ["t"]},
                   "else_branch": {"instructions": [{**kernel, "node": "e", "inputs": ["u"], "outputs": ["e"]}],
                                   "results": ["e"]}}],
              "memory": {"alignment": 64, "arena_bytes": 0, "offsets": {}}}
    plan = {"target": "llvm", "kernels": kernels, "hashes": {}, "workers": [worker, empty]}
    validate_plan(plan, "plan.json")
    worker["instructions"][2]["else_branch"]["results"] = ["t"]  # the other branch's value
    with pytest.raises(ArtifactError, match=r"instructions\[2\]\.else_branch\.results\[0\]: 't' is never written"):
        validate_plan(plan, "plan.json")
    worker["instructions"][2]["else_branch"]["results"] = ["e"]
    worker["instructions"][1]["peer"] = 0  # itself
    with pytest.raises(ArtifactError, match=r"instructions\[1\]\.peer: worker 0 cannot exchange a tensor with itself"):
        validate_plan(plan, "plan.json")
    worker["instructions"][1]["peer"] = 1
    worker["instructions"][0]["inputs"] = ["x"]  # an init instruction runs at load, before any input
    with pytest.raises(ArtifactError, match=r"instructions\[0\]\.inputs\[0\]: 'x' is neither a weight"):
        validate_plan(plan, "plan.json")


# ---- the published digest -----------------------------------------------------
def test_expect_sha256_accepts_the_published_digest_and_refuses_another(compiled, tmp_path, capsys):
    digest = artifact_digest(compiled)
    assert main(["run", str(compiled), "--expect-sha256", digest]) == 0
    published = tmp_path / "art.sha256"
    published.write_text(f"{digest}  plan.json\n")
    assert main(["run", str(compiled), "--expect-sha256", str(published)]) == 0
    capsys.readouterr()
    assert "not the expected" in run_refused(compiled, capsys, None, "--expect-sha256", "0" * 64)
    assert "neither 64 hex digits" in run_refused(compiled, capsys, None, "--expect-sha256", "abc")


def test_expect_sha256_refuses_a_resealed_plan(artifact, capsys):
    digest = artifact_digest(artifact)
    reseal(artifact, lambda plan: plan["workers"][0]["values"].update(extra="float32[1]"))  # passes every check but the digest
    assert main(["run", str(artifact)]) == 0
    capsys.readouterr()
    assert "not the expected" in run_refused(artifact, capsys, None, "--expect-sha256", digest)


# ---- memory -------------------------------------------------------------------
def test_arena_too_large_to_allocate_is_one_line():
    with pytest.raises(ArtifactError, match="needs .* bytes but this machine has") as caught:
        HostMemory(1 << 50)
    assert "\n" not in str(caught.value)


def test_arena_larger_than_this_machine_is_one_line(artifact, capsys):
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    huge = -(-2 * ram // 64) * 64

    def grow(plan: Plan) -> None:
        # A buffer larger than the RAM, past the others: the plan stays valid, only the allocation can fail.
        plan["workers"][0]["values"]["pad"] = f"uint8[{huge}]"
        plan["workers"][0]["memory"]["offsets"]["pad"] = 128
        plan["workers"][0]["memory"]["arena_bytes"] = 128 + huge

    reseal(artifact, grow)
    assert "this machine has" in run_refused(artifact, capsys)


def test_host_buffer_outside_the_arena_is_refused():
    memory = HostMemory(128)
    with pytest.raises(ArtifactError, match="outside the arena"):
        memory.at(64, (32,), np.float32)


def test_cli_run_of_a_foreign_kernel_path_exits_2_in_a_fresh_process(artifact, foreign_library):
    library, marker = foreign_library

    def point(plan: Plan) -> None:
        kernel_entry(plan)["file"] = str(library)

    reseal(artifact, point)
    result = subprocess.run([sys.executable, "-m", "tessel.compiler.cli", "run", str(artifact)], capture_output=True,
                            text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "not a plain relative path" in result.stderr and not marker.exists()
