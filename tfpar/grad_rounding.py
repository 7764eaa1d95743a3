"""The identity whose backward rounds the gradient to bfloat16: the float64 run of ``protocol.grad_rounding``.

``tf.towers`` and ``tf.single`` (:func:`tfpar.run.run_case`) insert it, in the float64 run a payload's
``grads_bf16`` asks for, where Keras' ``mixed_bfloat16`` recipe casts (``tfpar.models``): on every parameter as a
tower reads it (the recipe's bfloat16 read, whose gradient is a bfloat16 result cast back to float32, per tower and
per micro-batch, before the float32 combine) and on the model output before the loss (the recipe's float32 loss
of a bfloat16 output: the backward of that cast rounds ``dL/dout``, at the scale the tower differentiates its loss).
The forward pass is the float64 run's, bit for bit.
"""

from __future__ import annotations

import tensorflow as tf

__all__ = ["bf16_gradient"]


@tf.custom_gradient
def bf16_gradient(x: tf.Tensor):  # noqa: ANN201  (custom_gradient's pair)
    """``x`` itself; its gradient rounded to float32 and then to bfloat16 (to nearest, ties to even), in ``x``'s dtype:
    what the mixed run's float32 gradient meets at its cast to bfloat16."""

    def grad(dy: tf.Tensor) -> tf.Tensor:
        return tf.cast(tf.cast(tf.cast(dy, tf.float32), tf.bfloat16), dy.dtype)

    return tf.identity(x), grad
