"""The fuzzer's worker: runs cases one after another in its own process and reports each outcome.

A case runs in-process through the very code the `tessel` command runs
(`compiler.cli.main`) or the importer, inside the worker's own directory:
`case/` for what the case writes, `tmp/` as TMPDIR, and two watched
directories it must never change: `outside/` (targets of links and paths that
try to leave an artifact) and `bases/` (the compiled artifacts cases copy).
The driver (bench/fuzz_import.py) kills a worker that overruns a case's
timeout and classifies a worker that dies as a crash.
"""
from __future__ import annotations

import contextlib
import faulthandler
import gc
import io
import json
import os
import random
import shutil
import signal
import sys
import time
import traceback
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

FAMILIES = (("import", 0.385), ("load", 0.30), ("run", 0.30), ("compile", 0.015))
TIMEOUTS = {"import": 30.0, "load": 30.0, "run": 30.0, "compile": 120.0}
# What a case may never do; "mismatch" (a result onnxruntime disagrees with) and "fuzzer error" (a case the
# fuzzer itself failed to make) are reported beside them.
BAD = ("crash", "traceback", "hang", "write outside", "leftover", "process left", "messy error", "other exit")
# Base artifacts whose runs launch local worker processes (seconds each): a few cases take one.
MULTI_DEVICE = "pipeline2_"
MULTI_DEVICE_SHARE = 0.02
OUTSIDE_FILES = {"victim.md": b"# not Tessel's\n", "victim.so": b"\x7fELF not a library\n", "victim.npz": b"PK not inputs"}


def case_family(index: int, seed: int) -> tuple[str, random.Random]:
    """The family of case `index` and the generator that makes the rest of it."""
    rng = random.Random(f"{seed}:{index}")
    roll, total = rng.random(), 0.0
    for family, weight in FAMILIES:
        total += weight
        if roll < total:
            return family, rng
    return FAMILIES[-1][0], rng


def prepare_root(root: Path, bases: Path) -> None:
    """A worker's directory: its own copy of the base artifacts, the outside victims, an empty tmp/."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "outside").mkdir(exist_ok=True)
    for name, data in OUTSIDE_FILES.items():
        (root / "outside" / name).write_bytes(data)
    if not (root / "bases").exists():
        shutil.copytree(bases, root / "bases", symlinks=True)
    (root / "tmp").mkdir(exist_ok=True)


def watch_snapshot(root: Path) -> dict[str, tuple]:
    """What must not change: every entry under outside/ and bases/, and the names at the top of the root."""
    snapshot: dict[str, tuple] = {"/": tuple(sorted(p.name for p in root.iterdir() if p.name not in ("case", "logs")))}
    for top in ("outside", "bases"):
        for path in sorted((root / top).rglob("*")):
            st = path.lstat()
            snapshot[str(path.relative_to(root))] = (st.st_mode, st.st_size, st.st_mtime_ns, st.st_ino)
    return snapshot


class Worker:
    """Runs cases inside `root`; seed models, corpus mutations and base artifacts are loaded once."""

    def __init__(self, root: Path):
        from bench.fuzz_cases import seed_models

        self.root = root
        self.seeds = seed_models()
        names = sorted(p.name for p in (root / "bases").iterdir())
        self.bases = [n for n in names if not n.startswith(MULTI_DEVICE)]
        self.multi_device = [n for n in names if n.startswith(MULTI_DEVICE)]
        self._corpus = None
        self._types: dict[str, dict] = {}
        self._warm_up()
        self.baseline = watch_snapshot(root)

    def _warm_up(self) -> None:
        """One plain run first: libraries drop one-time files into TMPDIR on first use (a session id), not leftovers."""
        for base in self.bases:
            _cli("run", str(self.root / "bases" / base), "--check")
        for path in (self.root / "tmp").iterdir():
            _remove(path)

    # ---- one case ------------------------------------------------------------------------------------
    def run(self, index: int, seed: int) -> dict:
        """Run case `index` and classify it: ok, clean, mismatch, or one of BAD (with a detail line)."""
        family, rng = case_family(index, seed)
        started = time.perf_counter()
        case = self.root / "case"
        if case.exists() or case.is_symlink():
            _remove(case)
        case.mkdir()
        try:
            outcome, detail = getattr(self, f"_{family}")(rng, case)
        except Exception:  # noqa: BLE001 - a failure of the fuzzer's own setup of the case, not of Tessel
            outcome, detail = "fuzzer error", traceback.format_exc().strip().splitlines()[-1]
        if family == "compile":
            gc.collect()  # a freshly compiled artifact holds its staging directory until collected (slow: only here)
        outcome, detail = self._check_side_effects(outcome, detail, family)
        _remove(case)
        return {"index": index, "family": family, "outcome": outcome, "detail": detail,
                "seconds": round(time.perf_counter() - started, 3)}

    def _check_side_effects(self, outcome: str, detail: str, family: str) -> tuple[str, str]:
        left_running = _stray_processes() if family in ("load", "run") else []
        if left_running:
            return "process left", f"{', '.join(left_running[:3])} still running after the case ({detail})"
        now = watch_snapshot(self.root)
        if now != self.baseline:
            changed = sorted(k for k in set(now) | set(self.baseline) if now.get(k) != self.baseline.get(k))
            self.baseline = now
            return "write outside", f"changed {', '.join(changed[:3])} ({detail})"
        left = sorted(p.name for p in (self.root / "tmp").iterdir())
        if left:
            for name in left:
                _remove(self.root / "tmp" / name)
            if outcome in ("ok", "clean", "mismatch"):
                return "leftover", f"left in TMPDIR: {', '.join(left[:3])} ({detail})"
        return outcome, detail

    # ---- families ------------------------------------------------------------------------------------
    def _import(self, rng: random.Random, case: Path) -> tuple[str, str]:
        from tessel import ir
        from bench.fuzz_import import fuzz_models, mutate

        if self._corpus is None:
            self._corpus = [(m, m.path.read_bytes()) for m in fuzz_models()]
        model, data = self._corpus[rng.randrange(len(self._corpus))]
        try:
            ir.from_onnx(mutate(data, rng), model.input_shapes)
        except ir.TesselError as exc:
            return _error_outcome(str(exc), f"{model.name}: {exc}")
        except Exception:  # noqa: BLE001 - exactly what the fuzzer hunts for
            return "traceback", f"{model.name}: " + traceback.format_exc().strip().splitlines()[-1]
        return "ok", model.name

    def _compile(self, rng: random.Random, case: Path) -> tuple[str, str]:
        import onnx

        from bench.fuzz_cases import mutate_model

        name = rng.choice(sorted(self.seeds))
        onnx.save(mutate_model(self.seeds[name], rng), case / "model.onnx")
        what = f"mutated {name}"
        outcome, detail = _cli("compile", str(case / "model.onnx"), "-o", str(case / "art"), "--jobs", "1")
        if outcome == "ok":
            outcome, detail = _cli("run", str(case / "art"), "--check")
        return outcome, f"{what}: {detail}"

    def _load(self, rng: random.Random, case: Path) -> tuple[str, str]:
        from bench.fuzz_cases import copy_artifact, mutate_artifact

        base = self._base(rng)
        copy_artifact(self.root / "bases" / base, case / "art")
        what = mutate_artifact(case / "art", self.root / "outside", rng)
        args = ["run", str(case / "art"), "--outputs", str(case / "out.npz")]
        if rng.random() < 0.3:
            args.append("--check")
        outcome, detail = _cli(*args)
        return outcome, f"{base}, {what}: {detail}"

    def _run(self, rng: random.Random, case: Path) -> tuple[str, str]:
        from bench.fuzz_cases import copy_artifact, random_inputs, write_npz

        base = self._base(rng)
        copy_artifact(self.root / "bases" / base, case / "art")
        inputs, what = random_inputs(self._input_types(base), rng)
        damage = write_npz(case / "in.npz", inputs, rng)
        outcome, detail = _cli("run", str(case / "art"), "--inputs", str(case / "in.npz"), "--check")
        return outcome, f"{base}, {damage or what}: {detail}"

    def _base(self, rng: random.Random) -> str:
        if self.multi_device and rng.random() < MULTI_DEVICE_SHARE:
            return rng.choice(self.multi_device)
        return rng.choice(self.bases)

    def _input_types(self, base: str) -> dict:
        if base not in self._types:
            from tessel import compiler
            from tessel.ir.types import numpy_dtype

            artifact = compiler.load(self.root / "bases" / base)
            self._types[base] = {n: (t.shape, numpy_dtype(t.dtype)) for n, t in artifact.batch_input_types().items()}
        return self._types[base]


def _stray_processes(grace: float = 3.0) -> list[str]:
    """Processes a run left behind: this worker's children (orphans included: the worker is their subreaper)
    still alive `grace` seconds after the case, killed once named. Kernel build workers are the builder's pool."""
    deadline = time.monotonic() + grace
    while True:
        _reap()
        alive = {pid: cmd for pid, cmd in _children().items() if "build_worker" not in cmd}
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for pid in alive:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    time.sleep(0.05)
    _reap()
    return [f"pid {pid} ({cmd[:60]})" for pid, cmd in alive.items()]


def _children() -> dict[int, str]:
    me, found = os.getpid(), {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[1]) == me and fields[0] != "Z":
                found[int(entry)] = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError):
            continue
    return found


def _reap() -> None:
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass


def _become_subreaper() -> None:
    """Orphaned descendants (workers a launcher failed to stop) become this process's children, to be seen."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER


def _cli(*args: str) -> tuple[str, str]:
    """Run `tessel ARGS` in this process as the command would; classify its exit."""
    from tessel.compiler.cli import main

    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            code = main(list(args))
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 2
        except Exception:  # noqa: BLE001 - exactly what the fuzzer hunts for
            return "traceback", f"tessel {args[0]}: " + traceback.format_exc().strip().splitlines()[-1]
    text = err.getvalue()
    if code == 0:
        return "ok", f"tessel {args[0]} ok"
    if code == 1 and "--check" in args:
        return "mismatch", f"tessel {args[0]} --check: " + _last_line(out.getvalue())
    if code == 2:
        errors = [line for line in text.splitlines() if line.startswith("tessel")]
        return _error_outcome("\n".join(errors) if errors else text, f"tessel {args[0]}: {_last_line(text)}")
    return "other exit", f"tessel {args[0]} exit {code}: {_last_line(text)}"


def _error_outcome(message: str, detail: str) -> tuple[str, str]:
    lines = message.strip().splitlines()
    if len(lines) == 1 and "Traceback" not in message:
        return "clean", detail
    return "messy error", detail[:300]


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else "(no message)"


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path, ignore_errors=True)


def serve(root: Path) -> None:
    """Worker main loop: read case numbers (JSON lines) on stdin, answer each outcome on the original stdout.

    Everything a case prints, native code included, goes to the log beside the root, not into the protocol.
    """
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    log = os.open(root.parent / f"{root.name}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    os.dup2(log, 2)
    faulthandler.enable()  # a crash leaves the Python stack in the log
    _become_subreaper()
    worker = Worker(root)
    protocol.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        request = json.loads(line)
        print(f"case {request['index']}", file=sys.stderr, flush=True)
        protocol.write(json.dumps(worker.run(request["index"], request["seed"])) + "\n")


if __name__ == "__main__":
    serve(Path(sys.argv[1]))
