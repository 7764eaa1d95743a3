"""Each side alone: torch without TensorFlow records runs under torchrun, TensorFlow without torch
records them with ``tfpar run`` and its launcher, and ``tfpar compare ... recorded:FILE`` judges them.

A GPU machine often has one framework only (docs/cluster.md's H100: torch, no TensorFlow). Each
side runs here in a child process where the other framework cannot be imported (tests/absent.py:
the import system finds nothing for it, in the child and every process it starts), at the
smallest size that can fail: float64, 2 devices, 2 steps of the MLP, the float64 bound (1e-10)
deciding. A side that reached for the other framework would fail with ModuleNotFoundError; a
recorded run that was wrong would be judged a divergence.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from parity_tests.tests.absent import PYTHON, ROOT, absent_env
from parity_tests.tests.helpers import MLP, set_path

pytestmark = pytest.mark.slow

TORCHRUN = Path(sys.executable).with_name("torchrun")
MLP_EXAMPLE = ROOT / "examples" / "byo" / "mlp"
# lr 0.125 is exact in float32: Keras' rounding of the learning rate is the identity, so recorded
# torch runs (which cannot be re-run at Keras' rounded value) are judged by the float64 bound alone
CASE = set_path(set_path(set_path(MLP, "optimizer.lr", 0.125), "steps", 2), "parallel.devices", 2)
TF_ABSENT = ("tensorflow", "keras")  # tfpar and torchref stay: one distribution, and neither imports a framework
TORCH_ABSENT = ("torch",)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(cmd: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"{cmd}\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"
    return out


def _torchrun(tmp: Path, impl: str, out: str, env: dict[str, str]) -> None:
    _run([str(TORCHRUN), "--nnodes", "1", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
          "--master-port", str(_free_port()), "--log-dir", str(tmp / f"torchelastic-{out}"),
          "-m", "parity_tests.launch.torch", "case.json", "--impl", impl, "--out", out], env, tmp)


@pytest.fixture(scope="module")
def sides(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("sides")
    (tmp / "case.json").write_text(json.dumps(CASE))
    (tmp / "case1.json").write_text(json.dumps(set_path(CASE, "parallel.devices", 1)))
    torch_only, tf_only = absent_env(tmp / "t", *TF_ABSENT), absent_env(tmp / "f", *TORCH_ABSENT)
    # the children really lack the other side (else every test below proves nothing)
    probe = "import importlib.util as u; print([m for m in {!r} if u.find_spec(m) is not None])"
    assert _run([PYTHON, "-c", probe.format(TF_ABSENT)], torch_only, tmp).stdout.strip() == "[]"
    assert _run([PYTHON, "-c", probe.format(TORCH_ABSENT)], tf_only, tmp).stdout.strip() == "[]"
    # torch alone: the reference and a plugin under torchrun
    _torchrun(tmp, "torch.ddp", "torch.npz", torch_only)
    _torchrun(tmp, f"{MLP_EXAMPLE / 'torch_ddp.py'}:ddp", "torch_plugin.npz", torch_only)
    # TensorFlow alone: tfpar run of the towers and a plugin, and one worker of the multi-worker launcher
    _run([PYTHON, "-m", "tfpar", "run", "case.json", "--impl", "tf.towers", "--out", "tf.npz"], tf_only, tmp)
    _run([PYTHON, "-m", "tfpar", "run", "case.json", "--impl", f"{MLP_EXAMPLE / 'tf_towers.py'}:towers",
          "--out", "tf_plugin.npz"], tf_only, tmp)
    port = _free_port()
    worker = {**tf_only, "TF_CONFIG": json.dumps({"cluster": {"worker": [f"127.0.0.1:{port}"]},
                                                  "task": {"type": "worker", "index": 0}})}
    _run([PYTHON, "-m", "parity_tests.launch.tf", "case1.json", "--impl", "tf.multiworker", "--out",
          "multiworker.npz"], worker, tmp)
    return tmp


@pytest.mark.parametrize(("name", "framework"), [("torch", "torch"), ("torch_plugin", "torch"), ("tf", "tf"),
                                                 ("tf_plugin", "tf"), ("multiworker", "tf")])
def test_each_side_records_a_run_alone(sides, name, framework):
    manifest = json.loads((sides / f"{name}.manifest.json").read_text())
    assert manifest["implementation"]["framework"] == framework and manifest["findings"] == []
    assert (sides / f"{name}.npz").is_file()


def test_compare_judges_the_recorded_sides(sides):
    impls = ",".join(f"recorded:{n}.npz" for n in ("tf", "torch", "torch_plugin", "tf_plugin"))
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    out = _run([PYTHON, "-m", "tfpar", "compare", "case.json", "--impls", impls], env, sides)
    pairs = [ln for ln in out.stdout.splitlines() if ln.startswith("recorded:tf.npz vs ")]
    assert len(pairs) == 3 and all(" parity " in ln for ln in pairs), out.stdout
    # the multi-worker run (1 worker, 1 device) against the torch reference on one process, run here
    out = _run([PYTHON, "-m", "tfpar", "compare", "case1.json", "--impls", "recorded:multiworker.npz,torch.single"],
               env, sides)
    assert "verdict: PARITY" in out.stdout, out.stdout
