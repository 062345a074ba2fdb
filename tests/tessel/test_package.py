"""Tessel installs as one package, `tessel`, and says which versions it is made of."""
from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SUBPACKAGES = ("ir", "passes", "backends", "runtime", "compiler")


def _wheel(tmp_path: Path) -> zipfile.ZipFile:
    source = tmp_path / "source"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for folder in ("tessel", *SUBPACKAGES):
        shutil.copytree(ROOT / folder, source / folder, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copyfile(ROOT / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "dist"), str(source)], check=True, capture_output=True, timeout=300)
    return zipfile.ZipFile(next((tmp_path / "dist").glob("tessel-*.whl")))


def test_the_wheel_holds_one_top_level_package_with_every_subpackage(tmp_path):
    names = _wheel(tmp_path).namelist()
    assert {name.split("/")[0] for name in names} == {"tessel", f"tessel-{_version()}.dist-info"}
    packaged = {str(Path(name).parent) for name in names if name.endswith("/__init__.py")}
    in_tree = {"tessel"} | {f"tessel/{init.parent.relative_to(ROOT)}" for folder in SUBPACKAGES
                            for init in (ROOT / folder).rglob("__init__.py") if "__pycache__" not in init.parts}
    assert packaged == in_tree


def test_version_names_tessel_tvm_and_the_opset():
    done = subprocess.run([sys.executable, "-m", "tessel", "--version"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"tessel {_version()} (TVM 0.27") and "ONNX opset 21" in done.stdout


def test_import_tessel_loads_neither_tvm_nor_the_compiler():
    code = ("import sys, tessel; assert tessel.ir.from_onnx; "
            "print(sorted(m for m in sys.modules if m == 'tvm' or m.startswith('tessel.compiler')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def _version() -> str:
    import tessel

    return tessel.__version__
