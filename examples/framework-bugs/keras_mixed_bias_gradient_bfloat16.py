"""Keras' ``Dense(dtype="mixed_bfloat16")`` sums its bias gradient in bfloat16 on TensorFlow's CPU kernels.

    .venv/bin/python examples/framework-bugs/keras_mixed_bias_gradient_bfloat16.py

Versions: Keras 3.15.1, TensorFlow 2.21.0 (CPU; measured on an AMD EPYC with AVX512_BF16, with and
without oneDNN: ``TF_ENABLE_ONEDNN_OPTS=0`` gives the same).

``Dense.call`` adds its bias with ``ops.add(x, self.bias)`` (keras/src/layers/core/dense.py 224), and
the TensorFlow backend's ``add`` turns an add whose second operand squeezes to a vector matching the
last axis into ``tf.nn.bias_add`` (keras/src/backend/tensorflow/numpy.py 108-130). Under the
``mixed_bfloat16`` policy the bias is read as bfloat16, so the gradient is ``BiasAddGrad`` on a
bfloat16 tensor, and TensorFlow's kernel for it adds the rows up *in bfloat16*: once the partial
sum reaches 256, adding 1 rounds back to 256. A broadcasting add (``x + bias``, whose gradient is a
``Sum`` that accumulates in float32) and torch (``nn.Linear`` under autocast: the bias gradient of a
float32 parameter, summed in float32) give the exact sum.

Expected: the bias gradient of 4096 rows whose output gradient is 1 is 4096 in every column.
Observed:
  Keras Dense, mixed_bfloat16:   [256. 256. 256.]
  x + bias in bfloat16:          [4096. 4096. 4096.]
  Keras Dense, float32:          [4096. 4096. 4096.]
"""

import keras
import numpy as np
import tensorflow as tf

rows = 4096
x = np.ones((rows, 4), np.float32)
for policy in ("mixed_bfloat16", "float32"):
    dense = keras.layers.Dense(3, dtype=policy)
    dense.build(x.shape)
    with tf.GradientTape() as tape:
        y = dense(x)
    grad = tape.gradient(y, dense.bias, output_gradients=tf.ones_like(y))
    print(f"Keras Dense, {policy}:".ljust(32), np.asarray(grad))
    if policy == "mixed_bfloat16":
        bias = tf.Variable(tf.zeros([3]))
        with tf.GradientTape() as tape:
            z = tf.zeros([rows, 3], tf.bfloat16) + tf.cast(bias, tf.bfloat16)
        print("x + bias in bfloat16:".ljust(32), np.asarray(tape.gradient(z, bias, output_gradients=tf.ones_like(z))))
