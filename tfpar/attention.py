"""Self-attention as Keras 3's ``MultiHeadAttention`` computes it, on canonical parameters.

``x``: ``[B, T, D]``; H heads, ``dk = key_dim``, ``dv = value_dim``; parameters (``docs/layers.md``)
``q.kernel [D, H, dk]``, ``q.bias [H, dk]``, ``k.*`` alike, ``v.kernel [D, H, dv]``, ``v.bias [H, dv]``,
``o.kernel [H, dv, D]``, ``o.bias [D]``::

    q = einsum("abc,cde->abde", x, Wq) + bq            # EinsumDense (multi_head_attention.py:294), [B, T, H, dk]
    k, v likewise
    s = scale * q k^T per head                         # [B, H, T, T]
    s = where(causal_ok, s, large negative)
    w = softmax(s over keys)                           # dropout: where(keep, w / (1 - rate), 0)
    o = einsum("abcd,cde->abe", w v, Wo) + bo          # the output EinsumDense (line 352)

Keras has two code paths and this follows both, op for op (``tests/test_layers_attention.py`` pins each
bit for bit against the class):

* ``dropout == 0``: ``ops.dot_product_attention`` (keras/src/backend/tensorflow/nn.py 1704-1721): the
  logits ``einsum("BTNH,BSNH->BNTS", q, k)`` multiplied by the scale afterwards; causal positions set
  to ``-0.7 * 3.38953e38`` (``_apply_masks``); ``tf.nn.softmax``; ``einsum("BNTS,BSNH->BTNH")``.
* ``dropout > 0``: the explicit path (multi_head_attention.py 576-608): the *query* multiplied by the
  scale first, ``einsum("aecd,abcd->acbe", k, q)``, the ``Softmax`` layer with the causal mask
  (-1e9 in masked logits, masked weights zeroed afterwards), ``Dropout`` on the weights (the case's
  keep-mask, ``tf.nn.dropout``'s arithmetic ``where(keep, w * (1 / (1 - rate)), 0)``), then
  ``einsum("acbe,aecd->abcd", w, v)``.

The scale: Keras keeps ``1/sqrt(key_dim)`` as a Python float and applies it as
``tf.cast(scale, dtype)``, which makes a float32 tensor first: in float64 the scale is
``float32(1/sqrt(key_dim))`` (exact when key_dim is a power of 4). ``semantics: torch`` uses the
float64 scale ``sqrt(1/key_dim)`` as torch's ``F.multi_head_attention_forward`` computes it in Python
double; ``native`` and ``tf`` use Keras'.

Mixed precision (``compute=tf.bfloat16``; Keras' ``mixed_bfloat16`` policy, pinned bit for bit against
``MultiHeadAttention(dtype="mixed_bfloat16")`` by ``tests/test_mixed_architectures.py``): the projections
are ``EinsumDense`` in bfloat16 (kernel and bias read as bfloat16, the einsum and ``+ bias`` each rounded);
on the ``dropout == 0`` path ``_dot_product_attention_xla`` casts the bfloat16 logits to float32, scales,
masks and takes the softmax in float32 ("Softmax is always carried out in high precision") and casts the
weights back to bfloat16 for the last einsum; on the explicit path everything stays bfloat16, the scale
included (``ops.cast(1/sqrt(key_dim), query.dtype)``: rounded to bfloat16 unless key_dim is a power of 4)
and the mask value ``-1e9`` rounded to bfloat16.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import tensorflow as tf

from .bias import bias_add_fn

__all__ = ["attention", "attention_scale", "refuse_fully_masked"]

_KERAS_LARGE_NEGATIVE = -0.7 * 3.38953e38  # keras/src/backend/tensorflow/nn.py _get_large_negative
_SOFTMAX_LARGE_NEGATIVE = -1e9  # keras/src/layers/activations/softmax.py _large_negative_number


def attention_scale(key_dim: int, dtype: tf.DType, semantics: str = "native") -> tf.Tensor:
    """The logits' scale in ``dtype``: Keras' ``tf.cast(1/sqrt(key_dim))`` (through float32) unless ``semantics`` is torch."""
    if semantics == "torch":
        return tf.constant(math.sqrt(1.0 / float(key_dim)), dtype)  # torch/nn/functional.py: math.sqrt(1.0 / E)
    return tf.cast(1.0 / math.sqrt(float(key_dim)), dtype)


def refuse_fully_masked(allowed: np.ndarray, path: str) -> np.ndarray:
    """``allowed`` (``[T, S]``, True attends), refused in one line when a query row attends to no key.

    No case can build one (``parity_tests.contract.attention``: causal self-attention always attends to
    key 0); kept as a guard, since Keras gives such a row uniform or zero weights and torch NaN.
    """
    empty = np.flatnonzero(~np.asarray(allowed, bool).any(axis=-1))
    if empty.size:
        raise ValueError(f"layer {path}: attention query row(s) {empty.tolist()} attend to no key (every key masked);"
                         " Keras gives such a row uniform or zero weights and torch NaN, so it is refused")
    return allowed


def _causal(t: int, path: str) -> np.ndarray:
    """``[T, T]`` True where query ``i`` attends to key ``j <= i`` (Keras' sense)."""
    return refuse_fully_masked(np.tril(np.ones((t, t), bool)), path)


def attention(path: str, layer: Mapping, params: Mapping[str, tf.Tensor], h: tf.Tensor,
              keep: tf.Tensor | None, compute: tf.DType | None = None) -> tf.Tensor:
    """Layer ``path`` (an ``attention`` layer) on one device's tokens ``h`` ``[n, T, D]`` -> ``[n, T, D]``.

    ``keep``: the dropout keep-mask ``[n, H, T, T]`` when ``layer["dropout"] > 0``. ``compute``:
    ``tf.bfloat16`` under mixed precision (module docstring, "Mixed precision"), ``h`` already in it.
    """
    import keras  # its einsum: what EinsumDense and the explicit path call (matmuls for these equations)

    def p(name: str) -> tf.Tensor:
        w = params[f"{path}.{name}"]
        return w if compute is None else tf.cast(w, compute)  # the layers' autocast of a variable read

    bias = layer["use_bias"]

    def add_bias(out: tf.Tensor, name: str) -> tf.Tensor:
        if compute is None:
            return out + p(f"{name}.bias")
        return bias_add_fn(layer)(out, p(f"{name}.bias"))  # EinsumDense's ops.add: its bias_add case included

    def project(name: str) -> tf.Tensor:
        out = keras.ops.einsum("abc,cde->abde", h, p(f"{name}.kernel"))
        return add_bias(out, name) if bias else out

    q, k, v = project("q"), project("k"), project("v")
    t = h.shape[1]
    allowed = tf.constant(_causal(t, path)[None, None]) if layer["causal"] else None
    if layer["dropout"] == 0.0:  # ops.dot_product_attention's path
        logits = tf.einsum("BTNH,BSNH->BNTS", q, k, optimize="optimal")
        if compute is not None:  # the logits, scale, mask and softmax in float32, the weights back in bfloat16
            logits = tf.cast(logits, tf.float32)
        logits = logits * attention_scale(layer["key_dim"], logits.dtype, layer["semantics"])
        if allowed is not None:
            logits = tf.where(allowed, logits, tf.constant(_KERAS_LARGE_NEGATIVE, logits.dtype))
        weights = tf.cast(tf.nn.softmax(logits, axis=-1), v.dtype)
        mixed = tf.einsum("BNTS,BSNH->BTNH", weights, v, optimize="optimal")
    else:  # the explicit path: scaled query, the Softmax layer, Dropout on the weights
        if keep is None:
            raise ValueError(f"layer {path}: an attention layer with dropout needs its keep-mask (payload['masks'][{path!r}])")
        scores = keras.ops.einsum("aecd,abcd->acbe", k, q * attention_scale(layer["key_dim"], q.dtype, layer["semantics"]))
        if allowed is not None:
            scores = tf.where(allowed, scores, tf.constant(_SOFTMAX_LARGE_NEGATIVE, scores.dtype))
        weights = tf.nn.softmax(scores, axis=-1)
        if allowed is not None:
            weights = tf.where(allowed, weights, tf.zeros_like(weights))
        rate = tf.constant(1.0 / (1.0 - layer["dropout"]), weights.dtype)
        weights = tf.where(keep, weights * rate, tf.zeros_like(weights))
        mixed = keras.ops.einsum("acbe,aecd->abcd", weights, v)
    out = keras.ops.einsum("abcd,cde->abe", mixed, p("o.kernel"))
    return add_bias(out, "o") if bias else out
