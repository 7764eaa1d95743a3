"""Tests for parity_tests.judging.gaps: the shared denominator (the scale floor) and the symmetry of the measure."""

from __future__ import annotations

from parity_tests.judging.rules import judge_float64
from parity_tests.tests.synthetic_runs import (
    copy,
    jitter,
    truth,
)


def test_zero_initialised_bias_is_measured_against_the_scale_floor() -> None:
    # row 0 of a bias is exactly zero; a residue of 1e-15 there is rounding, not a divergence
    a = truth()
    b = copy(a)
    b["param/0.bias"][0, 2] = 1e-15
    assert judge_float64(a, b).status == "parity"
    b["param/0.bias"][0, 2] = 1e-9  # but 1e-9 absolute is 1e-7 of the 1e-2 floor
    v = judge_float64(a, b)
    assert v.status == "divergence" and v.first_step == 0 and v.key == "param/0.bias"



def test_float64_judge_is_symmetric() -> None:
    a = truth()
    b = jitter(a, 1e-7, seed=2)
    va, vb = judge_float64(a, b), judge_float64(b, a)
    assert va.status == vb.status == "divergence"
    assert va.gap == vb.gap

