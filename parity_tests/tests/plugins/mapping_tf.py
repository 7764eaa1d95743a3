"""TensorFlow plugins for the judge's mapping and rounding tests (``test_mapping.py``).

The MLP case of ``parity_tests/tests/helpers.py`` (dense relu -> dense, sigmoid_ce), trained by
N towers as a user's code does it, each written the way a public program is:

* ``keras_recipe``: docs/plugins.md's Keras recipe, ``keras.config.set_floatx(run.dtype)`` and
  ``keras.config.set_dtype_policy(run.dtype)`` before the model and optimizer are made, and Keras'
  own Adam for the case's values: its learning rate lives in a variable of ``run.dtype`` (float64
  in the float64 run, exact);
* ``keras_l2``: Keras' Adam as Keras' default makes it (floatx float32), with an L2 term
  ``L2 * sum(kernel**2)`` on every kernel added to each tower's loss, as the TF2 custom-loop
  tutorial's kernel regularizers do: a loss term no case field expresses;
* ``own_adamw``: torch's AdamW rule written out by hand (no optimizer class at all);
* ``keras_regularized``: a Keras ``Sequential`` made under ``keras.config.set_floatx(run.dtype)`` with
  ``kernel_regularizer=keras.regularizers.L2(L2)``, ``model.losses`` added to each tower's loss as the
  TF2 custom-loop tutorial does, Keras' SGD: Keras casts the factor through float32 even in a float64 run
  (``L2.__call__``: ``ops.cast(self.l2, x.dtype)``), which no user code can reach;
* ``v1_losses``: a slim-style tower loop whose loss is ``tf.compat.v1.losses.sigmoid_cross_entropy``,
  which reduces in float32 even when its inputs are float64 (``compute_weighted_loss`` casts the
  per-example losses to float32, sums them and casts the mean back).
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

import tfpar

BOTH = ("float32", "float64")
#: the L2 factor of ``keras_l2`` (and of the torch ports in ``mapping_torch.py``): the tutorial's 1e-5 is
#: too small to move a 4-step run past the float64 bound by much; 1e-2 makes the term count
L2 = 1e-2


def _keras_adam(spec: dict):
    import keras

    o = spec["optimizer"]
    return keras.optimizers.Adam(o["lr"], beta_1=o["beta1"], beta_2=o["beta2"], epsilon=o["epsilon"])


def _tower_loss(w: dict, x, y, *, l2: float = 0.0, v1: bool = False):
    logits = tf.nn.relu(tf.constant(x) @ w["0.kernel"] + w["0.bias"]) @ w["1.kernel"] + w["1.bias"]
    if v1:
        loss = tf.compat.v1.losses.sigmoid_cross_entropy(tf.constant(y), logits)
    else:
        loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=tf.constant(y), logits=logits))
    if l2:
        loss += l2 * (tf.reduce_sum(w["0.kernel"] ** 2) + tf.reduce_sum(w["1.kernel"] ** 2))
    return loss


def _towers(run, apply, *, l2: float = 0.0, v1: bool = False, opt=None) -> None:
    """Each tower's loss and gradient on its contiguous slice, the gradients averaged, ``apply(g, w)``.

    ``opt``: the Keras optimizer ``apply`` uses, handed to ``run.use_optimizer`` (``--lockstep`` loads
    the reference's state into it; otherwise nothing happens).
    """
    w = {k: tf.Variable(v) for k, v in run.initial.items()}
    n = len(run.devices)
    if opt is not None:
        run.use_optimizer(opt, w)
    run.begin(w)
    for x, y in run.batches():
        grads, losses = [], []
        for dev, xr, yr in zip(run.devices, np.array_split(x, n), np.array_split(y, n), strict=True):
            with tf.device(dev), tf.GradientTape() as tape:
                loss = _tower_loss(w, xr, yr, l2=l2, v1=v1)
            grads.append(tape.gradient(loss, w))
            losses.append(loss)
        g = {k: tf.add_n([gr[k] for gr in grads]) / n for k in w}
        apply(g, w)
        run.record(tf.add_n(losses) / n, w, grads=g)


@tfpar.plugin.tensorflow(dtypes=BOTH)
def keras_recipe(run):
    """docs/plugins.md's recipe: floatx and the dtype policy set to ``run.dtype``, then Keras' Adam."""
    import keras

    keras.config.set_floatx(run.dtype)
    keras.config.set_dtype_policy(run.dtype)
    opt = _keras_adam(run.spec)
    _towers(run, lambda g, w: opt.apply_gradients([(g[k], w[k]) for k in w]), opt=opt)


@tfpar.plugin.tensorflow(dtypes=BOTH)
def keras_l2(run):
    """Keras' Adam (floatx float32, its default) and an L2 term on every kernel in the loss."""
    opt = _keras_adam(run.spec)
    _towers(run, lambda g, w: opt.apply_gradients([(g[k], w[k]) for k in w]), l2=L2, opt=opt)


@tfpar.plugin.tensorflow(dtypes=BOTH)
def keras_adam(run):
    """Keras' Adam (floatx float32, its default), nothing else: ``keras_l2`` without the L2 term."""
    opt = _keras_adam(run.spec)
    _towers(run, lambda g, w: opt.apply_gradients([(g[k], w[k]) for k in w]), opt=opt)


def _adamw_by_hand(run, *, keras_eps: bool) -> None:
    """AdamW written out, numbers exact: decay ``p -= lr wd p``, then Adam's step with ``eps`` added to
    ``sqrt(v_hat)`` (torch's rule) or, ``keras_eps``, to ``sqrt(v)`` (Keras':
    ``p -= lr sqrt(1 - b2^t) / (1 - b1^t) m / (sqrt(v) + eps)``)."""
    o = run.spec["optimizer"]
    lr, b1, b2, eps, wd = o["lr"], o["beta1"], o["beta2"], o["epsilon"], o["weight_decay"]
    state = {"t": 0, "m": {}, "v": {}}

    def apply(g, w):
        state["t"] += 1
        t = state["t"]
        for k in w:
            m = state["m"][k] = b1 * state["m"].get(k, tf.zeros_like(w[k])) + (1 - b1) * g[k]
            v = state["v"][k] = b2 * state["v"].get(k, tf.zeros_like(w[k])) + (1 - b2) * g[k] * g[k]
            w[k].assign(w[k] * (1 - lr * wd))
            if keras_eps:
                w[k].assign_sub(lr * (1 - b2 ** t) ** 0.5 / (1 - b1 ** t) * m / (tf.sqrt(v) + eps))
            else:
                w[k].assign_sub(lr / (1 - b1 ** t) * m / (tf.sqrt(v / (1 - b2 ** t)) + eps))

    _towers(run, apply)


@tfpar.plugin.tensorflow(dtypes=BOTH)
def own_adamw(run):
    """torch's AdamW written out (eps added to sqrt(v_hat))."""
    _adamw_by_hand(run, keras_eps=False)


@tfpar.plugin.tensorflow(dtypes=BOTH)
def own_keras_adamw(run):
    """Keras' AdamW written out, numbers exact (eps added to sqrt(v), not to sqrt(v_hat))."""
    _adamw_by_hand(run, keras_eps=True)


@tfpar.plugin.tensorflow(dtypes=BOTH)
def v1_losses(run):
    """Slim-style: the loss from ``tf.compat.v1.losses`` (reduced in float32), exact plain SGD."""
    lr = run.spec["optimizer"]["lr"]
    _towers(run, lambda g, w: [w[k].assign_sub(lr * g[k]) for k in w], v1=True)


@tfpar.plugin.tensorflow(dtypes=BOTH)
def v1_losses_lr_bug(run):
    """``v1_losses`` with a seeded bug: the learning rate of the last parameter is 1.001 times the case's."""
    lr = run.spec["optimizer"]["lr"]
    last = sorted(run.initial)[-1]
    _towers(run, lambda g, w: [w[k].assign_sub(lr * (1.001 if k == last else 1.0) * g[k]) for k in w], v1=True)


@tfpar.plugin.tensorflow(dtypes=BOTH)
def keras_regularized(run):
    """Keras layers with ``L2(L2)`` kernel regularizers and Keras' SGD, ``model.losses`` in each tower's loss."""
    import keras

    keras.config.set_floatx(run.dtype)
    reg = keras.regularizers.L2
    model = keras.Sequential([keras.Input(shape=(5,)),
                              keras.layers.Dense(10, activation="relu", kernel_regularizer=reg(L2)),
                              keras.layers.Dense(1, kernel_regularizer=reg(L2))])
    names = ("0.kernel", "0.bias", "1.kernel", "1.bias")
    model.set_weights([run.initial[k] for k in names])
    w = model.trainable_variables  # in ``names``' order
    opt = keras.optimizers.SGD(run.spec["optimizer"]["lr"])
    n = len(run.devices)
    run.begin(dict(zip(names, w, strict=True)))
    for x, y in run.batches():
        grads, losses = [], []
        for dev, xr, yr in zip(run.devices, np.array_split(x, n), np.array_split(y, n), strict=True):
            with tf.device(dev), tf.GradientTape() as tape:
                logits = model(tf.constant(xr))
                loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=tf.constant(yr), logits=logits))
                loss += tf.add_n(model.losses)
            grads.append(tape.gradient(loss, w))
            losses.append(loss)
        g = [tf.add_n([gr[i] for gr in grads]) / n for i in range(len(w))]
        opt.apply_gradients(zip(g, w, strict=True))
        run.record(tf.add_n(losses) / n, dict(zip(names, w, strict=True)), grads=dict(zip(names, g, strict=True)))
