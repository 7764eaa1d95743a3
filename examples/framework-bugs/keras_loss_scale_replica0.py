"""Keras' ``LossScaleOptimizer`` under ``MirroredStrategy`` checks only replica 0's gradients for
inf/NaN, then all-reduces and applies everyone's: an overflow on replica 1 goes into the weights.

    .venv/bin/python examples/framework-bugs/keras_loss_scale_replica0.py

Versions: Keras 3.15.1, TensorFlow 2.21.0 (CPU, two logical devices).

keras/src/optimizers/loss_scale_optimizer.py:268-278: ``check_finite`` runs on each replica's own
gradients and ``experimental_local_results(finite_per_replica)[0]`` is kept ("Each replica computed
the same `finite` value, since `grads` is all-reduced across replicas": it is not; the inner
optimizer all-reduces later, keras/src/backend/tensorflow/optimizer.py:159). torch's ``GradScaler``
checks ``param.grad`` after DDP's all-reduce, so every rank sees the inf and skips
(benchmarks/framework_differences/loss_scale.py runs both).

Expected: an inf on either replica skips the step (w stays 0.5) and halves the scale.
Observed:
  inf on replica 0: scale 32768 -> 16384, w = [0.5 0.5 0.5]
  inf on replica 1: scale 32768 -> 32768, w = [-inf -3.3505379e+28 1.2305164e+28]
"""

import keras
import numpy as np
import tensorflow as tf

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])

for bad in (0, 1):
    x = np.random.default_rng(7).standard_normal((2, 2, 3)).astype(np.float32)
    x[bad, 0, 0] = 1e30  # overflows float32 once the loss is scaled
    with strategy.scope():
        w = keras.Variable(np.full((3, 1), 0.5, np.float32))
        opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))
        opt.build([w])

    def replica(xr, w=w, opt=opt):
        with tf.GradientTape() as tape:
            scaled = opt.scale_loss(tf.reduce_sum(tf.square(tf.matmul(xr, w))) / 4.0)
        opt.apply_gradients(zip(tape.gradient(scaled, [w]), [w], strict=True))

    step = tf.function(lambda xs, replica=replica: strategy.run(replica, args=(xs,)))

    before = float(opt.dynamic_scale.numpy())
    step(strategy.experimental_distribute_values_from_function(lambda c, x=x: x[c.replica_id_in_sync_group]))
    print(f"inf on replica {bad}: scale {before:g} -> {float(opt.dynamic_scale.numpy()):g}, w = {np.asarray(w).ravel()}")
