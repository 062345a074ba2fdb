"""The link calibration: the fit of alpha and beta, and its store (link.json in the cache root, the default until the
first calibration)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from tessel.runtime.calibrate import DEFAULT_LINK, SIZES, LinkFit, fit_link, load_link, save_link


def test_a_saved_calibration_is_read_back_as_measured(tmp_path, monkeypatch):
    monkeypatch.setenv("TESSEL_CACHE_DIR", str(tmp_path / "cache"))
    assert load_link() == DEFAULT_LINK and not DEFAULT_LINK.measured
    path = save_link(LinkFit(2e-5, 1e-9, 0.05, 4, 2.1e-5), [(4, 2.1e-5), (1 << 20, 1.1e-3)])
    assert path == tmp_path / "cache" / "link.json"
    assert json.loads(path.read_text())["samples"][1] == {"bytes": 1 << 20, "seconds": 1.1e-3}
    link = load_link()
    assert (link.alpha, link.beta, link.measured) == (2e-5, 1e-9, True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]


def test_an_unreadable_calibration_falls_back_to_the_default(tmp_path, monkeypatch):
    monkeypatch.setenv("TESSEL_CACHE_DIR", str(tmp_path))
    (tmp_path / "link.json").write_text("{not json")
    assert load_link() == DEFAULT_LINK


def test_the_fit_recovers_alpha_and_beta_from_every_message_size():
    rng = np.random.default_rng(0)
    samples = [(size, (70e-6 + 0.7e-9 * size) * rng.uniform(0.95, 1.05)) for size in SIZES]
    fit = fit_link(samples)
    assert fit.alpha == pytest.approx(70e-6, rel=0.1) and fit.beta == pytest.approx(0.7e-9, rel=0.1)
    assert 0 < fit.relative_residual < 0.05
    assert fit.smallest_bytes == 4 and fit.smallest_seconds == samples[0][1]
    assert "fit residual" in fit.describe() and "the 4-byte message took" in fit.describe()


def test_alpha_never_falls_below_what_the_smallest_message_took():
    # An unweighted line through these (the reported case: 74 µs for 4 bytes, large messages cheap per byte) puts
    # alpha near zero; the fit must keep the smallest message's own time.
    samples = [(4, 74e-6), (1 << 10, 60e-6), (16 << 10, 65e-6), (128 << 10, 90e-6), (1 << 20, 0.35e-3),
               (4 << 20, 1.2e-3), (16 << 20, 4.4e-3)]
    fit = fit_link(samples)
    assert fit.alpha + fit.beta * 4 >= 74e-6 * (1 - 1e-9)
    assert fit.alpha <= 2 * 74e-6 and fit.beta > 0
    assert fit.relative_residual > 0


def test_a_fit_needs_two_sizes():
    with pytest.raises(ValueError, match="at least two"):
        fit_link([(4, 1e-5)])
