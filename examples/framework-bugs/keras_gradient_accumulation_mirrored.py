"""Keras' ``gradient_accumulation_steps`` fails under ``MirroredStrategy``.

    .venv/bin/python examples/framework-bugs/keras_gradient_accumulation_mirrored.py

Versions: Keras 3.15.1, TensorFlow 2.21.0 (CPU, two logical devices).

keras/src/optimizers/base_optimizer.py:551-585 (``_backend_apply_gradients``) chooses between
"apply" and "accumulate" with ``ops.cond`` in the replica context; the "apply" branch all-reduces
the gradients (``merge_call``, keras/src/backend/tensorflow/optimizer.py:159), and a ``merge_call``
inside a cond in a replica context is not supported by tf.distribute. torch's DDP accumulates with
``no_sync()`` (benchmarks/framework_differences/loss_scale.py checks it equals the whole batch).

Expected: model.fit and a custom loop both train, updating every 2 batches.
Observed:
  gradient_accumulation_steps=2: model.fit: RuntimeError: `merge_call` called while defining a new graph or a tf.function. This can often  ...
  gradient_accumulation_steps=None: model.fit trains, loss 1.32
  custom loop: RuntimeError: `merge_call` called while defining a new graph or a tf.function. This can often  ...
"""

import keras
import numpy as np
import tensorflow as tf

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
x = np.random.default_rng(0).standard_normal((8, 3)).astype(np.float32)
y = np.ones((8, 1), np.float32)


def first_line(e: Exception) -> str:
    text = str(e).replace("\x1b[1m", "").replace("\x1b[0m", "")
    cause = next((ln.strip() for ln in text.splitlines() if "merge_call" in ln), text.splitlines()[0])
    return f"{type(e).__name__}: {cause[:80]} ..."


for steps in (2, None):
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.1, gradient_accumulation_steps=steps), "mse")
    try:
        history = model.fit(x, y, batch_size=4, epochs=1, verbose=0)
        print(f"gradient_accumulation_steps={steps}: model.fit trains, loss {history.history['loss'][-1]:.3g}")
    except Exception as e:  # noqa: BLE001 - printing what it raises is the point
        print(f"gradient_accumulation_steps={steps}: model.fit: {first_line(e)}")

with strategy.scope():
    w = keras.Variable(np.ones((3, 1), np.float32))
    opt = keras.optimizers.SGD(0.1, gradient_accumulation_steps=2)
    opt.build([w])


def replica(xr):
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.square(tf.matmul(xr, w)))
    opt.apply_gradients(zip(tape.gradient(loss, [w]), [w], strict=True))


step = tf.function(lambda xs: strategy.run(replica, args=(xs,)))
try:
    step(strategy.experimental_distribute_values_from_function(lambda c: x[4 * c.replica_id_in_sync_group:][:4]))
    print("custom loop: trains")
except Exception as e:  # noqa: BLE001
    print(f"custom loop: {first_line(e)}")
