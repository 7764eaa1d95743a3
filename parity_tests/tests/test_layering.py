"""The architecture's one hard rule: tfpar never imports torch, torchref never imports TensorFlow,
and the CLI's top level imports neither (spawned workers re-import the parent's main module)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize(("package", "forbidden"), [("tfpar", {"torch", "torchref"}), ("torchref", {"tensorflow", "keras", "tfpar"})])
def test_no_source_file_imports_the_other_framework(package, forbidden):
    files = sorted((ROOT / package).rglob("*.py"))
    assert files
    bad = {str(f.relative_to(ROOT)): sorted(_imports(f) & forbidden) for f in files if _imports(f) & forbidden}
    assert not bad, bad


@pytest.mark.parametrize(
    ("module", "forbidden"),
    [("tfpar", ["torch"]), ("torchref.run", ["tensorflow", "keras"]), ("parity_tests.cli", ["tensorflow", "torch"]),
     ("parity_tests.contract.case", ["tensorflow", "torch"])],
)
def test_importing_does_not_load_the_other_framework(module, forbidden):
    code = f"import sys, {module}; print(','.join(m for m in {forbidden!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "", f"importing {module} loaded {out.stdout.strip()}"


TORCH_FROM_THE_POOL = """
import sys
from parity_tests.contract.case import case_from_dict
from parity_tests.running.harness import run_impl
from parity_tests.tests.helpers import MLP

if __name__ == "__main__":
    case = case_from_dict(dict(MLP, steps=1, parallel=dict(MLP["parallel"], devices=2)))
    for impl in ("torch.ddp", "torch.single"):
        assert len(run_impl(case, impl)["loss"]) == 1
    print("torch" in sys.modules)
"""


def test_running_torch_implementations_does_not_import_torch_in_the_parent():
    """The ranks import the job (torchref.jobs.JobRef) where the forkserver imported torch: a cold
    ``tfpar compare`` does not pay torch's import (~2.4 s) in the process that imports TensorFlow."""
    out = subprocess.run([sys.executable, "-c", TORCH_FROM_THE_POOL], capture_output=True, text=True, timeout=300,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "False"
