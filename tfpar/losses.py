"""Per-device losses, reduced over the elements of one device's shard."""

from __future__ import annotations

import tensorflow as tf

__all__ = ["device_loss"]


def device_loss(loss: str, reduction: str, out: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
    """The loss of one shard.

    Args:
        loss: ``mse`` (squared error per element), ``sigmoid_ce`` (``out`` are
            logits, ``y`` in [0, 1] shaped like ``out``), ``softmax_ce``
            (``out`` logits ``[n, k]``, ``y`` int labels ``[n]``).
        reduction: ``mean`` or ``sum`` over all elements of the shard (per
            element for mse/sigmoid_ce, per example for softmax_ce).
    Returns:
        a scalar.
    """
    if loss == "mse":
        per = tf.square(out - y)
    elif loss == "sigmoid_ce":
        per = tf.nn.sigmoid_cross_entropy_with_logits(labels=y, logits=out)
    elif loss == "softmax_ce":
        per = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=out)
    else:
        raise ValueError(f"unknown loss {loss!r}")
    return tf.reduce_mean(per) if reduction == "mean" else tf.reduce_sum(per)
