"""``running.room``: whether a case's TensorFlow and torch runs go beside each other, and that the compare obeys it."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from parity_tests.running import room
from parity_tests.session import comparison, executor
from parity_tests.session.comparison import compare_case
from parity_tests.tests.helpers import MLP, make

#: the MLP's values, counted by hand: kernel 5x10 and bias 10, kernel 10x1 and bias 1
MLP_PARAMETERS = 5 * 10 + 10 + 10 * 1 + 1


def test_the_estimates_count_float64_copies_of_the_parameters():
    case = make(MLP, parallel__devices=2)
    assert room.parameters(case) == MLP_PARAMETERS
    # TensorFlow: variables, Adam's two moments, 2 towers' gradients and their mean, the capture's stack
    assert room.tf_bytes(case) == room.TF_BASE + (2 + 8) * 8 * MLP_PARAMETERS
    # torch, per rank: model, bucket views, Adam's moments, activations, capture copies in flight
    assert room.torch_bytes(case) == 2 * (room.TORCH_BASE + 7 * 8 * MLP_PARAMETERS)
    assert room.tf_bytes(make(MLP, parallel__devices=4)) - room.tf_bytes(case) == 2 * 8 * MLP_PARAMETERS


def test_the_two_fit_beside_each_other_within_the_share_of_what_is_available():
    case = make(MLP, parallel__devices=2)
    need = room.tf_bytes(case) + room.torch_bytes(case)
    assert room.fits_beside(case, available=need / room.SHARE)
    assert not room.fits_beside(case, available=need / room.SHARE * 0.99)
    assert room.fits_beside(case)  # a 71-value model, on any machine that runs the suite


@pytest.mark.usefixtures("pool")
def test_runs_that_do_not_fit_go_one_after_another_with_the_same_verdict(monkeypatch):
    case = make(MLP, parallel__devices=2, dtype="float32")
    calls: list[int] = []
    real = executor._beside

    def spy(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(executor, "_beside", spy)
    together = compare_case(case, ["tf.towers", "torch.ddp"])
    assert calls, "a small case's TensorFlow and torch runs go beside each other"
    calls.clear()
    monkeypatch.setattr(comparison, "fits_beside", lambda c: False)
    alone = compare_case(case, ["tf.towers", "torch.ddp"])
    assert not calls, "runs that do not fit went beside each other"
    a, b = together.pairs[0].verdict, alone.pairs[0].verdict
    assert (a.status, a.rule, a.step, a.key) == (b.status, b.rule, b.step, b.key)
    np.testing.assert_array_equal(a.per_step_gap, b.per_step_gap)


@pytest.mark.usefixtures("pool")
def test_the_user_is_told_when_runs_go_one_after_another(monkeypatch, caplog):
    """Through the ``tfpar`` logger (the command shows its INFO lines on stderr)."""
    case = make(MLP, parallel__devices=2)
    with caplog.at_level(logging.INFO, logger="tfpar"):
        compare_case(case, ["tf.towers", "torch.ddp"])
    assert "one after another" not in caplog.text
    monkeypatch.setattr(comparison, "fits_beside", lambda c: False)
    with caplog.at_level(logging.INFO, logger="tfpar"):
        compare_case(case, ["tf.towers", "torch.ddp"])
    said = [r for r in caplog.records if "one after another" in r.getMessage()]
    assert [r.name for r in said] == ["tfpar.session"]
    line = said[0].getMessage()
    assert line.startswith("mlp: TensorFlow and torch runs one after another, not beside each other: together about")
    assert line.endswith("GB available (docs/memory.md)")
