"""The bias add of a layer under mixed precision: Keras' (``tf.nn.bias_add``) or torch's (a broadcasting add).

Used by :mod:`tfpar.models` (dense, conv2d, depthwise_conv2d) and :mod:`tfpar.attention` (``EinsumDense``'s
biases); docs/mixed-precision.md, "Bias gradients".
"""

from __future__ import annotations

from collections.abc import Mapping

import tensorflow as tf

__all__ = ["torch_bias_add", "keras_bias_add", "bias_add_fn"]


def torch_bias_add(h: tf.Tensor, bias: tf.Tensor) -> tf.Tensor:
    """A bias under mixed precision and the layer's ``semantics: torch``: ``h + bias``, a broadcasting add in
    bfloat16 whose gradient (``Sum``) accumulates the bfloat16 output gradient in float32 and rounds once, as
    torch's backward sums a float32 bias's gradient. ``tests/test_mixed_precision.py`` seeds a bias gradient
    summed in bfloat16 here."""
    return h + bias


def keras_bias_add(h: tf.Tensor, bias: tf.Tensor) -> tf.Tensor:
    """A bias under mixed precision as Keras adds it (``semantics: native``/``tf``): ``keras.ops.add(h, bias)``.

    Keras' ``Dense``, ``Conv2D``, ``DepthwiseConv2D`` and ``EinsumDense`` call ``ops.add(x, bias)``
    (dense.py 224, base_conv.py 263, base_depthwise_conv.py 215, einsum_dense.py), and the
    TensorFlow backend's ``add`` turns that into ``tf.nn.bias_add`` whenever the bias squeezes to a
    vector matching the last (or second) axis (keras/src/backend/tensorflow/numpy.py 108-130): every
    dense and conv bias, the attention output bias; a ``[H, dk]`` attention bias with ``H, dk > 1``
    stays a broadcasting add. **Warning, where TensorFlow and torch differ:** ``bias_add``'s gradient
    ``BiasAddGrad`` sums the bfloat16 output gradient over rows and positions *in bfloat16* where
    TensorFlow runs Eigen's kernel (after a matmul on this AMD EPYC, oneDNN or not: a real Keras
    ``Dense(dtype="mixed_bfloat16")``'s bias gradient over 4096 rows of ones is 256); torch sums a
    float32 bias's gradient in float32. ``theory`` predicts it (docs/mixed-precision.md, "Bias
    gradients"); the layer's ``semantics: torch`` maps it (:func:`torch_bias_add`).
    """
    import keras

    return keras.ops.add(h, bias)


def bias_add_fn(layer: Mapping):
    """The mixed-precision bias add for ``layer``: Keras' unless its ``semantics`` is ``torch``."""
    return torch_bias_add if layer.get("semantics", "native") == "torch" else keras_bias_add
