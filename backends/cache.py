"""The on-disk kernel cache: compiled kernels by spec key, shared by every compile.

An entry is `<key>.so` (with `.cu`/`.fatbin` beside it for CUDA) and `<key>.json`,
which holds the spec and the sha256 and size of every file of the entry. The
entry is trusted only while its files match: `damage` says what does not.
Every file reaches its name by rename from a staging directory, the metadata
last, so a crash mid-write never leaves a truncated file under an entry's name.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from .kernel import KernelSpec

STAGING_PREFIX = ".staging-"
_CHUNK = 1 << 20


def cache_root() -> Path:
    """The one directory Tessel caches into: $TESSEL_CACHE_DIR, else $XDG_CACHE_HOME/tessel (~/.cache/tessel).

    It holds `kernels/` (this cache), the profile database and the link calibration.
    """
    env = os.environ.get("TESSEL_CACHE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tessel"


def default_cache_dir() -> Path:
    """Where compiled kernels are kept unless a compile names another directory: `kernels/` of the cache root."""
    return cache_root() / "kernels"


def sha256_of(path: Path) -> str:
    """The hex sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for chunk in iter(lambda: file.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


class KernelCache:
    """Kernels stored as `<key>.so` with `<key>.json` (the spec and the files' hashes) beside them."""

    def __init__(self, root: Path | None = None):
        self.root = Path(root) if root is not None else default_cache_dir()

    def library(self, key: str) -> Path:
        """Where the compiled library of `key` lives (it may not exist yet)."""
        return self.root / f"{key}.so"

    def _metadata(self, key: str) -> Path:
        return self.root / f"{key}.json"

    def has(self, key: str) -> bool:
        """True when an entry for `key` was written (whether it is intact is `damage`'s question)."""
        return self._metadata(key).is_file()

    def damage(self, key: str) -> str | None:
        """None when every file of the entry matches the size and sha256 recorded with it; else what is wrong."""
        try:
            files = json.loads(self._metadata(key).read_text())["files"]
            recorded = {name: (int(entry["bytes"]), str(entry["sha256"])) for name, entry in files.items()}
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            return f"{key}.json is unreadable or records no hashes"
        if f"{key}.so" not in recorded:
            return f"{key}.json records no {key}.so"
        for name, (size, digest) in sorted(recorded.items()):
            path = self.root / name
            if Path(name).name != name or not name.startswith(key):
                return f"{key}.json names a file outside the entry ({name!r})"
            try:
                actual = path.stat().st_size
                if actual != size:
                    return f"{name} is {actual} bytes, the entry recorded {size}"
                if sha256_of(path) != digest:
                    return f"{name} differs from what the entry recorded (sha256 mismatch)"
            except OSError as exc:
                return f"{name} cannot be read ({exc.strerror or exc})"
        return None

    def discard(self, key: str) -> None:
        """Remove every file of the entry (the metadata first, so no reader trusts what is left)."""
        for suffix in (".json", ".so", ".cu", ".fatbin"):
            try:
                os.unlink(self.root / f"{key}{suffix}")
            except FileNotFoundError:
                pass

    def discard_staging(self, pid: int) -> None:
        """Remove what a writer process `pid` left half-written (it died while storing)."""
        for path in self.root.glob(f"{STAGING_PREFIX}{pid}-*"):
            shutil.rmtree(path, ignore_errors=True)

    def store(self, key: str, spec: KernelSpec, executable, extra_files: dict[str, bytes] | None = None) -> Path:
        """Export a compiled kernel into the cache, atomically (a reader never sees half a file)."""
        self.root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=self.root, prefix=f"{STAGING_PREFIX}{os.getpid()}-") as tmp:
            staged = Path(tmp)
            executable.export_library(str(staged / f"{key}.so"))
            for suffix, data in (extra_files or {}).items():
                (staged / f"{key}{suffix}").write_bytes(data)
            files = sorted(staged.iterdir())
            record = {"spec": spec.to_json(),
                      "files": {p.name: {"bytes": p.stat().st_size, "sha256": sha256_of(p)} for p in files}}
            metadata = staged / f"{key}.json"
            metadata.write_text(json.dumps(record))
            # The metadata goes last: `damage` trusts a library only once its hash is recorded.
            for path in files + [metadata]:
                _sync(path)
                os.replace(path, self.root / path.name)
        return self.library(key)


def _sync(path: Path) -> None:
    """Flush a file's bytes to disk before it is renamed into place (a rename may reach the disk first)."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
