"""Tests for parity_tests.judging.loss_channel: the loss judged beside the parameters, with its carried term."""

from __future__ import annotations

import json

import numpy as np

from parity_tests.judging.bounds import FLOAT32_ABS_FLOOR, FLOAT64_RTOL
from parity_tests.judging.rules import judge_float32, judge_float64
from parity_tests.judging.verdict import (
    RULE_FLOAT32,
    RULE_FLOAT64,
)
from parity_tests.tests.synthetic_runs import (
    STEPS,
    copy,
    f32_runs,
    jitter,
    truth,
)


def test_grad_is_not_judged_by_default_but_the_loss_is() -> None:
    a = truth()
    b = copy(a)
    b["grad/0.kernel"] *= 1 + 1e-3
    assert judge_float64(a, b).status == "parity"  # a gradient alone does not decide
    b["loss"][2:] *= 1 + 1e-3
    v = judge_float64(a, b)
    assert (v.status, v.rule, v.key, v.first_step) == ("divergence", RULE_FLOAT64, "loss", 3)  # loss row 2 is step 3
    assert "first at step 3 (loss)" in v.detail and "step 3, loss: Mismatched elements: 1 / 1" in v.detail
    assert v.per_step_loss_gap is not None and v.per_step_loss_gap.shape == (STEPS,)
    json.dumps(v.to_dict(), allow_nan=False)
    assert judge_float64(a, b, loss=False).status == "parity"
    v = judge_float64(a, b, keys=["grad/0.kernel"])
    assert (v.status, v.first_step) == ("divergence", 1)  # grad row 0 is step 1
    assert "first at step 1 (grad 0.kernel)" in v.detail
    v = judge_float64(a, b, keys=["grad/0.kernel", "param/0.kernel"])
    assert v.status == "error" and "do not share one step axis" in v.detail



def test_the_channel_that_breaks_first_names_the_key() -> None:
    a = truth()
    b = jitter(a, 1e-14, seed=1)
    b["param/1.kernel"][3:] *= 1 + 1e-6  # parameters after step 3
    b["loss"][4:] *= 1 + 1e-2  # the loss of step 5, far beyond what the parameter gap explains
    v = judge_float64(a, b)
    assert (v.key, v.first_step) == ("param/1.kernel", 3)
    assert "the loss is also over its bound from step 5" in v.detail
    b["loss"][2] *= 1 + 1e-6  # the loss of step 3 comes before the update of step 3
    v = judge_float64(a, b)
    assert (v.key, v.first_step, v.step) == ("loss", 3, v.step) and v.gap > v.bound
    assert "parameters: float64: relative gap" in v.detail



def test_loss_bound_carries_the_parameter_gap_through_the_recorded_gradient() -> None:
    # L(theta) = sum_p c_p . theta_p: exactly linear, so its gradient c is the sensitivity and the
    # loss gap caused by a parameter gap is S * pgap, which the bound must admit (and not much more)
    a = truth()
    c = {k: np.random.default_rng(7).normal(size=a[k].shape[1:]) for k in a if k.startswith("param/")}
    for t in (a,):
        t["loss"] = 10.0 + sum((t[k][:-1] * c[k]).reshape(STEPS, -1).sum(axis=1) for k in c)
        for k in c:
            t[f"grad/{k[6:]}"] = np.broadcast_to(c[k], (STEPS, *c[k].shape)).copy()
    b = copy(a)
    b["param/0.kernel"][1:] *= 1 + 5e-11  # a parameter gap within the float64 bound
    b["loss"] = 10.0 + sum((b[k][:-1] * c[k]).reshape(STEPS, -1).sum(axis=1) for k in c)
    v = judge_float64(a, b)
    assert v.status == "parity", v.detail
    assert v.per_step_loss_gap is not None and v.per_step_loss_bound is not None
    assert (v.per_step_loss_gap[1:] <= v.per_step_loss_bound[1:]).all()
    assert (v.per_step_loss_bound[1:] > FLOAT64_RTOL).all()  # the carried part is in the bound
    b["loss"][3] *= 1 + 1e-8  # a wrongly evaluated loss is still caught
    assert judge_float64(a, b).key == "loss"
    for k in c:  # without gradients the float64 rule cannot bound the carried part: it says so
        del a[f"grad/{k[6:]}"], b[f"grad/{k[6:]}"]
    v = judge_float64(a, b)
    assert v.status == "parity" and "no recorded gradient bounds its sensitivity" in v.detail



def test_float32_loss_is_judged_against_its_own_floor() -> None:
    # equal and opposite float32 errors of the loss only: the factor 2 is tight for the loss too
    a64 = truth()
    eps = 1e-4
    a32 = {k: v.astype(np.float32) for k, v in a64.items()}
    b32 = {k: v.astype(np.float32) for k, v in a64.items()}
    a32["loss"], b32["loss"] = (a64["loss"] * (1 + eps)).astype(np.float32), (a64["loss"] * (1 - eps)).astype(np.float32)
    v = judge_float32(a32, b32, a64=a64, b64=copy(a64))
    assert v.status == "parity" and v.per_step_loss_gap is not None and v.per_step_loss_bound is not None
    assert (v.per_step_loss_gap > 0.99 * (v.per_step_loss_bound - FLOAT32_ABS_FLOOR)).all()
    v = judge_float32(a32, b32, a64=a64, b64=copy(a64), factor=1.9)
    assert (v.status, v.rule, v.key, v.first_step) == ("divergence", RULE_FLOAT32, "loss", 1)
    assert "step 1, loss: Mismatched elements: 1 / 1" in v.detail
    # a loss offset in float32 only is charged to that side's floor (the documented limit) ...
    a32, b32, a64, b64 = f32_runs()
    b32["loss"][1:] *= np.float32(1 + 1e-3)
    v = judge_float32(a32, b32, a64=a64, b64=copy(a64))
    assert v.status == "parity" and "B up to 1.00e-03" in v.detail
    # ... while the same bug in both precisions is proven by the float64 rule, on the loss
    for t in (b32, b64):  # the same bug in both precisions: the float64 rule proves it
        t["loss"][1:] *= np.asarray(1 + 1e-3, dtype=t["loss"].dtype)
    v = judge_float32(a32, b32, a64=a64, b64=b64)
    assert (v.status, v.rule, v.key, v.first_step) == ("divergence", RULE_FLOAT64, "loss", 2)

