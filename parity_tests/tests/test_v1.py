"""``tf.v1``: the seeds' tf.compat.v1 graph towers against the TF2 tower engine, the v1
optimizers against a numpy statement of their rules, and the builder with a user's model."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from parity_tests.judging.compare import assert_trajectories_close, compare_trajectories
from parity_tests.protocol.errors import CaseError
from parity_tests.reporting.optimizer_rules import f32, np_update
from parity_tests.running.harness import run_impl
from parity_tests.tests.helpers import CNN, MLP, POLY, SOFTMAX, make

# float64: the same update computed by two programs agrees to ~1e-15 relative per
# step (measured here: 0.0, the graphs compute the same ops); 1e-10 leaves five
# orders of magnitude for accumulation over a few steps, while any semantic
# difference (a wrong weight, a missing 1/N, float32 hyperparameters) is >= 1e-8.
RTOL, ATOL = 1e-10, 1e-12
BASES = {"mlp": MLP, "poly": POLY, "softmax": SOFTMAX}


@functools.cache
def _towers(base: str, n: int, semantics: str) -> dict[str, np.ndarray]:
    return run_impl(make(BASES[base], parallel__devices=n, optimizer__semantics=semantics), "tf.towers")


# ------------------------------------------------------------------ parity with tf.towers


@pytest.mark.parametrize("semantics", ["torch", "tf"])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("base", list(BASES))
def test_v1_equals_towers_float64(base, n, semantics):
    case = make(BASES[base], parallel__devices=n, optimizer__semantics=semantics)
    assert_trajectories_close(run_impl(case, "tf.v1"), _towers(base, n, semantics), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize(
    "changes",
    [
        {"parallel__weighting": "by_size", "data__global_batch": 50},  # shards 13, 13, 12, 12
        {"parallel__weighting": "equal", "data__global_batch": 50},
        {"parallel__combine": "loss_mean"},
        {"parallel__combine": "loss_mean", "parallel__weighting": "by_size", "data__global_batch": 50},
        {"parallel__shard": "strided", "data__global_batch": 50},
        {"model__reduction": "sum"},
    ],
    ids=["uneven-by_size", "uneven-equal", "loss_mean", "loss_mean-by_size", "strided-uneven", "sum"],
)
def test_v1_equals_towers_combine_weighting_shard(changes):
    case = make(MLP, parallel__devices=4, optimizer__semantics="torch", **changes)
    assert_trajectories_close(run_impl(case, "tf.v1"), run_impl(case, "tf.towers"), rtol=RTOL, atol=ATOL)


# The classic tower code's other parts: batch norm whose moving statistics are the first
# tower's UPDATE_OPS, dropout masks fed with the batch, clipping inside each tower (or once
# after the average), and the loss options. The CNN case has conv, batch norm (Keras'
# moving variance), max pool, dropout 0.25 and flatten.
@pytest.mark.parametrize(
    "changes",
    [
        {"parallel__devices": 4},
        {"parallel__devices": 3, "parallel__combine": "loss_mean"},
        {"parallel__devices": 4, "parallel__shard": "strided", "parallel__weighting": "by_size", "data__global_batch": 30},
        {"parallel__devices": 4, "parallel__clip": {"global_norm": 0.05, "where": "per_device"}},
        {"parallel__devices": 2, "parallel__clip": {"global_norm": 0.05, "where": "after_combine"},
         "optimizer__semantics": "tf"},
        {"parallel__devices": 2, "model__layers__1__semantics": "torch"},
    ],
    ids=["grad_mean", "loss_mean", "strided-by_size", "clip-per_device", "clip-after_combine", "bn-torch-variance"],
)
def test_v1_equals_towers_on_the_cnn(changes):
    case = make(CNN, parallel__batch_norm="local", **changes)
    v1, towers = run_impl(case, "tf.v1"), run_impl(case, "tf.towers")
    assert {k for k in v1 if k.startswith("state/")} == {"state/1.moving_mean", "state/1.moving_variance"}
    assert_trajectories_close(v1, towers, rtol=RTOL, atol=ATOL)
    # the moving statistics moved (the UPDATE_OPS ran) and each step's is the first tower's
    assert not np.array_equal(v1["state/1.moving_mean"][0], v1["state/1.moving_mean"][1])
    if "parallel__clip" in changes:
        # the clipping acted: without it the run is another one
        unclipped = case.replace(**{"parallel.clip": None})
        assert not compare_trajectories(v1, run_impl(unclipped, "tf.v1"), rtol=RTOL, atol=ATOL).ok


def test_v1_batch_norm_keeps_the_first_towers_statistics():
    """Step 1's moving mean is m * 0 + (1 - m) * (mean of tower 0's conv output), not the batch's."""
    import tensorflow as tf

    from tfpar.models import forward

    case = make(CNN, parallel__devices=4, parallel__batch_norm="local", steps=1)
    traj = run_impl(case, "tf.v1")
    payload = case.payload()
    conv = [case.spec["model"]["layers"][0]]
    params = {k: tf.constant(v) for k, v in payload["init"].items() if k.startswith("0.")}
    h = forward(conv, params, tf.constant(case.x[:32])).numpy()  # [32, 8, 8, 4]
    m = case.spec["model"]["layers"][1]["momentum"]
    first = h[:8].mean(axis=(0, 1, 2))
    np.testing.assert_allclose(traj["state/1.moving_mean"][1], (1 - m) * first, rtol=1e-12, atol=1e-15)
    assert not np.allclose(traj["state/1.moving_mean"][1], (1 - m) * h.mean(axis=(0, 1, 2)), rtol=1e-6)


@pytest.mark.parametrize(
    "changes",
    [
        {"model__class_weights": [1.0, 3.0, 0.5]},
        {"model__label_smoothing": 0.1},
        {"model__class_weights": [1.0, 3.0, 0.5], "model__loss_semantics": "torch"},
        {"data__sample_weights": {"seed": 3}},
    ],
    ids=["class_weights", "label_smoothing", "class_weights-torch", "sample_weights"],
)
def test_v1_equals_towers_with_loss_options(changes):
    case = make(SOFTMAX, parallel__devices=3, **changes)
    assert_trajectories_close(run_impl(case, "tf.v1"), run_impl(case, "tf.towers"), rtol=RTOL, atol=ATOL)


def test_v1_by_size_uneven_equals_full_batch_and_equal_does_not():
    by_size = make(SOFTMAX, parallel__devices=3, parallel__weighting="by_size", data__global_batch=50)
    assert_trajectories_close(run_impl(by_size, "tf.v1"), run_impl(by_size, "tf.single"), rtol=RTOL, atol=ATOL)
    equal = make(SOFTMAX, parallel__devices=3, data__global_batch=50)
    assert not compare_trajectories(run_impl(equal, "tf.v1"), run_impl(equal, "tf.single"), rtol=RTOL, atol=ATOL).ok


def test_v1_shard_choice_is_honoured():
    """With uneven shards and equal weights the rows a tower gets change the update: strided != contiguous."""
    contiguous = make(MLP, parallel__devices=3, data__global_batch=50, steps=1)  # rows 0-16, 17-33, 34-49
    strided = make(MLP, parallel__devices=3, data__global_batch=50, steps=1, parallel__shard="strided")
    assert not compare_trajectories(run_impl(contiguous, "tf.v1"), run_impl(strided, "tf.v1"), rtol=RTOL, atol=ATOL).ok


# ------------------------------------------------------------------ the v1 optimizers

HP = {
    "sgd": {"name": "sgd", "lr": 0.01},
    "momentum": {"name": "momentum", "lr": 0.01, "momentum": 0.9},
    "adam": {"name": "adam", "lr": 0.01, "beta1": 0.9, "beta2": 0.999, "epsilon": 1e-7},
}
_rng = np.random.default_rng(0)
P0 = _rng.normal(size=(3, 4))
# small gradients make Adam's epsilon and its rounding visible; varied signs and scales
GRADS = [_rng.normal(size=(3, 4)) * s for s in (1.0, 1e-3, 0.5, 1e-4, 2.0)]


def np_update_v1_native(name: str, hp: dict, p0: np.ndarray, grads: list[np.ndarray]) -> list[np.ndarray]:
    """What the ``tf.compat.v1.train`` optimizers compute in a float64 run (numpy, float64).

    The rules are ``training_ops.cc``'s (ApplyGradientDescent, ApplyMomentum,
    ApplyAdam); every hyperparameter enters as a float32 tensor cast to float64
    (``convert_to_tensor`` of a Python float), and Adam's ``beta1^t``,
    ``beta2^t`` are float32 variables multiplied by the float32 betas each step.
    """
    p = p0.copy()
    lr = f32(hp["lr"])
    m, v = np.zeros_like(p), np.zeros_like(p)
    b1p = b2p = np.float32(1.0)
    out = []
    for g in grads:
        if name == "sgd":
            p = p - lr * g
        elif name == "momentum":
            m = m * f32(hp["momentum"]) + g  # accum = accum * momentum + grad
            p = p - m * lr
        else:
            b1, b2, eps = f32(hp["beta1"]), f32(hp["beta2"]), f32(hp["epsilon"])
            b1p, b2p = np.float32(b1p * np.float32(hp["beta1"])), np.float32(b2p * np.float32(hp["beta2"]))
            alpha = lr * np.sqrt(1.0 - float(b2p)) / (1.0 - float(b1p))
            m = m + (g - m) * (1.0 - b1)
            v = v + (g * g - v) * (1.0 - b2)
            p = p - (m * alpha) / (np.sqrt(v) + eps)
        out.append(p.copy())
    return out


def _v1_apply(spec: dict) -> list[np.ndarray]:
    import tensorflow as tf

    from tfpar.v1 import make_v1_optimizer

    v1 = tf.compat.v1
    with tf.Graph().as_default() as graph:
        var = v1.get_variable("p", initializer=tf.constant(P0))
        g = v1.placeholder(tf.float64, P0.shape)
        step = make_v1_optimizer(spec).apply_gradients([(g, var)])
        with v1.Session(graph=graph) as sess:
            sess.run(v1.global_variables_initializer())
            out = []
            for grad in GRADS:
                sess.run(step, {g: grad})
                out.append(sess.run(var))
    return out


def _rel_gap(got: list[np.ndarray], want: list[np.ndarray]) -> float:
    return max(float(np.max(np.abs(a - b) / np.abs(b))) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("name", ["sgd", "momentum", "adam"])
@pytest.mark.parametrize("semantics", ["torch", "tf"])
def test_exact_rule_optimizer_matches_numpy(name, semantics):
    spec = dict(HP[name], semantics=semantics)
    # a handful of float64 ulps: the same formula in a different op order
    assert _rel_gap(_v1_apply(spec), np_update(name, semantics, spec, P0, GRADS)) < 1e-12


@pytest.mark.parametrize("name", ["sgd", "momentum", "adam"])
def test_v1_native_optimizers_round_hyperparameters_to_float32(name):
    spec = dict(HP[name], semantics="native")
    got = _v1_apply(spec)
    assert _rel_gap(got, np_update_v1_native(name, spec, P0, GRADS)) < 1e-12
    # the rounding is a real, measurable difference from the exact rule
    # (measured: sgd 4e-8, momentum 2e-7, adam 4e-5 relative)
    exact = np_update(name, "torch" if name == "momentum" else "tf", spec, P0, GRADS)
    assert _rel_gap(got, exact) > 1e-9


def test_v1_native_sgd_and_momentum_match_keras_towers():
    """Both round lr and momentum to float32, and the two momentum forms agree for a constant lr."""
    for base in (MLP, SOFTMAX):
        case = make(base, parallel__devices=4, optimizer__semantics="native")
        assert_trajectories_close(run_impl(case, "tf.v1"), run_impl(case, "tf.towers"), rtol=RTOL, atol=ATOL)


def test_v1_native_adam_differs_from_keras_adam_in_float64():
    """v1 also rounds epsilon and 1 - beta and keeps beta^t in float32: a float64 gap Keras does not have."""
    case = make(POLY, parallel__devices=4, optimizer__semantics="native")
    v1, keras = run_impl(case, "tf.v1"), run_impl(case, "tf.towers")
    assert not compare_trajectories(v1, keras, rtol=RTOL, atol=ATOL).ok
    gap = max(float(np.max(np.abs(v1[k] - keras[k]) / np.abs(keras[k]))) for k in v1 if k.startswith("param/"))
    assert 1e-9 < gap < 1e-4, gap  # float32 rounding of hyperparameters, not a different formula


# ------------------------------------------------------------------ the builder with a user's model


def _linear_towers(n: int, *, model_fn=None, combine="grad_mean", run_steps: int = 1):
    import tensorflow as tf

    from tfpar import build_towers, session_config, tower_devices

    v1 = tf.compat.v1
    rng = np.random.default_rng(7)
    x = rng.normal(size=(48, 5))
    y = rng.normal(size=(48, 1))
    w0 = rng.normal(size=(5, 1))

    def linear(xs, ys):  # one tower: mean squared error of x w + b
        w = v1.get_variable("w", shape=[5, 1], dtype=tf.float64, initializer=v1.constant_initializer(w0))
        b = v1.get_variable("b", shape=[1], dtype=tf.float64, initializer=v1.zeros_initializer())
        # a batch-norm-like statistic registered in UPDATE_OPS: the seeds run the first tower's only
        seen = v1.get_variable("seen", shape=[], dtype=tf.float64, initializer=v1.zeros_initializer(), trainable=False)
        v1.add_to_collection(v1.GraphKeys.UPDATE_OPS, v1.assign_add(seen, tf.cast(tf.shape(xs)[0], tf.float64)))
        return tf.reduce_mean(tf.square(tf.matmul(xs, w) + b - ys))

    with tf.Graph().as_default() as graph:
        xp, yp = v1.placeholder(tf.float64, [48, 5]), v1.placeholder(tf.float64, [48, 1])
        towers = build_towers(model_fn or linear, (xp, yp), tower_devices(n),
                              v1.train.GradientDescentOptimizer(0.1), combine=combine)
        with v1.Session(graph=graph, config=session_config()) as sess:
            sess.run(v1.global_variables_initializer())
            meta = v1.RunMetadata()
            for _ in range(run_steps):
                sess.run(towers.train_op, {xp: x, yp: y},
                         options=v1.RunOptions(trace_level=v1.RunOptions.FULL_TRACE), run_metadata=meta)
            values = {v.op.name: sess.run(v) for v in v1.global_variables()}
    return x, y, w0, towers, values, meta


@pytest.mark.parametrize("combine", ["grad_mean", "loss_mean"])
def test_build_towers_with_a_user_model_fn(combine):
    x, y, w0, towers, values, meta = _linear_towers(4, combine=combine, run_steps=2)
    # numpy: two full-batch gradient steps (equal shards of 12 rows: the tower mean is the full mean)
    # GradientDescentOptimizer(0.1) applies 0.1 rounded to float32 (a 1e-8 gap otherwise)
    lr = f32(0.1)
    w, b = w0.copy(), np.zeros(1)
    for _ in range(2):
        r = x @ w + b - y
        w, b = w - lr * (2.0 / 48) * x.T @ r, b - lr * (2.0 / 48) * r.sum(0)
    np.testing.assert_allclose(values["w"], w, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(values["b"], b, rtol=RTOL, atol=ATOL)
    assert values["global_step"] == 2
    # the first tower's update op ran (12 rows per step), the other towers' did not
    assert values["seen"] == 24.0
    assert [v.op.name for _, v in towers.grads_and_vars] == ["w", "b"]


def test_build_towers_places_variables_on_cpu0_and_towers_on_their_devices():
    _, _, _, towers, _, meta = _linear_towers(4)
    assert all(v.device.endswith("device:CPU:0") for _, v in towers.grads_and_vars)
    ran_on = {d.device.rsplit("/", 1)[-1] for d in meta.step_stats.dev_stats if d.node_stats}
    assert {"device:CPU:0", "device:CPU:1", "device:CPU:2", "device:CPU:3"} <= ran_on
    assert "device:CPU:4" not in ran_on  # the first N devices, no more


def test_build_towers_refuses_unshared_variables():
    import tensorflow as tf

    def per_tower_variable(xs, ys):
        w = tf.Variable(tf.zeros([5, 1], tf.float64))  # not get_variable: one per tower
        return tf.reduce_mean(tf.square(tf.matmul(xs, w) - ys))

    with pytest.raises(ValueError, match="created variables in tower 1"):
        _linear_towers(2, model_fn=per_tower_variable)


def test_classic_average_gradients_keeps_the_first_towers_variable():
    import tensorflow as tf

    from tfpar.v1 import average_gradients

    with tf.Graph().as_default():
        zeros = tf.compat.v1.zeros_initializer()
        a, b = tf.compat.v1.get_variable("a", [2], initializer=zeros), tf.compat.v1.get_variable("b", [], initializer=zeros)
        towers = [[(tf.constant([1.0, 2.0]), a), (tf.constant(3.0), b)],
                  [(tf.constant([3.0, 6.0]), a), (tf.constant(5.0), b)]]
        mean = average_gradients(towers)
        weighted = average_gradients(towers, [0.25, 0.75])
        with tf.compat.v1.Session() as s:
            got = s.run([g for g, _ in mean] + [g for g, _ in weighted])
    assert mean[0][1] is a and mean[1][1] is b
    np.testing.assert_array_equal(got[0], [2.0, 4.0])
    assert got[1] == 4.0
    np.testing.assert_array_equal(got[2], [2.5, 5.0])
    assert got[3] == 4.5


# ------------------------------------------------------------------ refusals


def test_v1_refuses_features_it_does_not_implement():
    """A valid case v1 does not implement is bad input for tf.v1 (exit 2 on the command line), naming the field."""
    with pytest.raises(CaseError, match=r"^optimizer.name: expected sgd, momentum or adam for tf.v1, got 'rmsprop'$"):
        run_impl(make(MLP, optimizer={"name": "rmsprop", "lr": 0.01}), "tf.v1")
    with pytest.raises(CaseError, match=r"^parallel.batch_norm: expected local for tf.v1"):
        run_impl(make(CNN, parallel__devices=2, parallel__batch_norm="sync"), "tf.v1")
    # without batch-norm layers the setting changes nothing, and nothing is refused
    sync_mlp = make(MLP, parallel__devices=2, parallel__batch_norm="sync")
    assert_trajectories_close(run_impl(sync_mlp, "tf.v1"), run_impl(sync_mlp, "tf.towers"), rtol=RTOL, atol=ATOL)


def test_v1_more_devices_than_configured_is_refused():
    import tfpar
    from tfpar import DeviceError

    case = make(MLP, parallel__devices=4)
    payload = case.payload()
    have = len(tfpar.available_devices())  # 64 logical CPU devices without GPUs (tfpar.devices)
    payload["spec"] = dict(payload["spec"], parallel=dict(payload["spec"]["parallel"], devices=have + 1))
    with pytest.raises(DeviceError, match=f"{have + 1} devices asked for, but this process has {have}"):
        tfpar.run_case(payload, "tf.v1")


@pytest.mark.parametrize(
    ("field", "value"),
    [("class_weights", [1.0, 2.0, 0.5]), ("label_smoothing", 0.1), ("loss_semantics", "torch"), ("from_logits", False)],
)
def test_a_path_without_loss_options_refuses_them(field, value):
    """``refuse_unimplemented`` (for a path that computes the plain loss only) names a loss option it would drop."""
    from tfpar.errors import Unsupported, refuse_unimplemented

    changes = {f"model__{field}": value}
    if field == "from_logits":  # probabilities need a final sigmoid
        changes["model__layers"] = [{"type": "dense", "units": 10, "activation": "relu"},
                                    {"type": "dense", "units": 1, "activation": "sigmoid"}]
    spec = make(MLP if field == "from_logits" else SOFTMAX, **changes).spec
    with pytest.raises(Unsupported, match=rf"^model.{field}: "):
        refuse_unimplemented(spec, "tf.example")
    refuse_unimplemented(spec, "tf.example", loss_options=True)  # a path that has them: no refusal
