"""A missing framework is one line naming the extra to install, exit 2 (parity_tests.running.frameworks)."""

from __future__ import annotations

import subprocess

import pytest

from parity_tests.running.frameworks import FrameworkMissing, installed, missing_module, require
from parity_tests.tests.absent import PYTHON, ROOT, absent_env
from parity_tests.tests.processes import HANG_DEADLINE

MLP = ROOT / "examples" / "byo" / "mlp"


def _tfpar(tmp_path, absent: tuple[str, ...], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, "-m", "parity_tests.cli", *args], env=absent_env(tmp_path, *absent),
                          capture_output=True, text=True, timeout=HANG_DEADLINE, cwd=tmp_path)


@pytest.mark.parametrize(("absent", "impls", "extra"), [
    (("tensorflow",), "tf.towers,torch.ddp", "tfpar[tf]"),  # the default reference, without TensorFlow
    (("keras",), "tf.single,torch.single", "tfpar[tf]"),  # TensorFlow without Keras 3
    (("torch",), "tf.towers,torch.ddp", "tfpar[torch]"),
    (("torch",), f"tf.towers,{MLP / 'torch_ddp.py'}:ddp", "tfpar[torch]"),  # a torch plugin imports torch
    (("tensorflow",), f"{MLP / 'tf_towers.py'}:towers,torch.ddp", "tfpar[tf]"),  # a TF plugin
])
def test_missing_framework_is_one_line_naming_the_extra(tmp_path, absent, impls, extra):
    out = _tfpar(tmp_path, absent, "compare", str(MLP / "case.json"), "--impls", impls)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert lines[0].startswith("tfpar: error: --impls: expected ") and f"pip install '{extra}'" in lines[0]
    assert repr(absent[0]) in lines[0]  # names the module that is missing


def test_installed_frameworks_pass():
    # this environment has both: the guard must not fire on them (the other direction of the tests above)
    assert installed("tf") and installed("torch")
    require("tf", "tf.towers")
    require("torch", "torch.ddp")
    require("recorded", "recorded:x.npz")  # a recorded run needs neither


def test_missing_module_only_for_the_frameworks():
    other = ModuleNotFoundError("No module named 'no_such_module_here'", name="no_such_module_here")
    assert missing_module(other, "p.py:f", "--impls") is None  # the user's own missing module: their error
    assert missing_module(ValueError("x"), "p.py:f", "--impls") is None
    torch_present = ModuleNotFoundError("No module named 'torch.nothing'", name="torch.nothing")
    assert missing_module(torch_present, "p.py:f", "--impls") is None  # torch is installed: not "install torch"
    absent = missing_module(ModuleNotFoundError("", name="torch"), "p.py:f", "--impls")
    assert absent is None  # torch IS importable here; only a truly absent framework counts
    assert issubclass(FrameworkMissing, ValueError)


def test_the_pool_fixture_without_torch_names_the_extra(tmp_path):
    (tmp_path / "test_user.py").write_text("def test_uses_the_pool(tfpar_pool):\n    pass\n")
    env = absent_env(tmp_path, "torch")
    env.pop("PYTEST_DISABLE_PLUGIN_AUTOLOAD", None)
    out = subprocess.run([PYTHON, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_user.py"], env=env,
                         capture_output=True, text=True, timeout=HANG_DEADLINE, cwd=tmp_path)
    assert out.returncode == 1, out.stdout[-2000:]
    assert "1 error" in out.stdout and "expected torch for the tfpar_pool fixture" in out.stdout, out.stdout[-2000:]
    assert "pip install 'tfpar[torch]'" in out.stdout and "ModuleNotFoundError" not in out.stdout


def test_tensorboard_is_asked_for_by_name(tmp_path):
    require("tensorboard", "--tensorboard", "--tensorboard")  # installed here: passes
    code = ("from parity_tests.running.frameworks import require\n"
            "try:\n    require('tensorboard', '--tensorboard', '--tensorboard')\n"
            "except ValueError as e:\n    print(e)\n")
    out = subprocess.run([PYTHON, "-c", code], env=absent_env(tmp_path, "tensorboard"), capture_output=True,
                         text=True, timeout=HANG_DEADLINE, cwd=tmp_path)
    assert out.stdout.strip() == ("--tensorboard: expected TensorBoard for --tensorboard; no module named"
                                  " 'tensorboard' here: pip install 'tfpar[tensorboard]' (or your own build;"
                                  " docs/install.md)"), out.stdout + out.stderr[-2000:]


def test_compare_with_tensorboard_missing_stops_before_any_run(tmp_path):
    """TensorFlow without tensorboard fails only at its first ``tf.summary``, after every run of the comparison:
    ``tfpar compare --tensorboard`` asks for it first (one line, exit 2, nothing run, no folder written)."""
    out = _tfpar(tmp_path, ("tensorboard",), "compare", str(MLP / "case.json"), "--impls", "tf.towers,torch.ddp",
                 "--tensorboard", str(tmp_path / "tb"))
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tfpar: error: --tensorboard: expected TensorBoard"), lines
    assert "pip install 'tfpar[tensorboard]'" in lines[0]
    assert out.stdout == "" and not (tmp_path / "tb").exists()  # no verdict table: nothing ran
