"""The on-disk kernel cache: compiled kernels by spec key, shared by every compile."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from .kernel import KernelSpec


def default_cache_dir() -> Path:
    """$TESSEL_CACHE_DIR, else ~/.cache/tessel/kernels."""
    env = os.environ.get("TESSEL_CACHE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tessel" / "kernels"


class KernelCache:
    """Kernels stored as `<key>.so` with `<key>.json` (the spec) beside them."""

    def __init__(self, root: Path | None = None):
        self.root = Path(root) if root is not None else default_cache_dir()

    def library(self, key: str) -> Path:
        """Where the compiled library of `key` lives (it may not exist yet)."""
        return self.root / f"{key}.so"

    def has(self, key: str) -> bool:
        """True when a compiled kernel for `key` is cached."""
        return self.library(key).is_file() and (self.root / f"{key}.json").is_file()

    def store(self, key: str, spec: KernelSpec, executable, extra_files: dict[str, bytes] | None = None) -> Path:
        """Export a compiled kernel into the cache, atomically (a reader never sees half a file)."""
        self.root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=self.root) as tmp:
            staged = Path(tmp)
            executable.export_library(str(staged / f"{key}.so"))
            for suffix, data in (extra_files or {}).items():
                (staged / f"{key}{suffix}").write_bytes(data)
            (staged / f"{key}.json").write_text(json.dumps(spec.to_json()))
            # The spec goes last: `has` trusts a library only once its spec is there.
            for path in sorted(staged.iterdir(), key=lambda p: p.suffix == ".json"):
                os.replace(path, self.root / path.name)
        return self.library(key)
