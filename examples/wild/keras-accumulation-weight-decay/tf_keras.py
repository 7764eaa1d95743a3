"""keras-team/keras #19990 / PR #19998, reproduced: Keras 3 gradient accumulation is not the large batch.

    tfpar compare examples/wild/keras-accumulation-weight-decay/case.json --impls tf.towers,examples/wild/keras-accumulation-weight-decay/tf_keras.py:fixed,examples/wild/keras-accumulation-weight-decay/tf_keras.py:buggy

Origin (written anew, not copied): keras-team/keras at d7a8c20d104f26716ff496fe71d4fdefdffc2bbc (the
parent of the fix 0ed820f5), ``keras/src/optimizers/base_optimizer.py``: ``apply`` L347-348 clips the
gradients and applies weight decay on *every* call, i.e. every micro-step of an accumulation window;
``_backend_apply_gradients`` L373-376 updates only when ``(iterations + 1) % gradient_accumulation_steps
== 0``, with the mean of the accumulated gradients, and L427 advances ``iterations`` on every micro-step,
so Adam's bias correction at the first real update reads ``t = k`` instead of 1. The issue's test: SGD
without weight decay matches the large batch, SGD with weight decay does not (decay k times per update),
Adam never does (the step counter). The fix hides the raw counter behind ``iterations`` (micro-steps
// k) and applies clipping and decay only on the update step.

Both versions are the optimizer's arithmetic written out in TensorFlow (Keras' AdamW rule,
``semantics: tf``: ``p <- p - p wd lr``, then ``m <- m + (g - m)(1 - b1)``, ``v <- v + (g^2 - v)(1 - b2)``,
``p <- p - lr sqrt(1 - b2^t) / (1 - b1^t) m / (sqrt(v) + eps)``) in the case dtype, so the float64
run has no float32 constant in it; the built-in ``tf.towers`` with ``parallel.accumulate`` is the large
batch it must equal.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

import tfpar

NAMES = ("0.kernel", "0.bias", "1.kernel", "1.bias")


def _train(run, *, pre_fix: bool) -> None:
    dt = tf.float64 if run.dtype == "float64" else tf.float32
    c = lambda v: tf.constant(v, dt)  # noqa: E731  (a Python float straight to the case dtype, never via float32)
    w = {n: tf.Variable(run.initial[n]) for n in NAMES}
    o = run.spec["optimizer"]
    lr, wd, eps, b1, b2 = c(o["lr"]), c(o["weight_decay"]), c(o["epsilon"]), c(o.get("beta1", 0.9)), c(o.get("beta2", 0.999))
    m = {n: tf.Variable(tf.zeros_like(w[n])) for n in NAMES}
    v = {n: tf.Variable(tf.zeros_like(w[n])) for n in NAMES}
    acc = {n: tf.Variable(tf.zeros_like(w[n])) for n in NAMES}
    k = run.spec["parallel"].get("accumulate", 1)
    raw = 0                                                   # the optimizer's own counter: one per apply()
    run.begin(w)
    for x, y in run.batches():
        losses, acts = [], {"0": [], "1": []}
        for xm, ym in zip(np.array_split(x, k), np.array_split(y, k), strict=True):
            with tf.GradientTape() as tape:
                h = tf.nn.relu(xm @ w["0.kernel"] + w["0.bias"])
                logits = h @ w["1.kernel"] + w["1.bias"]
                loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=ym, logits=logits))
            g = dict(zip(NAMES, tape.gradient(loss, [w[n] for n in NAMES]), strict=True))
            losses.append(loss)
            acts["0"].append(h)                               # each layer's output, micro-batch by micro-batch
            acts["1"].append(logits)
            update = (raw + 1) % k == 0
            if pre_fix or update:                             # L348: decay at every apply(); fixed: on the update only
                for n in NAMES:
                    w[n].assign_sub(w[n] * wd * lr)
            if update:
                t = c(raw + 1 if pre_fix else (raw + 1) // k)  # L427: the raw micro-step count; fixed: real steps
                applied = {}
                for n in NAMES:
                    gm = (g[n] + acc[n]) / c(k)
                    applied[n] = gm
                    m[n].assign_add((gm - m[n]) * (c(1.0) - b1))
                    v[n].assign_add((tf.square(gm) - v[n]) * (c(1.0) - b2))
                    alpha = lr * tf.sqrt(c(1.0) - tf.pow(b2, t)) / (c(1.0) - tf.pow(b1, t))
                    w[n].assign_sub(alpha * m[n] / (tf.sqrt(v[n]) + eps))
                    acc[n].assign(tf.zeros_like(acc[n]))
            else:
                for n in NAMES:
                    acc[n].assign_add(g[n])
            raw += 1
        # the rows and layer outputs of the one tower, micro-batches in order (as tf.towers captures them): the
        # stage chain sees micro-batch 1 agree and micro-batch 2 read decayed weights (localise._later_micro_batch)
        run.record(tf.add_n(losses) / c(k), w, grads=applied, device_inputs=[x],
                   activations=[{layer: tf.concat(outs, 0) for layer, outs in acts.items()}])


@tfpar.plugin.tensorflow(dtypes=("float32", "float64"))
def buggy(run):
    """Keras before PR #19998: decay every micro-step, ``iterations`` counting micro-steps."""
    _train(run, pre_fix=True)


@tfpar.plugin.tensorflow(dtypes=("float32", "float64"))
def fixed(run):
    """Keras after PR #19998: decay and the step counter once per real update."""
    _train(run, pre_fix=False)
