"""Adadelta, an optimizer the built-ins do not know, in TensorFlow towers (MLP case of ``tests/helpers.py``).

The case names ``{"name": "adadelta", "lr": ..., "rho": ..., "epsilon": ...}``: kept as data,
read here from ``run.spec["optimizer"]``. Adadelta as ``torch.optim.Adadelta`` computes it::

    v <- rho v + (1 - rho) g^2;  d = sqrt(u + eps) / sqrt(v + eps) g;  u <- rho u + (1 - rho) d^2;  p <- p - lr d
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

import tfpar


@tfpar.plugin.tensorflow(dtypes=("float32", "float64"))
def towers(run):
    dt = tf.float64 if run.dtype == "float64" else tf.float32
    opt = run.spec["optimizer"]
    lr, rho, eps = (tf.constant(opt[k], dt) for k in ("lr", "rho", "epsilon"))
    w = {k: tf.Variable(v) for k, v in run.initial.items()}
    v = {k: tf.Variable(tf.zeros_like(x)) for k, x in w.items()}
    u = {k: tf.Variable(tf.zeros_like(x)) for k, x in w.items()}
    n = len(run.devices)
    run.begin(w)
    for x, y in run.batches():
        grads, losses = [], []
        for dev, xr, yr in zip(run.devices, np.array_split(x, n), np.array_split(y, n), strict=True):
            with tf.device(dev), tf.GradientTape() as tape:
                h = tf.nn.relu(tf.constant(xr) @ w["0.kernel"] + w["0.bias"])
                out = h @ w["1.kernel"] + w["1.bias"]
                loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=tf.constant(yr), logits=out))
            grads.append(tape.gradient(loss, w))
            losses.append(loss)
        g = {k: tf.add_n([gr[k] for gr in grads]) / n for k in w}
        for k in w:
            v[k].assign(rho * v[k] + (1 - rho) * g[k] * g[k])
            d = tf.sqrt(u[k] + eps) / tf.sqrt(v[k] + eps) * g[k]
            u[k].assign(rho * u[k] + (1 - rho) * d * d)
            w[k].assign_sub(lr * d)
        run.record(tf.add_n(losses) / n, w, grads=g)
