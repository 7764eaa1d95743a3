"""Models built from the case's layer list, as plain functions over named variables.

Parameters are ``tf.Variable`` objects keyed by canonical name (``0.kernel``),
in canonical layouts (dense kernel ``[in, out]``); the forward pass is a pure
function of the parameters and the input, so each tower calls it under its
own ``tf.device`` while sharing the one set of variables.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import tensorflow as tf

__all__ = ["build_variables", "forward"]

_ACT = {"none": lambda t: t, "relu": tf.nn.relu, "tanh": tf.tanh, "sigmoid": tf.sigmoid}


def build_variables(init: Mapping[str, np.ndarray], dtype: tf.DType, *, device: str = "/device:CPU:0") -> dict[str, tf.Variable]:
    """One variable per canonical parameter, on ``device`` (the seeds keep variables on the CPU)."""
    with tf.device(device):
        return {k: tf.Variable(np.asarray(v), dtype=dtype, name=k.replace(".", "_")) for k, v in init.items()}


def forward(layers: list[dict], params: Mapping[str, tf.Tensor], x: tf.Tensor) -> tf.Tensor:
    """Apply the layer list.

    Args:
        layers: validated ``model.layers``.
        params: canonical name -> tensor.
        x: ``[batch, *input_shape]``.
    Returns:
        ``[batch, *output_shape]`` (logits for the cross-entropy losses).
    """
    h = x
    for i, layer in enumerate(layers):
        kind = layer["type"]
        if kind == "poly":
            d = layer["degree"]
            powers = tf.constant(np.arange(d, -1, -1, dtype=np.float64), dtype=h.dtype)
            h = tf.pow(h[:, None], powers)  # [batch, d+1]: x^d ... x^1, x^0 = 1
        elif kind == "dense":
            h = tf.matmul(h, params[f"{i}.kernel"])
            if layer["use_bias"]:
                h = h + params[f"{i}.bias"]
            h = _ACT[layer["activation"]](h)
        else:
            raise ValueError(f"layer {i}: unknown type {kind!r}")
    return h
