"""Optimizers and hyperparameters only plugins know (issue 26, item 4): kept as data, refused by the built-ins."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from parity_tests.cli import main
from parity_tests.contract.case import case_from_dict
from parity_tests.contract.optimizer import builtin_refusal
from parity_tests.judging.theory import predict
from parity_tests.protocol.errors import CaseError
from parity_tests.protocol.optimizer_state import plugins_only
from parity_tests.tests.helpers import MLP, set_path

HERE = Path(__file__).resolve().parent / "plugins"
TF = f"{HERE / 'adadelta_tf.py'}:towers"
TORCH = f"{HERE / 'adadelta_torch.py'}:ddp"
ADADELTA = {"name": "adadelta", "lr": 1.0, "rho": 0.9, "epsilon": 1e-6}

pytestmark = pytest.mark.usefixtures("pool")


def _file(tmp_path: Path, optimizer: dict, **changes) -> str:
    raw = set_path(MLP, "optimizer", optimizer)
    for k, v in changes.items():
        raw = set_path(raw, k, v)
    p = tmp_path / "case.json"
    p.write_text(json.dumps(raw))
    return str(p)


@pytest.mark.parametrize(("optimizer", "kept"), [
    (ADADELTA, {"rho": 0.9, "epsilon": 1e-6}),
    ({"name": "sgd", "lr": 0.1, "dampening": 0.5}, {"dampening": 0.5}),   # a hyperparameter SGD does not take here
    ({"name": "sgd", "lr": 0.1, "momentum": 0.9}, {"momentum": 0.9}),
    ({"name": "lion", "lr": 1e-4, "betas": "0.9,0.99", "decoupled": True}, {"betas": "0.9,0.99", "decoupled": True}),
])
def test_the_case_keeps_what_the_builtins_do_not_know_as_data(optimizer, kept):
    spec = case_from_dict(set_path(MLP, "optimizer", optimizer)).spec["optimizer"]
    assert plugins_only(spec)
    assert {k: spec[k] for k in kept} == kept and spec["lr"] == optimizer["lr"] and spec["name"] == optimizer["name"]
    assert builtin_refusal(spec, "torch.ddp") is not None


def test_a_known_optimizer_is_validated_and_filled_in_as_before():
    spec = case_from_dict(set_path(MLP, "optimizer", {"name": "momentum", "lr": 0.1})).spec["optimizer"]
    assert not plugins_only(spec) and spec["momentum"] == 0.9 and builtin_refusal(spec, "tf.towers") is None


@pytest.mark.parametrize(("optimizer", "field"), [
    ({"name": "adadelta", "lr": -1.0}, "optimizer.lr"),
    ({"name": "adadelta"}, "optimizer.lr"),
    ({"name": "adadelta", "lr": 1.0, "rho": [0.9]}, "optimizer.rho"),
    ({"name": "adadelta", "lr": 1.0, "rho": float("inf")}, "optimizer.rho"),
    ({"name": "adadelta", "lr": 1.0, "semantics": "jax"}, "optimizer.semantics"),
    ({"name": "ada delta", "lr": 1.0}, "optimizer.name"),  # not a name: the built-ins' list is what is expected
])
def test_what_plugins_cannot_take_either_is_still_bad_input(optimizer, field):
    with pytest.raises(CaseError) as e:
        case_from_dict(set_path(MLP, "optimizer", optimizer))
    assert e.value.field == field and "\n" not in str(e.value)


@pytest.mark.parametrize(("optimizer", "impls", "field"), [
    (ADADELTA, f"{TF},torch.ddp", "optimizer.name"),
    (ADADELTA, f"tf.towers,{TORCH}", "optimizer.name"),
    ({"name": "sgd", "lr": 0.1, "dampening": 0.5}, f"{TF},torch.single", "optimizer.dampening"),
])
def test_a_builtin_among_the_implementations_refuses_it_in_one_line_exit_2(tmp_path, capsys, optimizer, impls, field):
    assert main(["compare", _file(tmp_path, optimizer), "--impls", impls]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"tfpar: error: {field}: expected "), err
    assert "for the built-in" in err[0] and "all plugins" in err[0]


def test_theory_says_it_predicts_nothing_about_it():
    spec = case_from_dict(set_path(MLP, "optimizer", ADADELTA)).spec
    pred = predict(spec, TF, TORCH)
    assert pred.expected == () and pred.known == ()
    assert any("theory predicts nothing" in k and "adadelta" in k for k in pred.absent), pred.absent


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_two_plugins_run_an_optimizer_only_they_know(tmp_path, capsys, dtype):
    status = main(["compare", _file(tmp_path, ADADELTA, dtype=dtype, steps=4), "--impls", f"{TF},{TORCH}"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "adadelta (native)" in out and "theory predicts nothing" in out and "verdict: PARITY" in out
