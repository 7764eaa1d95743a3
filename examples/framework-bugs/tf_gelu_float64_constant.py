"""``tf.nn.gelu`` in float64 uses a float32-rounded ``1/sqrt(2)`` (and ``0.044715`` in the tanh form).

    .venv/bin/python examples/framework-bugs/tf_gelu_float64_constant.py

Versions: TensorFlow 2.21.0 (CPU); Keras 3.15.1's ``activations.gelu`` and ``ops.gelu`` call it.

tensorflow/python/ops/nn_ops.py:3755 computes ``0.5 x erfc(-x * math_ops.cast(0.7071067811865476,
x.dtype))``; ``math_ops.cast`` first turns the Python float into a float32 tensor, so in float64 the
constant is 0.70710676908493042 (off by 1.2e-8). The result is off by up to
``2 / (e sqrt(pi)) * 1.2e-8 = 5.0e-9`` (at x = sqrt 2), about 10^7 float64 roundings.

Expected: tf.nn.gelu(sqrt 2) - exact of order 1e-16 (torch's F.gelu in float64: 8.9e-16 at most).
Observed:
  tf.cast(0.7071067811865476, tf.float64) = 0.7071067690849304
  x = 1.4142135623730951: tf.nn.gelu = 1.3029862213690997, exact 0.5 x erfc(-x/sqrt 2) = 1.3029862263925718, difference -5.02e-09
"""

import math

import tensorflow as tf

x = math.sqrt(2.0)
tf_value = float(tf.nn.gelu(tf.constant(x, tf.float64)))
exact = 0.5 * x * math.erfc(-x / math.sqrt(2.0))
print(f"tf.cast(0.7071067811865476, tf.float64) = {float(tf.cast(0.7071067811865476, tf.float64))!r}")
print(f"x = {x!r}: tf.nn.gelu = {tf_value!r}, exact 0.5 x erfc(-x/sqrt 2) = {exact!r}, "
      f"difference {tf_value - exact:.3g}")
