"""Fuzz Tessel's compile, run and artifact loading, and its importer.

Four families of cases (bench/fuzz_worker.py):
  import   mutated corpus model bytes through the importer;
  compile  mutated tiny models through `tessel compile` and `tessel run --check`;
  load     damaged artifacts (plan.json edited and resealed, files truncated, flipped,
           rehashed or replaced by links out of the artifact) through `tessel run`;
  run      random inputs (indices out of range, NaN, infinities, empty, mistyped,
           missing, damaged .npz) through `tessel run --inputs --check`.
Each case runs in a worker process with a per-case watchdog and is classified:
ok, clean (exit 2 and one line), mismatch (onnxruntime disagrees), or a bug:
crash (the worker died of a signal), traceback, hang (past the timeout),
write outside (a watched directory changed), leftover (a temporary file
remained), messy error (exit 2 but not one line), other exit.

    python bench/fuzz_import.py [--cases 10000] [--seed 0] [--workers 2]
    python bench/fuzz_import.py --replay CASE [--seed 0]     # one case, in this process, with details
"""
from __future__ import annotations

import argparse
import json
import os
import random
import resource
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import onnx  # noqa: E402

from tessel import ir  # noqa: E402
from tessel.compiler.corpus import CorpusModel, load_corpus  # noqa: E402

# Models small enough that thousands of imports stay quick.
FUZZ_MODEL_BYTES = 600_000


def fuzz_models() -> list[CorpusModel]:
    """Corpus models (negative ones included) small enough to fuzz."""
    return [m for m in load_corpus() if m.path.stat().st_size <= FUZZ_MODEL_BYTES]


def mutate(data: bytes, rng: random.Random) -> bytes:
    """One random corruption: half the time of the raw bytes, half the time of the model's structure."""
    return mutate_bytes(data, rng) if rng.random() < 0.5 else mutate_structure(data, rng)


def mutate_structure(data: bytes, rng: random.Random) -> bytes:
    """A well-formed protobuf with one semantic fault: a dropped node, a rewired input, a changed
    attribute, dimension or op type (what a buggy exporter writes)."""
    model = onnx.ModelProto()
    model.ParseFromString(data)
    graph = model.graph
    nodes = list(graph.node)
    if not nodes:
        return data
    node = rng.choice(nodes)
    kind = rng.choice(("drop", "rewire", "attr", "dims", "op"))
    if kind == "drop":
        graph.node.remove(node)
    elif kind == "rewire" and node.input:
        names = [n for other in nodes for n in other.output] + [""]
        node.input[rng.randrange(len(node.input))] = rng.choice(names)
    elif kind == "attr" and node.attribute:
        attr = rng.choice(list(node.attribute))
        if attr.type == onnx.AttributeProto.INT:
            attr.i = rng.randint(-3, 10)
        elif attr.type == onnx.AttributeProto.INTS and attr.ints:
            attr.ints[rng.randrange(len(attr.ints))] = rng.randint(-3, 10)
        elif attr.type == onnx.AttributeProto.FLOAT:
            attr.f = rng.choice((0.0, -1.0, 1e30, float("nan")))
    elif kind == "dims":
        tensors = list(graph.initializer)
        if tensors:
            tensor = rng.choice(tensors)
            if tensor.dims:
                tensor.dims[rng.randrange(len(tensor.dims))] = rng.randint(0, 9)
    else:
        node.op_type = rng.choice(("Add", "Reshape", "Conv", "Gather", "Concat", "Transpose", "Split", "If", "Loop", "Nope"))
    return model.SerializeToString()


def mutate_bytes(data: bytes, rng: random.Random) -> bytes:
    """Flipped bytes, truncation, an inserted or zeroed run, or a copied chunk."""
    buf = bytearray(data)
    kind = rng.choice(("flip", "truncate", "insert", "zero", "splice"))
    if kind == "flip":
        for _ in range(rng.randint(1, 16)):
            buf[rng.randrange(len(buf))] = rng.randrange(256)
    elif kind == "truncate":
        del buf[rng.randrange(len(buf)):]
    elif kind == "insert":
        at = rng.randrange(len(buf))
        buf[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 32)))
    elif kind == "zero":
        at = rng.randrange(len(buf))
        buf[at:at + rng.randint(1, 64)] = bytes(min(64, len(buf) - at))
    else:
        start = rng.randrange(len(buf))
        chunk = buf[start:start + rng.randint(1, 256)]
        at = rng.randrange(len(buf))
        buf[at:at] = chunk
    return bytes(buf)


def run_case(model: CorpusModel, data: bytes) -> str:
    """'imported', or the name of the TesselError subclass raised; other exceptions propagate."""
    try:
        ir.from_onnx(data, model.input_shapes)
    except ir.TesselError as exc:
        return type(exc).__name__
    return "imported"


# ---- compile, run and load, in worker processes ---------------------------------------------------------

WORKER = Path(__file__).resolve().parent / "fuzz_worker.py"
# A case may use this much memory; more is a bug of its own (and must not take the machine down).
WORKER_MEMORY = 6 << 30
READY_TIMEOUT = 300.0


def compile_bases(directory: Path) -> list[str]:
    """Compile the seed models (bench/fuzz_cases.py) into artifacts under `directory`, and the MLP as a
    two-device pipeline (named with the MULTI_DEVICE prefix: its runs launch worker processes); their names."""
    from tessel import compiler
    from bench.fuzz_cases import seed_models
    from bench.fuzz_worker import MULTI_DEVICE

    directory.mkdir(parents=True, exist_ok=True)
    seeds = seed_models()
    builds = [(name, model, {}) for name, model in seeds.items()]
    builds.append((f"{MULTI_DEVICE}mlp", seeds["mlp"], {"devices": 2, "placement": "pipeline", "profile": False}))
    names = []
    for name, model, options in builds:
        try:
            # Kept: runs with --check compare with it (a model compiled from bytes has no file to find again).
            compiler.compile(model.SerializeToString(), keep_model=True, **options).save(directory / name)
        except ir.TesselError as exc:
            print(f"seed model {name} does not compile ({exc}); left out", file=sys.stderr)
            continue
        names.append(name)
    return names


class WorkerProcess:
    """One worker subprocess in its own directory and process group, restarted after a crash or a hang."""

    def __init__(self, root: Path, bases: Path):
        from bench.fuzz_worker import prepare_root

        self.root = root
        prepare_root(root, bases)
        self.process: subprocess.Popen | None = None

    def _start(self) -> None:
        from bench.fuzz_worker import watch_snapshot

        env = {**os.environ, "TMPDIR": str(self.root / "tmp"), "PYTHONFAULTHANDLER": "1"}
        self.process = subprocess.Popen(
            [sys.executable, str(WORKER), str(self.root)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            env=env, text=True, start_new_session=True, preexec_fn=_limit_memory, cwd=self.root)
        ready = self._read(READY_TIMEOUT)
        if not isinstance(ready, dict) or not ready.get("ready"):
            self.stop()
            raise RuntimeError(f"fuzz worker did not start; see {self.root}.log")
        self.baseline = watch_snapshot(self.root)

    def run(self, index: int, seed: int, timeout: float) -> dict:
        """The outcome of case `index`: the worker's answer, or crash/hang when it dies or overruns."""
        from bench.fuzz_worker import case_family, watch_snapshot

        if self.process is None:
            self._start()
        self.process.stdin.write(json.dumps({"index": index, "seed": seed}) + "\n")
        self.process.stdin.flush()
        answer = self._read(timeout)
        if isinstance(answer, dict):
            return answer
        family = case_family(index, seed)[0]
        if answer == "timeout":
            outcome, detail = "hang", f"no answer in {timeout:.0f} s"
            self.stop()
        else:
            code = self.process.wait()
            outcome = "crash" if code < 0 else "other exit"
            detail = (f"worker killed by {signal.Signals(-code).name}" if code < 0 else f"worker exited {code}") \
                + f" ({_crash_site(self.root)})"
            self.stop()
        if watch_snapshot(self.root) != self.baseline:
            outcome, detail = "write outside", f"a watched file changed ({detail})"
        for leftover in ("case", "tmp"):
            shutil.rmtree(self.root / leftover, ignore_errors=True)
        (self.root / "tmp").mkdir(exist_ok=True)
        return {"index": index, "family": family, "outcome": outcome, "detail": detail}

    def _read(self, timeout: float) -> dict | str:
        """The worker's next answer, or "timeout", or "eof" when it died."""
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        if not ready:
            return "timeout"
        line = self.process.stdout.readline()
        return json.loads(line) if line else "eof"

    def stop(self) -> None:
        """End the worker and everything it started (its process group)."""
        if self.process is None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()
        for stream in (self.process.stdin, self.process.stdout):
            stream.close()
        self.process = None


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_DATA, (WORKER_MEMORY, WORKER_MEMORY))


def _crash_site(root: Path) -> str:
    """The innermost Tessel frame faulthandler logged for the crash, or the last log line."""
    try:
        lines = (root.parent / f"{root.name}.log").read_text(errors="replace").splitlines()[-60:]
    except OSError:
        return "no log"
    frames = [line.strip() for line in lines if line.strip().startswith("File ") and "/site-packages/" not in line]
    return frames[0] if frames else (lines[-1].strip() if lines else "empty log")


def run_cases(indices: list[int], seed: int, workers: int, root: Path, bases: Path,
              progress: bool = False) -> list[dict]:
    """Run the cases on `workers` worker processes; their outcomes in case order."""
    from bench.fuzz_worker import TIMEOUTS, case_family

    pending = list(reversed(indices))
    results: list[dict] = []
    lock = threading.Lock()
    started = time.perf_counter()

    def drive(worker: WorkerProcess) -> None:
        try:
            while True:
                with lock:
                    if not pending:
                        return
                    index = pending.pop()
                result = worker.run(index, seed, TIMEOUTS[case_family(index, seed)[0]])
                with lock:
                    results.append(result)
                    if progress and len(results) % 500 == 0:
                        rate = len(results) / (time.perf_counter() - started)
                        print(f"  {len(results)} cases, {rate:.1f}/s", file=sys.stderr, flush=True)
        finally:
            worker.stop()

    pool = [WorkerProcess(root / f"w{k}", bases) for k in range(workers)]
    threads = [threading.Thread(target=drive, args=(w,)) for w in pool]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sorted(results, key=lambda r: r["index"])


def summarize(results: list[dict], elapsed: float) -> str:
    """Counts per outcome, per family, and up to three examples of every outcome that is not ok or clean."""
    from bench.fuzz_worker import BAD

    lines = [f"{len(results)} cases in {elapsed:.0f} s ({len(results) / max(elapsed, 1e-9):.1f}/s)"]
    totals = Counter(r["outcome"] for r in results)
    lines.append("outcomes: " + ", ".join(f"{k} {totals.get(k, 0)}" for k in ("ok", "clean", "mismatch", *BAD, "fuzzer error")))
    by_family: dict[str, Counter] = defaultdict(Counter)
    for r in results:
        by_family[r["family"]][r["outcome"]] += 1
    for family, counts in sorted(by_family.items()):
        seconds = [r["seconds"] for r in results if r["family"] == family and "seconds" in r]
        mean = f" ({1e3 * sum(seconds) / len(seconds):.0f} ms a case)" if seconds else ""
        lines.append(f"  {family:<8} " + ", ".join(f"{k} {v}" for k, v in counts.most_common()) + mean)
    examples: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in results:
        if r["outcome"] not in ("ok", "clean"):
            examples[(r["outcome"], r["family"])].append(r)
    for (outcome, family), rs in sorted(examples.items()):
        lines.append(f"{outcome} in {family} ({len(rs)}):")
        lines.extend(f"  case {r['index']}: {r['detail']}" for r in rs[:3])
    return "\n".join(lines)


def bad_count(results: list[dict]) -> int:
    """Cases whose outcome is a bug (see bench.fuzz_worker.BAD)."""
    from bench.fuzz_worker import BAD

    return sum(r["outcome"] in BAD for r in results)


def fuzz(cases: int, seed: int = 0, workers: int = 1, first: int = 0, progress: bool = False) -> list[dict]:
    """Run cases first..first+cases-1 in a fresh scratch directory (removed afterwards); their outcomes."""
    root = Path(tempfile.mkdtemp(prefix="tessel-fuzz-"))
    try:
        compile_bases(root / "bases")
        return run_cases(list(range(first, first + cases)), seed, workers, root, root / "bases", progress)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def replay(index: int, seed: int) -> dict:
    """Run one case in this process (a crash takes it down too), for debugging."""
    from bench.fuzz_worker import Worker, prepare_root

    root = Path(tempfile.mkdtemp(prefix="tessel-fuzz-replay-"))
    try:
        compile_bases(root / "bases_src")
        prepare_root(root / "w", root / "bases_src")
        os.environ["TMPDIR"] = tempfile.tempdir = str(root / "w" / "tmp")
        return Worker(root / "w").run(index, seed)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=10000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--first", type=int, default=0, help="number of the first case")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--replay", type=int, metavar="CASE", help="run one case here and print its outcome")
    parser.add_argument("--json", metavar="FILE", help="write every case's outcome to FILE")
    args = parser.parse_args(argv)
    if args.replay is not None:
        print(json.dumps(replay(args.replay, args.seed), indent=1))
        return 0
    started = time.perf_counter()
    results = fuzz(args.cases, args.seed, args.workers, args.first, progress=True)
    print(summarize(results, time.perf_counter() - started))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=0))
    return 1 if bad_count(results) else 0


if __name__ == "__main__":
    sys.exit(main())
