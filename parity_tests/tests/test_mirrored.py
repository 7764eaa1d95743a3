"""``tf.mirrored``: a MirroredStrategy custom training loop against the TF2 tower engine."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from parity_tests.compare import assert_trajectories_close, compare_trajectories
from parity_tests.errors import CaseError
from parity_tests.harness import run_impl
from parity_tests.tests.helpers import MLP, POLY, SOFTMAX, make

# float64: the strategy sums replica gradients of losses pre-scaled by w_r, the
# tower engine averages unscaled gradients: the same number in two orders,
# measured 2e-16 relative; 1e-10 leaves room for accumulation over the steps,
# while a wrong weight or a missing 1/N is >= 1e-3 relative.
RTOL, ATOL = 1e-10, 1e-12
BASES = {"mlp": MLP, "poly": POLY, "softmax": SOFTMAX}


@functools.cache
def _towers(base: str, n: int, semantics: str) -> dict[str, np.ndarray]:
    return run_impl(make(BASES[base], parallel__devices=n, optimizer__semantics=semantics), "tf.towers")


# MLP trains with sgd, whose torch and tf rules are one formula: run it once
@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("base,semantics", [("mlp", "torch"), ("poly", "torch"), ("poly", "tf"),
                                            ("softmax", "torch"), ("softmax", "tf")])
def test_mirrored_equals_towers_float64(base, semantics, n):
    case = make(BASES[base], parallel__devices=n, optimizer__semantics=semantics)
    assert_trajectories_close(run_impl(case, "tf.mirrored"), _towers(base, n, semantics), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize(
    "changes",
    [
        {"parallel__weighting": "by_size", "data__global_batch": 50},  # shards 13, 13, 12, 12
        {"parallel__weighting": "equal", "data__global_batch": 50},
        {"parallel__combine": "loss_mean"},
        {"parallel__combine": "loss_mean", "parallel__weighting": "by_size", "data__global_batch": 50},
        {"parallel__shard": "strided", "data__global_batch": 50},
        {"model__reduction": "sum"},
        {"model__reduction": "sum", "parallel__weighting": "by_size", "data__global_batch": 50},
    ],
    ids=["uneven-by_size", "uneven-equal", "loss_mean", "loss_mean-by_size", "strided-uneven", "sum", "sum-by_size"],
)
def test_mirrored_equals_towers_combine_weighting_shard(changes):
    case = make(MLP, parallel__devices=4, optimizer__semantics="torch", **changes)
    assert_trajectories_close(run_impl(case, "tf.mirrored"), run_impl(case, "tf.towers"), rtol=RTOL, atol=ATOL)


def test_compute_average_loss_with_the_global_batch_is_by_size_weighting():
    """The strategy's documented scaling (global_batch_size=B) equals the full-batch step; the default does not."""
    by_size = make(SOFTMAX, parallel__devices=3, parallel__weighting="by_size", data__global_batch=50)
    assert_trajectories_close(run_impl(by_size, "tf.mirrored"), run_impl(by_size, "tf.single"), rtol=RTOL, atol=ATOL)
    equal = make(SOFTMAX, parallel__devices=3, data__global_batch=50)
    assert not compare_trajectories(run_impl(equal, "tf.mirrored"), run_impl(equal, "tf.single"), rtol=RTOL, atol=ATOL).ok


def test_mirrored_shard_choice_is_honoured():
    """Uneven shards, equal weights: the rows a replica gets change the update, so strided != contiguous."""
    contiguous = make(MLP, parallel__devices=3, data__global_batch=50, steps=1)
    strided = make(MLP, parallel__devices=3, data__global_batch=50, steps=1, parallel__shard="strided")
    assert not compare_trajectories(run_impl(contiguous, "tf.mirrored"), run_impl(strided, "tf.mirrored"),
                                    rtol=RTOL, atol=ATOL).ok


@pytest.mark.parametrize("base", [MLP, POLY, SOFTMAX], ids=["sgd", "adam", "momentum"])
def test_mirrored_native_keras_equals_towers_native(base):
    """The same Keras optimizer class, applied inside strategy.run (it all-reduces itself) or once by the towers."""
    case = make(base, parallel__devices=4, optimizer__semantics="native")
    assert_trajectories_close(run_impl(case, "tf.mirrored"), run_impl(case, "tf.towers"), rtol=RTOL, atol=ATOL)


def test_mirrored_exact_rule_with_a_schedule_and_weight_decay():
    case = make(POLY, parallel__devices=3, optimizer__semantics="torch", optimizer__name="adamw",
                optimizer__weight_decay=0.01, optimizer__schedule={"kind": "step", "boundaries": [2], "values": [0.05, 0.01]})
    assert_trajectories_close(run_impl(case, "tf.mirrored"), run_impl(case, "tf.towers"), rtol=RTOL, atol=ATOL)


def test_strategy_uses_the_first_n_devices_and_reduces_to_one_device():
    import tensorflow as tf

    from tfpar import make_strategy, tower_devices

    strategy = make_strategy(tower_devices(3))
    got = [d.rsplit("/", 1)[-1] for d in strategy.extended.worker_devices]
    assert got == ["device:CPU:0", "device:CPU:1", "device:CPU:2"]
    assert strategy.num_replicas_in_sync == 3
    with strategy.scope():
        v = tf.Variable(1.0)
    assert [c.device.rsplit("/", 1)[-1] for c in strategy.experimental_local_results(v)] == got
    # the all-reduce works on logical CPU devices: replica r contributes r + 1
    per = strategy.experimental_distribute_values_from_function(lambda ctx: tf.constant(ctx.replica_id_in_sync_group + 1.0))
    assert float(strategy.reduce(tf.distribute.ReduceOp.SUM, per, axis=None)) == 6.0


def test_split_rows_keeps_row_order():
    from tfpar.mirrored import split_rows

    rows = np.arange(10)
    assert [s.tolist() for s in split_rows(rows, 3, "contiguous")] == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert [s.tolist() for s in split_rows(rows, 3, "strided")] == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]


def test_per_example_loss_means_to_the_device_loss():
    import tensorflow as tf

    from tfpar.losses import device_loss
    from tfpar.mirrored import per_example_loss

    rng = np.random.default_rng(3)
    out = tf.constant(rng.normal(size=(6, 2)))
    y = tf.constant(rng.uniform(size=(6, 2)))
    for loss in ("mse", "sigmoid_ce"):
        per = per_example_loss(loss, out, y)
        assert per.shape == (6,)
        np.testing.assert_allclose(float(tf.reduce_mean(per)), float(device_loss(loss, "mean", out, y)), rtol=1e-15)
    labels = tf.constant([0, 1, 1, 0, 1, 0], tf.int64)
    per = per_example_loss("softmax_ce", out, labels)
    np.testing.assert_allclose(float(tf.reduce_mean(per)), float(device_loss("softmax_ce", "mean", out, labels)), rtol=1e-15)


def test_mirrored_refuses_features_it_does_not_implement():
    with pytest.raises(CaseError, match=r"^parallel.clip: expected no gradient clipping for tf.mirrored"):
        run_impl(make(MLP, parallel__clip={"global_norm": 1.0}), "tf.mirrored")


def test_mirrored_more_devices_than_configured_is_refused():
    import tfpar
    from tfpar import DeviceError

    payload = make(MLP).payload()
    payload["spec"] = dict(payload["spec"], parallel=dict(payload["spec"]["parallel"], devices=9))
    with pytest.raises(DeviceError, match="9 devices asked for, but this process has 8"):
        tfpar.run_case(payload, "tf.mirrored")
