"""The factor (``parity_tests.judging.factor``): fires on exact scales, never on noise or non-constant ratios."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from parity_tests.judging.factor import (
    attach,
    common_factor,
    constant_ratio,
    describe,
    factor_of_arrays,
    name_in_setup,
    small_rational,
)

RNG = np.random.default_rng(37)
A = RNG.normal(size=(5, 10))


@pytest.mark.parametrize("c", [0.25, 8.0, 1 / 3, 2.0, -0.5, 7 / 4])
def test_an_exact_scale_is_found(c):
    assert constant_ratio(A, c * A) == pytest.approx(c, rel=1e-12)


def test_a_float32_rounded_scale_is_found():
    # the other side computed c*A in float32: a relative residual of at most 6e-8 (float32's unit roundoff)
    b = (A.astype(np.float32) * np.float32(1 / 3)).astype(np.float64)
    assert constant_ratio(A, b) == pytest.approx(1 / 3, rel=1e-6)


@pytest.mark.parametrize("b", [
    RNG.normal(size=(5, 10)),                                   # noise
    A * np.linspace(0.5, 2.0, 10),                              # a ratio that varies by column (per-row normaliser)
    A * 0.25 + 1e-3 * RNG.normal(size=(5, 10)),                 # a scale plus a difference of its own, 1e-3
], ids=["noise", "varying", "scale-plus-noise"])
def test_no_constant_ratio_where_there_is_none(b):
    assert constant_ratio(A, b) is None


def test_degenerate_arrays_carry_no_ratio():
    assert constant_ratio(np.zeros(3), np.ones(3)) is None
    assert constant_ratio(np.ones(3), np.ones(4)) is None
    assert constant_ratio(np.array([1.0, np.nan]), np.array([1.0, 2.0])) is None


def test_small_rationals():
    assert small_rational(0.25) == Fraction(1, 4)
    assert small_rational(8.0) == Fraction(8)
    assert small_rational(1 / 3 * (1 + 1e-8)) == Fraction(1, 3)
    assert small_rational(0.2500013) is None          # 5e-6 away from 1/4: over the 1e-6 allowance
    assert small_rational(np.pi) is None               # no p/q with p, q <= 64 within 1e-6
    assert small_rational(1 / 97) is None               # denominator over 64


def test_names_in_the_setup():
    assert name_in_setup(Fraction(1, 4), 4) == ["1/N"]
    assert name_in_setup(Fraction(8), 4, 2) == ["N x k"]
    assert name_in_setup(Fraction(2), 2, 2) == ["N", "k"]          # both name it: both are said
    assert name_in_setup(Fraction(4), 1, 1) == []                    # no devices, no accumulation: no name
    assert name_in_setup(Fraction(2), 4, 2) == ["k", "N/k"]


def test_describe_says_the_factor_as_the_issue_writes_it():
    d = describe(0.25, 4)
    assert d["exact"] == "1/4" and d["as"] == "1/N"
    assert d["text"] == "0.250x the reference's (1/N: 1 / ranks, N = 4)"
    d = describe(8.0, 4, 2)
    assert d["as"] == "N x k" and "ranks x accumulation steps, N = 4, k = 2" in d["text"]
    d = describe(1 / 3, 4)
    assert d["exact"] == "1/3" and d["as"] is None and "not a ratio of the set-up" in d["text"]
    assert describe(1.0 + 1e-9, 4) is None                             # a factor of 1 is no factor
    assert describe(np.pi, 4)["exact"] is None


def test_one_factor_over_parameters_or_one_per_parameter():
    a = {"0.kernel": A, "0.bias": A[0]}
    c, _ = common_factor(a, {"0.kernel": 0.25 * A, "0.bias": 0.25 * A[0]})
    assert c == pytest.approx(0.25)
    c, per = common_factor(a, {"0.kernel": 0.25 * A, "0.bias": 0.5 * A[0]})
    assert c is None and per["0.bias"] == pytest.approx(0.5)
    f = factor_of_arrays(a, {"0.kernel": 0.25 * A, "0.bias": 0.5 * A[0]}, "combined gradients", 4)
    assert f["value"] is None and f["per_name"]["0.kernel"] == pytest.approx(0.25)
    assert factor_of_arrays(a, {"0.kernel": RNG.normal(size=A.shape), "0.bias": A[0]}, "x", 4) is None


def _traj(scale_grad: float = 1.0, scale_loss: float = 1.0) -> dict:
    g = {"0.kernel": A[None], "0.bias": A[0][None]}
    return {"loss": np.array([0.7 * scale_loss]),
            "param/0.kernel": np.stack([A, A - 0.1 * scale_grad * A]),
            "param/0.bias": np.stack([A[0], A[0] - 0.1 * scale_grad * A[0]]),
            **{f"grad/{k}": scale_grad * v for k, v in g.items()}}


SPEC = {"parallel": {"devices": 4, "accumulate": 2}}


def test_attach_reads_the_stage_it_is_given():
    where = {"first_bad_step": 1, "stage": "combined_grads", "explanation": "step 1: ..."}
    out = attach(where, _traj(), _traj(scale_grad=8.0), SPEC)
    assert out["factor"]["as"] == "N x k"
    assert out["explanation"].endswith("combined gradients 8.00x the reference's (N x k: ranks x accumulation steps,"
                                       " N = 4, k = 2)")
    out = attach({**where, "stage": "update"}, _traj(), _traj(scale_grad=0.25), SPEC)
    assert out["factor"]["of"] == "updates" and out["factor"]["exact"] == "1/4"
    out = attach({**where, "stage": "record"}, _traj(), _traj(scale_loss=4.0), SPEC)
    assert out["factor"]["of"] == "logged losses" and out["factor"]["as"] == "N"


def test_attach_names_the_devices_that_differ():
    ga = np.stack([A, 2 * A])
    ca = {"device/grad/0.kernel": ga, "device/loss": np.array([0.5, 0.6])}
    cb = {"device/grad/0.kernel": np.stack([A, 3.5 * A]), "device/loss": np.array([0.5, 0.6])}
    out = attach({"first_bad_step": 1, "stage": "device_grads", "explanation": "e"}, {}, {}, SPEC, (ca, cb))
    assert out["factor"]["per_device"] == [pytest.approx(1.0), pytest.approx(1.75)]
    assert "device 0 1x (agrees), device 1 1.75x (7/4" in out["factor"]["text"]


def test_attach_leaves_a_localisation_without_a_scale_alone():
    where = {"first_bad_step": 1, "stage": "combined_grads", "explanation": "e"}
    other = _traj()
    other["grad/0.kernel"] = RNG.normal(size=(1, *A.shape))
    assert attach(where, _traj(), other, SPEC) == where
    assert attach({"first_bad_step": None, "stage": None}, _traj(), _traj(8.0), SPEC) == {"first_bad_step": None,
                                                                                          "stage": None}


def test_a_ratio_of_two_single_numbers_is_named_only_as_a_ratio_of_the_setup():
    assert describe(11 / 12, 2, 2, scalar=True)["exact"] is None            # by chance: no p/q claimed
    assert describe(0.25, 4, scalar=True)["as"] == "1/N"                     # the set-up's ratio: said
    # one logged loss against another: a ratio is always there, only the set-up's ratios are said
    assert factor_of_arrays({"loss": np.float64(0.7)}, {"loss": np.float64(0.7 * 11 / 12)}, "logged losses", 2, 2) is None
    assert factor_of_arrays({"loss": np.float64(0.7)}, {"loss": np.float64(0.35)}, "logged losses", 2, 2)["as"] == "1/N or 1/k"


def test_a_sum_where_a_mean_was_due_is_named_by_the_batch():
    assert name_in_setup(Fraction(16), 1, 1, 16) == ["B"]
    assert name_in_setup(Fraction(12), 2, 1, 24) == ["B/N"]
    assert name_in_setup(Fraction(12), 2, 1, None) == []
    assert name_in_setup(Fraction(1, 4), 4, 1, 16) == ["1/N"]          # N/B is 1/4 too: N explains it first
    assert describe(16.0, 1, b=16)["text"] == "16.0x the reference's (B: the global batch's rows, N = 1, B = 16)"
