"""Tests for parity_tests.judging.rules: the float64 bound and the float32 noise floor."""

from __future__ import annotations

import json

import numpy as np
import pytest

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



# ---------------------------------------------------------------- the runs each rule declares it needs

def test_each_rule_declares_the_runs_it_judges_from() -> None:
    """``needs(planned)``: the first rule that declares needs for the pair, from what each side declares alone."""
    from parity_tests.judging.rules import Can, Planned, needs
    from parity_tests.judging.run_kinds import FLOAT64, PERTURBED_RUN, ROUNDED64, Variant, as_given

    f32, mixed = as_given("float32"), as_given("mixed_bfloat16")
    full, f32_only, recorded = Can(), Can(float64=False), Can(float64=False, rerunnable=False)
    assert needs(Planned("float64", "float64", full, full)) == ((FLOAT64,), (FLOAT64,))
    assert needs(Planned("float32", "float64", full, full)) == ((f32, FLOAT64), (f32, FLOAT64))
    assert needs(Planned("float32", "perturbation", full, recorded)) == ((f32, PERTURBED_RUN), (f32,))
    second, moved64 = Variant("perturbed", index=1), (Variant("perturbed64"), Variant("perturbed64", index=1))
    a, b = needs(Planned("mixed_bfloat16", "perturbation", full, f32_only))
    assert a == (mixed, FLOAT64, ROUNDED64, PERTURBED_RUN, second, *moved64)
    # a side without float64 runs is judged by the perturbation rule after the bfloat16 one: its reruns only
    assert b == (mixed, PERTURBED_RUN, second)


def test_the_plan_is_the_union_of_the_rules_needs_each_run_once_float64_first() -> None:
    """Three implementations of a float32 case, one of them a float32-only plugin: the float64 floor for the pair
    of built-ins, the perturbation for the plugin's pair (its reference rerun once, shared)."""
    from pathlib import Path

    from parity_tests.session.plan import _floor_rules, _plan
    from parity_tests.tests.helpers import MLP, make

    plugin = f"{Path(__file__).parent / 'hunt' / 'torch_side.py'}:ddp_f32"
    case = make(MLP, dtype="float32", parallel__devices=2)
    impls = ["tf.towers", "torch.ddp", plugin]
    plan = [f"{i}@{v}" for i, v in _plan(case, impls, _floor_rules(case, impls, "auto"))]
    assert plan == ["tf.towers@float64", "torch.ddp@float64", "tf.towers@float32", "torch.ddp@float32",
                    f"{plugin}@float32", "tf.towers@float32+perturbed", f"{plugin}@float32+perturbed"]
