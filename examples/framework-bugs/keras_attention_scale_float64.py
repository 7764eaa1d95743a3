"""Keras' ``MultiHeadAttention`` in float64 scales the queries by a float32-rounded ``1/sqrt(key_dim)``.

    .venv/bin/python examples/framework-bugs/keras_attention_scale_float64.py

Versions: Keras 3.15.1, TensorFlow 2.21.0 (CPU).

keras/src/layers/attention/multi_head_attention.py:201 keeps ``1.0 / math.sqrt(key_dim)`` as a
Python float, exact in double; it is applied as ``tf.cast(scale, logits.dtype)``
(keras/src/backend/tensorflow/nn.py:1708, the default path) or ``ops.cast(scale, query.dtype)``
(multi_head_attention.py:584, the explicit path), and ``tf.cast`` of a Python float makes a
float32 tensor first. For key_dim 3 the scale is off by 1.8e-8 relative; when 1/sqrt(key_dim) is
exact in float32 (key_dim 1, 4, 16, 64) nothing is lost.

Expected: the layer equals the same attention computed in float64 numpy from its own weights to
about 1e-16 for every key_dim.
Observed:
  key_dim 3: max |Keras - float64 numpy| = 2.3e-08 (exact scale), 5.6e-16 (float32-rounded scale)
  key_dim 4: max |Keras - float64 numpy| = 2.2e-16 (exact scale), 2.2e-16 (float32-rounded scale)
"""

import keras
import numpy as np


def attention(x, layer, scale):
    w = {n: (np.asarray(d.kernel), np.asarray(d.bias)) for n, d in zip(
        "qkvo", (layer._query_dense, layer._key_dense, layer._value_dense, layer._output_dense), strict=True)}
    q, k, v = (np.einsum("btd,dhk->bthk", x, w[n][0]) + w[n][1] for n in "qkv")
    s = np.einsum("bthk,bshk->bhts", q * scale, k)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bthk,hkd->btd", np.einsum("bhts,bshk->bthk", p, v), w["o"][0]) + w["o"][1]


x = np.random.default_rng(0).standard_normal((2, 5, 6))
for key_dim in (3, 4):
    layer = keras.layers.MultiHeadAttention(num_heads=2, key_dim=key_dim, dtype="float64")
    y = np.asarray(layer(x, x))
    exact = np.abs(y - attention(x, layer, 1 / np.sqrt(key_dim))).max()
    rounded = np.abs(y - attention(x, layer, float(np.float32(1 / np.sqrt(key_dim))))).max()
    print(f"key_dim {key_dim}: max |Keras - float64 numpy| = {exact:.2g} (exact scale), "
          f"{rounded:.2g} (float32-rounded scale)")
