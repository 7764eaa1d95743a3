"""A TensorFlow plugin for an external model: linear regression under the user's own names ``lin.w``, ``lin.b``.

The tool knows the model only through ``init.npz``; ``run.begin`` says both names are parameters.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

import tfpar


@tfpar.plugin.tensorflow(dtypes=("float32", "float64"))
def towers(run):
    dt = tf.float64 if run.dtype == "float64" else tf.float32
    w = {k: tf.Variable(v) for k, v in run.initial.items()}
    lr = tf.constant(run.spec["optimizer"]["lr"], dt)
    n = len(run.devices)
    run.begin(w)
    for x, y in run.batches():
        grads, losses = [], []
        for dev, xr, yr in zip(run.devices, np.array_split(x, n), np.array_split(y, n), strict=True):
            with tf.device(dev), tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(xr @ w["lin.w"] + w["lin.b"] - yr))
            grads.append(tape.gradient(loss, w))
            losses.append(loss)
        g = {k: tf.add_n([gr[k] for gr in grads]) / n for k in w}
        for k in w:
            w[k].assign_sub(lr * g[k])
        run.record(tf.add_n(losses) / n, w, grads=g)
