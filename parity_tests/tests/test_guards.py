"""Tests for parity_tests.judging.guards: structure, dtypes and non-finite values on both rules."""

from __future__ import annotations

import json

import numpy as np
import pytest

from parity_tests.judging.bounds import FLOAT64_RTOL
from parity_tests.judging.rules import judge_float32, judge_float64
from parity_tests.judging.verdict import (
    RULE_FLOAT64,
    RULE_NONFINITE,
    RULE_STRUCTURE,
)
from parity_tests.tests.synthetic_runs import (
    copy,
    f32_runs,
    jitter,
    truth,
)


def test_float64_judge_rejects_float32_arrays() -> None:
    a = truth()
    with pytest.raises(
        ValueError, match=r"side B, param/0\.bias: expected float64 values, got float32"
    ):
        judge_float64(a, jitter(a, 0.0, seed=0, dtype=np.float32))



def test_structure_problems_are_errors() -> None:
    a = truth()
    b = copy(a)
    del b["param/1.bias"]
    v = judge_float64(a, b)
    assert (v.status, v.rule) == ("error", RULE_STRUCTURE)
    assert "param/1.bias" in v.detail and "side B" in v.detail
    b = copy(a)
    b["param/1.kernel"] = b["param/1.kernel"][:, :, :1]
    v = judge_float64(a, b)
    assert v.status == "error" and "side A (7, 5, 2), side B (7, 5, 1)" in v.detail
    json.dumps(v.to_dict(), allow_nan=False)



def test_non_finite_values() -> None:
    a = truth()
    b = jitter(a, 1e-14, seed=5)
    for t in (a, b):
        t["param/0.kernel"][4:] = np.nan
    v = judge_float64(a, b)
    assert (v.status, v.rule, v.step) == ("error", RULE_NONFINITE, 4)
    assert "both trajectories are NaN from step 4 (param 0.kernel) on" in v.detail
    assert v.gap < FLOAT64_RTOL  # the figures before the NaN are still reported

    b = jitter(truth(), 1e-14, seed=5)
    b["param/1.bias"][2:] = np.inf
    v = judge_float64(truth(), b)
    assert (v.status, v.rule, v.first_step, v.gap) == ("divergence", RULE_NONFINITE, 2, np.inf)
    assert "side B becomes Inf at step 2 (param 1.bias) while side A stays finite" in v.detail
    json.dumps(v.to_dict(), allow_nan=False)

    # a divergence before the blow-up is reported by the float64 rule
    a, b = truth(), truth()
    b["param/0.bias"][1:] += 1e-3
    for t in (a, b):
        t["param/0.kernel"][4:] = np.nan
    v = judge_float64(a, b)
    assert (v.status, v.rule, v.first_step) == ("divergence", RULE_FLOAT64, 1)



def test_float32_non_finite_on_one_side() -> None:
    a32, b32, a64, b64 = f32_runs()
    a32["param/0.kernel"][5:] = np.inf
    v = judge_float32(a32, b32, a64=a64, b64=b64)
    assert (v.status, v.rule, v.first_step) == ("divergence", RULE_NONFINITE, 5)
    assert "side A becomes Inf at step 5 (param 0.kernel) while side B stays finite" in v.detail



def test_float32_judge_checks_dtypes_and_structure() -> None:
    a32, b32, a64, b64 = f32_runs()
    with pytest.raises(ValueError, match=r"side A32, param/0\.bias: expected float32"):
        judge_float32(a64, b32, a64=a64, b64=b64)
    del a64["state/2.moving_mean"]
    v = judge_float32(a32, b32, a64=a64, b64=b64)
    assert (v.status, v.rule) == ("error", RULE_STRUCTURE)
    assert "state/2.moving_mean" in v.detail

