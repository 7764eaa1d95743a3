"""A TensorFlow tower plugin for the MLP case of ``tests/helpers.py`` training with the Keras optimizer the case names.

Per-tower gradients on each device, averaged, one ``apply_gradients`` of a ``keras.optimizers``
class with the case's hyperparameters (as a GPT trainer: ``exclude_from_weight_decay`` for
``optimizer.no_decay`` kinds, micro-batches for ``parallel.accumulate``, ``tf.clip_by_global_norm``
of the averaged gradient for ``parallel.clip``, Keras' ``CosineDecay`` for warm-up + cosine); ``run.use_optimizer`` hands it to the tool, so that
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
    wd = opt.get("weight_decay", 0.0) or None
    if name in ("adam", "amsgrad"):
        return keras.optimizers.Adam(lr, beta_1=opt["beta1"], beta_2=opt["beta2"], epsilon=opt["epsilon"],
                                     amsgrad=name == "amsgrad", weight_decay=wd)
    if name == "adamw":
        return keras.optimizers.AdamW(lr, weight_decay=opt["weight_decay"], beta_1=opt["beta1"], beta_2=opt["beta2"],
                                      epsilon=opt["epsilon"])
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
    kinds = run.spec["optimizer"].get("no_decay", [])  # ["bias"]: the biases take no weight decay
    if kinds:  # before the optimizer is built (use_optimizer builds it)
        optimizer.exclude_from_weight_decay(var_list=[v for k, v in variables.items() if k.rsplit(".", 1)[-1] in kinds])
    run.use_optimizer(optimizer, variables)  # under --lockstep: the reference's slots and step counter
    n = len(run.devices)
    k = run.spec["parallel"].get("accumulate", 1)
    clip = run.spec["parallel"].get("clip")

    def params():
        return {k: v.numpy() for k, v in variables.items()}

    run.begin(params())
    for x, y in run.batches():
        grads, losses = [], []
        for dev, xr, yr in zip(run.devices, np.array_split(x, n), np.array_split(y, n), strict=True):
            micro, micro_losses = [], []
            for xm, ym in zip(np.array_split(xr, k), np.array_split(yr, k), strict=True):
                with tf.device(dev), tf.GradientTape() as tape:
                    loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=ym, logits=model(xm)))
                micro.append(tape.gradient(loss, model.trainable_variables))
                micro_losses.append(loss)
            grads.append([tf.add_n(parts) / k for parts in zip(*micro, strict=True)])
            losses.append(tf.add_n(micro_losses) / k)
        g = [tf.add_n(parts) / n for parts in zip(*grads, strict=True)]
        if clip is not None:
            g = tf.clip_by_global_norm(g, clip["global_norm"])[0]
        optimizer.apply_gradients(zip(g, model.trainable_variables, strict=True))
        run.record(tf.add_n(losses) / n, params(), grads=dict(zip(NAMES, g, strict=True)))
