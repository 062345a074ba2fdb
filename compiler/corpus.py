"""The shared model corpus: where it lives and how to make valid inputs for its models."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tessel.ir.errors import TesselError

DEFAULT_MODELS_DIR = Path(__file__).resolve().parent.parent.parent / "shared" / "models"


class CorpusMissingError(TesselError):
    """The corpus folder or its corpus.json is not where it should be."""


@dataclass(frozen=True)
class CorpusModel:
    """One corpus entry: its file, category and input specs (dtype, shape, fill)."""

    name: str
    path: Path
    category: str
    inputs: dict[str, dict[str, Any]]

    @property
    def negative(self) -> bool:
        """True for models that must be refused."""
        return self.category == "negative"

    @property
    def topology(self) -> bool:
        """True for structure-only models whose weights are constant fills."""
        return self.category == "cnn-topology"

    @property
    def input_shapes(self) -> dict[str, tuple[int, ...]]:
        """The listed input shapes, for `ir.from_onnx`."""
        return {name: tuple(spec["shape"]) for name, spec in self.inputs.items()}

    def make_inputs(self, seed: int = 0) -> dict[str, np.ndarray]:
        """Inputs filled as the corpus says (rand, randn, [int, lo, hi), [const, v], [scale, s], zeros, ones)."""
        rng = np.random.default_rng(seed)
        return {name: fill(spec["fill"], spec["dtype"], tuple(spec["shape"]), rng) for name, spec in self.inputs.items()}


def fill(how: Any, dtype: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """One input array made as a corpus `fill` spec says."""
    kind = how if isinstance(how, str) else how[0]
    if kind == "rand":
        data = rng.random(shape)
    elif kind == "randn":
        data = rng.standard_normal(shape)
    elif kind == "int":
        data = rng.integers(how[1], how[2], size=shape)
    elif kind == "const":
        data = np.full(shape, how[1])
    elif kind == "scale":
        data = rng.standard_normal(shape) * how[1]
    elif kind == "zeros":
        data = np.zeros(shape)
    elif kind == "ones":
        data = np.ones(shape)
    else:
        raise ValueError(f"unknown fill {how!r}")
    return np.asarray(data).astype(dtype)


def models_dir() -> Path:
    """The corpus folder: $TESSEL_MODELS, else ../shared/models beside the repository."""
    path = Path(os.environ.get("TESSEL_MODELS", DEFAULT_MODELS_DIR))
    if not (path / "corpus.json").is_file():
        raise CorpusMissingError(
            f"model corpus not found at {path} (no corpus.json); put the shared models there or set TESSEL_MODELS"
        )
    return path


def load_corpus() -> list[CorpusModel]:
    """Every model listed in corpus.json."""
    root = models_dir()
    entries = json.loads((root / "corpus.json").read_text())["models"]
    return [CorpusModel(e["name"], root / e["file"], e.get("category", ""), e["inputs"]) for e in entries]
