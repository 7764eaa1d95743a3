"""``tfpar.record.stack_trajectory``: the contract's keys and shapes from a run's lists."""

from __future__ import annotations

import numpy as np

from tfpar.record import stack_trajectory


def test_keys_and_shapes_follow_the_contract():
    steps = 3
    params = {"0.kernel": [np.full((2, 3), float(k)) for k in range(steps + 1)]}
    grads = {"0.kernel": [np.full((2, 3), -float(k)) for k in range(steps)]}
    states = {"1.moving_mean": [np.full(3, 0.5 * k) for k in range(steps + 1)]}
    traj = stack_trajectory([0.3, 0.2, 0.1], params, grads, states)
    assert sorted(traj) == ["grad/0.kernel", "loss", "param/0.kernel", "state/1.moving_mean"]
    assert traj["loss"].shape == (3,) and traj["param/0.kernel"].shape == (4, 2, 3)
    assert traj["grad/0.kernel"].shape == (3, 2, 3) and traj["state/1.moving_mean"].shape == (4, 3)
    np.testing.assert_array_equal(traj["param/0.kernel"][2], np.full((2, 3), 2.0))
    np.testing.assert_array_equal(traj["grad/0.kernel"][1], np.full((2, 3), -1.0))


def test_runs_without_gradients_or_state_record_only_losses_and_parameters():
    traj = stack_trajectory([1.0], {"w": [np.zeros(2), np.ones(2)]})
    assert sorted(traj) == ["loss", "param/w"]
    np.testing.assert_array_equal(traj["param/w"], [[0.0, 0.0], [1.0, 1.0]])
