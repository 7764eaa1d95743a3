"""TensorFlow plugins for the judge's own tests (``test_pair.py``): correct Keras towers, and wrong logged losses.

The MLP case of ``parity_tests/tests/helpers.py`` (relu or tanh); the update is Keras' own optimizer class
for the case's optimizer (SGD, momentum or Adam), as a user's tower code runs it. What
differs between them is only what is recorded: the loss that is logged, and whether the
applied gradient is given to ``run.record``.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

import tfpar

BOTH = ("float32", "float64")


def _optimizer(spec: dict):
    import keras

    o = spec["optimizer"]
    if o["name"] == "adam":
        return keras.optimizers.Adam(o["lr"], beta_1=o["beta1"], beta_2=o["beta2"], epsilon=o["epsilon"])
    return keras.optimizers.SGD(o["lr"], momentum=o.get("momentum", 0.0))


def _towers(run, *, logged: str = "mean", grads: bool = False) -> None:
    w = {k: tf.Variable(v) for k, v in run.initial.items()}
    opt = _optimizer(run.spec)
    n = len(run.devices)
    act = {"relu": tf.nn.relu, "tanh": tf.tanh}[run.spec["model"]["layers"][0]["activation"]]
    run.begin(w)
    for x, y in run.batches():
        g_towers, losses = [], []
        for dev, xr, yr in zip(run.devices, np.array_split(x, n), np.array_split(y, n), strict=True):
            with tf.device(dev), tf.GradientTape() as tape:
                out = act(tf.constant(xr) @ w["0.kernel"] + w["0.bias"]) @ w["1.kernel"] + w["1.bias"]
                loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=tf.constant(yr), logits=out))
            g_towers.append(tape.gradient(loss, w))
            losses.append(loss)
        g = {k: tf.add_n([gr[k] for gr in g_towers]) / n for k in w}
        opt.apply_gradients([(g[k], w[k]) for k in w])
        if logged == "mean":
            value = tf.add_n(losses) / n
        elif logged == "last_tower":
            value = losses[-1]
        elif logged == "first_tower":
            value = losses[0]
        elif logged == "sum":
            value = tf.add_n(losses)
        else:  # "after_update": the loss of the same batch recomputed with the new weights
            xs = tf.constant(x)
            out = act(xs @ w["0.kernel"] + w["0.bias"]) @ w["1.kernel"] + w["1.bias"]
            value = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=tf.constant(y), logits=out))
        run.record(value, w, grads=g if grads else None)


@tfpar.plugin.tensorflow(dtypes=BOTH)
def keras_towers(run):
    """Correct towers, no gradient recorded."""
    _towers(run)


@tfpar.plugin.tensorflow(dtypes=BOTH)
def keras_towers_grads(run):
    """Correct towers, the applied gradient recorded."""
    _towers(run, grads=True)


@tfpar.plugin.tensorflow(dtypes=BOTH)
def logs_last_tower(run):
    _towers(run, logged="last_tower")


@tfpar.plugin.tensorflow(dtypes=BOTH)
def logs_first_tower(run):
    _towers(run, logged="first_tower")


@tfpar.plugin.tensorflow(dtypes=BOTH)
def logs_sum(run):
    _towers(run, logged="sum")


@tfpar.plugin.tensorflow(dtypes=BOTH)
def logs_after_update(run):
    _towers(run, logged="after_update")
