"""Per-device losses, reduced over the elements of one device's shard.

The loss options come from the case's ``model`` section (``docs/layers.md``);
``semantics`` is ``model.loss_semantics``: ``native`` and ``tf`` compute what
Keras computes (its own loss functions), ``torch`` computes torch's formula in
TensorFlow ops. Notation: ``l_i`` per-example cross entropy, ``w_i = cw[y_i]``
the class weight of example i's target (1 without class weights), ``n`` the
examples in the shard, ``k`` the classes, ``s`` the label smoothing.

softmax_ce, Keras (``CategoricalCrossentropy`` with ``sample_weight = w``)
    ``t = (1 - s) onehot(y) + s / k``; ``L = sum_i w_i (-sum_c t_ic log p_ic) / n``
    (``sum_over_batch_size``: divided by the number of examples, whatever the weights).
softmax_ce, torch (``F.cross_entropy(weight=cw, label_smoothing=s)``)
    ``L = [(1 - s) sum_i w_i (-log p_iy) + (s / k) sum_i sum_c cw_c (-log p_ic)] / sum_i w_i``
    (``mean`` divides by the sum of the targets' weights, and the smoothing term
    weights each *class* by its weight, not each example by its target's).
sigmoid_ce (both; torch has no label smoothing for it, so torchref smooths the
    labels by hand the way Keras does): ``t = y (1 - s) + s / 2``; from logits
    ``softplus`` form (``tf.nn.sigmoid_cross_entropy_with_logits``).
sigmoid_ce on probabilities (``from_logits: false``)
    Keras (``keras.ops.binary_crossentropy``): when ``p`` comes straight from a
    ``Sigmoid`` op in a graph (the tower engine's ``tf.function``, or a Keras
    activation's ``_keras_logits``) it *recovers the logits* and uses the
    logits formula; otherwise (eager ``tf.sigmoid``, any op in between) it clips
    ``p`` to ``[1e-7, 1 - 1e-7]`` and computes ``-(t log p + (1-t) log(1-p))``.
    torch (``F.binary_cross_entropy``): ``-(t max(log p, -100) + (1-t) max(log1p(-p), -100))``,
    with the gradient ``(p - t) / max(p (1 - p), 1e-12)``.

``reduction``: ``mean`` (the above; for mse and sigmoid_ce the mean over all
elements) or ``sum`` (the same without the division).

Sample weights (``data.sample_weights``, one ``v_i > 0`` per example; not
combined with class weights or label smoothing). With ``e_ij`` the elementwise
losses of example i (k per example)::

    Keras (sample_weight, sum_over_batch_size):  L = sum_i v_i sum_j e_ij / (n k)
    torch idiom ((v * l).sum() / v.sum()):        L = sum_i v_i sum_j e_ij / (k sum_i v_i)
    sum reduction (both):                         L = sum_i v_i sum_j e_ij

.. warning:: torch has no ``sample_weight`` argument; the torch side of a
   ``native`` case uses the idiom above, the way ``cross_entropy(weight=)``
   normalises class weights. The two differ unless the weights average 1 in
   every shard, and under data parallelism the torch idiom divides each shard by
   its own weight sum, so N devices differ from one (as with class weights).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from .tokens import flatten_tokens, ignore_label_ce

__all__ = ["device_loss", "elementwise_loss", "model_loss", "sparse_softmax_ce", "TORCH_BCE_EPS"]

#: torch's BCE backward divides by max(p (1 - p), EPSILON), EPSILON = 1e-12 as a C++ float (measured)
TORCH_BCE_EPS = float(np.float32(1e-12))


@tf.custom_gradient
def _torch_bce(p: tf.Tensor, t: tf.Tensor):
    """torch's ``binary_cross_entropy`` elementwise: clamped logs, and its own backward formula."""
    loss = (t - 1.0) * tf.maximum(tf.math.log1p(-p), -100.0) - t * tf.maximum(tf.math.log(p), -100.0)

    def grad(g):
        return g * (p - t) / tf.maximum((1.0 - p) * p, TORCH_BCE_EPS), None

    return loss, grad


def _reduce(per: tf.Tensor, reduction: str, sample_weight: tf.Tensor | None = None, rule: str = "tf") -> tf.Tensor:
    """Mean or sum of the elementwise losses ``per`` ``[n, ...]``, weighted per example when given."""
    if sample_weight is None:
        return tf.reduce_mean(per) if reduction == "mean" else tf.reduce_sum(per)
    v = tf.reshape(tf.cast(sample_weight, per.dtype), [-1] + [1] * (per.shape.rank - 1))
    total = tf.reduce_sum(v * per)
    if reduction == "sum":
        return total
    size = tf.cast(tf.size(per), per.dtype)
    if rule == "tf":  # Keras: sum_over_batch_size counts examples, whatever the weights
        return total / size
    per_example = size / tf.cast(tf.shape(per)[0], per.dtype)
    return total / (tf.reduce_sum(v) * per_example)  # the torch idiom: a weighted mean


def sparse_softmax_ce(y: tf.Tensor, out: tf.Tensor) -> tf.Tensor:
    """``-log_softmax(out)[i, y_i]``, ``[n]``, for logits ``out`` ``[n, k]`` and labels ``y`` ``[n]`` in ``[0, k)``.

    What ``tf.nn.sparse_softmax_cross_entropy_with_logits`` computes under op
    determinism (which the towers enable): ``log_softmax``, then the label's entry,
    negated. TensorFlow takes that entry with ``gather(batch_dims=1)``, whose
    gradient is the costliest thing to trace in a small model's step (half of an
    8-tower softmax step's trace, cProfile 2026-11-23). Here the entry is
    ``sum_c onehot(y)_ic log p_ic``: the other terms are exact (negative) zeros, so
    the loss and, through ``LogSoftmaxGrad``, the gradient are the same bits
    (``test_losses``), and the gradient is a multiplication. TensorFlow's dense
    ``softmax_cross_entropy_with_logits`` takes this very form under determinism.
    Labels outside ``[0, k)`` would give 0 here where TensorFlow gives NaN: case
    validation refuses them (``data.y``), so none reach this.
    """
    precise = tf.cast(out, tf.float32) if out.dtype == tf.float16 else out  # as TensorFlow's op does
    return tf.cast(-_label_entry(tf.nn.log_softmax(precise, axis=-1), y), out.dtype)


def _label_entry(logp: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
    """``logp[i, y_i]``, ``[n]``, as a one-hot sum (exact; cheap to trace: :func:`sparse_softmax_ce`)."""
    return tf.reduce_sum(logp * tf.one_hot(y, int(logp.shape[-1]), dtype=logp.dtype), axis=-1)


def _softmax_torch(out: tf.Tensor, y: tf.Tensor, reduction: str, smoothing: float, cw: tf.Tensor | None) -> tf.Tensor:
    """torch's ``cross_entropy(weight=cw, label_smoothing=s)`` written in TensorFlow ops."""
    logp = tf.nn.log_softmax(out, axis=-1)
    nll = -_label_entry(logp, y)  # [n]: -log p_iy
    w = tf.ones_like(nll) if cw is None else tf.gather(cw, y)
    smooth = -tf.reduce_sum(logp if cw is None else logp * cw, axis=-1)  # [n]
    k = int(out.shape[-1])
    total = (1.0 - smoothing) * tf.reduce_sum(w * nll) + (smoothing / k) * tf.reduce_sum(smooth)
    return total / tf.reduce_sum(w) if reduction == "mean" else total


def elementwise_loss(loss: str, out: tf.Tensor, y: tf.Tensor, *, from_logits: bool = True,
                     label_smoothing: float = 0.0, semantics: str = "native") -> tf.Tensor:
    """The unreduced loss of ``mse`` or ``sigmoid_ce``, shaped like ``out`` ``[n, ...]``.

    ``sigmoid_ce`` smooths the labels as Keras does (``y (1 - s) + s/2``) and takes
    logits, or probabilities (Keras' ``binary_crossentropy``, or torch's clamped
    formula with ``semantics: torch``); see the module docstring.
    """
    if loss == "mse":
        return tf.square(out - y)
    if loss != "sigmoid_ce":
        raise ValueError(f"no elementwise form for loss {loss!r}")
    t = y * (1.0 - label_smoothing) + 0.5 * label_smoothing if label_smoothing else y  # Keras' smoothing
    if from_logits:
        return tf.nn.sigmoid_cross_entropy_with_logits(labels=t, logits=out)
    if semantics == "torch":
        return _torch_bce(out, t)
    return keras.ops.binary_crossentropy(t, out, from_logits=False)


def device_loss(
    loss: str,
    reduction: str,
    out: tf.Tensor,
    y: tf.Tensor,
    *,
    from_logits: bool = True,
    label_smoothing: float = 0.0,
    class_weights: Sequence[float] | None = None,
    semantics: str = "native",
    sample_weight: tf.Tensor | None = None,
    ignore_label: int | None = None,
) -> tf.Tensor:
    """The loss of one shard.

    Args:
        loss: ``mse`` (squared error per element), ``sigmoid_ce`` (``out`` are
            logits, or probabilities when ``from_logits`` is false; ``y`` in
            [0, 1] shaped like ``out``), ``softmax_ce`` (``out`` logits
            ``[n, k]``, ``y`` int labels ``[n]``).
        reduction: ``mean`` or ``sum`` over the shard (see the module docstring).
        from_logits, label_smoothing, class_weights, semantics: the case's
            ``model`` options (validated: class weights only for softmax_ce,
            probabilities only for sigmoid_ce).
        sample_weight: ``[n]`` per-example weights, or ``None`` (module docstring).
        ignore_label: ``softmax_ce``'s excluded label (Keras' ``ignore_class``), or ``None``.
            ``softmax_ce`` also takes per-token logits ``[n, ..., k]`` with labels ``[n, ...]``.
    Returns:
        a scalar.
    """
    rule = "torch" if semantics == "torch" else "tf"
    if loss in ("mse", "sigmoid_ce"):
        per = elementwise_loss(loss, out, y, from_logits=from_logits, label_smoothing=label_smoothing,
                               semantics=semantics)
        return _reduce(per, reduction, sample_weight, rule)
    if loss != "softmax_ce":
        raise ValueError(f"unknown loss {loss!r}")
    out, y = flatten_tokens(out, y)  # per-token logits [n, ..., k]: every position (tfpar.tokens)
    if ignore_label is not None:
        return ignore_label_ce(out, y, ignore_label, reduction)
    if not label_smoothing and class_weights is None:
        return _reduce(sparse_softmax_ce(y, out), reduction, sample_weight, rule)
    if sample_weight is not None:
        raise ValueError("sample weights are not combined with class weights or label smoothing")
    cw = None if class_weights is None else tf.constant(list(class_weights), dtype=out.dtype)
    if semantics == "torch":
        return _softmax_torch(out, y, reduction, label_smoothing, cw)
    k = int(out.shape[-1])
    keras_loss = keras.losses.CategoricalCrossentropy(
        from_logits=True, label_smoothing=label_smoothing,
        reduction="sum_over_batch_size" if reduction == "mean" else "sum", dtype=out.dtype.name,
    )
    return keras_loss(tf.one_hot(y, k, dtype=out.dtype), out, sample_weight=None if cw is None else tf.gather(cw, y))


def model_loss(model: Mapping[str, Any], out: tf.Tensor, y: tf.Tensor,
               sample_weight: tf.Tensor | None = None) -> tf.Tensor:
    """:func:`device_loss` with every option read from a validated ``model`` section.

    Mixed precision: bfloat16 model outputs are cast to float32 first, as Keras'
    ``Loss.__call__`` converts ``y_pred`` to the loss's own dtype (float32 under the
    ``mixed_bfloat16`` policy; ``keras/src/losses/loss.py`` 59-62), so the loss and
    its first derivatives are float32.
    """
    if out.dtype == tf.bfloat16:
        out = tf.cast(out, tf.float32)
    return device_loss(
        model["loss"], model["reduction"], out, y,
        from_logits=model.get("from_logits", True),
        label_smoothing=model.get("label_smoothing", 0.0),
        class_weights=model.get("class_weights"),
        semantics=model.get("loss_semantics", "native"),
        sample_weight=sample_weight,
        ignore_label=model.get("ignore_label"),
    )
