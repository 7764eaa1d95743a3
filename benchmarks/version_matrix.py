"""The version matrix: build one cell's environment and run the named check set in it.

    python benchmarks/version_matrix.py --cell lock      # constraints.txt exactly (what make installs)
    python benchmarks/version_matrix.py --cell oldest    # every lower bound of pyproject.toml, exactly
    python benchmarks/version_matrix.py --cell newest    # the newest releases the ranges allow (Python 3.13)
    python benchmarks/version_matrix.py --cell oldest --checks matrix --skip-build   # or --reuse

Each cell's virtual environment goes under ``/work/envs/CELL`` (``--envs`` to move it; outside the
repository), with this repository installed into it editable, extras ``tf-cpu,torch,tensorboard,dev``.
The check sets (``--checks``, default all, in this order):

* ``matrix``   -- ``tfpar matrix --quick`` into ``ENVS/CELL/report`` (the built-in scenario matrix);
* ``examples`` -- pytest on test_byo_examples.py and test_real_examples.py (the byo and real examples);
* ``oracles``  -- pytest on test_param_mean.py, test_async.py and test_optimizers.py (plain-numpy and
  published-rule oracles of the combine rules and the optimizers).

Prints, per check, pass or fail and seconds; then the versions the cell ran (numpy, TensorFlow,
Keras, torch, hypothesis, ...); and, when the ``lock`` cell's matrix report exists, every verdict of
the matrix that differs from the lock's. The figures go in docs/versions.md. Cells other than the
lock run on demand, not in CI (each builds an environment of 1.5 to 6 GB).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = "tf-cpu,torch,tensorboard,dev"
PYTHONS = {"lock": "3.11", "oldest": "3.11", "newest": "3.13"}
CHECKS = {
    "matrix": None,  # tfpar matrix --quick (built in main)
    "examples": ["parity_tests/tests/test_byo_examples.py", "parity_tests/tests/test_real_examples.py"],
    "oracles": ["parity_tests/tests/test_param_mean.py", "parity_tests/tests/test_async.py",
                "parity_tests/tests/test_optimizers.py"],
}
SHOWN = ["numpy", "tensorflow-cpu", "tensorflow", "keras", "torch", "tensorboard", "hypothesis", "matplotlib",
         "tqdm", "psutil", "pytest", "pytest-xdist", "pytest-timeout"]


def find_python(version: str) -> str:
    """An interpreter of ``version`` (``3.13``): pyenv's, else on PATH."""
    pyenv = Path(os.environ.get("PYENV_ROOT", "/root/.pyenv")) / "versions"
    for found in sorted(pyenv.glob(f"{version}.*"), reverse=True):
        if (found / "bin" / "python3").exists():
            return str(found / "bin" / "python3")
    path = shutil.which(f"python{version}")
    if path is None:
        sys.exit(f"version_matrix: no Python {version} here (pyenv install {version}, or put python{version} on PATH)")
    return path


def lower_bounds() -> list[str]:
    """``name==lower`` for every requirement of pyproject.toml with a lower bound (core and the cell's extras)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in EXTRAS.split(","):
        reqs += [r for r in project["optional-dependencies"][extra] if not r.startswith("tfpar[")]
    pins = []
    for req in reqs:
        m = re.match(r"^\s*([A-Za-z0-9_.-]+)\s*\[?[^>=<]*?>=\s*([0-9][^,;\s]*)", req)
        if m:
            pins.append(f"{m.group(1)}=={m.group(2)}")
    return pins


def run(cmd: list[str], **kw) -> int:
    print("+", " ".join(cmd), flush=True)
    return subprocess.call(cmd, **kw)


def build(cell: str, env: Path, reuse: bool = False) -> None:
    """A new venv for the cell (``reuse``: install into the one there, pip changing only what differs)."""
    if not (reuse and (env / "bin" / "python").exists()):
        if env.exists():
            shutil.rmtree(env)
        python = find_python(PYTHONS[cell])
        if run([python, "-m", "venv", str(env)]) != 0:
            sys.exit(f"version_matrix: could not make a venv with {python}")
    pip = [str(env / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    run(pip + ["--upgrade", "pip"])
    cmd = pip[:]
    if cell == "lock":
        cmd += ["-c", str(ROOT / "constraints.txt")]
    elif cell == "oldest":
        pins = env / "oldest-constraints.txt"
        pins.write_text("\n".join(lower_bounds()) + "\n")
        cmd += ["-c", str(pins)]
    if run(cmd + ["-e", f"{ROOT}[{EXTRAS}]"]) != 0:
        sys.exit(f"version_matrix: the {cell} cell's install failed")


def versions(env: Path) -> dict[str, str]:
    out = subprocess.run([str(env / "bin" / "python"), "-m", "pip", "list", "--format", "json",
                          "--disable-pip-version-check"], capture_output=True, text=True)
    got = {d["name"].lower().replace("_", "-"): d["version"] for d in json.loads(out.stdout or "[]")}
    pyv = subprocess.run([str(env / "bin" / "python"), "-c", "import platform; print(platform.python_version())"],
                         capture_output=True, text=True).stdout.strip()
    return {"python": pyv, **{n: got[n] for n in SHOWN if n in got}}


def verdicts(report: Path) -> dict[str, str]:
    """Every pair's verdict in the matrix's row files: ``"case: ref vs impl"`` -> ``"status, gap"``."""
    found: dict[str, str] = {}
    for row in sorted((report / "rows").glob("*.json")):
        result = json.loads(row.read_text()).get("result", {})
        for pair in result.get("pairs", []):
            v = pair.get("verdict", {})
            gap, bound = (float(v.get(k, "nan")) for k in ("gap", "bound"))  # a non-finite one is written as text
            found[f"{result['case']['name']}: {pair['reference']} vs {pair['impl']}"] = (
                f"{v.get('status')} (gap {gap:.3g}, bound {bound:.3g})")
    return found


def check(name: str, env: Path) -> tuple[bool, float, str]:
    bin_ = env / "bin"
    environ = {**os.environ, "HYPOTHESIS_PROFILE": "ci", "TF_CPP_MIN_LOG_LEVEL": "2"}
    environ.pop("PYTHONPATH", None)  # the cell's own install, nothing of the caller's
    t0 = time.monotonic()
    if name == "matrix":
        cmd = [str(bin_ / "tfpar"), "matrix", "--quick", "--out", str(env / "report")]
    else:
        cmd = [str(bin_ / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider", *CHECKS[name]]
    log = env / f"{name}.log"
    with log.open("w") as f:
        print("+", " ".join(cmd), f"> {log}", flush=True)
        rc = subprocess.call(cmd, cwd=ROOT, env=environ, stdout=f, stderr=subprocess.STDOUT)
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    summary = next((ln for ln in reversed(lines) if re.search(r"passed|failed|verdicts|error", ln)), "")
    return rc == 0, time.monotonic() - t0, summary.strip()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cell", required=True, choices=sorted(PYTHONS))
    p.add_argument("--checks", default=",".join(CHECKS), help="comma-separated, of: " + ", ".join(CHECKS))
    p.add_argument("--envs", default="/work/envs", help="where the cells' environments go (default %(default)s)")
    p.add_argument("--skip-build", action="store_true", help="use the cell's environment as built before")
    p.add_argument("--reuse", action="store_true",
                   help="install into the cell's environment as built before (after a bound moved: pip changes only that)")
    args = p.parse_args()
    names = [c for c in args.checks.split(",") if c]
    unknown = [c for c in names if c not in CHECKS]
    if unknown:
        p.error(f"--checks: expected some of {', '.join(CHECKS)}, got {unknown[0]!r}")
    env = Path(args.envs) / args.cell
    t0 = time.monotonic()
    if not args.skip_build:
        build(args.cell, env, args.reuse)
        print(f"built {env} in {time.monotonic() - t0:.0f} s", flush=True)
    results = {name: check(name, env) for name in names}
    print(f"\ncell {args.cell}: " + ", ".join(f"{k} {v}" for k, v in versions(env).items()))
    for name, (ok, secs, summary) in results.items():
        print(f"  {name:9s} {'pass' if ok else 'FAIL'}  {secs:6.0f} s  {summary}")
    lock = Path(args.envs) / "lock" / "report"
    if "matrix" in names and args.cell != "lock" and (lock / "rows").is_dir():
        mine, theirs = verdicts(env / "report"), verdicts(lock)
        def status(text: str | None) -> str | None:
            return text.split(" (")[0] if text else text

        moved = {k: (theirs.get(k), v) for k, v in mine.items() if status(theirs.get(k)) != status(v)}
        print(f"  matrix verdicts that differ from the lock cell's: {len(moved)} of {len(mine)}")
        for k, (a, b) in sorted(moved.items()):
            print(f"    {k}: lock {a}, {args.cell} {b}")
    return 0 if all(ok for ok, _, _ in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
