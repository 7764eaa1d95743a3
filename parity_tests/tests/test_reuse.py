"""A trainer reused across runs of one structure (tfpar.reuse) trains exactly as a fresh one.

Each case runs three times in one process: A (a fresh trainer, traced), then B (the same
structure from other initial weights and data: a reuse, after which the optimizer, the
variables and the batch-norm state hold B's end), then A again (a reuse). A's two
trajectories must agree bit for bit, and B's must equal B run with reuse turned off. The
cases cover every kind of state a reset must restore: an exact rule's slots and step
counter, Keras' slots, iterations and a learning-rate schedule, Adagrad's non-zero initial
accumulator, batch-norm moving statistics and dropout masks, a captured step and lockstep.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import tfpar
from parity_tests.tests.helpers import CNN, MLP, SOFTMAX, make
from tfpar.reuse import CACHE, TrainerCache, disabled, structure_key

CASES = {
    "sgd-native": (MLP, {}),
    "momentum-tf-rule": (SOFTMAX, {"optimizer": {"name": "momentum", "lr": 0.05, "momentum": 0.9, "semantics": "tf"}}),
    "adam-native-schedule-decay": (MLP, {"optimizer": {"name": "adam", "lr": 0.01, "weight_decay": 0.01,
                                                       "schedule": {"kind": "step", "boundaries": [2], "values": [0.01, 0.001]}}}),
    "adagrad-native": (MLP, {"optimizer": {"name": "adagrad", "lr": 0.1}}),
    "rmsprop-torch-rule": (SOFTMAX, {"optimizer": {"name": "rmsprop", "lr": 0.01, "centered": True, "momentum": 0.5,
                                                   "semantics": "torch"}}),
    "cnn-sync-bn-dropout": (CNN, {"parallel__batch_norm": "sync", "steps": 2}),
}


def _other(changes: dict) -> dict:
    """The same structure from other initial weights and data."""
    return {**changes, "init__seed": 101, "data__seed": 102}


def _assert_same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]), err_msg=k, strict=True)


def _fresh(payload: dict, impl: str) -> dict[str, np.ndarray]:
    # pytest.MonkeyPatch, not the fixture: conftest turns reuse off for a test that asks for it
    with pytest.MonkeyPatch.context() as m:
        m.setenv("TFPAR_TRACE_CACHE", "0")
        return tfpar.run_case(payload, impl)


# tf.towers only: tf.single is the same trainer with one device (the same build, key and reset)
@pytest.mark.parametrize("name", list(CASES))
def test_a_reused_trainer_trains_bit_for_bit_as_a_fresh_one(name):
    impl = "tf.towers"
    base, changes = CASES[name]
    a, b = make(base, **changes).payload(), make(base, **_other(changes)).payload()
    assert not np.array_equal(a["init"][next(iter(a["init"]))], b["init"][next(iter(b["init"]))])
    CACHE.clear()
    hits = CACHE.hits
    first = tfpar.run_case(a, impl)
    other = tfpar.run_case(b, impl)
    again = tfpar.run_case(a, impl)
    assert CACHE.hits - hits == 2, "B and A's second run must reuse A's trainer"
    _assert_same(first, again)
    _assert_same(other, _fresh(b, impl))


def test_a_captured_step_and_lockstep_reuse_the_trainer_exactly():
    capture = dataclasses.replace(make(CNN, parallel__batch_norm="sync", steps=3), capture=2).payload()
    assert capture["capture"] == 2
    CACHE.clear()
    first = tfpar.run_case(capture, "tf.towers")
    assert any(k.startswith("device/") for k in first)
    # lockstep: one step from each start state, as parity_tests.session.lockstep asks for them
    starts = [{"init": {k: np.asarray(v[i]) for k, v in first.items() if k.startswith(("param/", "state/"))}}
              for i in range(3)]
    starts = [{"init": {k.split("/", 1)[1]: v for k, v in s["init"].items()}, "opt": None} for s in starts]
    lock = {**capture, "capture": None, "lockstep": {"starts": starts}}
    hits = CACHE.hits
    stepped = tfpar.run_case(lock, "tf.towers")
    again = tfpar.run_case(capture, "tf.towers")
    assert CACHE.hits - hits == 2
    _assert_same(first, again)
    _assert_same(stepped, _fresh(lock, "tf.towers"))


def test_different_structures_do_not_share_a_trainer():
    CACHE.clear()
    hits = CACHE.hits
    tfpar.run_case(make(MLP).payload(), "tf.towers")
    for changes in ({"optimizer__lr": 0.02}, {"parallel__devices": 2}, {"dtype": "float32"},
                    {"parallel__combine": "loss_mean"}, {"model__layers__0__units": 11}):
        tfpar.run_case(make(MLP, **changes).payload(), "tf.towers")
    tfpar.run_case(make(MLP).payload(), "tf.single")
    assert CACHE.hits == hits


def test_the_cache_is_bounded_and_keeps_no_large_trainer():
    small = TrainerCache(max_entries=2, max_entry_bytes=1 << 20)
    built = []
    for i, units in enumerate((3, 4, 5)):
        payload = make(MLP, model__layers__0__units=units).payload()
        CACHE.clear()
        tfpar.run_case(payload, "tf.towers")
        key, entry = next(iter(CACHE._entries.items()))
        small.give(key, entry[0])
        built.append(key)
        assert len(small) == min(i + 1, 2)
    assert small.take(built[0]) is None and small.take(built[2]) is not None  # the oldest went first
    key, (last, size) = next(iter(CACHE._entries.items()))
    # float64 MLP 5-5-1: 36 parameters; Keras' SGD has no slot, only iterations (int64) and its learning rate (float32)
    assert size == 8 * (5 * 5 + 5 + 5 * 1 + 1) + 8 + 4
    over = TrainerCache(max_entry_bytes=size - 1)
    over.give(key, last)
    assert len(over) == 0


def test_a_failed_run_gives_nothing_back():
    payload = make(MLP).payload()
    CACHE.clear()
    tfpar.run_case(payload, "tf.towers")
    assert len(CACHE) == 1
    bad = {**payload, "x": np.asarray(payload["x"])[:, :3]}  # inputs of the wrong width: the step fails
    with pytest.raises(Exception):  # noqa: B017  (TensorFlow's own shape error)
        tfpar.run_case(bad, "tf.towers")
    assert len(CACHE) == 0
    _assert_same(tfpar.run_case(payload, "tf.towers"), _fresh(payload, "tf.towers"))


def test_reuse_can_be_turned_off():
    CACHE.clear()
    hits = CACHE.hits
    with pytest.MonkeyPatch.context() as m:
        m.setenv("TFPAR_TRACE_CACHE", "0")
        tfpar.run_case(make(MLP).payload(), "tf.towers")
        tfpar.run_case(make(MLP).payload(), "tf.towers")
    assert CACHE.hits == hits and len(CACHE) == 0


def test_disabled_turns_reuse_off_and_restores_the_variable():
    import os

    assert "TFPAR_TRACE_CACHE" not in os.environ
    CACHE.clear()
    hits = CACHE.hits
    with disabled():
        tfpar.run_case(make(MLP).payload(), "tf.towers")
        tfpar.run_case(make(MLP).payload(), "tf.towers")
    assert CACHE.hits == hits and len(CACHE) == 0 and "TFPAR_TRACE_CACHE" not in os.environ
    with pytest.MonkeyPatch.context() as m:
        m.setenv("TFPAR_TRACE_CACHE", "1")
        with disabled():
            assert not CACHE.enabled()
        assert os.environ["TFPAR_TRACE_CACHE"] == "1"


def test_a_test_that_monkeypatches_runs_without_reuse(monkeypatch):
    """conftest: a test asking for ``monkeypatch`` may patch what a trace reads (a seeded bug in
    tfpar.models): it must neither reuse a clean trainer nor leave a patched one behind."""
    import os

    assert os.environ["TFPAR_TRACE_CACHE"] == "0" and len(CACHE) == 0


def test_keys_tell_long_arrays_apart():
    """A keyed section holding a numpy array (a user's class weights, say) keys by every element:
    ``str`` would abbreviate a 2000-element array with "...", and two such arrays would share a key."""
    payload = make(MLP).payload()
    weights = np.zeros(2000)
    other = weights.copy()
    other[1000] = 1.0
    assert str(weights) == str(other)
    a = {**payload, "spec": {**payload["spec"], "model": {**payload["spec"]["model"], "class_weights": weights}}}
    b = {**payload, "spec": {**payload["spec"], "model": {**payload["spec"]["model"], "class_weights": other}}}
    assert structure_key("tf.towers", ["/cpu:0"], a) != structure_key("tf.towers", ["/cpu:0"], b)
