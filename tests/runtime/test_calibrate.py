"""The link calibration store: link.json in the cache root, the default until the first calibration."""
from __future__ import annotations

import json

from tessel.runtime.calibrate import DEFAULT_LINK, load_link, save_link


def test_a_saved_calibration_is_read_back_as_measured(tmp_path, monkeypatch):
    monkeypatch.setenv("TESSEL_CACHE_DIR", str(tmp_path / "cache"))
    assert load_link() == DEFAULT_LINK and not DEFAULT_LINK.measured
    path = save_link(2e-5, 1e-9, [(4, 2.1e-5), (1 << 20, 1.1e-3)])
    assert path == tmp_path / "cache" / "link.json"
    assert json.loads(path.read_text())["samples"][1] == {"bytes": 1 << 20, "seconds": 1.1e-3}
    link = load_link()
    assert (link.alpha, link.beta, link.measured) == (2e-5, 1e-9, True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]


def test_an_unreadable_calibration_falls_back_to_the_default(tmp_path, monkeypatch):
    monkeypatch.setenv("TESSEL_CACHE_DIR", str(tmp_path))
    (tmp_path / "link.json").write_text("{not json")
    assert load_link() == DEFAULT_LINK
