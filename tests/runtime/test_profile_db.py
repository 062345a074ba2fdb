"""The profile database: staleness, the machine it belongs to, and its place in the cache root."""
from __future__ import annotations

from tessel.runtime.profile_db import PROFILE_MAX_AGE_S, ProfileDB


def test_profile_times_go_stale(tmp_path):
    path = tmp_path / "profiles.json"
    db = ProfileDB(path, now=1000.0)
    db.put_workspace("k", 4096)
    db.put({ProfileDB.key("k", 2): 1.5})
    assert ProfileDB(path, now=1000.0 + PROFILE_MAX_AGE_S - 1).get("k", 2) == 1.5
    assert ProfileDB(path, now=1000.0 + PROFILE_MAX_AGE_S + 1).get("k", 2) is None  # too old: measured again
    other = ProfileDB(path, now=1000.0)
    other.machine = "another CPU x64"
    assert other.get("k", 2) is None and other.workspace("k") == 4096  # times belong to the machine, workspaces do not


def test_the_database_lives_in_the_cache_root(tmp_path, monkeypatch):
    monkeypatch.setenv("TESSEL_CACHE_DIR", str(tmp_path / "cache"))
    db = ProfileDB()
    db.put({ProfileDB.key("k", 1): 2.0})
    assert db.path == tmp_path / "cache" / "profiles.json"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]
    assert ProfileDB().get("k", 1) == 2.0


def test_a_time_inside_a_step_is_kept_apart_from_the_time_on_its_own_and_by_its_workers(tmp_path):
    db = ProfileDB(tmp_path / "profiles.json")
    db.put({ProfileDB.key("k", 1, step_workers=2): 3.0})
    assert db.get("k", 1) is None and db.get("k", 1, step_workers=2) == 3.0 and db.get("k", 1, step_workers=4) is None
    db.put({ProfileDB.key("k", 1): 2.0})
    assert ProfileDB(db.path).get("k", 1) == 2.0 and ProfileDB(db.path).get("k", 1, step_workers=2) == 3.0
