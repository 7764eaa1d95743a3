"""``protocol.recorder.Recorder``: the one recorder of a built-in trajectory, keys and shapes as the contract says."""

from __future__ import annotations

import numpy as np
import pytest

from parity_tests.protocol import rows
from parity_tests.protocol.recorder import Recorder
from parity_tests.protocol.trajectory import Trajectory


def test_keys_shapes_and_rows_follow_the_contract():
    steps = 3
    rec = Recorder({"0.kernel": np.zeros((2, 3))}, {"1.moving_mean": np.zeros(3)})
    for k in range(1, steps + 1):
        rec.loss(0.4 - 0.1 * k)
        rec.grad("0.kernel", np.full((2, 3), -float(k)))
        rec.param("0.kernel", np.full((2, 3), float(k)))
        rec.states({"1.moving_mean": np.full(3, 0.5 * k)})
    rec.add({"device/step": np.asarray(2)})
    traj = rec.finish()
    assert isinstance(traj, Trajectory)
    assert list(traj) == ["loss", "param/0.kernel", "grad/0.kernel", "state/1.moving_mean", "device/step"]
    assert traj["loss"].shape == (3,) and traj["param/0.kernel"].shape == (4, 2, 3)
    assert traj["grad/0.kernel"].shape == (3, 2, 3) and traj["state/1.moving_mean"].shape == (4, 3)
    np.testing.assert_array_equal(traj["param/0.kernel"][2], np.full((2, 3), 2.0))
    np.testing.assert_array_equal(traj["grad/0.kernel"][0], np.full((2, 3), -1.0))
    np.testing.assert_array_equal(traj["state/1.moving_mean"][3], np.full(3, 1.5))


def test_runs_without_gradients_or_state_record_only_losses_and_parameters():
    rec = Recorder({"w": np.zeros(2)}, grads=False)
    rec.loss(1.0)
    rec.params({"w": np.ones(2)})
    traj = rec.finish()
    assert sorted(traj) == ["loss", "param/w"]
    np.testing.assert_array_equal(traj["param/w"], [[0.0, 0.0], [1.0, 1.0]])
    with pytest.raises(AssertionError):
        rec.grad("w", np.ones(2))


def test_findings_travel_with_the_trajectory():
    rec = Recorder({"w": np.zeros(1)})
    rec.finding("replicas out of sync after step 2: rank 1, parameter w")
    assert rec.finish().findings == ["replicas out of sync after step 2: rank 1, parameter w"]


def test_a_large_history_spills_to_a_file():
    old = rows.set_spill_threshold(0)
    try:
        rec = Recorder({"w": np.zeros(4)})
        rec.loss(0.0)
        rec.grad("w", np.ones(4))
        rec.param("w", np.ones(4))
        traj = rec.finish()
    finally:
        rows.set_spill_threshold(old)
    assert isinstance(traj["param/w"], rows.RowArray)
    np.testing.assert_array_equal(np.asarray(traj["param/w"]), [np.zeros(4), np.ones(4)])


def test_a_captured_step_past_the_threshold_goes_to_files_and_nothing_else_beside_the_rows_does():
    """A captured step (``device/...``) is N + 2 copies of the model: past the threshold it is spilled like rows
    (so a child or a rank sends file names, not the arrays); the optimizer state and scalars stay as given."""
    captured = {"device/grad/w": np.arange(8.0).reshape(2, 4), "device/step": np.asarray(1)}
    below = Recorder({"w": np.zeros(4)})
    below.add(captured)
    assert below.finish()["device/grad/w"] is captured["device/grad/w"]  # under the default threshold: as given
    old = rows.set_spill_threshold(0)
    try:
        rec = Recorder({"w": np.zeros(4)})
        rec.add({**captured, "opt/m/w": np.ones(4)})
        traj = rec.finish()
    finally:
        rows.set_spill_threshold(old)
    assert isinstance(traj["device/grad/w"], rows.RowArray)
    assert np.asarray(traj["device/grad/w"]).tobytes() == captured["device/grad/w"].tobytes()
    assert isinstance(traj["device/step"], np.ndarray) and isinstance(traj["opt/m/w"], np.ndarray)


def test_initial_values_given_as_pairs_are_taken_one_at_a_time():
    """An engine hands over a generator of copies: each is recorded (here spilled) and let go before the next
    is made, so the recorder never holds a second copy of the whole model (a float64 GPT-2 small: 1 GB)."""
    import gc
    import weakref

    alive: list[weakref.ref] = []

    def copy(k: int) -> tuple[str, np.ndarray]:
        a = np.full(4, float(k))
        alive.append(weakref.ref(a))
        return f"p{k}", a

    def copies():
        for k in range(4):
            gc.collect()
            # the one just handed over may still be bound in the recorder's loop; none before it
            assert all(r() is None for r in alive[:-1]), "an earlier copy is still held"
            yield copy(k)

    old = rows.set_spill_threshold(0)  # every row to a file as it comes
    try:
        traj = Recorder(copies()).finish()
    finally:
        rows.set_spill_threshold(old)
    assert [k for k in traj if k.startswith("param/")] == ["param/p0", "param/p1", "param/p2", "param/p3"]
    np.testing.assert_array_equal(np.asarray(traj["param/p2"]), [np.full(4, 2.0)])
