"""What the charts drawn on every compile cost: the memory timeline of corpus models, drawn again from their
compiled artifact's memory reports, repeated; and a warm compile's total time for scale.

    python bench/report_charts.py [MODEL ...] [--repeats N]

Per model: one compile (kernels from the cache after the first run), then a second, timed; then the memory
timeline drawn N times from reports/memory*.json (median and fastest). Run it with another checkout on
PYTHONPATH to time that checkout's charts.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

from tessel.compiler.api import compile  # noqa: E402
from tessel.compiler.corpus import load_corpus  # noqa: E402
from tessel.compiler.plots.memory_timeline import write_memory_timeline  # noqa: E402


def chart_seconds(reports: Path, name: str, repeats: int) -> list[float]:
    """Seconds per drawing of the memory timeline from the artifact's reports, `repeats` times."""
    workers = [json.loads(p.read_text()) for p in sorted(reports.glob("memory*.json"))]
    seconds = []
    with tempfile.TemporaryDirectory() as out:
        for i in range(repeats):
            start = time.perf_counter()
            write_memory_timeline(Path(out) / f"memory_timeline{i}", workers, f"{name}: planned activation memory")
            seconds.append(time.perf_counter() - start)
    return seconds


def main() -> None:
    """Print one line per model: warm compile seconds and memory-timeline seconds (first, median, fastest)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=["oww_embedding"], help="corpus model names")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    corpus = {m.name: m for m in load_corpus()}
    for name in args.models:
        model = corpus[name]
        compile(str(model.path), input_shapes=model.input_shapes)
        start = time.perf_counter()
        artifact = compile(str(model.path), input_shapes=model.input_shapes)
        compile_s = time.perf_counter() - start
        seconds = chart_seconds(artifact.directory / "reports", name, args.repeats)
        print(f"{name}: warm compile {compile_s:.3f} s; memory timeline first {seconds[0]:.3f} s, "
              f"median {statistics.median(seconds):.3f} s, fastest {min(seconds):.3f} s ({args.repeats} draws)")


if __name__ == "__main__":
    main()
