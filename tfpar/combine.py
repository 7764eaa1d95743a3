"""Combining towers: the classic tower programs' ``average_gradients`` and the averaged loss.

Weights: ``equal`` gives every tower 1/N (a plain mean, as the classic tower programs and DDP
do); ``by_size`` gives tower r the weight n_r/B, which makes the combined
gradient equal the full-batch gradient of a mean loss even for uneven shards;
``sum`` gives every tower 1 (with a sum reduction: the full-batch sum).
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

__all__ = ["average_gradients", "combine_losses", "tower_weights"]


def tower_weights(sizes: Sequence[int], weighting: str) -> list[float] | None:
    """Per-tower weights; ``None`` means the plain mean (``equal``).

    Args:
        sizes: rows per tower, ``[N]``.
        weighting: ``equal``, ``by_size`` or ``sum`` (every weight 1).
    """
    if weighting == "equal":
        return None
    if weighting == "by_size":
        total = float(sum(sizes))
        return [n / total for n in sizes]
    if weighting == "sum":  # the devices' losses summed (a sum reduction across devices, not averaged)
        return [1.0] * len(sizes)
    raise ValueError(f"unknown weighting {weighting!r}")


def average_gradients(tower_grads: Sequence[Sequence[tf.Tensor]], weights: Sequence[float] | None = None) -> list[tf.Tensor]:
    """Average gradients across towers, variable by variable.

    Args:
        tower_grads: ``[N towers][V variables]`` gradients, each of the
            variable's shape (as the classic tower programs collect them: one list per tower).
        weights: ``[N]`` tower weights summing to 1, or ``None`` for the plain mean.
    Returns:
        ``[V]`` combined gradients: ``g = (1/N) sum_r g_r`` or ``g = sum_r w_r g_r``.

    The plain mean is computed as the classic tower programs do it: stack along a new tower
    axis and ``reduce_mean``.
    """
    out = []
    for grads in zip(*tower_grads, strict=True):
        if any(g is None for g in grads):
            raise ValueError("a tower produced no gradient for a variable (is it used in the loss?)")
        if all(isinstance(g, tf.IndexedSlices) for g in grads):
            out.append(_sparse_mean(grads, weights))
            continue
        stacked = tf.stack(list(grads), axis=0)  # [N, *shape]
        if weights is None:
            out.append(tf.reduce_mean(stacked, axis=0))
        else:
            w = tf.reshape(tf.constant(list(weights), dtype=stacked.dtype), [-1] + [1] * (stacked.shape.rank - 1))
            out.append(tf.reduce_sum(stacked * w, axis=0))
    return out


def _sparse_mean(grads: Sequence[tf.IndexedSlices], weights: Sequence[float] | None) -> tf.IndexedSlices:
    """Towers' ``IndexedSlices`` (an embedding's gradient) combined as tf.distribute's all-reduce combines them.

    ``MirroredStrategy`` (and Keras' optimizer under it) concatenates the replicas' slices,
    duplicate ids kept; the mean scales the values by ``1/N`` (or ``w_r``). One tower's slices
    pass unchanged: what a one-device Keras model hands its optimizer. (The classic
    ``average_gradients``' ``tf.stack`` would densify them, summing duplicates, and hide
    Keras' sparse second moment; docs/layers.md "Token layers".)
    """
    if len(grads) == 1 and weights is None:
        return grads[0]
    scale = [1.0 / len(grads)] * len(grads) if weights is None else list(weights)
    values = tf.concat([g.values * tf.constant(w, g.values.dtype) for g, w in zip(grads, scale, strict=True)], axis=0)
    return tf.IndexedSlices(values, tf.concat([g.indices for g in grads], axis=0), grads[0].dense_shape)


def combine_losses(losses: Sequence[tf.Tensor], weights: Sequence[float] | None = None) -> tf.Tensor:
    """The combined loss ``(1/N) sum_r l_r`` or ``sum_r w_r l_r`` (a scalar)."""
    stacked = tf.stack(list(losses))
    if weights is None:
        return tf.reduce_mean(stacked)
    return tf.reduce_sum(stacked * tf.constant(list(weights), dtype=stacked.dtype))
