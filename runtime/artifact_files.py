"""The artifact directory's files: the plan, the hashes that guard them, and the digest that names the whole.

Trust model: an artifact is native code. Its kernels are shared libraries that
run with the caller's rights as soon as they are loaded, so run only artifacts
that you, or a source you trust, compiled. What Tessel checks before loading
anything:

- plan.json carries its own hash (`plan_sha256`, over its canonical JSON): an
  edit or a damaged byte is refused;
- plan.json lists the sha256 of every file the runtime reads (kernels, weights,
  the model, the graph); a file the plan references but does not list, a
  missing file or a changed one is refused — the plan's list does not decide
  what gets checked, the references do;
- every path is a plain relative path that resolves (symbolic links followed)
  inside the artifact directory;
- the plan matches its schema (runtime/plan_schema.py);
- with a published digest (`tessel run --expect-sha256`, `load(dir,
  expect_sha256=...)`): the sha256 of plan.json's bytes, which `tessel compile`
  prints. plan.json holds every other file's hash, so this digest pins the
  whole artifact; it and a detached signature of plan.json (`load(dir,
  signature=...)`) are the checks a forger who rewrites the plan cannot pass.
"""
from __future__ import annotations

import hashlib
import json
import re
import zipfile
from pathlib import Path
from typing import Any, Iterator

from numpy.lib import format as npy_format

from tessel.ir.types import TensorType, numpy_dtype

from .errors import ArtifactError
from .instructions import FORMAT_VERSION
from .memory import physical_memory
from .plan_schema import path_problem, validate_plan
from .signature import Signature, verify_signature

PLAN_FILE = "plan.json"
FORMAT = "tessel.artifact"
SELF_HASH = "plan_sha256"
# Files the runtime or the CLI read when they are there, beyond those the plan names.
KNOWN_FILES = ("model.onnx", "graph.json", "input_defaults.npz")
# No plan of a real model is this large; a larger file is not read into memory.
MAX_PLAN_BYTES = 256 << 20
_DIGEST = re.compile(r"[0-9a-f]{64}")


def file_hash(path: Path) -> str:
    """sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def canonical_hash(plan: dict[str, Any]) -> str:
    """The plan's own hash: sha256 of its canonical JSON without the hash field."""
    body = {key: value for key, value in plan.items() if key != SELF_HASH}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def sealed_plan_bytes(plan: dict[str, Any]) -> bytes:
    """plan.json's bytes: the plan with its own hash added."""
    return json.dumps({**plan, SELF_HASH: canonical_hash(plan)}, indent=1).encode()


def artifact_digest(directory: Path) -> str:
    """The digest that names a whole artifact: sha256 of its plan.json bytes (which hold every other file's hash)."""
    return hashlib.sha256((Path(directory) / PLAN_FILE).read_bytes()).hexdigest()


def parse_expected_digest(text: str) -> str:
    """A published sha256: 64 hex digits, or a file holding them first (as `sha256sum` writes); raise ArtifactError."""
    candidate = text.strip().lower()
    if not _DIGEST.fullmatch(candidate):
        path = Path(text)
        if not path.is_file():
            raise ArtifactError(f"--expect-sha256 {text!r}: neither 64 hex digits nor a file holding them")
        try:
            candidate = (path.read_text(errors="replace")[:4096].split() or [""])[0].lower()
        except OSError as exc:
            raise ArtifactError(f"{text}: cannot read the expected sha256 ({exc.strerror or exc})") from exc
        if not _DIGEST.fullmatch(candidate):
            raise ArtifactError(f"{text}: does not start with a sha256 (64 hex digits)")
    return candidate


def inside(directory: Path, relative: str) -> Path:
    """`directory/relative` once it is sure to stay inside `directory`, symbolic links followed; else ArtifactError."""
    problem = path_problem(relative)
    if problem is not None:
        raise ArtifactError(f"{directory}: {PLAN_FILE} names {problem}; refusing to load it")
    root = directory.resolve()
    resolved = (root / relative).resolve()
    if not resolved.is_relative_to(root):
        raise ArtifactError(f"{directory / relative}: leads outside the artifact (to {resolved}); refusing to load it")
    return directory / relative


def read_plan(directory: Path, expect_sha256: str | None = None, signature: Signature | None = None) -> dict[str, Any]:
    """The artifact's plan, checked: format, version, its own hash, the published digest and the detached
    signature if given (runtime/signature.py), the schema.

    Raise ArtifactError when it is missing, unreadable, another format, edited or damaged.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise ArtifactError(f"{directory}: no such artifact directory; compile a model with 'tessel compile MODEL -o DIR'")
    if not (directory / PLAN_FILE).is_file():
        raise ArtifactError(f"{directory}: not a Tessel artifact (no {PLAN_FILE})")
    path = inside(directory, PLAN_FILE)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_PLAN_BYTES + 1)
    except OSError as exc:
        raise ArtifactError(f"{path}: unreadable ({exc.strerror or exc})") from exc
    if len(data) > MAX_PLAN_BYTES:
        raise ArtifactError(f"{path}: larger than {MAX_PLAN_BYTES >> 20} MiB, not a plan Tessel wrote")
    if expect_sha256 is not None and hashlib.sha256(data).hexdigest() != expect_sha256:
        raise ArtifactError(f"{directory}: sha256 {hashlib.sha256(data).hexdigest()} is not the expected "
                            f"{expect_sha256}; this is not the artifact that was published")
    if signature is not None:
        verify_signature(data, signature)
    try:
        plan = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise ArtifactError(f"{path}: corrupt ({str(exc).splitlines()[0] if str(exc) else 'nested too deeply'})") from None
    if not isinstance(plan, dict) or plan.get("format") != FORMAT:
        raise ArtifactError(f"{path}: not a Tessel artifact plan")
    if plan.get("format_version") != FORMAT_VERSION:
        raise ArtifactError(f"{path}: format version {plan.get('format_version')} is not {FORMAT_VERSION}; recompile the model")
    try:
        sealed = plan.get(SELF_HASH) == canonical_hash(plan)
    except RecursionError:  # nested just below json's limit: too deep to encode again
        sealed = False
    if not sealed:
        raise ArtifactError(f"{path}: content does not match its {SELF_HASH} (edited or damaged after compiling); "
                            "recompile the model")
    validate_plan(plan, str(path))
    return plan


def worker_count(plan: dict[str, Any]) -> int:
    """Workers an artifact runs on: one per program in the plan."""
    return len(plan["workers"])


def referenced_files(directory: Path, plan: dict[str, Any]) -> list[str]:
    """Every file the runtime reads from this artifact: kernels, weights, and the model and graph where present."""
    names = {entry["file"] for entry in plan["kernels"].values()}
    names.update(section["weights"]["file"] for section in plan["workers"])
    if "state" in plan:
        names.add(plan["state"]["file"])
    names.update(name for name in KNOWN_FILES if (directory / name).exists() or (directory / name).is_symlink())
    return sorted(names)


def verify_files(directory: Path, plan: dict[str, Any]) -> None:
    """Check every file the artifact reads is listed in the plan's hashes, stays inside, and has its sha256.

    The references decide what must be checked, not the hashes map: a reference without a hash is refused.
    """
    directory = Path(directory)
    hashes = plan["hashes"]
    for name in referenced_files(directory, plan):
        if name not in hashes:
            raise ArtifactError(f"{directory / name}: the artifact reads this file but {PLAN_FILE} lists no hash "
                                "for it (edited plan); recompile the model")
    for name, expected in hashes.items():
        path = inside(directory, name)
        if not path.is_file():
            raise ArtifactError(f"{path}: missing from the artifact; recompile the model")
        if file_hash(path) != expected:
            raise ArtifactError(f"{path}: content does not match its hash in {PLAN_FILE} (corrupted or edited); recompile the model")
    for section in plan["workers"]:
        check_weights(directory / section["weights"]["file"], section)
    if "state" in plan:
        check_state_file(directory / plan["state"]["file"], plan["state"]["names"], state_types(plan))


def check_weights(path: Path, section: dict[str, Any]) -> None:
    """The weights file holds every array the section names, with the type the plan gives it, and fits in memory.

    Only CRCs and .npy headers are read: a damaged archive or one claiming huge arrays is refused before loading.
    """
    try:
        headers = _npz_headers(path)
    except (OSError, ValueError, EOFError, NotImplementedError, zipfile.BadZipFile) as exc:
        raise ArtifactError(f"{path}: not a readable weights archive ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}); "
                            "recompile the model") from None
    total = 0
    at_load = section["weights"].get("at_load", {})
    for name in section["weights"]["names"]:
        # A weight transformed at load is stored in its own form (runtime/load_transforms.py) and held transformed.
        total += TensorType.parse(section["values"][name]).nbytes
        want = TensorType.parse(at_load[name]["stored"] if name in at_load else section["values"][name])
        if headers.get(name) != (want.shape, numpy_dtype(want.dtype)):
            have = "no such array" if name not in headers else f"{headers[name][1]}{list(headers[name][0])}"
            raise ArtifactError(f"{path}: weight '{name}' is {have}, the plan declares {want.spec()}; recompile the model")
    ram = physical_memory()
    if ram is not None and total > ram:
        raise ArtifactError(f"{path}: weights need {total} bytes but this machine has {ram} bytes of memory")


def state_types(plan: dict[str, Any]) -> dict[str, str]:
    """Each state value's type spec, from the worker that holds it (pipeline stages hold different state)."""
    names = set(plan["state"]["names"])
    return {name: spec for section in plan["workers"] for name, spec in section["values"].items() if name in names}


def worker_state_names(plan: dict[str, Any], worker: int) -> list[str]:
    """The state values worker `worker` holds: its own list under the state's "workers" (pipeline stages), else
    every state value (one worker, or data-parallel replicas)."""
    state = plan["state"]
    return list(state["workers"][worker]) if "workers" in state else list(state["names"])


def check_state_file(path: Path, names: list[str], values: dict[str, str]) -> None:
    """The state archive holds an array of the plan's type (`values`: name → type spec) for every state name;
    only its headers are read."""
    try:
        headers = _npz_headers(path)
    except (OSError, ValueError, EOFError, NotImplementedError, zipfile.BadZipFile) as exc:
        raise ArtifactError(f"{path}: not a readable state archive ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None
    for name in names:
        want = TensorType.parse(values[name])
        if headers.get(name) != (want.shape, numpy_dtype(want.dtype)):
            have = "no such array" if name not in headers else f"{headers[name][1]}{list(headers[name][0])}"
            raise ArtifactError(f"{path}: state '{name}' is {have}, the plan declares {want.spec()}")


def _npz_headers(path: Path) -> dict[str, tuple[tuple[int, ...], Any]]:
    """(shape, dtype) of each C-ordered array of an .npz, from its headers (after a CRC check of every member)."""
    readers = {(1, 0): npy_format.read_array_header_1_0, (2, 0): npy_format.read_array_header_2_0}
    headers = {}
    with zipfile.ZipFile(path) as archive:
        damaged = archive.testzip()  # every member's CRC: the loader must not meet a bad one mid-load
        if damaged is not None:
            raise ValueError(f"array '{damaged}' fails its CRC check")
        for member in archive.namelist():
            with archive.open(member) as stream:
                version = npy_format.read_magic(stream)
                if version not in readers:
                    raise ValueError(f"array '{member}' is in .npy format {version}")
                shape, fortran_order, dtype = readers[version](stream)
            if not fortran_order:
                headers[member.removesuffix(".npy")] = (tuple(shape), dtype)
    return headers


def unlisted_files(directory: Path, plan: dict[str, Any]) -> Iterator[Path]:
    """Files in the artifact directory that are not its own: outside reports/, neither plan.json, its signature
    (`ssh-keygen -Y sign` writes plan.json.sig beside it) nor hashed."""
    listed = set(plan["hashes"]) | {PLAN_FILE, f"{PLAN_FILE}.sig"}
    for path in sorted(Path(directory).rglob("*")):
        relative = path.relative_to(directory)
        if relative.parts[0] == "reports" or path.is_dir() and not path.is_symlink():
            continue
        if relative.as_posix() not in listed:
            yield path
