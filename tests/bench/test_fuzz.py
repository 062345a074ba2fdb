"""The fuzzer of compile, run and artifacts (bench/fuzz_import.py): its classification, and a few hundred cases
with no crash, traceback, hang, write outside the artifact, leftover or messy error (issue 13)."""
from __future__ import annotations

import sys
import textwrap

import pytest

from bench import fuzz_import
from bench.fuzz_worker import BAD, case_family, prepare_root, watch_snapshot

CASES = 300


def _fake_worker(tmp_path, body: str):
    """A worker script that says it is ready, then does `body` with the first request."""
    script = tmp_path / "fake_worker.py"
    script.write_text(textwrap.dedent(f"""
        import json, os, signal, sys, time
        print(json.dumps({{"ready": True}}), flush=True)
        request = json.loads(sys.stdin.readline())
        {body}
    """))
    return script


@pytest.mark.parametrize("body, outcome, detail", [
    ("os.kill(os.getpid(), signal.SIGSEGV)", "crash", "worker killed by SIGSEGV"),
    ("time.sleep(60)", "hang", "no answer in 1 s"),
    ("open(sys.argv[1] + '/outside/victim.md', 'a').write('x'); os._exit(3)", "write outside", "worker exited 3"),
])
def test_a_worker_that_dies_overruns_or_writes_outside_is_classified(tmp_path, monkeypatch, body, outcome, detail):
    bases = tmp_path / "bases"
    bases.mkdir()
    monkeypatch.setattr(fuzz_import, "WORKER", _fake_worker(tmp_path, body))
    worker = fuzz_import.WorkerProcess(tmp_path / "w0", bases)
    try:
        result = worker.run(7, 0, timeout=1.0)
    finally:
        worker.stop()
    assert result["outcome"] == outcome and detail in result["detail"]
    assert result["family"] == case_family(7, 0)[0]


def test_watch_snapshot_sees_a_changed_victim(tmp_path):
    (tmp_path / "bases").mkdir()
    prepare_root(tmp_path / "w", tmp_path / "bases")
    before = watch_snapshot(tmp_path / "w")
    (tmp_path / "w" / "outside" / "victim.so").write_bytes(b"replaced")
    assert watch_snapshot(tmp_path / "w") != before


def test_summary_counts_every_outcome_and_shows_examples():
    results = [{"index": 0, "family": "run", "outcome": "ok", "detail": "", "seconds": 0.1},
               {"index": 1, "family": "load", "outcome": "crash", "detail": "worker killed by SIGSEGV"}]
    text = fuzz_import.summarize(results, 1.0)
    assert "ok 1, clean 0, mismatch 0, crash 1," in text
    assert "crash in load (1):\n  case 1: worker killed by SIGSEGV" in text
    assert fuzz_import.bad_count(results) == 1


@pytest.mark.skipif(sys.platform != "linux", reason="the fuzzer's worker limits and process groups are Linux's")
def test_a_few_hundred_cases_over_compile_run_and_load_have_no_bug():
    results = fuzz_import.fuzz(CASES, seed=1, workers=1)
    assert len(results) == CASES
    assert {r["family"] for r in results} == {"import", "load", "run", "compile"}
    bad = [r for r in results if r["outcome"] in BAD]
    assert not bad, fuzz_import.summarize(results, 1.0)
