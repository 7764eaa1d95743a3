"""Tests for parity_tests.judging.verdict: the statuses a prediction and known differences make of a rule's result, and the verdict's JSON form."""

from __future__ import annotations

import json

import numpy as np
import pytest

from parity_tests.judging.rules import judge_float32, judge_float64
from parity_tests.judging.verdict import (
    RULE_FLOAT32,
    RULE_FLOAT64,
    Verdict,
)
from parity_tests.tests.synthetic_runs import (
    f32_runs,
    jitter,
    truth,
)


@pytest.mark.parametrize(
    ("rel", "status"),
    [
        pytest.param(1e-6, "expected_difference", id="predicted-and-found"),
        pytest.param(1e-14, "unexpected_parity", id="predicted-not-found"),
    ],
)
def test_float64_expectations(rel, status) -> None:
    a = truth()
    v = judge_float64(a, jitter(a, rel, seed=3), expect_difference=True)
    assert v.status == status and v.rule == RULE_FLOAT64



def test_known_differences_are_carried_and_named() -> None:
    a = truth()
    known = ("Keras keeps learning_rate in float32",)
    v = judge_float64(a, jitter(a, 1e-7, seed=4), known_differences=known)
    assert v.status == "divergence"
    assert v.known_differences == known
    assert (
        "known differences attached: Keras keeps learning_rate in float32"
        in v.detail.splitlines()[0]
    )
    d = v.to_dict()
    assert d["known_differences"] == list(known) and d["status"] == "divergence"
    json.dumps(d, allow_nan=False)



@pytest.mark.parametrize(
    ("perturb", "status", "rule"),
    [
        pytest.param(True, "expected_difference", RULE_FLOAT64, id="predicted-and-found"),
        pytest.param(False, "unexpected_parity", RULE_FLOAT32, id="predicted-not-found"),
    ],
)
def test_float32_expectations(perturb, status, rule) -> None:
    a32, b32, a64, b64 = f32_runs()
    if perturb:
        for t in (b32, b64):
            t["param/0.bias"][1:] += np.asarray(1e-3, dtype=t["param/0.bias"].dtype)
    v = judge_float32(a32, b32, a64=a64, b64=b64, expect_difference=True)
    assert (v.status, v.rule) == (status, rule)



def test_to_dict_and_from_dict_round_trip_non_finite_figures() -> None:
    a = truth()
    b = jitter(a, 1e-14, seed=5)
    b["param/1.bias"][2:] = np.inf
    v = judge_float64(a, b, known_differences=("a note",))
    assert v.gap == np.inf
    d = json.loads(json.dumps(v.to_dict(), allow_nan=False))
    assert d["gap"] == "inf"
    back = Verdict.from_dict(d)
    assert back.to_dict() == v.to_dict()
    assert back.diverged and not judge_float64(a, a).diverged
