"""A TensorFlow tower trainer built from a Keras ``Sequential`` that passes no ``activations=`` (test_layer_hooks.py).

One model, its variables shared by the N towers: each tower calls it on its shard under
``tf.device``, the gradients are averaged, one SGD step. Variants: the seeded forward bug
(``sigmoid`` in layer 1) on every tower or on tower 2 only, the tower step as a ``tf.function``,
one that reports an activation by hand, and the same training under ``tf.distribute.MirroredStrategy``.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

import tfpar

BOTH = ("float32", "float64")


def _model(run, act1="tanh"):
    """The case's three dense layers as a Keras ``Sequential``, loaded; and its variables by canonical name."""
    dt = run.dtype
    model = keras.Sequential([keras.Input((5,), dtype=dt), keras.layers.Dense(6, activation="tanh", dtype=dt),
                              keras.layers.Dense(6, activation=act1, dtype=dt), keras.layers.Dense(1, dtype=dt)])
    for i, layer in enumerate(model.layers):
        layer.kernel.assign(run.initial[f"{i}.kernel"])
        layer.bias.assign(run.initial[f"{i}.bias"])
    return model, {**{f"{i}.kernel": layer.kernel for i, layer in enumerate(model.layers)},
                   **{f"{i}.bias": layer.bias for i, layer in enumerate(model.layers)}}


def _train(run, *, act1="tanh", bad_tower=None, function=False, by_hand=False):
    dt = run.dtype
    on_bad = [False]
    if bad_tower is not None:  # the bug on one tower only: eager code reads the flag per call
        act1 = lambda h: tf.sigmoid(h) if on_bad[0] else tf.tanh(h)  # noqa: E731
    model, params = _model(run, act1)
    lr = tf.constant(run.spec["optimizer"]["lr"], dt)
    n = len(run.devices)

    def tower(x, y):
        with tf.GradientTape() as tape:
            out = model(x)
            loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=y, logits=out))
        return loss, dict(zip(params, tape.gradient(loss, list(params.values())), strict=True)), out

    step = tf.function(tower) if function else tower
    run.begin(params)
    for x, y in run.batches():
        losses, grads, outs = [], [], []
        for r, (dev, xr, yr) in enumerate(zip(run.devices, np.array_split(x, n), np.array_split(y, n), strict=True)):
            on_bad[0] = r == bad_tower
            with tf.device(dev):
                loss, g, out = step(tf.constant(xr), tf.constant(yr))
            losses.append(loss)
            grads.append(g)
            outs.append(out)
        g = {k: tf.add_n([gr[k] for gr in grads]) / n for k in params}
        for k, v in params.items():
            v.assign_sub(lr * g[k])
        extra = {"activations": [{"logits": o} for o in outs]} if by_hand else {}
        run.record(tf.add_n(losses) / n, params, grads=g, **extra)


@tfpar.plugin.tensorflow(dtypes=BOTH)
def good(run):
    _train(run)


@tfpar.plugin.tensorflow(dtypes=BOTH)
def sigmoid_layer_1(run):
    _train(run, act1="sigmoid")


@tfpar.plugin.tensorflow(dtypes=BOTH)
def sigmoid_layer_1_function(run):
    _train(run, act1="sigmoid", function=True)


@tfpar.plugin.tensorflow(dtypes=BOTH)
def good_function(run):
    _train(run, function=True)


@tfpar.plugin.tensorflow(dtypes=BOTH)
def sigmoid_layer_1_tower_2(run):
    _train(run, bad_tower=2)


@tfpar.plugin.tensorflow(dtypes=BOTH)
def by_hand(run):
    _train(run, by_hand=True)


@tfpar.plugin.tensorflow(dtypes=BOTH)
def mirrored(run):
    """``strategy.run`` of the tower step inside a ``tf.function``: replicas on their own threads and devices."""
    strategy = tf.distribute.MirroredStrategy(run.devices)
    with strategy.scope():
        model, params = _model(run)
    lr = tf.constant(run.spec["optimizer"]["lr"], run.dtype)
    n = len(run.devices)

    def tower(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=y, logits=model(x)))
        ctx = tf.distribute.get_replica_context()
        grads = ctx.all_reduce("mean", tape.gradient(loss, list(params.values())))
        for v, g in zip(params.values(), grads, strict=True):
            v.assign_sub(lr * g)
        return ctx.all_reduce("mean", loss)

    step = tf.function(lambda x, y: strategy.run(tower, args=(x, y)))
    run.begin(params)
    for x, y in run.batches():
        xs, ys = np.array_split(x, n), np.array_split(y, n)
        per = [strategy.experimental_distribute_values_from_function(lambda c, a=a: tf.constant(a[c.replica_id_in_sync_group]))
               for a in (xs, ys)]
        loss = step(*per)
        run.record(strategy.experimental_local_results(loss)[0], params)
