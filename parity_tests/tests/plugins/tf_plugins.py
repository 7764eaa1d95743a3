"""TensorFlow plugins for the MLP case of ``parity_tests/tests/helpers.py`` (dense relu -> dense, sigmoid_ce, SGD).

``good`` is a correct tower trainer (split, per-tower gradients on each device,
average, one SGD step); every other function is ``good`` with one protocol mistake.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

import tfpar

BOTH = ("float32", "float64")


def _train(run, *, begin=True, steps=None, change=None, lr_scale=lambda k: 1.0):
    dt = tf.float64 if run.dtype == "float64" else tf.float32
    w = {k: tf.Variable(v) for k, v in run.initial.items()}
    lr0 = run.spec["optimizer"]["lr"]
    n = len(run.devices)
    if begin:
        run.begin(w)
    for k, (x, y) in enumerate(run.batches(), start=run.first_step):
        if steps is not None and k > steps:
            break
        grads, losses = [], []
        for dev, xr, yr in zip(run.devices, np.array_split(x, n), np.array_split(y, n), strict=True):
            with tf.device(dev), tf.GradientTape() as tape:
                h = tf.nn.relu(tf.constant(xr) @ w["0.kernel"] + w["0.bias"])
                out = h @ w["1.kernel"] + w["1.bias"]
                loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=tf.constant(yr), logits=out))
            grads.append(tape.gradient(loss, w))
            losses.append(loss)
        g = {name: tf.add_n([gr[name] for gr in grads]) / n for name in w}
        lr = tf.constant(lr0 * lr_scale(k), dt)
        for name in w:
            w[name].assign_sub(lr * g[name])
        loss, params = tf.add_n(losses) / n, dict(w)
        if change:
            loss, params = change(k, loss, params)
        run.record(loss, params, grads=g)
    if steps is not None and steps > run.steps:
        run.record(loss, dict(w))


@tfpar.plugin.tensorflow(dtypes=BOTH)
def good(run):
    _train(run)


@tfpar.plugin.tensorflow(dtypes=BOTH)
def lr_doubled_from_step_3(run):
    _train(run, lr_scale=lambda k: 2.0 if k >= 3 else 1.0)


@tfpar.plugin.tensorflow
def float32_only(run):
    _train(run)


@tfpar.plugin.tensorflow(dtypes=BOTH)
def no_begin(run):
    _train(run, begin=False)


@tfpar.plugin.tensorflow(dtypes=BOTH)
def one_step_short(run):
    _train(run, steps=run.steps - 1)


@tfpar.plugin.tensorflow(dtypes=BOTH)
def one_step_extra(run):
    _train(run, steps=run.steps + 1)


@tfpar.plugin.tensorflow(dtypes=BOTH)
def extra_name(run):
    _train(run, change=lambda k, loss, p: (loss, {**p, "0.kernal": p["0.kernel"]}))


@tfpar.plugin.tensorflow(dtypes=BOTH)
def missing_name(run):
    _train(run, change=lambda k, loss, p: (loss, {n: v for n, v in p.items() if n != "1.bias"}))


@tfpar.plugin.tensorflow(dtypes=BOTH)
def wrong_shape(run):
    # a torch-layout kernel recorded without run.to_tf
    _train(run, change=lambda k, loss, p: (loss, {**p, "0.kernel": tf.transpose(p["0.kernel"])}))


@tfpar.plugin.tensorflow(dtypes=BOTH)
def nan_at_step_2(run):
    def change(k, loss, p):
        if k == 2:
            p = {**p, "1.bias": p["1.bias"] * np.nan}
        return loss, p

    _train(run, change=change)


@tfpar.plugin.tensorflow(dtypes=BOTH)
def raises_at_step_3(run):
    def change(k, loss, p):
        if k == 3:
            raise ValueError("the learning rate schedule ran out")
        return loss, p

    _train(run, change=change)


def _keras_opt(spec):
    """Keras' own class for the case's optimizer, with its nominal hyperparameters (what a user writes)."""
    import keras

    o = spec["optimizer"]
    if o["name"] == "adam":
        return keras.optimizers.Adam(o["lr"], beta_1=o["beta1"], beta_2=o["beta2"], epsilon=o["epsilon"])
    return keras.optimizers.SGD(o["lr"], momentum=o.get("momentum", 0.0))


def _keras_sgd(run):
    """The towers of ``_train`` with the update applied by Keras' own optimizer class (SGD, momentum or Adam)."""
    w = {k: tf.Variable(v) for k, v in run.initial.items()}
    opt = _keras_opt(run.spec)
    n = len(run.devices)
    run.begin(w)
    for x, y in run.batches():
        grads, losses = [], []
        for dev, xr, yr in zip(run.devices, np.array_split(x, n), np.array_split(y, n), strict=True):
            with tf.device(dev), tf.GradientTape() as tape:
                out = tf.nn.relu(tf.constant(xr) @ w["0.kernel"] + w["0.bias"]) @ w["1.kernel"] + w["1.bias"]
                loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=tf.constant(yr), logits=out))
            grads.append(tape.gradient(loss, w))
            losses.append(loss)
        g = {k: tf.add_n([gr[k] for gr in grads]) / n for k in w}
        opt.apply_gradients([(g[k], w[k]) for k in w])
        run.record(tf.add_n(losses) / n, w, grads=g)


@tfpar.plugin.tensorflow(dtypes=BOTH, keras=True)
def keras_sgd(run):
    _keras_sgd(run)


@tfpar.plugin.tensorflow(dtypes=BOTH)
def keras_sgd_undeclared(run):
    _keras_sgd(run)


@tfpar.plugin.tensorflow(dtypes=BOTH)
def keras_floatx64(run):
    """Keras code that sets ``floatx`` float64 first (as float64 Keras programs do): its rate stays exact."""
    import keras

    before = keras.config.floatx()
    keras.config.set_floatx("float64" if run.dtype == "float64" else "float32")
    try:
        _keras_sgd(run)
    finally:
        keras.config.set_floatx(before)


def undecorated(run):
    _train(run)


def _schedule(run):
    return run.spec["optimizer"]["lr_schedule"]  # a key the case does not have: raises KeyError


@tfpar.plugin.tensorflow(dtypes=BOTH)
def raises_before_begin(run):
    _schedule(run)  # before run.begin: the line says "before step 1"
    _train(run)


@tfpar.plugin.tensorflow(dtypes=BOTH)
def prints(run):
    """``good``, printing as a user's program does: a line on stdout, an unfinished line on stderr."""
    import sys

    print(f"a line from the plugin ({run.dtype})")
    print("an unfinished line", end="", file=sys.stderr)
    _train(run)


@tfpar.plugin.tensorflow(dtypes=BOTH)
def exits_at_step_2(run):
    """Leaves without a word at step 2 (a crash inside a library looks like this to the tool)."""
    import os

    def change(k, loss, params):
        if k == 2:
            os._exit(3)
        return loss, params

    _train(run, change=change)
