"""Tests for parity_tests.judging.compare: places, figures and messages of the one comparator."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from parity_tests.judging.compare import (
    assert_trajectories_close,
    compare_arrays,
    compare_trajectories,
    relative_gap,
    step_of_row,
)

STEPS = 5
SHAPES = {"0.kernel": (3, 5), "0.bias": (5,), "1.kernel": (5, 2), "1.bias": (2,)}
TOL = {"rtol": 1e-10, "atol": 1e-12}


def make_traj(seed: int = 0, steps: int = STEPS, dtype: type = np.float64) -> dict[str, np.ndarray]:
    """A synthetic trajectory in the contract's layout, O(1) values."""
    rng = np.random.default_rng(seed)
    traj = {"loss": rng.random(steps).astype(dtype)}
    for name, shape in SHAPES.items():
        traj[f"param/{name}"] = rng.normal(size=(steps + 1, *shape)).astype(dtype)
        traj[f"grad/{name}"] = rng.normal(size=(steps, *shape)).astype(dtype)
    traj["state/2.moving_mean"] = rng.normal(size=(steps + 1, 2)).astype(dtype)
    return traj


def copy(traj: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: v.copy() for k, v in traj.items()}


def test_identical_trajectories_agree() -> None:
    a = make_traj()
    c = compare_trajectories(a, copy(a), **TOL)
    assert c.ok
    assert c.mismatch is None
    assert c.max_abs == 0.0 and c.max_rel == 0.0
    assert c.first_nonfinite is None
    assert len(c.compared) == len(a)
    np.testing.assert_array_equal(c.per_step_gap, np.zeros(STEPS + 1))
    assert c.message().startswith("trajectories agree: 10 arrays compared")
    assert_trajectories_close(a, copy(a), **TOL)


def test_one_perturbed_element_is_located_exactly() -> None:
    a = make_traj()
    b = copy(a)
    b["param/1.kernel"][3, 4, 0] += 1.5e-3
    expected_abs = abs(float(a["param/1.kernel"][3, 4, 0]) - float(b["param/1.kernel"][3, 4, 0]))
    c = compare_trajectories(a, b, **TOL)
    assert not c.ok
    m = c.mismatch
    assert m is not None
    assert (m.key, m.step, m.index) == ("param/1.kernel", 3, (4, 0))
    assert m.max_abs == expected_abs
    assert m.max_rel == expected_abs / abs(float(b["param/1.kernel"][3, 4, 0]))
    assert (m.mismatched, m.total) == (1, 10)
    assert c.max_abs == expected_abs
    assert (
        m.message().splitlines()[0] == "step 3, param 1.kernel: Mismatched elements: 1 / 10 (10.0%)"
    )
    assert "at index (4, 0) (up to 1e-12 allowed)" in m.message()
    assert "(up to 1e-10 allowed)" in m.message()
    # the plot curve shows the gap at row 3 only
    assert c.per_step_gap[3] > 0 and np.count_nonzero(c.per_step_gap) == 1
    with pytest.raises(
        AssertionError, match=r"step 3, param 1\.kernel: Mismatched elements: 1 / 10"
    ):
        assert_trajectories_close(a, b, **TOL)


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        pytest.param(
            [("grad/0.bias", 2), ("param/1.kernel", 3)],
            ("grad/0.bias", 3),
            id="grad-before-param-same-step",
        ),
        pytest.param(
            [("loss", 2), ("grad/0.bias", 2)], ("loss", 3), id="loss-before-grad-same-step"
        ),
        pytest.param(
            [("param/1.kernel", 2), ("grad/0.kernel", 2)],
            ("param/1.kernel", 2),
            id="earlier-step-first",
        ),
        pytest.param(
            [("state/2.moving_mean", 1), ("param/0.bias", 2)],
            ("state/2.moving_mean", 1),
            id="state-earlier",
        ),
        pytest.param([("param/1.bias", 0)], ("param/1.bias", 0), id="initial-values"),
    ],
)
def test_first_failing_place_is_earliest_step_then_key_order(changes, expected) -> None:
    a = make_traj()
    b = copy(a)
    for key, row in changes:
        b[key][row] += 1.0
    m = compare_trajectories(a, b, **TOL).mismatch
    assert m is not None
    assert (m.key, m.step) == expected


def test_initial_values_are_named_as_such() -> None:
    a = make_traj()
    b = copy(a)
    b["param/0.bias"][0, 1] += 1.0
    m = compare_trajectories(a, b, **TOL).mismatch
    assert m is not None
    assert m.message().startswith(
        "step 0 (initial values), param 0.bias: Mismatched elements: 1 / 5 (20.0%)"
    )


def test_layer_indices_sort_as_numbers() -> None:
    a = {"param/10.kernel": np.zeros((2, 1)), "param/2.kernel": np.zeros((2, 1))}
    b = {"param/10.kernel": np.ones((2, 1)), "param/2.kernel": np.ones((2, 1))}
    c = compare_trajectories(a, b, **TOL)
    assert c.compared == ("param/2.kernel", "param/10.kernel")
    assert c.mismatch is not None and c.mismatch.key == "param/2.kernel"


def test_rule_is_atol_plus_rtol_times_b_inclusive() -> None:
    # |a - b| = 0.5 = atol + rtol * |b| = 0.25 + 0.125 * 2 (all exact in binary)
    assert compare_arrays(np.array([2.5]), np.array([2.0]), rtol=0.125, atol=0.25) is None
    m = compare_arrays(np.array([2.5 + 1e-12]), np.array([2.0]), rtol=0.125, atol=0.25)
    assert m is not None and m.mismatched == 1
    # b is the reference: swapping sides changes the allowance
    assert compare_arrays(np.array([2.0]), np.array([2.5]), rtol=0.1, atol=0.25) is None
    assert compare_arrays(np.array([2.5]), np.array([2.0]), rtol=0.1, atol=0.25) is not None


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        pytest.param({"rtol": 1e-3}, r"atol is required when rtol is given", id="rtol-only"),
        pytest.param({"atol": 1e-3}, r"rtol is required when atol is given", id="atol-only"),
        pytest.param({}, r"both rtol and atol are required", id="neither"),
        pytest.param(
            {"rtol": -1e-3, "atol": 0.0}, r"rtol must be finite and >= 0", id="negative-rtol"
        ),
        pytest.param(
            {"rtol": 0.0, "atol": float("nan")}, r"atol must be finite and >= 0", id="nan-atol"
        ),
        pytest.param(
            {"rtol": float("inf"), "atol": 0.0}, r"rtol must be finite and >= 0", id="inf-rtol"
        ),
    ],
)
def test_tolerances_are_both_required_and_valid(kwargs, pattern) -> None:
    a = make_traj()
    with pytest.raises(ValueError, match=pattern):
        compare_trajectories(a, copy(a), **kwargs)
    with pytest.raises(ValueError, match=pattern):
        assert_trajectories_close(a, copy(a), **kwargs)


def test_bool_tolerance_is_rejected() -> None:
    a = make_traj()
    with pytest.raises(TypeError, match="rtol must be a real number"):
        compare_trajectories(a, a, rtol=True, atol=0.0)


def test_missing_keys_are_named_with_the_side_that_lacks_them() -> None:
    a = make_traj()
    b = copy(a)
    del b["param/1.bias"]
    a2 = copy(a)
    del a2["grad/0.kernel"]
    c = compare_trajectories(a2, b, **TOL)
    assert not c.ok
    assert c.missing_in_b == ("param/1.bias",)
    assert c.missing_in_a == ("grad/0.kernel",)
    msg = c.message()
    assert "missing from side B (present in side A): param/1.bias" in msg
    assert "missing from side A (present in side B): grad/0.kernel" in msg
    # the keys both sides have are still compared
    assert "param/0.kernel" in c.compared and "param/1.bias" not in c.compared
    assert c.mismatch is None


def test_shape_mismatch_names_key_and_both_shapes() -> None:
    a = make_traj()
    b = copy(a)
    b["param/1.kernel"] = np.ascontiguousarray(b["param/1.kernel"].transpose(0, 2, 1))
    c = compare_trajectories(a, b, **TOL)
    assert not c.ok
    assert c.shape_mismatches == (
        "shape mismatch for param/1.kernel: side A (6, 5, 2), side B (6, 2, 5)",
    )
    assert "shape mismatch for param/1.kernel: side A (6, 5, 2), side B (6, 2, 5)" in c.message()
    with pytest.raises(AssertionError, match=re.escape("side A (6, 5, 2), side B (6, 2, 5)")):
        assert_trajectories_close(a, b, **TOL)


def test_explicit_keys_and_other_keys_ignored_by_default() -> None:
    a = make_traj()
    b = copy(a)
    b["grad/0.kernel"] += 1.0
    a["meta/note"] = np.zeros(3)  # not a trajectory key: ignored by default
    assert compare_trajectories(a, b, keys=["param/0.kernel", "loss"], **TOL).ok
    assert not compare_trajectories(a, b, **TOL).ok
    c = compare_trajectories(a, b, keys=["param/0.kernel", "param/9.kernel"], **TOL)
    assert c.missing_in_a == ("param/9.kernel",) and c.missing_in_b == ("param/9.kernel",)


def test_nothing_to_compare_is_not_ok() -> None:
    c = compare_trajectories({}, {}, **TOL)
    assert not c.ok
    assert "no arrays to compare" in c.message()


def test_non_numeric_array_is_rejected_with_its_key() -> None:
    a = make_traj()
    b = copy(a)
    b["loss"] = np.array(["x"] * STEPS)
    with pytest.raises(TypeError, match=r"side B, key 'loss'"):
        compare_trajectories(a, b, **TOL)


def test_nan_at_the_same_places_needs_equal_nan() -> None:
    a = make_traj()
    b = copy(a)
    for t in (a, b):
        t["param/0.kernel"][4:] = np.nan
    c = compare_trajectories(a, b, **TOL)
    assert not c.ok
    assert c.first_nonfinite == "both trajectories are NaN from step 4 (param 0.kernel) on"
    m = c.mismatch
    assert m is not None and (m.key, m.step, m.mismatched, m.nonfinite) == (
        "param/0.kernel",
        4,
        15,
        15,
    )
    assert "pass equal_nan=True to accept them" in c.message()

    c = compare_trajectories(a, b, equal_nan=True, **TOL)
    assert c.ok
    assert c.first_nonfinite == "both trajectories are NaN from step 4 (param 0.kernel) on"
    assert np.isnan(c.per_step_gap[4:]).all() and (c.per_step_gap[:4] == 0).all()


def test_nan_in_both_but_finite_parts_differ_is_a_mismatch() -> None:
    a = make_traj()
    b = copy(a)
    for t in (a, b):
        t["param/0.kernel"][4:] = np.nan
    b["param/0.bias"][5, 0] += 1.0
    c = compare_trajectories(a, b, equal_nan=True, **TOL)
    assert not c.ok and c.mismatch is not None and c.mismatch.key == "param/0.bias"


def test_one_side_inf_is_a_mismatch_even_with_equal_nan() -> None:
    a = make_traj()
    b = copy(a)
    b["grad/1.bias"][1, 0] = np.inf
    for equal_nan in (False, True):
        c = compare_trajectories(a, b, equal_nan=equal_nan, **TOL)
        assert not c.ok
        assert (
            c.first_nonfinite
            == "side B becomes Inf at step 2 (grad 1.bias) while side A stays finite"
        )
        m = c.mismatch
        assert m is not None
        assert (m.key, m.step, m.index, m.max_abs, m.nonfinite) == (
            "grad/1.bias",
            2,
            (0,),
            np.inf,
            1,
        )
        assert "NaN/Inf on one side only" in m.message()


@pytest.mark.parametrize(
    ("va", "vb"),
    [
        pytest.param(np.nan, np.inf, id="nan-vs-inf"),
        pytest.param(np.inf, -np.inf, id="plus-vs-minus-inf"),
    ],
)
def test_different_non_finite_values_never_match(va, vb) -> None:
    a = make_traj()
    b = copy(a)
    a["param/1.bias"][2, 1] = va
    b["param/1.bias"][2, 1] = vb
    c = compare_trajectories(a, b, equal_nan=True, **TOL)
    assert (
        not c.ok
        and c.mismatch is not None
        and (c.mismatch.key, c.mismatch.step) == ("param/1.bias", 2)
    )


def test_non_finite_description_when_sides_blow_up_at_different_steps() -> None:
    a = make_traj()
    b = copy(a)
    a["param/0.bias"][2:] = np.nan
    b["param/0.bias"][4:] = np.nan
    c = compare_trajectories(a, b, **TOL)
    assert c.first_nonfinite == (
        "side A becomes NaN at step 2 (param 0.bias); side B follows (NaN) at step 4 (param 0.bias)"
    )


def test_relative_gap_rows() -> None:
    b = np.array([[1.0, -2.0], [0.0, 0.0], [4.0, 1.0]])
    a = b + np.array([[0.0, 0.5], [0.0, 0.0], [-1.0, 0.0]])
    np.testing.assert_array_equal(relative_gap(a, b), [0.25, 0.0, 0.25])
    np.testing.assert_array_equal(relative_gap(a, b, scale=8.0), [0.0625, 0.0, 0.125])
    np.testing.assert_array_equal(relative_gap(a, b, scale_floor=10.0), [0.05, 0.0, 0.1])
    a[1, 0], b[1, 0] = np.nan, np.nan
    a[2, 1] = np.inf
    gap = relative_gap(a, b)
    assert gap[0] == 0.25 and np.isnan(gap[1]) and gap[2] == np.inf
    with pytest.raises(ValueError, match="shapes differ"):
        relative_gap(a, b[:2])


@given(st.integers(1, 4), st.integers(1, 7), st.integers(0, 2**32 - 1), st.sampled_from([None, 3.0]),
       st.sampled_from(["finite", "overflow", "nan", "inf"]))
def test_relative_gap_is_the_definition_on_every_path(rows, cols, seed, scale, kind) -> None:
    """``max_j |a_kj - b_kj| / max(s_k, floor)``, written out here elementwise, bit for bit: on the fast path (every
    difference finite) and the general one (a non-finite value, or a difference that overflows)."""
    rng = np.random.default_rng(seed)
    a, b = rng.normal(size=(rows, cols)) * 10.0 ** rng.integers(-20, 20), rng.normal(size=(rows, cols))
    if kind == "overflow":
        a[0, 0], b[0, 0] = 1e308, -1e308  # both finite, their difference is not
    elif kind != "finite":
        a[0, -1] = np.nan if kind == "nan" else np.inf
    want = np.empty(rows)
    for k in range(rows):
        both = np.isfinite(a[k]) & np.isfinite(b[k])
        num = max(abs(float(x) - float(y)) if ok else 0.0 for x, y, ok in zip(a[k], b[k], both, strict=True))
        den = max(abs(float(y)) if np.isfinite(y) else 0.0 for y in b[k]) if scale is None else scale
        want[k] = num / max(den, 1e-30) if both.all() else np.inf
    got = relative_gap(a, b, scale=scale, scale_floor=1e-30)
    np.testing.assert_array_equal(got, want)


def test_step_of_row() -> None:
    assert [step_of_row("loss", 0), step_of_row("grad/0.bias", 2)] == [1, 3]
    assert [step_of_row("param/0.bias", 0), step_of_row("state/3.moving_mean", 2)] == [0, 2]


_GROUPS = st.sampled_from(["param", "grad", "state"])


@given(
    rows=st.integers(2, 6),
    shape=st.lists(st.integers(1, 4), min_size=0, max_size=2).map(tuple),
    group=_GROUPS,
    seed=st.integers(0, 2**32 - 1),
    data=st.data(),
)
def test_reported_place_is_the_perturbed_one(rows, shape, group, seed, data) -> None:
    rng = np.random.default_rng(seed)
    a = {f"{group}/0.kernel": rng.uniform(-10, 10, size=(rows, *shape))}
    b = copy(a)
    row = data.draw(st.integers(0, rows - 1), label="row")
    index = tuple(data.draw(st.integers(0, n - 1), label=f"index{i}") for i, n in enumerate(shape))
    delta = data.draw(st.floats(1e-3, 1e3) | st.floats(-1e3, -1e-3), label="delta")
    b[f"{group}/0.kernel"][(row, *index)] += delta
    c = compare_trajectories(a, b, rtol=1e-9, atol=1e-12)
    m = c.mismatch
    assert m is not None and not c.ok
    assert m.key == f"{group}/0.kernel"
    assert m.step == (row + 1 if group == "grad" else row)
    assert m.index == index
    assert m.max_abs == abs(a[m.key][(row, *index)] - b[m.key][(row, *index)])
    assert (m.mismatched, m.total) == (1, int(np.prod(shape, dtype=int)))


def test_a_comparison_reads_as_one_line() -> None:
    a = {"loss": np.ones(3), "param/w": np.ones((4, 2))}
    b = {"loss": np.array([1.0, 1.5, 1.0]), "param/w": np.ones((4, 2))}
    assert repr(compare_trajectories(a, b, rtol=1e-10, atol=0)) == (
        "Comparison(NOT ok, 2 arrays compared, greatest absolute difference 0.5, relative 0.333 (rtol 1e-10, atol 0);"
        " first mismatch: step 2, loss)")
    assert repr(compare_trajectories(a, a, rtol=1e-10, atol=0)) == (
        "Comparison(ok, 2 arrays compared, greatest absolute difference 0, relative 0 (rtol 1e-10, atol 0))")
