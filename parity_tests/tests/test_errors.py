"""``parity_tests.protocol.errors``: one root for every exception class of the three packages, and
``CaseError``'s one-line message.

The list below is the inventory; :func:`_declared` finds every exception class in the source (tests
excluded) so that a new one without the root, or one this list forgot, fails here.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import sys
from pathlib import Path

import pytest

from parity_tests.protocol import CaseError, TfparError

ROOT = Path(__file__).resolve().parents[2]

#: (module, class, the standard base it kept): ``except ValueError`` / ``except RuntimeError`` catch what they did
ERRORS = [
    ("parity_tests.protocol.errors", "CaseError", ValueError),
    ("parity_tests.protocol.layouts", "LayoutError", ValueError),
    ("parity_tests.protocol.plugin_mark", "PluginDeclarationError", ValueError),
    ("parity_tests.protocol.plugin_mark", "PluginRaised", RuntimeError),
    ("parity_tests.running.frameworks", "FrameworkMissing", ValueError),
    ("parity_tests.running.backends", "RunError", RuntimeError),
    ("parity_tests.running.plugins", "PluginFailed", RuntimeError),
    ("parity_tests.running.tf_worker", "WorkerDied", RuntimeError),
    ("parity_tests.launch.tf", "_Failed", RuntimeError),
    ("parity_tests.testing.strategies", "_Draws", Exception),
    ("tfpar.errors", "Unsupported", ValueError),
    ("tfpar.devices", "DeviceError", RuntimeError),
    ("tfpar.plugin", "PluginRaised", RuntimeError),
    ("torchref.plugin", "PluginInputError", RuntimeError),
    ("torchref.plugin", "PluginRaised", RuntimeError),
    ("torchref.pool", "PoolError", RuntimeError),
    ("torchref.pool", "RankFailed", RuntimeError),
]
#: not errors: SIGTERM turned into an exception, a ``BaseException`` as ``KeyboardInterrupt`` is, so that no
#: ``except Exception`` (nor ``except TfparError``) swallows it
OUTSIDE = {("parity_tests.cli", "Terminated")}


def _declared() -> set[tuple[str, str]]:
    """(module, class) of every exception class declared in tfpar, torchref and parity_tests (tests excluded).

    A class is an exception when a base (by its last dotted name) is a builtin exception or another class
    found so: enough for this code base, where every base is named, not computed.
    """
    builtin = {n for n in dir(builtins) if isinstance(getattr(builtins, n), type) and issubclass(getattr(builtins, n),
                                                                                                    BaseException)}
    classes = []
    for pkg in ("tfpar", "torchref", "parity_tests"):
        for f in (ROOT / pkg).rglob("*.py"):
            if "tests" in f.relative_to(ROOT).parts:
                continue
            module = ".".join(f.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            for node in ast.walk(ast.parse(f.read_text(), filename=str(f))):
                if isinstance(node, ast.ClassDef):
                    classes.append((module, node.name, {ast.unparse(b).rpartition(".")[2] for b in node.bases}))
    found: set[tuple[str, str]] = set()
    names = set(builtin)
    while True:
        more = {(m, c) for m, c, bases in classes if bases & names} - found
        if not more:
            return found
        found |= more
        names |= {c for _, c in more}


def test_the_inventory_is_every_exception_class_declared():
    assert _declared() == {(m, c) for m, c, _ in ERRORS} | OUTSIDE | {("parity_tests.protocol.errors", "TfparError")}


@pytest.mark.parametrize(("module", "name", "standard"), ERRORS, ids=[f"{m}.{c}" for m, c, _ in ERRORS])
def test_each_derives_from_the_root_and_keeps_its_standard_base(module, name, standard):
    cls = getattr(importlib.import_module(module), name)
    assert issubclass(cls, TfparError)
    assert issubclass(cls, standard)


def test_the_two_plugin_decorators_raise_the_one_declaration_error():
    import tfpar.plugin
    import torchref.plugin
    from parity_tests.protocol.plugin_mark import PluginDeclarationError

    assert tfpar.plugin.PluginDeclarationError is torchref.plugin.PluginDeclarationError is PluginDeclarationError


def test_except_the_root_catches_a_raised_error_and_not_sigterm():
    from parity_tests.cli import Terminated

    with pytest.raises(TfparError, match="^optimizer.lr: expected a number > 0, got -1$"):
        raise CaseError("optimizer.lr", "a number > 0", -1)
    assert not issubclass(Terminated, Exception)
    assert not issubclass(Terminated, TfparError)


def test_the_scan_finds_a_new_exception_class_without_the_root(tmp_path, monkeypatch):
    """The inventory check can fail: a class deriving from an error of ours, or from a builtin, is found."""
    pkg = tmp_path / "parity_tests"
    pkg.mkdir()
    (pkg / "zz.py").write_text("class A(KeyError):\n    pass\n\nclass B(zz.A):\n    pass\n\nclass C:\n    pass\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert _declared() == {("parity_tests.zz", "A"), ("parity_tests.zz", "B")}
