"""Every TFPAR_* environment variable is read in protocol/settings.py only, documented in
docs/settings.md, and a bad value is one CaseError naming the variable."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from parity_tests.protocol import settings
from parity_tests.protocol.errors import CaseError

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = [p for pkg in ("tfpar", "torchref", "parity_tests") for p in (ROOT / pkg).rglob("*.py") if "tests" not in p.parts]


def _tfpar_strings(path: Path) -> set[str]:
    """String constants of ``path`` that are a ``TFPAR_*`` name and nothing else: the key a module
    reads a variable by (``os.environ["TFPAR_X"]``, ``getenv("TFPAR_X")``, a constant holding it).
    A message that mentions a variable in a sentence is not a read."""
    return {node.value for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(r"TFPAR_[A-Z_]+", node.value)}


def test_no_other_module_names_a_tfpar_variable_in_code():
    """Only the settings module holds a variable's name as a key; others use ``settings.X.name``."""
    assert PRODUCT
    readers = {str(p.relative_to(ROOT)): sorted(_tfpar_strings(p)) for p in PRODUCT
               if p.name != "settings.py" and _tfpar_strings(p)}
    assert not readers, readers


def test_every_setting_is_documented_and_every_documented_one_exists():
    doc = (ROOT / "docs" / "settings.md").read_text()
    documented = set(re.findall(r"^\| `(TFPAR_[A-Z_]+)` \|", doc, flags=re.M))
    assert documented == {s.name for s in settings.SETTINGS}


@pytest.mark.parametrize(("name", "value", "read"), [
    ("TFPAR_SPILL_BYTES", "64MB", settings.spill_bytes),
    ("TFPAR_SPILL_BYTES", "-1", settings.spill_bytes),
    ("TFPAR_DEVICES", "0", lambda: settings.devices(8)),
    ("TFPAR_DEVICES", "eight", lambda: settings.devices(8)),
    ("TFPAR_GPU_MEMORY_MB", "1G", settings.gpu_memory_mb),
    ("TFPAR_LOCAL_DEVICES", "0", settings.local_devices),
])
def test_a_bad_value_is_one_case_error_naming_the_variable(monkeypatch, name, value, read):
    monkeypatch.setenv(name, value)
    with pytest.raises(CaseError) as e:
        read()
    assert e.value.field == name and repr(value) in str(e.value)
    with pytest.raises(CaseError):
        settings.check()


def test_defaults_and_values(monkeypatch):
    for s in settings.SETTINGS:
        monkeypatch.delenv(s.name, raising=False)
    assert settings.spill_bytes() == 64 * 2**20
    assert settings.devices(8) == 8 and settings.gpu_memory_mb() is None and settings.local_devices() is None
    assert settings.trace_cache() and settings.failures_folder() == Path("failures")
    settings.check()
    monkeypatch.setenv("TFPAR_SPILL_BYTES", "0")
    monkeypatch.setenv("TFPAR_DEVICES", "3")
    assert settings.spill_bytes() == 0 and settings.devices(8) == 3


def test_trace_cache_off_restores_the_earlier_value(monkeypatch):
    monkeypatch.delenv("TFPAR_TRACE_CACHE", raising=False)
    with settings.trace_cache_off():
        assert not settings.trace_cache()
    assert settings.trace_cache() and "TFPAR_TRACE_CACHE" not in __import__("os").environ
    monkeypatch.setenv("TFPAR_TRACE_CACHE", "1")
    with settings.trace_cache_off():
        assert not settings.trace_cache()
    assert __import__("os").environ["TFPAR_TRACE_CACHE"] == "1"
