"""Detached signatures of artifacts, made and checked with OpenSSH's `ssh-keygen -Y`.

The signed message is plan.json's bytes: they hold the sha256 of every other
file the runtime reads, so one signature covers the whole artifact. Sign with

    ssh-keygen -Y sign -f KEY -n tessel-artifact DIR/plan.json     # writes DIR/plan.json.sig

and check with `compiler.load(DIR, signature=Signature(sig, allowed_signers, signer))`,
where `allowed_signers` lists the public keys you trust (ssh-keygen(1), "ALLOWED SIGNERS").
"""
from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from .errors import ArtifactError

NAMESPACE = "tessel-artifact"
VERIFY_TIMEOUT_S = 30


@dataclass(frozen=True)
class Signature:
    """A detached signature of plan.json, whom it must come from, and the keys trusted to say so."""

    signature: Path
    allowed_signers: Path
    signer: str


def verify_signature(plan_bytes: bytes, expected: Signature) -> None:
    """Raise ArtifactError unless `expected.signature` is `expected.signer`'s signature of `plan_bytes`."""
    ssh_keygen = shutil.which("ssh-keygen")
    if ssh_keygen is None:
        raise ArtifactError("checking an artifact's signature needs OpenSSH's ssh-keygen, which is not on PATH")
    for path in (expected.signature, expected.allowed_signers):
        if not Path(path).is_file():
            raise ArtifactError(f"{path}: no such file (a signature check needs the signature and the allowed signers)")
    command = [ssh_keygen, "-Y", "verify", "-f", str(expected.allowed_signers), "-I", expected.signer,
               "-n", NAMESPACE, "-s", str(expected.signature)]
    try:
        result = subprocess.run(command, input=plan_bytes, capture_output=True, timeout=VERIFY_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise ArtifactError(f"{expected.signature}: ssh-keygen did not check the signature within "
                            f"{VERIFY_TIMEOUT_S} s") from None
    if result.returncode != 0:
        reason = (result.stderr.decode(errors="replace").strip().splitlines() or ["rejected"])[-1]
        raise ArtifactError(f"{expected.signature}: not a valid signature of this artifact by '{expected.signer}' "
                            f"({reason}); do not run it")
