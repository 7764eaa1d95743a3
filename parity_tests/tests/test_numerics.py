"""Numerical faults: an exploding run is reported where it starts, and two NaN runs are not 'equal'."""

from __future__ import annotations

import numpy as np
import pytest

from parity_tests.judging.compare import compare_trajectories, first_nonfinite
from parity_tests.running.harness import run_impl
from parity_tests.session.comparison import compare_case
from parity_tests.tests.helpers import POLY, make

pytestmark = pytest.mark.usefixtures("pool")

# y = 5x^2 + 3 with x in [-10, 10]: features up to 100, so SGD at lr 1 grows ~1e4-fold a step
# and overflows float32 (3.4e38) within 8 steps
EXPLODING = {"optimizer": {"name": "sgd", "lr": 1.0, "semantics": "torch"}, "steps": 8, "dtype": "float32"}


def _first_bad_row(a: np.ndarray) -> int:
    bad = ~np.isfinite(a.reshape(len(a), -1)).all(axis=1)
    return int(np.argmax(bad)) if bad.any() else 10**6


@pytest.mark.parametrize("impl", ["tf.towers", "torch.ddp"])
def test_first_nonfinite_step_implementation_and_array(impl):
    traj = run_impl(make(POLY, **EXPLODING), impl)
    text = first_nonfinite(traj, impl)
    assert text is not None and text.startswith(f"{impl} becomes ")
    # the step it names is the first row, over all arrays, that holds a NaN or Inf
    loss_step = _first_bad_row(traj["loss"]) + 1
    grad_step = _first_bad_row(traj["grad/1.kernel"]) + 1
    param_step = _first_bad_row(traj["param/1.kernel"])
    assert f"at step {min(loss_step, grad_step, param_step)} " in text


def test_finite_run_reports_nothing():
    assert first_nonfinite(run_impl(make(POLY), "tf.single")) is None


def test_two_runs_nan_at_the_same_place_are_said_to_be_so():
    case = make(POLY, **EXPLODING)
    a, b = run_impl(case, "tf.towers"), run_impl(case, "torch.ddp")
    c = compare_trajectories(a, b, rtol=1e-10, atol=1e-12)
    assert c.first_nonfinite is not None and "both trajectories" in c.first_nonfinite
    r = compare_case(case, ["tf.towers", "torch.ddp"])
    v = r.pairs[0].verdict
    assert v.status == "error" and v.rule == "non-finite values", v.detail  # never silently equal
    step = _first_bad_row(a["loss"]) + 1  # the loss overflows first: it squares the residual
    assert step < _first_bad_row(a["param/1.kernel"]) and np.array_equal(np.isfinite(a["loss"]), np.isfinite(b["loss"]))
    assert v.detail.startswith(f"both trajectories are Inf from step {step} (loss)"), v.detail
    assert "non-finite: tf.towers@float32 becomes" in r.summary()
    assert "non-finite: torch.ddp@float32 becomes" in r.summary()
