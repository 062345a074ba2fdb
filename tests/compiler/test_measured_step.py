"""A data-parallel step profiled on its two workers (TESSEL_STEP_PROFILE=1, runtime/step_profile.py) and drawn as
the measured step chart (compiler/measured_step.py, parallel_auto.record_measured)."""
from __future__ import annotations

import numpy as np
import pytest

import tessel
from bench.training_models import SPECS, export
from tessel.compiler.measured_step import measured_timeline, run_phases
from tessel.compiler.parallel_auto import GANTT_MEASURED, REPORT, Alternative, record_measured, write_report
from tessel.compiler.step_timeline import ALLREDUCE, BACKWARD, FORWARD, UPDATE, WAIT
from tessel.passes.machine import Link
from tessel.runtime.step_profile import PROFILE_ENV, RUN


def test_two_workers_answer_each_steps_spans_and_the_chart_says_measured(tmp_path, kernel_cache, monkeypatch):
    spec = SPECS["mlp"]
    path = export(spec.model(0), spec.input_shape, tmp_path / "mlp.onnx")
    batches = [spec.batch(np.random.default_rng(k)) for k in range(3)]
    monkeypatch.setenv(PROFILE_ENV, "1")  # the workers inherit it
    # The step test_dp_training.py compiles (same optimizer, same 10 kB buckets): its kernels are in the session's
    # cache by the time this runs in the whole suite, so this compile builds none.
    trainer = tessel.compile_training(str(path), loss=spec.loss, optimizer=tessel.optim.SGD(lr=0.05, momentum=0.9),
                                      input_shapes={"x": spec.input_shape}, cache_dir=kernel_cache, devices=2,
                                      placement="data", bucket_bytes=10_000)
    try:
        assert trainer.step_profile is None
        seconds = []
        for x, labels in batches:
            trainer.step({"x": x}, labels)
            seconds.append(0.01)
        profile, plan = trainer.step_profile, trainer.step_artifact.plan
    finally:
        trainer.close()
    assert sorted(profile) == ["0", "1"]
    phases = run_phases(plan)
    for rank, rows in profile.items():
        runs = [row for row in rows if row[0] == RUN]
        # The run spans cover the worker's run instructions once, in order (one step only: the last).
        covered = [k for _, first, last, _, _ in runs for k in range(first, last + 1)]
        assert covered == list(range(len(phases[int(rank)])))
    timeline = measured_timeline(plan, profile)
    used = {bar.phase for bar in timeline.bars}
    assert {FORWARD, BACKWARD, UPDATE, ALLREDUCE, WAIT} <= used
    assert timeline.step_s > 0 and all(0 < busy <= timeline.step_s for busy in timeline.busy_s)

    reports = tmp_path / "reports"
    reports.mkdir()
    chosen = Alternative("data", "data", None, 0.01, "measured")
    write_report(reports, [chosen], chosen, Link(1e-5, 1e-9), "given", 2)
    measured = record_measured(reports, seconds, warmup=1, timeline=timeline)
    assert measured["chart"] == f"{GANTT_MEASURED}.png" and (reports / f"{GANTT_MEASURED}.png").is_file()
    assert "measured: the workers' step profile" in (reports / f"{REPORT}.md").read_text()
    assert measured["error"] == pytest.approx(0.0)
