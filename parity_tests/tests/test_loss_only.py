"""Would the loss have shown it (``parity_tests.judging.loss_only``): flagged where the loss parts, reasons where not."""

from __future__ import annotations

import numpy as np

from parity_tests.judging.loss_only import attach, loss_only

A = np.array([0.70, 0.65, 0.61, 0.58])


def test_a_loss_that_parts_is_flagged_at_its_first_step():
    out = loss_only(A, A * np.array([1.0, 1.0, 1.01, 1.02]))
    assert out["detectable"] and out["first_step"] == 3 and out["why_not"] == []


def test_the_atol_and_rtol_rule_of_assert_allclose():
    # 1.5e-3 absolute on a loss of 0.7: over rtol 1e-3 alone (7e-4) but within atol + rtol |a| (1.7e-3)
    assert not loss_only(A, A + 1.5e-3)["detectable"]
    assert loss_only(A, A + 2e-3)["detectable"]
    assert loss_only(A, np.array([0.70, np.nan, 0.61, 0.58]))["detectable"]   # a NaN loss is flagged


def test_adams_scale_invariance_is_named_for_a_scaled_gradient():
    where = {"first_bad_step": 1, "stage": "combined_grads", "factor": {"text": "combined gradients 0.250x ..."}}
    out = loss_only(A, A * (1 + 1e-9), where=where, spec={"optimizer": {"name": "adamw"}})
    assert not out["detectable"] and "invariant to a constant gradient scale" in out["why_not"][0]
    sgd = loss_only(A, A * (1 + 1e-9), where=where, spec={"optimizer": {"name": "sgd"}})
    assert not any("invariant" in w for w in sgd["why_not"])                  # SGD is not scale invariant


def test_a_growing_gap_says_too_few_steps_and_when_it_would_cross():
    out = loss_only(A, A * (1 + np.array([0.0, 1e-6, 1e-5, 1e-4])))
    assert not out["detectable"]
    assert any(w.startswith("too few steps: the loss gap grows about 10x a step") and "about 1 more step(s)" in w
               for w in out["why_not"])


def test_a_bug_at_the_last_update_cannot_show_in_the_loss():
    out = loss_only(A, A, where={"first_bad_step": 4, "stage": "update"})
    assert "the run's last" in out["why_not"][0]


def test_attach_adds_the_field_and_needs_both_losses():
    where = {"first_bad_step": 1, "stage": "loss"}
    assert attach(where, {"loss": A}, {"loss": A * 1.1}, None)["loss_only"]["detectable"]
    assert "loss_only" not in attach(where, {}, {"loss": A}, None)
