"""The one registry of implementations: built-ins, plugins, installed entry points, and every place that takes names."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis.errors import InvalidArgument

from parity_tests.protocol.engine import EngineSpec
from parity_tests.protocol.errors import CaseError
from parity_tests.reporting.matrix import run_matrix
from parity_tests.running import registry
from parity_tests.running.harness import IMPLS, parse_impls
from parity_tests.testing.strategies import implementations
from parity_tests.tests.helpers import MLP, make

PLUGINS = Path(__file__).resolve().parent / "plugins"
TF_GOOD = f"{PLUGINS / 'tf_plugins.py'}:good"


def test_builtins_are_registered_through_the_registry():
    assert registry.builtin_names() == IMPLS
    for name in IMPLS:
        impl = registry.resolve(name)
        mixed = ("mixed_bfloat16",) if name in ("tf.towers", "tf.single", "torch.ddp", "torch.single") else ()
        assert impl.kind == "builtin" and impl.dtypes == ("float32", "float64", *mixed)
    assert registry.resolve("torch.single").parallel is False and registry.resolve("tf.v1").parallel is True


def test_a_plugin_may_not_take_a_builtin_name():
    with pytest.raises(CaseError, match="a name other than the built-in 'tf.towers'"):
        registry.register(registry.Implementation(EngineSpec("tf.towers", "plugin", "tf", True, ("float64",)), run=None))


@pytest.fixture
def installed_package(tmp_path, monkeypatch):
    """A package installed the way pip installs one: a module and a dist-info declaring the entry point."""
    pkg = tmp_path / "my_towers_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text((PLUGINS / "tf_plugins.py").read_text())
    info = tmp_path / "my_towers_pkg-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-towers-pkg\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{registry.ENTRY_POINT_GROUP}]\nmy.towers = my_towers_pkg:good\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my.towers"
    sys.modules.pop("my_towers_pkg", None)
    registry._registry.pop("my.towers", None)


def test_an_installed_package_registers_a_short_name(installed_package):
    assert installed_package in registry.names()
    impl = registry.resolve(installed_package)
    assert (impl.name, impl.kind, impl.framework, impl.dtypes) == ("my.towers", "plugin", "tf", ("float32", "float64"))
    assert parse_impls(f"torch.ddp,{installed_package}") == ["torch.ddp", "my.towers"]


@pytest.mark.usefixtures("pool")
def test_an_installed_name_runs_like_any_implementation(installed_package):
    from parity_tests.session.comparison import compare_case

    result = compare_case(make(MLP, parallel__devices=2), ["torch.ddp", installed_package])
    assert result.pairs[0].verdict.status == "parity", result.summary()


def test_the_strategy_draws_names_the_registry_resolves():
    seen = []

    @settings(max_examples=10, database=None)
    @given(implementations(["torch.ddp", TF_GOOD, "tf.towers"]))
    def check(names):
        seen.append(names)
        assert names[0] == "torch.ddp" and 2 <= len(names) <= 3 and len(set(names)) == len(names)

    check()
    assert any(TF_GOOD in names for names in seen)


@pytest.mark.parametrize(("names", "says"), [
    (["torch.ddp"], "at least 2"),
    (["torch.ddp", "torch.ddp"], "distinct"),
    (["torch.ddp", "nope.py:fn"], "does not exist"),
], ids=["one-name", "repeated", "missing-plugin"])
def test_the_strategy_checks_its_names_up_front(names, says):
    with pytest.raises(InvalidArgument, match=says):
        implementations(names)


@pytest.mark.usefixtures("pool")
def test_the_matrix_judges_a_plugin_beside_the_builtins(tmp_path, capsys):
    case = make(MLP, parallel__devices=2)
    status = run_matrix(tmp_path, cases=[case], extra=[TF_GOOD])
    out = capsys.readouterr().out
    assert status == 0, out
    report = (tmp_path / "report.json").read_text()
    assert TF_GOOD in report


def test_the_builtins_are_the_engines_declarations():
    """One source: each built-in implementation is built from its engine's declaration (tfpar.engines,
    torchref.engines), the registry declares it for the judge, and the lists that used to be written
    by hand (harness, lockstep, the matrix) are read from the declarations."""
    from parity_tests.protocol.engine import declared
    from parity_tests.reporting.matrix import IMPLS as MATRIX
    from parity_tests.running.builtins import SPECS
    from parity_tests.running.harness import IMPLS
    from parity_tests.session.lockstep import STATEFUL, STEPWISE
    from tfpar import engines as tf_engines
    from torchref import engines as torch_engines

    assert SPECS == (*tf_engines.SPECS, *torch_engines.SPECS)
    in_process = [s.name for s in SPECS if s.in_process]
    assert list(registry.builtin_names()) == in_process == list(IMPLS) and sorted(MATRIX) == sorted(in_process)
    for s in SPECS:
        found = registry.resolve(s.name)
        assert found.spec is s and declared(s.name) is s
        assert (found.framework, found.parallel, found.dtypes, found.captures) == (s.framework, s.parallel, s.dtypes, s.captures)
    assert set(STEPWISE) == {s.name for s in SPECS if s.stepwise} and set(STATEFUL) == {s.name for s in SPECS if s.stateful}


def test_an_engine_refuses_what_it_does_not_declare():
    """tf.v1 declares sgd, momentum and adam: its runner refuses rmsprop in one line naming the field."""
    from parity_tests.contract.case import case_from_dict
    from parity_tests.protocol.errors import CaseError
    from parity_tests.running.harness import run_impl
    from parity_tests.tests.helpers import MLP
    from tfpar.engines import by_name

    assert "rmsprop" not in by_name("tf.v1").optimizers
    case = case_from_dict(dict(MLP, steps=1, optimizer={"name": "rmsprop", "lr": 0.01, "semantics": "tf"}))
    with pytest.raises(CaseError, match="optimizer"):
        run_impl(case, "tf.v1")


def test_every_builtin_declares_the_whole_layer_vocabulary_and_undeclared_layers_are_refused(monkeypatch):
    """The built-ins build every layer type the case format knows (docs/layers.md): a type added to the
    contract without being declared by the engines fails here. A layer an engine does not declare is
    refused before anything runs, in one line naming the nested layer."""
    import dataclasses

    from parity_tests.contract.case import case_from_dict
    from parity_tests.contract.model import LAYER_TYPES
    from parity_tests.protocol.errors import CaseError
    from parity_tests.running.builtins import SPECS
    from parity_tests.running.harness import check_dtypes
    from parity_tests.tests.helpers import MLP

    for s in SPECS:
        assert set(s.layers) == set(LAYER_TYPES), s.name
    found = registry.resolve("torch.single")
    narrowed = dataclasses.replace(found, spec=dataclasses.replace(found.spec, layers=("dense", "residual")))
    monkeypatch.setitem(registry._registry, "torch.single", narrowed)
    layers = [{"type": "residual", "body": [{"type": "dense", "units": 5}, {"type": "layer_norm", "epsilon": 1e-5}]},
              {"type": "dense", "units": 1}]
    case = case_from_dict(dict(MLP, steps=1, model=dict(MLP["model"], layers=layers)))
    with pytest.raises(CaseError, match=r"model\.layers\[0\]\.body\[1\]\.type: expected one of the layers torch\.single"):
        check_dtypes(case, ["torch.single"])
    plain = case_from_dict(dict(MLP, steps=1, model=dict(MLP["model"], layers=[{"type": "dense", "units": 1}])))
    check_dtypes(plain, ["torch.single"])
