"""What ``pip install tfpar`` brings and ships: the ranges, the extras, the lock, ``python -m``, ``py.typed``."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
import zipfile

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from parity_tests.tests.absent import ROOT
from parity_tests.tests.processes import HANG_DEADLINE

PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
FRAMEWORKS = {"tensorflow", "tensorflow-cpu", "keras", "torch", "tensorboard"}
PACKAGES = ("tfpar", "torchref", "parity_tests")


def _lock() -> dict[str, Version]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", line  # exact, every line
            pins[canonicalize_name(req.name)] = Version(spec.version)
    return pins


def test_the_core_requirements_name_no_framework():
    # pip install tfpar must never install, replace or downgrade a user's TensorFlow, Keras or torch
    core = {canonicalize_name(Requirement(r).name) for r in PROJECT["dependencies"]}
    assert core and not core & FRAMEWORKS, core & FRAMEWORKS
    extras = PROJECT["optional-dependencies"]
    assert {canonicalize_name(Requirement(r).name) for r in extras["tf"]} == {"tensorflow", "keras"}
    assert {canonicalize_name(Requirement(r).name) for r in extras["tf-cpu"]} == {"tensorflow-cpu", "keras"}
    assert {canonicalize_name(Requirement(r).name) for r in extras["torch"]} == {"torch"}
    assert "<" not in PROJECT["requires-python"]  # no cap that nothing enforces (docs/versions.md)


def test_every_requirement_has_a_lower_bound_and_the_lock_lies_inside_the_ranges():
    lock = _lock()
    extras = PROJECT["optional-dependencies"]
    reqs = [*PROJECT["dependencies"], *(r for name in ("tf-cpu", "torch", "tensorboard", "dev") for r in extras[name])]
    for text in reqs:
        req = Requirement(text)
        assert any(s.operator == ">=" for s in req.specifier), f"{text}: no lower bound"
        name = canonicalize_name(req.name)
        assert name in lock, f"constraints.txt pins no {name}"
        assert req.specifier.contains(lock[name], prereleases=True), f"the lock's {name} {lock[name]} is outside {text}"


def test_the_lock_is_the_environment_the_readme_names():
    lock = _lock()  # README: "TensorFlow 2.21 CPU, torch 2.13 CPU"
    assert lock["tensorflow-cpu"].release[:2] == (2, 21) and "tensorflow" not in lock
    assert lock["torch"].release[:2] == (2, 13) and lock["torch"].local == "cpu"
    assert canonicalize_name("tfpar") not in lock  # the project itself is installed editable, not pinned


@pytest.mark.parametrize("module", ["tfpar", "parity_tests"])
def test_python_dash_m_runs_the_command(module):
    out = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=HANG_DEADLINE,
                         cwd=ROOT)
    assert out.returncode == 0 and out.stdout.startswith("usage: tfpar "), out.stderr[-2000:]
    bad = subprocess.run([sys.executable, "-m", module, "compare", "no-such-case.json"], capture_output=True,
                         text=True, timeout=HANG_DEADLINE, cwd=ROOT)
    assert bad.returncode == 2 and bad.stderr.strip().startswith("tfpar: error: CASE: expected"), bad.stderr[-2000:]


def test_python_dash_m_tfpar_runs_torch_workers(tmp_path):
    # the pool's workers re-import the main module (tfpar.__main__ as __mp_main__): it must not run the command again
    out = subprocess.run([sys.executable, "-m", "tfpar", "run", str(ROOT / "examples/byo/mlp/case.json"), "--impl",
                          "torch.ddp", "--out", str(tmp_path / "run.npz")], capture_output=True, text=True,
                         timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "run.npz").is_file() and (tmp_path / "run.manifest.json").is_file()


@pytest.mark.slow
def test_the_wheel_ships_py_typed_and_the_main_modules(tmp_path):
    # built from a copy: setuptools writes build/ and *.egg-info into the tree it builds
    src = tmp_path / "src"
    src.mkdir()
    for part in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / part, src / part)
    for package in PACKAGES:
        shutil.copytree(ROOT / package, src / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                          str(tmp_path), str(src)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    (wheel,) = tmp_path.glob("tfpar-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for package in PACKAGES:
        assert (ROOT / package / "py.typed").is_file()
        assert f"{package}/py.typed" in names
    assert {"tfpar/__main__.py", "parity_tests/__main__.py"} <= names


def _doc_requirements(line: str) -> set[str]:
    """The requirements a table row of docs/install.md names: `numpy` `>= 1.26.4` -> {'numpy>=1.26.4'}."""
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if cells[1].startswith("`") and not cells[1].startswith("`>"):  # | `extra` | `name >=a,<b`, ... | why |
        return {str(Requirement(r.replace(" ", ""))) for r in re.findall(r"`([A-Za-z-]+ [^`]+)`", cells[1])}
    return {str(Requirement(cells[0] + cells[1].replace(" ", "")))}  # | name | >= a | why |


def test_install_md_states_the_ranges_of_pyproject():
    text = (ROOT / "docs" / "install.md").read_text()
    core_rows = [ln for ln in text.splitlines() if re.match(r"\| [a-z]+ \| >= ", ln)]
    assert set().union(*map(_doc_requirements, core_rows)) == {str(Requirement(r)) for r in PROJECT["dependencies"]}
    extras = PROJECT["optional-dependencies"]
    for extra in ("tf", "tf-cpu", "torch", "tensorboard"):
        (row,) = [ln for ln in text.splitlines() if ln.startswith(f"| `{extra}` |")]
        assert _doc_requirements(row) == {str(Requirement(r)) for r in extras[extra]}, row
