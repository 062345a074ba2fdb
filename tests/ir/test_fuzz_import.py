"""Mutated model bytes import or raise TesselError, never anything else."""
from __future__ import annotations

import random

import pytest

from bench.fuzz_import import fuzz_models, mutate, run_case

CASES = 200
MODELS = fuzz_models()
ORIGINALS = {m.name: m.path.read_bytes() for m in MODELS}


@pytest.mark.parametrize("case", range(CASES))
def test_mutated_model_imports_or_raises_tessel_error(case):
    rng = random.Random(case)
    model = MODELS[case % len(MODELS)]
    assert run_case(model, mutate(ORIGINALS[model.name], rng))
