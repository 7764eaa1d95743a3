"""Tests for parity_tests.judging.bounds: the float32 factor 2 is tight, and never calls rounding a divergence."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from parity_tests.judging.bounds import FLOAT32_ABS_FLOOR
from parity_tests.judging.rules import judge_float32
from parity_tests.judging.verdict import (
    RULE_FLOAT32,
)
from parity_tests.tests.synthetic_runs import (
    copy,
    jitter,
    truth,
)


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

