"""``parity_tests.protocol.user_code``: the one importer of users' code (plugins by name, in every process)."""

from __future__ import annotations

import sys

import pytest

from parity_tests.protocol.errors import CaseError
from parity_tests.protocol.user_code import import_module, locate, module_name, where


def test_a_bad_name_is_one_line_naming_the_field(tmp_path):
    with pytest.raises(CaseError, match=r"^--impls: expected a plugin named FILE.py:FUNCTION or package.module:FUNCTION"):
        locate("no_colon_here", "--impls")
    with pytest.raises(CaseError, match=r"^--impls: expected an existing Python file; .*absent.py does not exist"):
        locate(f"{tmp_path / 'absent.py'}:train", "--impls")
    with pytest.raises(CaseError, match=r"^--impls: expected an importable module; no module named 'no_such_pkg_x'"):
        locate("no_such_pkg_x:train", "--impls")


def test_a_file_is_located_without_importing_it_and_named_by_its_path(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    for d in ("a", "b"):
        (tmp_path / d / "train.py").write_text("raise RuntimeError('imported')\n")
    one, path = locate(f"{tmp_path / 'a' / 'train.py'}:fn", "--impls")  # raises nothing: not imported
    two, _ = locate(f"{tmp_path / 'b' / 'train.py'}:fn", "--impls")
    assert path == (tmp_path / "a" / "train.py").resolve() and one["attr"] == "fn"
    assert one["module_name"] != two["module_name"]  # two train.py files are two modules
    assert one["module_name"] == module_name(path) and where(one) == "train.py"
    located, source = locate("json:dumps", "f")
    assert located == {"module": "json", "attr": "dumps"} and where(located) == "json" and source.name == "__init__.py"


def test_a_module_that_raises_leaves_nothing_behind_and_one_that_imports_is_kept(tmp_path):
    (tmp_path / "sibling_of_plugin_x.py").write_text("VALUE = 7\n")
    good = tmp_path / "good_plugin.py"
    good.write_text("import sibling_of_plugin_x\n\ndef fn():\n    return sibling_of_plugin_x.VALUE\n")
    bad = tmp_path / "bad_plugin.py"
    bad.write_text("raise KeyError('lr')\n")
    location, _ = locate(f"{bad}:fn", "--impls")
    with pytest.raises(KeyError):
        import_module(location)
    assert location["module_name"] not in sys.modules  # a later import starts afresh
    location, _ = locate(f"{good}:fn", "--impls")
    try:
        module = import_module(location)
        assert module.fn() == 7  # its sibling imported as under python FILE
        assert import_module(location) is module  # once per process
    finally:
        sys.modules.pop(location["module_name"], None)
        sys.modules.pop("sibling_of_plugin_x", None)
        sys.path.remove(str(tmp_path))
