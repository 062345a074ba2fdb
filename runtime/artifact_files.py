"""The artifact directory's files: the plan and the content hashes that guard them."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from .errors import ArtifactError

PLAN_FILE = "plan.json"
FORMAT = "tessel.artifact"
FORMAT_VERSION = 1


def file_hash(path: Path) -> str:
    """sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def read_plan(directory: Path) -> dict[str, Any]:
    """The artifact's plan; raise ArtifactError when it is missing, unreadable or another format."""
    path = directory / PLAN_FILE
    if not directory.is_dir():
        raise ArtifactError(f"{directory}: no such artifact directory; compile a model with 'tessel compile MODEL -o DIR'")
    if not path.is_file():
        raise ArtifactError(f"{directory}: not a Tessel artifact (no {PLAN_FILE})")
    try:
        plan = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ArtifactError(f"{path}: unreadable or corrupt ({exc})") from exc
    if not isinstance(plan, dict) or plan.get("format") != FORMAT:
        raise ArtifactError(f"{path}: not a Tessel artifact plan")
    if plan.get("format_version") != FORMAT_VERSION:
        raise ArtifactError(f"{path}: format version {plan.get('format_version')} is not {FORMAT_VERSION}; recompile the model")
    return plan


def device_count(plan: dict[str, Any]) -> int:
    """Workers an artifact runs on: one per device program, or the replicas of a data-parallel or hybrid one."""
    return (int(plan.get("data_parallel", 0)) or int(plan.get("hybrid", {}).get("replicas", 0))
            or len(plan.get("devices", [None])))


def verify_files(directory: Path, plan: dict[str, Any]) -> None:
    """Check every file the plan lists exists and has its recorded sha256."""
    for name, expected in plan.get("hashes", {}).items():
        path = directory / name
        if not path.is_file():
            raise ArtifactError(f"{path}: missing from the artifact; recompile the model")
        if file_hash(path) != expected:
            raise ArtifactError(f"{path}: content does not match its hash in {PLAN_FILE} (corrupted or edited); recompile the model")
