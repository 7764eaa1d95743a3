"""A TensorFlow tower plugin for the MLP case of ``tests/helpers.py`` training with the Keras optimizer the case names.

Per-tower gradients on each device, averaged, one ``apply_gradients`` of a ``keras.optimizers``
class with the case's hyperparameters; ``run.use_optimizer`` hands it to the tool, so that
``--lockstep`` can start each step from the reference's optimizer state (``tests/test_lockstep_plugins.py``).
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

import tfpar

NAMES = ("0.kernel", "0.bias", "1.kernel", "1.bias")


def keras_optimizer(opt: dict) -> keras.optimizers.Optimizer:
    name, lr = opt["name"], opt["lr"]
    schedule = opt.get("schedule", {"kind": "constant"})
    if schedule["kind"] == "warmup_cosine":  # as a Keras user writes warm-up + cosine (alpha: a fraction of lr)
        lr = keras.optimizers.schedules.CosineDecay(0.0, schedule["decay_steps"], alpha=schedule["min_lr"] / lr,
                                                    warmup_target=lr, warmup_steps=schedule["warmup_steps"])
    if name in ("adam", "amsgrad"):
        return keras.optimizers.Adam(lr, beta_1=opt["beta1"], beta_2=opt["beta2"], epsilon=opt["epsilon"],
                                     amsgrad=name == "amsgrad")
    if name == "rmsprop":
        return keras.optimizers.RMSprop(lr, rho=opt["rho"], epsilon=opt["epsilon"], momentum=opt["momentum"],
                                        centered=opt["centered"])
    if name == "adagrad":
        return keras.optimizers.Adagrad(lr, initial_accumulator_value=opt["initial_accumulator"], epsilon=opt["epsilon"])
    if name == "adadelta":
        return keras.optimizers.Adadelta(lr, rho=opt["rho"], epsilon=opt["epsilon"])
    return keras.optimizers.SGD(lr, momentum=opt.get("momentum", 0.0), nesterov=name == "nesterov")


@tfpar.plugin.tensorflow(dtypes=("float32", "float64"))
def towers(run):
    dt = run.dtype
    model = keras.Sequential([keras.Input(shape=(5,), dtype=dt), keras.layers.Dense(10, activation="relu", dtype=dt),
                              keras.layers.Dense(1, dtype=dt)])
    model.set_weights([run.initial[k] for k in NAMES])
    variables = dict(zip(NAMES, model.trainable_variables, strict=True))
    optimizer = keras_optimizer(run.spec["optimizer"])
    run.use_optimizer(optimizer, variables)  # under --lockstep: the reference's slots and step counter
    n = len(run.devices)

    def params():
        return {k: v.numpy() for k, v in variables.items()}

    run.begin(params())
    for x, y in run.batches():
        grads, losses = [], []
        for dev, xr, yr in zip(run.devices, np.array_split(x, n), np.array_split(y, n), strict=True):
            with tf.device(dev), tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=yr, logits=model(xr)))
            grads.append(tape.gradient(loss, model.trainable_variables))
            losses.append(loss)
        g = [tf.add_n(parts) / n for parts in zip(*grads, strict=True)]
        optimizer.apply_gradients(zip(g, model.trainable_variables, strict=True))
        run.record(tf.add_n(losses) / n, params(), grads=dict(zip(NAMES, g, strict=True)))
