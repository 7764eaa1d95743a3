"""``tf.mirrored``: a MirroredStrategy custom training loop against the TF2 tower engine."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from parity_tests.judging.compare import assert_trajectories_close, compare_trajectories
from parity_tests.protocol.errors import CaseError
from parity_tests.running.harness import run_impl
from parity_tests.tests.helpers import CNN, MLP, POLY, SOFTMAX, make, run_once

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


def test_mirrored_refuses_what_runs_on_tf_towers_only():
    with pytest.raises(CaseError, match=r"^parallel.combine: expected grad_mean or loss_mean for tf.mirrored"):
        run_impl(make(MLP, parallel__combine="param_mean"), "tf.mirrored")


# ------------------------------------------------------------------ batch norm and dropout

@pytest.mark.parametrize(
    "changes",
    [
        {"parallel__devices": 4, "parallel__batch_norm": "sync"},
        {"parallel__devices": 4, "parallel__batch_norm": "local"},
        {"parallel__devices": 3, "parallel__batch_norm": "local", "parallel__weighting": "by_size", "data__global_batch": 31},
        {"parallel__devices": 3, "parallel__batch_norm": "sync", "parallel__weighting": "by_size", "data__global_batch": 31,
         "parallel__shard": "strided"},
        {"parallel__devices": 2, "parallel__batch_norm": "sync", "model__layers__1__semantics": "torch",
         "optimizer": {"name": "adam", "lr": 0.01, "semantics": "native"}},
        {"parallel__devices": 4, "parallel__batch_norm": "local", "parallel__clip": {"global_norm": 0.05, "where": "per_device"}},
        {"parallel__devices": 4, "parallel__batch_norm": "sync", "parallel__clip": {"global_norm": 0.05, "where": "after_combine"}},
    ],
    ids=["sync", "local", "local-uneven-by_size", "sync-strided-uneven", "sync-torch-variance-native-adam",
         "local-clip-per_device", "sync-clip-after_combine"],
)
def test_mirrored_cnn_equals_towers(changes):
    """Conv, batch norm (replica statistics, or all-reduced sums), max pool, dropout masks by replica shard."""
    case = make(CNN, **changes)
    mirrored = run_once(case, "tf.mirrored")  # the sync and local runs serve the next test too
    assert {k for k in mirrored if k.startswith("state/")} == {"state/1.moving_mean", "state/1.moving_variance"}
    assert_trajectories_close(mirrored, run_impl(case, "tf.towers"), rtol=RTOL, atol=ATOL)
    assert not np.array_equal(mirrored["state/1.moving_variance"][0], mirrored["state/1.moving_variance"][1])


def test_mirrored_local_and_sync_statistics_differ():
    """The two modes are really different programs: sync equals one device on the full batch, local does not."""
    sync = make(CNN, parallel__devices=4, parallel__batch_norm="sync")
    local = make(CNN, parallel__devices=4, parallel__batch_norm="local")
    assert_trajectories_close(run_once(sync, "tf.mirrored"), run_impl(sync, "tf.single"), rtol=RTOL, atol=ATOL)
    assert not compare_trajectories(run_once(local, "tf.mirrored"), run_impl(local, "tf.single"), rtol=RTOL, atol=ATOL).ok


# ------------------------------------------------------------------ loss options and sample weights

SW = {"seed": 5, "low": 0.25, "high": 4.0}
SIGMOID_OUT = [{"type": "dense", "units": 10, "activation": "relu"}, {"type": "dense", "units": 1, "activation": "sigmoid"}]


@pytest.mark.parametrize(
    ("base", "changes"),
    [
        (SOFTMAX, {"model__class_weights": [1.0, 3.0, 0.5]}),
        (SOFTMAX, {"model__class_weights": [1.0, 3.0, 0.5], "model__label_smoothing": 0.1}),
        (SOFTMAX, {"model__class_weights": [1.0, 3.0, 0.5], "model__label_smoothing": 0.1, "model__loss_semantics": "torch"}),
        (SOFTMAX, {"model__class_weights": [1.0, 3.0, 0.5], "parallel__weighting": "by_size", "data__global_batch": 50}),
        (MLP, {"model__label_smoothing": 0.2}),
        (MLP, {"model__layers": SIGMOID_OUT, "model__from_logits": False}),
        (MLP, {"data__sample_weights": SW}),
        (MLP, {"data__sample_weights": SW, "model__loss_semantics": "torch"}),
        (MLP, {"data__sample_weights": SW, "parallel__weighting": "by_size", "data__global_batch": 50}),
        (MLP, {"data__sample_weights": SW, "model__reduction": "sum"}),
    ],
    ids=["class_weights", "class_weights-smoothing", "class_weights-smoothing-torch", "class_weights-by_size",
         "sigmoid-smoothing", "probabilities", "sample_weights", "sample_weights-torch", "sample_weights-by_size",
         "sample_weights-sum"],
)
def test_mirrored_loss_options_equal_towers(base, changes):
    """Keras' rule through per-example losses and compute_average_loss; torch's by the shard's weighted mean."""
    case = make(base, parallel__devices=3, **changes)
    assert_trajectories_close(run_impl(case, "tf.mirrored"), run_impl(case, "tf.towers"), rtol=RTOL, atol=ATOL)


def test_compute_average_loss_rounds_sample_weighted_losses_to_float32():
    """Why tf.mirrored multiplies by the weights itself: TF 2.21's sample_weight path casts to float32."""
    import tensorflow as tf

    rng = np.random.default_rng(11)
    per = rng.uniform(0.1, 3.0, size=64)
    v = rng.uniform(0.25, 4.0, size=64)
    exact = float(np.sum(per * v) / 64)
    with_arg = float(tf.nn.compute_average_loss(tf.constant(per), sample_weight=tf.constant(v), global_batch_size=64))
    ours = float(tf.nn.compute_average_loss(tf.constant(per) * tf.constant(v), global_batch_size=64))
    assert abs(ours - exact) <= 1e-15 * exact
    assert 1e-10 < abs(with_arg - exact) / exact < 1e-6  # float32 rounding, in a float64 computation


# ------------------------------------------------------------------ clipping

CLIP = 0.05  # below every step's per-device and combined gradient norm on SOFTMAX: clipping acts


@pytest.mark.parametrize("where", ["per_device", "after_combine"])
@pytest.mark.parametrize(
    ("semantics", "opt"),
    [("torch", {"name": "momentum", "lr": 0.05, "momentum": 0.9}), ("tf", {"name": "adam", "lr": 0.01}),
     ("native", {"name": "sgd", "lr": 0.0625})],
)
@pytest.mark.parametrize("changes", [{}, {"parallel__weighting": "by_size", "data__global_batch": 50}],
                         ids=["even", "uneven-by_size"])
def test_mirrored_clipping_equals_towers(where, semantics, opt, changes):
    """Per replica, the scaled gradient w g_r is clipped as w clip(g_r); after the all-reduce, the sum is clipped."""
    case = make(SOFTMAX, parallel__devices=3, optimizer=dict(opt, semantics=semantics),
                parallel__clip={"global_norm": CLIP, "where": where}, **changes)
    mirrored = run_impl(case, "tf.mirrored")
    assert_trajectories_close(mirrored, run_impl(case, "tf.towers"), rtol=RTOL, atol=ATOL)
    # the clipping acted: without it the run is another one
    unclipped = case.replace(**{"parallel.clip": None})  # one run serves both values of where
    assert not compare_trajectories(mirrored, run_once(unclipped, "tf.mirrored"), rtol=RTOL, atol=ATOL).ok


def test_keras_global_clipnorm_under_mirrored_strategy_clips_each_replica_at_n_times_c():
    """What the guide's loop does with ``SGD(global_clipnorm=c)``: per-replica clipping of w g_r at c.

    Keras clips in the replica, before its all-reduce, the gradient of the
    scaled loss (1/N of the replica's own); so with N equal replicas it is
    ``per_device`` clipping at N c, and it is not ``after_combine`` at c (what
    DDP users do with clip_grad_norm_ after backward). Read in
    keras/src/optimizers/base_optimizer.py (_backend_apply_gradients) and
    keras/src/backend/tensorflow/optimizer.py (_backend_update_step).
    """
    import keras
    import tensorflow as tf

    from tfpar import make_strategy, tower_devices
    from tfpar.mirrored import per_example_loss, split_rows
    from tfpar.models import forward

    n, lr = 3, 0.0625
    case = make(SOFTMAX, parallel__devices=n, steps=1, optimizer={"name": "sgd", "lr": lr, "semantics": "native"})
    payload = case.payload()
    strategy = make_strategy(tower_devices(n))
    with strategy.scope():
        variables = {k: tf.Variable(v) for k, v in payload["init"].items()}
        opt = keras.optimizers.SGD(lr, global_clipnorm=CLIP)
        opt.build(list(variables.values()))
    layers = case.spec["model"]["layers"]

    def replica_step(x, y):
        with tf.GradientTape() as tape:
            out = forward(layers, variables, x)
            loss = tf.nn.compute_average_loss(per_example_loss("softmax_ce", out, y))
        grads = tape.gradient(loss, list(variables.values()))
        opt.apply_gradients(zip(grads, list(variables.values()), strict=True))

    def dist(a):
        parts = split_rows(a, n, "contiguous")
        return strategy.experimental_distribute_values_from_function(lambda ctx: tf.constant(parts[ctx.replica_id_in_sync_group]))

    rows = case.spec["data"]["global_batch"]
    strategy.run(tf.function(replica_step), args=(dist(case.x[:rows]), dist(case.y[:rows].astype(np.int64))))
    keras_params = {k: strategy.experimental_local_results(v)[0].numpy() for k, v in variables.items()}

    def ours(where, c):
        traj = run_impl(case.replace(**{"parallel.clip": {"global_norm": c, "where": where}}), "tf.mirrored")
        return {k: traj[f"param/{k}"][1] for k in keras_params}

    per_device = ours("per_device", n * CLIP)
    for k, v in keras_params.items():
        np.testing.assert_allclose(v, per_device[k], rtol=1e-12, atol=1e-14, err_msg=k)
    after = ours("after_combine", CLIP)
    assert max(float(np.max(np.abs(after[k] - keras_params[k]))) for k in keras_params) > 1e-4


def test_mirrored_more_devices_than_configured_is_refused():
    import tfpar
    from tfpar import DeviceError

    payload = make(MLP).payload()
    have = len(tfpar.available_devices())  # 64 logical CPU devices without GPUs (tfpar.devices)
    payload["spec"] = dict(payload["spec"], parallel=dict(payload["spec"]["parallel"], devices=have + 1))
    with pytest.raises(DeviceError, match=f"{have + 1} devices asked for, but this process has {have}"):
        tfpar.run_case(payload, "tf.mirrored")


def test_non_finite_values_are_reported_not_raised():
    """Adam with epsilon 0 divides 0 by 0 where a ReLU unit is dead: every replica holds the same NaN, and the
    run reports it (the judge then finds it), instead of failing its replica check (NaN != NaN)."""
    case = make(MLP, optimizer={"name": "adam", "lr": 0.01, "epsilon": 0.0, "semantics": "torch"}, parallel__devices=2)
    traj = run_impl(case, "tf.mirrored")
    assert np.isnan(traj["param/0.bias"][1:]).any()
