"""The GPT input/output path in TensorFlow: token inputs, ``embedding``, ``tied_logits``, per-token cross entropy.

Each computes what Keras computes (``docs/layers.md``, "Token layers"); pinned equal to the
Keras classes by ``parity_tests/tests/test_layers_tokens.py``:

embedding
    ``keras.ops.take(embeddings, ids, axis=0)`` (Keras ``Embedding.call``), i.e. ``tf.gather``:
    ``[B, ...] -> [B, ..., D]``. Its gradient is a sparse ``tf.IndexedSlices`` with one slice per
    occurrence of an id, duplicates *not* summed. Under ``gradient: native`` that is what the
    engines hand to the optimizer, as a Keras model's ``apply_gradients`` gets it (Keras 3.15's
    Adam, RMSprop and Adagrad then square each occurrence before the duplicates are summed:
    ``sum g_i^2`` where torch's dense gradient gives ``(sum g_i)^2``; docs/framework-differences.md).
    ``gradient: dense`` routes the table through :func:`_dense_gradient`, whose gradient is
    ``tf.convert_to_tensor`` of the ``IndexedSlices`` (duplicates summed): the optimizer sees ``G``.
tied_logits
    ``h @ embeddings^T`` (``keras.ops.matmul(h, transpose(embeddings))``, as a Keras model writes it; on
    ``[B, T, D]`` that is ``tf.tensordot``, one ``MatMul`` over the ``B*T`` rows): ``[..., D] -> [..., V]``.
    The table's gradient is then the sum of a dense term (this matmul) and the embedding's
    ``IndexedSlices``; TensorFlow's gradient aggregation densifies that sum, so with tied
    embeddings the optimizer always receives a dense gradient (measured; ``theory`` uses it).
per-token softmax_ce
    logits ``[n, ..., k]`` and labels ``[n, ...]`` are flattened to ``[m, k]`` and ``[m]``
    (the mean over every position of the shard, or the sum); ``ignore_label`` c:
    ``keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=c)``, which zeroes the
    ignored positions and divides the sum by the labelled count (``sum_over_batch_size``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import keras
import numpy as np
import tensorflow as tf

__all__ = ["embed", "tied_logits", "flatten_tokens", "ignore_label_ce", "inputs", "densify", "scaled", "layer", "TOKEN_LAYERS"]

TOKEN_LAYERS = ("embedding", "tied_logits")


@tf.custom_gradient
def _dense_gradient(table: tf.Tensor):
    """The identity, whose gradient is made dense (``gradient: dense``): duplicates summed before any optimizer."""

    def grad(dy):
        return tf.convert_to_tensor(dy)

    return tf.identity(table), grad


def embed(ids: tf.Tensor, table: tf.Tensor, gradient: str = "native") -> tf.Tensor:
    """Rows ``table[ids]``: ``ids`` int ``[B, ...]``, ``table`` ``[V, D]`` -> ``[B, ..., D]`` (Keras ``Embedding``)."""
    if gradient == "dense":
        table = _dense_gradient(table)
    return keras.ops.take(table, ids, axis=0)


def tied_logits(h: tf.Tensor, table: tf.Tensor) -> tf.Tensor:
    """``h @ table^T``: ``[B, ..., D]`` and ``[V, D]`` -> ``[B, ..., V]``."""
    return keras.ops.matmul(h, tf.transpose(table))  # on [B, T, D]: tf.tensordot, one MatMul over B*T rows


def flatten_tokens(out: tf.Tensor, y: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """Per-token logits ``[n, ..., k]`` and labels ``[n, ...]`` as ``[m, k]`` and ``[m]`` (row-major positions)."""
    if out.shape.rank <= 2:
        return out, y
    return tf.reshape(out, [-1, int(out.shape[-1])]), tf.reshape(y, [-1])


def ignore_label_ce(out: tf.Tensor, y: tf.Tensor, label: int, reduction: str) -> tf.Tensor:
    """What Keras' ``SparseCategoricalCrossentropy(from_logits=True, ignore_class=label)`` computes, on ``[m, k]`` logits.

    ``mean``: ``sum_{i: y_i != c} l_i / #{i: y_i != c}``; ``sum``: the numerator. Keras zeroes the
    ignored positions' losses and weights the rest by ``total / valid`` before its
    ``sum_over_batch_size``. Written out here because the Keras class, called inside a
    ``tf.distribute`` replica, also multiplies its mean by ``1 / num_replicas``
    (``keras/src/losses/loss.py`` 160, ``scale_loss_for_distribution``), which ``tf.mirrored``
    weights itself; pinned to the class outside one by ``test_layers_tokens``. (The case refuses a shard without a labelled
    position, where Keras gives 0 and torch NaN.)
    """
    valid = tf.not_equal(y, tf.constant(int(label), y.dtype))
    safe = tf.where(valid, y, tf.zeros_like(y))
    logp = tf.nn.log_softmax(out, axis=-1)
    per = -tf.reduce_sum(logp * tf.one_hot(safe, int(out.shape[-1]), dtype=out.dtype), axis=-1)
    mask = tf.cast(valid, out.dtype)
    total = tf.reduce_sum(per * mask)
    return total / tf.reduce_sum(mask) if reduction == "mean" else total


def densify(grads: list[Any]) -> list[Any]:
    """``IndexedSlices`` made dense (duplicates summed), other gradients as they are (for the formula optimizers)."""
    return [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]


def scaled(g: Any, coef: tf.Tensor) -> Any:
    """``g * coef``, an ``IndexedSlices`` kept sparse (its values scaled), as ``tf.clip_by_global_norm`` scales one."""
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(g.values * coef, g.indices, g.dense_shape)
    return g * coef


def inputs(x: Any, np_dtype: Any) -> np.ndarray:
    """The case's ``x`` as an engine feeds it: integer token ids stay int64, anything else ``np_dtype``."""
    a = np.asarray(x)
    return a.astype(np.int64) if a.dtype.kind in "iu" else a.astype(np_dtype)


def layer(kind: str, path: str, spec: Mapping[str, Any], params: Mapping[str, tf.Tensor], h: tf.Tensor,
          compute: tf.DType | None = None) -> tf.Tensor:
    """``embedding`` or ``tied_logits`` at ``path`` (what :func:`tfpar.models._apply` dispatches here).

    Under mixed precision (``compute``: ``tf.bfloat16``): Keras' ``Embedding`` (``autocast = False``)
    gathers float32 rows and casts them to the compute dtype (embedding.py 196-197); ``tied_logits``
    is ``h @ E^T`` in the compute dtype, the table read as bfloat16 (what a layer reading it under
    Keras' autocast scope computes, and what torch's autocast makes of ``F.linear(h, E)``).
    """
    if kind == "embedding":
        out = embed(h, params[f"{path}.embeddings"], spec["gradient"])
        return out if compute is None else tf.cast(out, compute)
    table = params[f"{spec['embedding']}.embeddings"]
    if compute is not None:
        h, table = tf.cast(h, compute), tf.cast(table, compute)
    return tied_logits(h, table)
