"""tfpar compare examples/byo/poly-adam/case.json --impls examples/byo/poly-adam/tf_graph.py:make_parallel,examples/byo/poly-adam/torch_ddp.py:ddp,torch.ddp

The seed's ``make_parallel`` program, as a ``tf.compat.v1`` graph, wrapped as a
tfpar plugin. The program (a polynomial fit ``y = w . [x^2, x, 1]``)::

    def make_parallel(fn, num_gpus, **kwargs):
        in_splits = {k: tf.split(v, num_gpus) for k, v in kwargs.items()}
        out_split = []
        for i in range(num_gpus):
            with tf.device(...GPU i...), tf.variable_scope(tf.get_variable_scope(), reuse=i > 0):
                out_split.append(fn(**{k: v[i] for k, v in in_splits.items()}))
        return tf.concat(out_split, axis=0)

    loss = tf.reduce_mean(make_parallel(model, num_gpus, x=x, y=y))   # ONE mean over all examples
    train_op = tf.train.AdamOptimizer(0.1).minimize(loss, colocate_gradients_with_ops=True)

Each tower returns its per-example squared errors; they are concatenated and
averaged once, so the loss is the mean over the whole global batch whatever
the split (``weighting: by_size`` in the case; for even shards the same as the
mean of the tower means, ``combine: loss_mean``). Differentiating that one
mean is what makes this "parallel": the gradient flows back through every
tower's device.

Two functions:

``make_parallel``
    the program, with Adam's hyperparameters given as tensors of the case
    dtype, so a float64 run computes Adam's rule in float64.
``make_parallel_as_written``
    the program exactly as the seed wrote it, ``AdamOptimizer(0.1)`` with
    Python floats: ``tf.compat.v1.train`` optimizers turn those into float32
    tensors (``beta1``, ``beta2``, ``epsilon``, ``lr`` and the ``beta^t``
    accumulators are float32 even when the variables are float64). The README
    shows the tool reporting that as a divergence of about 1e-7.
"""

from __future__ import annotations

import math

import numpy as np
import tensorflow as tf

import tfpar

v1 = tf.compat.v1


def model(x, y, *, dtype, initial_w):
    """One tower: ``x [n]``, ``y [n, 1]`` -> per-example squared errors ``[n, 1]``.

    ``get_variable`` (not ``tf.Variable``) so the towers built with ``reuse=True``
    share the first tower's ``w`` instead of each creating their own.
    """
    w = v1.get_variable("w", dtype=dtype, initializer=tf.constant(initial_w, dtype))  # [3, 1]
    f = tf.stack([tf.square(x), x, tf.ones_like(x)], 1)                  # [n, 3]: x^2, x, 1
    return tf.square(tf.matmul(f, w) - y)


def _make_parallel(fn, devices, sizes, **kwargs):
    """The seed's helper: split every input, one tower per device, concatenate the outputs.

    ``sizes``: rows per tower. ``tf.split(v, num_gpus)`` needs equal parts; the
    ``np.array_split`` sizes keep the program valid for any batch and device count.
    """
    in_splits = {k: tf.split(v, sizes) for k, v in kwargs.items()}
    out_split = []
    for i, device in enumerate(devices):
        with tf.device(device), v1.variable_scope(v1.get_variable_scope(), reuse=i > 0):
            out_split.append(fn(**{k: v[i] for k, v in in_splits.items()}))
    return tf.concat(out_split, axis=0)


def _train(run, *, hyperparameters_in_case_dtype: bool) -> None:
    dt = tf.float64 if run.dtype == "float64" else tf.float32
    opt_spec = run.spec["optimizer"]
    lr, b1, b2, eps = opt_spec["lr"], opt_spec["beta1"], opt_spec["beta2"], opt_spec["epsilon"]
    b = run.spec["data"]["global_batch"]
    sizes = [len(part) for part in np.array_split(np.arange(b), len(run.devices))]
    # torch semantics (epsilon added to the bias-corrected sqrt(v)) from TensorFlow's
    # rule (epsilon added to the raw sqrt(v)): eps_hat_t = eps * sqrt(1 - b2^t), fed per step
    torch_rule = opt_spec["semantics"] == "torch"

    with tf.Graph().as_default() as graph:
        x = v1.placeholder(dt, [b], name="x")
        y = v1.placeholder(dt, [b, 1], name="y")
        eps_hat = v1.placeholder(dt, [], name="eps_hat")
        per_example = _make_parallel(lambda x, y: model(x, y, dtype=dt, initial_w=run.initial["1.kernel"]),
                                     run.devices, sizes, x=x, y=y)
        loss = tf.reduce_mean(per_example)
        if hyperparameters_in_case_dtype:
            # tf.constant(v, dt), not tf.cast(v, dt): a cast of a Python float goes through float32
            opt = v1.train.AdamOptimizer(tf.constant(lr, dt), beta1=tf.constant(b1, dt), beta2=tf.constant(b2, dt),
                                         epsilon=eps_hat)
        else:
            opt = v1.train.AdamOptimizer(lr, beta1=b1, beta2=b2, epsilon=eps)
        # minimize() is compute_gradients + apply_gradients; kept apart to record the gradient applied
        grads_and_vars = opt.compute_gradients(loss, colocate_gradients_with_ops=True)
        train_op = opt.apply_gradients(grads_and_vars)
        # one variable, however many towers: they all reused the first tower's w
        (w,) = v1.trainable_variables()

        with v1.Session(graph=graph) as sess:
            sess.run(v1.global_variables_initializer())
            run.begin({"1.kernel": sess.run(w)})
            for t, (xb, yb) in enumerate(run.batches(), start=1):
                feed = {x: xb, y: yb, eps_hat: eps * math.sqrt(1.0 - b2 ** t) if torch_rule else eps}
                loss_value, grad, _ = sess.run([loss, grads_and_vars[0][0], train_op], feed)
                run.record(loss_value, {"1.kernel": sess.run(w)}, grads={"1.kernel": grad})


@tfpar.plugin.tensorflow(dtypes=("float32", "float64"))
def make_parallel(run):
    """The seed's program, Adam's hyperparameters as tensors of the case dtype."""
    _train(run, hyperparameters_in_case_dtype=True)


@tfpar.plugin.tensorflow(dtypes=("float32", "float64"))
def make_parallel_as_written(run):
    """The seed's program verbatim: ``AdamOptimizer`` with Python floats (float32 hyperparameters)."""
    _train(run, hyperparameters_in_case_dtype=False)
