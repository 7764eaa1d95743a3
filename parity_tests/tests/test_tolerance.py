"""Tests for parity_tests.judging.tolerance: the float64 bound, the float32 noise floor, the statuses."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from parity_tests.judging.tolerance import (
    FLOAT32_ABS_FLOOR,
    FLOAT64_RTOL,
    RULE_FLOAT32,
    RULE_FLOAT64,
    RULE_NONFINITE,
    RULE_PERTURBATION,
    RULE_STRUCTURE,
    judge_float32,
    judge_float64,
    judge_perturbation,
    perturb_ulp,
)

STEPS = 6
SHAPES = {"0.kernel": (3, 5), "0.bias": (5,), "1.kernel": (5, 2), "1.bias": (2,)}
Traj = dict[str, np.ndarray]


def truth(seed: int = 0, steps: int = STEPS) -> Traj:
    """A float64 'exact' trajectory: O(1) parameters moved by small updates, zero-initialised biases."""
    rng = np.random.default_rng(seed)
    traj: Traj = {"loss": rng.random(steps) + 0.5}
    for name, shape in SHAPES.items():
        start = np.zeros(shape) if name.endswith("bias") else rng.normal(size=shape)
        updates = 0.01 * rng.normal(size=(steps, *shape))
        traj[f"param/{name}"] = np.concatenate([start[None], start + np.cumsum(updates, axis=0)])
        traj[f"grad/{name}"] = updates / 0.01
    traj["state/2.moving_mean"] = 0.5 + 0.1 * rng.normal(size=(steps + 1, 2))
    return traj


def jitter(traj: Traj, rel: float, seed: int, dtype: type = np.float64) -> Traj:
    """Elementwise relative noise of size ~rel (rounding-like, random sign), then cast."""
    rng = np.random.default_rng(seed)
    return {
        k: (v * (1 + rel * rng.uniform(-1, 1, size=v.shape))).astype(dtype) for k, v in traj.items()
    }


def copy(traj: Traj) -> Traj:
    return {k: v.copy() for k, v in traj.items()}


# ---------------------------------------------------------------- float64 rule


def test_float64_rounding_sized_gap_is_parity() -> None:
    a = truth()
    b = jitter(a, 1e-14, seed=1)
    v = judge_float64(a, b)
    assert (v.status, v.rule) == ("parity", RULE_FLOAT64)
    assert 1e-16 < v.gap <= 1e-14 and v.bound == FLOAT64_RTOL
    assert v.per_step_gap.shape == (STEPS + 1,)
    assert v.detail.startswith("float64: greatest relative gap ")
    assert "<= bound 1e-10" in v.detail


def test_float64_semantic_gap_is_divergence_with_place() -> None:
    a = truth()
    b = jitter(a, 1e-14, seed=1)
    b["param/1.kernel"][3:, 4, 0] *= 1 + 1e-6
    v = judge_float64(a, b)
    assert (v.status, v.rule) == ("divergence", RULE_FLOAT64)
    assert v.first_step == 3 and v.key == "param/1.kernel"
    assert v.gap > v.bound == FLOAT64_RTOL
    assert 1e-8 < v.gap < 1e-6
    assert (v.per_step_gap[:3] < 1e-13).all() and (v.per_step_gap[3:] > FLOAT64_RTOL).all()
    assert "first at step 3 (param 1.kernel)" in v.detail
    assert "step 3, param 1.kernel: Mismatched elements: 1 / 10 (10.0%)" in v.detail
    assert "at index (4, 0)" in v.detail


def test_float64_judge_is_symmetric() -> None:
    a = truth()
    b = jitter(a, 1e-7, seed=2)
    va, vb = judge_float64(a, b), judge_float64(b, a)
    assert va.status == vb.status == "divergence"
    assert va.gap == vb.gap


def test_zero_initialised_bias_is_measured_against_the_scale_floor() -> None:
    # row 0 of a bias is exactly zero; a residue of 1e-15 there is rounding, not a divergence
    a = truth()
    b = copy(a)
    b["param/0.bias"][0, 2] = 1e-15
    assert judge_float64(a, b).status == "parity"
    b["param/0.bias"][0, 2] = 1e-9  # but 1e-9 absolute is 1e-7 of the 1e-2 floor
    v = judge_float64(a, b)
    assert v.status == "divergence" and v.first_step == 0 and v.key == "param/0.bias"


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


# ---------------------------------------------------------------- float32 rule


def f32_runs(seed: int = 0, noise: float = 2e-6) -> tuple[Traj, Traj, Traj, Traj]:
    """(a32, b32, a64, b64): float64 runs equal up to rounding, float32 runs each with its own noise."""
    a64 = truth(seed)
    b64 = jitter(a64, 1e-15, seed=seed + 100)
    a32 = jitter(a64, noise, seed=seed + 200, dtype=np.float32)
    b32 = jitter(b64, noise, seed=seed + 300, dtype=np.float32)
    return a32, b32, a64, b64


def test_float32_noise_within_floors_is_parity() -> None:
    a32, b32, a64, b64 = f32_runs()
    v = judge_float32(a32, b32, a64=a64, b64=b64)
    assert (v.status, v.rule) == ("parity", RULE_FLOAT32)
    assert v.floor_a is not None and v.floor_b is not None
    assert 1e-7 < v.floor_a < 1e-5 and 1e-7 < v.floor_b < 1e-5
    assert v.gap <= v.bound
    assert v.per_step_floor is not None and v.per_step_bound is not None
    np.testing.assert_allclose(v.per_step_bound, 2 * v.per_step_floor + FLOAT32_ABS_FLOOR)
    assert "float32: relative gap" in v.detail and "float64 runs agree" in v.detail
    json.dumps(v.to_dict(), allow_nan=False)


def test_float32_systematic_offset_of_ten_floors_is_a_divergence() -> None:
    # The offset is a semantic difference: it is there in both precisions, so the
    # float64 runs prove it and that rule decides; the detail says it shows in float32.
    a32, b32, a64, b64 = f32_runs()
    floor = judge_float32(a32, b32, a64=a64, b64=b64).floor_b
    assert floor is not None
    offset = 10 * floor
    for t in (b32, b64):
        t["param/1.kernel"][2:] += np.asarray(offset, dtype=t["param/1.kernel"].dtype)
    v = judge_float32(a32, b32, a64=a64, b64=b64)
    assert (v.status, v.rule, v.first_step) == ("divergence", RULE_FLOAT64, 2)
    assert "visible in float32 from step 2" in v.detail


def test_float32_below_noise_semantic_difference_is_named_as_such() -> None:
    a32, b32, a64, b64 = f32_runs()
    b64 = copy(b64)
    b64["param/0.kernel"][1:] *= 1 + 1e-9  # proven by float64, invisible under float32 rounding
    v = judge_float32(a32, b32, a64=a64, b64=b64)
    assert (v.status, v.rule) == ("divergence", RULE_FLOAT64)
    assert "below the float32 noise at every step" in v.detail


def test_offset_in_one_float32_run_only_is_charged_to_its_floor() -> None:
    # The documented limit: with floors measured against each side's own float64 run,
    # a float32-only offset raises that side's floor; the verdict shows the lopsided floors.
    a32, b32, a64, b64 = f32_runs()
    b32["param/1.kernel"][2:] += np.float32(1e-4)
    v = judge_float32(a32, b32, a64=a64, b64=b64)
    assert v.status == "parity"
    assert v.floor_a is not None and v.floor_b is not None and v.floor_b > 10 * v.floor_a


def test_factor_two_is_tight_for_equal_and_opposite_errors() -> None:
    a64 = truth()
    eps = 1e-4  # >> FLOAT32_ABS_FLOOR, so the factor alone decides
    a32 = {k: (v * (1 + eps)).astype(np.float32) for k, v in a64.items()}
    b32 = {k: (v * (1 - eps)).astype(np.float32) for k, v in a64.items()}
    v = judge_float32(a32, b32, a64=a64, b64=copy(a64))
    assert v.status == "parity"
    # the gap really reaches twice the floor: only the absolute floor separates it from the bound
    assert (
        (v.bound - FLOAT32_ABS_FLOOR) * (1 + 1e-12) >= v.gap > 0.99 * (v.bound - FLOAT32_ABS_FLOOR)
    )
    low = judge_float32(a32, b32, a64=a64, b64=copy(a64), factor=1.9)
    assert (low.status, low.rule) == ("divergence", RULE_FLOAT32)
    assert low.gap > low.bound
    assert "float32: relative gap" in low.detail and "Mismatched elements" in low.detail


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


def test_float32_non_finite_on_one_side() -> None:
    a32, b32, a64, b64 = f32_runs()
    a32["param/0.kernel"][5:] = np.inf
    v = judge_float32(a32, b32, a64=a64, b64=b64)
    assert (v.status, v.rule, v.first_step) == ("divergence", RULE_NONFINITE, 5)
    assert "side A becomes Inf at step 5 (param 0.kernel) while side B stays finite" in v.detail


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        pytest.param(
            {"factor": 0.0}, ValueError, "factor must be finite and > 0", id="zero-factor"
        ),
        pytest.param(
            {"factor": float("nan")}, ValueError, "factor must be finite and > 0", id="nan-factor"
        ),
        pytest.param({"factor": "2"}, TypeError, "factor must be a real number", id="str-factor"),
        pytest.param({"known_differences": [3]}, TypeError, "known_differences", id="bad-known"),
    ],
)
def test_float32_argument_validation(kwargs, error, pattern) -> None:
    a32, b32, a64, b64 = f32_runs()
    with pytest.raises(error, match=pattern):
        judge_float32(a32, b32, a64=a64, b64=b64, **kwargs)


def test_float32_judge_checks_dtypes_and_structure() -> None:
    a32, b32, a64, b64 = f32_runs()
    with pytest.raises(ValueError, match=r"side A32, param/0\.bias: expected float32"):
        judge_float32(a64, b32, a64=a64, b64=b64)
    del a64["state/2.moving_mean"]
    v = judge_float32(a32, b32, a64=a64, b64=b64)
    assert (v.status, v.rule) == ("error", RULE_STRUCTURE)
    assert "state/2.moving_mean" in v.detail


@given(
    seed=st.integers(0, 2**16),
    noise_a=st.floats(0.0, 1e-3),
    noise_b=st.floats(0.0, 1e-3),
)
def test_float32_rule_never_calls_rounding_a_divergence(seed, noise_a, noise_b) -> None:
    # Triangle inequality: with identical float64 runs, any float32 noise whatsoever
    # stays within 2 * max(floor_A, floor_B) + FLOAT32_ABS_FLOOR.
    a64 = truth(seed, steps=3)
    a32 = jitter(a64, noise_a, seed=seed + 1, dtype=np.float32)
    b32 = jitter(a64, noise_b, seed=seed + 2, dtype=np.float32)
    v = judge_float32(a32, b32, a64=a64, b64=copy(a64))
    assert v.status == "parity", v.detail
    assert v.gap <= v.bound


# ---------------------------------------------------------------- perturbation floor


def test_perturb_ulp_moves_every_element_by_one_float32_ulp_seeded() -> None:
    init = {"0.kernel": np.random.default_rng(0).normal(size=(4, 3)), "0.bias": np.zeros(3)}
    p = perturb_ulp(init, seed=5)
    k32 = init["0.kernel"].astype(np.float32)
    moved = p["0.kernel"].astype(np.float32)
    assert p["0.kernel"].dtype == np.float64 and (moved.astype(np.float64) == p["0.kernel"]).all()
    ups = moved == np.nextafter(k32, np.float32(np.inf))
    downs = moved == np.nextafter(k32, np.float32(-np.inf))
    assert (ups | downs).all() and ups.any() and downs.any()
    assert (p["0.bias"] == 0).all()  # an exact zero is not rounded by storage: it stays
    assert all((perturb_ulp(init, seed=5)[k] == p[k]).all() for k in p)  # reproducible
    assert not (perturb_ulp(init, seed=6)["0.kernel"] == p["0.kernel"]).all()


def perturbation_runs(seed: int = 0, noise: float = 2e-6) -> tuple[Traj, Traj, Traj, Traj]:
    """(a32, b32, a32p, b32p): each side's rounding noise, and its perturbed rerun's independent noise."""
    a64 = truth(seed)
    return tuple(jitter(a64, noise, seed=seed + s, dtype=np.float32) for s in (200, 300, 400, 500))  # type: ignore[return-value]


def test_perturbation_floor_parity_and_figures() -> None:
    a32, b32, a32p, b32p = perturbation_runs()
    v = judge_perturbation(a32, b32, a32p=a32p, b32p=b32p)
    assert (v.status, v.rule) == ("parity", RULE_PERTURBATION), v.detail
    assert v.floor_a is not None and 1e-7 < v.floor_a < 1e-5
    assert v.per_step_floor is not None and v.per_step_bound is not None
    np.testing.assert_allclose(v.per_step_bound, 2 * v.per_step_floor + FLOAT32_ABS_FLOOR)
    assert "one-ulp perturbation" in v.detail
    json.dumps(v.to_dict(), allow_nan=False)


def test_perturbation_floor_catches_what_is_above_float32_noise() -> None:
    # a bug is reproduced by the buggy side's perturbed rerun too
    a32, b32, a32p, b32p = perturbation_runs()
    for t in (b32, b32p):
        t["param/1.kernel"][3:] *= np.float32(1 + 1e-3)
    v = judge_perturbation(a32, b32, a32p=a32p, b32p=b32p)
    assert (v.status, v.rule, v.first_step, v.key) == ("divergence", RULE_PERTURBATION, 3, "param/1.kernel")
    a32, b32, a32p, b32p = perturbation_runs()
    for t in (b32, b32p):
        t["loss"][1:] *= np.float32(1 + 1e-3)
    v = judge_perturbation(a32, b32, a32p=a32p, b32p=b32p, expect_difference=True)
    assert (v.status, v.key, v.first_step) == ("expected_difference", "loss", 2)


def test_a_side_that_cannot_rerun_takes_the_other_sides_floor() -> None:
    a32, b32, a32p, _ = perturbation_runs()
    v = judge_perturbation(a32, b32, a32p=a32p, b32p=None)
    assert v.status == "parity" and v.floor_a == v.floor_b
    assert "side B cannot be re-run" in v.detail
    with pytest.raises(ValueError, match="needs a perturbed run"):
        judge_perturbation(a32, b32, a32p=None, b32p=None)
    with pytest.raises(ValueError, match=r"side A32 perturbed, param/0\.bias: expected float32"):
        judge_perturbation(a32, b32, a32p=truth(), b32p=None)
