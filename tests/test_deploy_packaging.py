"""What `pip install sluice` (and so the images, which install the same way) ships:
every third-party module the shipped packages import comes from a base dependency,
and the built wheel carries the files the code reads at run time."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SHIPPED = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]  # ["app*", ...]
PACKAGES = sorted({p.rstrip("*") for p in SHIPPED})

# Imported by shipped code but rightly outside [project].dependencies.
NOT_BASE = {
    "flashinfer": "the gpu extra; imported only on CUDA",
    "pydantic_core": "pydantic's own core, pinned by pydantic",
}


def _third_party_imports() -> dict[str, set[str]]:
    """Top-level module -> the shipped files that import it (any depth: lazy imports count)."""
    found: dict[str, set[str]] = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top not in PACKAGES:
                        found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_shipped_import_is_a_base_dependency():
    """`sluice bench serving` once needed httpx, which only the test extra installed: the
    shipped CLI broke in the images. Direct imports need direct dependencies."""
    base = {canonicalize_name(Requirement(d).name) for d in PYPROJECT["project"]["dependencies"]}
    providers = importlib.metadata.packages_distributions()
    missing = {}
    for module, files in _third_party_imports().items():
        if module in NOT_BASE:
            continue
        dists = {canonicalize_name(d) for d in providers.get(module, [module])}
        if not dists & base:
            missing[module] = sorted(files)
    assert not missing, f"imported by shipped code but not in [project].dependencies: {missing}"


def test_not_base_names_modules_still_imported():
    assert set(NOT_BASE) <= set(_third_party_imports()), "stale NOT_BASE entries"


def test_the_wheel_carries_the_cpu_kernel_source(tmp_path: Path):
    """kernels/cpu compiles paged_decode.cpp at run time; a wheel without it (a non-.py
    file, not package data) leaves every installed server on the slow torch path. Built
    from a copy without .git, as the image's build context is."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for package in PACKAGES:
        shutil.copytree(ROOT / package, src / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path / "dist"), str(src)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = (tmp_path / "dist").glob("sluice-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    needed = {str(p.relative_to(ROOT)) for p in (ROOT / "kernels").rglob("*") if re.search(r"\.(cpp|cu|h)$", p.name)}
    assert needed, "kernels/ has no C++ sources: update this test"
    assert needed <= names, f"missing from the wheel: {sorted(needed - names)}"
    # GET /dashboard serves these files.
    dashboard = {str(p.relative_to(ROOT)) for p in (ROOT / "app" / "dashboard").iterdir()}
    assert {"app/dashboard/index.html", "app/dashboard/dashboard.js"} <= dashboard <= names, sorted(dashboard - names)
