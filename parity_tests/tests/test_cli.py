"""The ``tfpar`` command: run, compare, exit statuses, one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from parity_tests.cli import main
from parity_tests.protocol.trajectory import load_trajectory
from parity_tests.tests.helpers import MLP, set_path

TFPAR = [sys.executable, "-m", "parity_tests.cli"]


def _write(tmp_path: Path, raw: dict, name: str = "case.json") -> Path:
    p = tmp_path / name
    p.write_text(json.dumps(raw))
    return p


def _cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    return subprocess.run([*TFPAR, *args], capture_output=True, text=True, timeout=timeout, env=env)


def test_run_writes_a_contract_trajectory(tmp_path):
    case = _write(tmp_path, set_path(MLP, "parallel.devices", 2))
    out = tmp_path / "t.npz"
    res = _cli("run", str(case), "--impl", "torch.ddp", "--out", str(out))
    assert res.returncode == 0, res.stderr
    traj = load_trajectory(out)
    assert traj["loss"].shape == (4,)
    assert traj["param/0.kernel"].shape == (5, 5, 10) and traj["grad/1.bias"].shape == (4, 1)
    assert traj["param/0.kernel"].dtype == np.float64
    assert not list(tmp_path.glob(".*.tmp"))


def test_compare_parity_exit_0_and_divergence_exit_1(tmp_path, capsys):
    good = _write(tmp_path, set_path(set_path(MLP, "parallel.devices", 2), "optimizer.semantics", "torch"), "good.json")
    res = _cli("compare", str(good), "--impls", "tf.towers,torch.ddp", "--report", str(tmp_path / "rep"))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "verdict: PARITY" in res.stdout
    assert (tmp_path / "rep" / "report.md").is_file() and (tmp_path / "rep" / "case" / "case.json").is_file()
    # statuses through main(): the console script exits with what main returns, which the
    # subprocess above (0) and test_timeout_flag_bounds_a_job_and_names_the_rank (3) prove
    # an expected difference (the residual is parity) exits 0 as well (CONTRACT section 8); a divergence 1
    summed = set_path(set_path(MLP, "parallel.devices", 2), "model.reduction", "sum")
    capsys.readouterr()
    assert main(["compare", str(_write(tmp_path, summed, "sum.json")), "--impls", "torch.ddp,torch.single"]) == 0
    out = capsys.readouterr().out
    assert "expected_difference" in out and "sum reduction" in out and "verdict: EXPECTED DIFFERENCE" in out
    buggy = f"{Path(__file__).parent / 'plugins' / 'tf_plugins.py'}:lr_doubled_from_step_3"
    assert main(["compare", str(good), "--impls", f"torch.ddp,{buggy}"]) == 1
    out = capsys.readouterr().out
    assert "divergence" in out and "verdict: DIVERGENCE" in out
    assert "step 3" in out  # the mismatch message names the step


BAD_ARGS = [
    (["run", "{case}", "--impl", "tf.nope", "--out", "{tmp}/t.npz"], "--impl"),
    (["run", "{case}", "--impl", "tf.towers", "--out", "{tmp}/t.txt"], "--out"),
    (["run", "{case}", "--impl", "tf.towers", "--out", "{tmp}/missing/t.npz"], "--out"),
    (["run", "{tmp}/nope.json", "--impl", "tf.towers", "--out", "{tmp}/t.npz"], "CASE"),
    (["compare", "{case}", "--impls", "tf.towers"], "--impls"),
    (["compare", "{case}", "--impls", "tf.towers,tf.towers"], "--impls"),
    (["frobnicate"], "command line"),
    (["run", "{case}"], "command line"),
]


@pytest.mark.parametrize(("argv", "field"), BAD_ARGS, ids=[" ".join(a[:1] + [f]) for a, f in BAD_ARGS])
def test_bad_arguments_exit_2_with_one_line(tmp_path, capsys, argv, field):
    case = _write(tmp_path, MLP)
    argv = [a.format(case=case, tmp=tmp_path) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"tfpar: error: {field}"), err


def test_bad_case_file_exit_2_names_the_field(tmp_path, capsys):
    p = _write(tmp_path, set_path(MLP, "optimizer.lr", -1))
    assert main(["run", str(p), "--impl", "tf.single", "--out", str(tmp_path / "t.npz")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["tfpar: error: optimizer.lr: expected a number >= 0 (torch.optim.SGD refuses lr < 0: 'Invalid learning rate'), got -1.0"]
    (tmp_path / "broken.json").write_text("{not json")
    assert main(["run", str(tmp_path / "broken.json"), "--impl", "tf.single", "--out", str(tmp_path / "t.npz")]) == 2
    assert "valid JSON" in capsys.readouterr().err


def test_too_many_devices_is_bad_input(tmp_path, capsys, monkeypatch):
    from tfpar import devices

    devices.configure_devices()  # as if TensorFlow had started with 8 tower devices (it fixes them then)
    monkeypatch.setattr(devices, "_configured", devices.available_devices()[:8])
    p = _write(tmp_path, set_path(MLP, "parallel.devices", 9))
    assert main(["run", str(p), "--impl", "tf.towers", "--out", str(tmp_path / "t.npz")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tfpar: error: parallel.devices: expected at most 8"), err


def test_timeout_flag_bounds_a_job_and_names_the_rank(tmp_path):
    """A 0.001 s budget cannot hold a DDP job: the run fails fast, naming a rank, status 3 (an implementation
    failed: nothing to judge), nothing left.

    The job is 2000 steps at 8 ranks (about a minute on the 2-core machine), so it cannot
    finish inside the budget whether a collective hits the 1 ms gloo timeout or the
    parent stops waiting after the budget plus its 2 s margin (a short job on an idle
    machine can run every collective in under 1 ms, and did once in CI rehearsal).
    """
    case = _write(tmp_path, set_path(set_path(MLP, "parallel.devices", 8), "steps", 2000))
    res = _cli("--timeout", "0.001", "run", str(case), "--impl", "torch.ddp", "--out", str(tmp_path / "t.npz"))
    assert res.returncode == 3, res.stdout + res.stderr
    err = res.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tfpar: run failed: torch.ddp failed: rank "), err
    assert "timed out" in err[0].lower()
    assert not (tmp_path / "t.npz").exists()


def test_version_prints_the_installed_version_and_the_source_tree_agrees(capsys):
    import tomllib
    from importlib import metadata

    import parity_tests

    assert main(["--version"]) == 0
    try:
        installed = metadata.version("tfpar")
    except metadata.PackageNotFoundError:  # a source tree on PYTHONPATH: the package's own
        installed = parity_tests.__version__
    assert capsys.readouterr().out == f"tfpar {installed}\n"
    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    assert parity_tests.__version__ == pyproject["project"]["version"]


@pytest.mark.parametrize(("argv", "shown"), [
    (["replay", "m.json"], ["a note"]),
    (["-q", "replay", "m.json"], []),
    (["replay", "m.json", "--quiet"], []),
    (["--verbose", "replay", "m.json"], ["a detail", "a note"]),
    (["replay", "-v", "m.json"], ["a detail", "a note"]),
], ids=["default", "quiet-before", "quiet-after", "verbose-before", "verbose-after"])
def test_the_library_logs_and_the_command_shows_it_as_asked(monkeypatch, capsys, argv, shown):
    """The library's messages go to the ``tfpar`` logger; the command shows INFO on stderr, ``-q`` none,
    ``-v`` DEBUG too, and leaves logging as it found it: no handler left, the root logger untouched."""
    import logging

    from parity_tests import cli

    def command(args):
        logging.getLogger("tfpar.session").debug("a detail")
        logging.getLogger("tfpar.session").info("a note")
        return 0

    monkeypatch.setattr(cli, "_cmd_replay", command)
    root = (logging.getLogger().level, list(logging.getLogger().handlers))
    assert main(argv) == 0
    assert capsys.readouterr().err.splitlines() == shown
    assert logging.getLogger("tfpar").handlers == [] and logging.getLogger("tfpar").level == logging.NOTSET
    assert (logging.getLogger().level, logging.getLogger().handlers) == root


def test_quiet_and_verbose_are_refused_together(capsys):
    assert main(["-q", "-v", "replay", "m.json"]) == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_quiet_compare_prints_the_verdicts_and_nothing_on_stderr(tmp_path, capsys):
    case = _write(tmp_path, set_path(set_path(MLP, "parallel.devices", 1), "steps", 2))
    assert main(["compare", str(case), "--impls", "torch.single,tf.single", "--quiet"]) == 0
    out, err = capsys.readouterr()
    assert "verdict: PARITY" in out and not [line for line in err.splitlines() if ": run " in line], err


def test_matrix_takes_junit_and_quiet_from_the_command_line(monkeypatch, tmp_path):
    from parity_tests.reporting import matrix

    seen = {}
    monkeypatch.setattr(matrix, "run_matrix", lambda out, **kw: seen.update(out=out, **kw) or 0)
    assert main(["matrix", "--out", str(tmp_path / "r"), "--junit", str(tmp_path / "j.xml"), "-q"]) == 0
    assert (seen["out"], seen["junit"], seen["progress"]) == (tmp_path / "r", tmp_path / "j.xml", False)
    assert main(["matrix", "--out", str(tmp_path / "r")]) == 0
    assert (seen["junit"], seen["progress"]) == (None, True)
