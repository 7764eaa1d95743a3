"""The float64 attention scale: where Keras' ``MultiHeadAttention`` and torch's attention differ, and by how much.

Keras keeps ``1/sqrt(key_dim)`` as a Python float and applies it as ``tf.cast(scale, dtype)``,
which goes through a float32 tensor (keras/src/backend/tensorflow/nn.py 1708, and
multi_head_attention.py 584 on the dropout path); torch computes ``math.sqrt(1.0 / key_dim)`` in
Python double (torch/nn/functional.py 7025, or inside ``scaled_dot_product_attention``). In float64
the two scales differ by the relative error of rounding the scale to float32::

    delta(key_dim) = |float32(1/sqrt(key_dim)) * sqrt(key_dim) - 1|      (at most 2^-24 = 6e-8)

which multiplies every attention logit: the weights move by about ``delta * |logits|`` (relative), the
layer's output and gradients by as much. ``delta`` is 0 exactly when ``1/sqrt(key_dim)`` is a float32
number, i.e. ``key_dim`` a power of 4 (1, 4, 16, 64, 256: ViT-B's and GPT-2's 64 lose nothing); 3
gives 1.8e-8, 2 gives 2.5e-8, 8 and 32 give 2.5e-8. In float32 both scales are float32 numbers and
the difference is within rounding. ``semantics: tf`` or ``torch`` on the layer makes both sides use
that framework's scale (``tfpar.attention``, ``torchref.attention``).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from parity_tests.contract.model import nested_layers

__all__ = ["scale_error", "native_attention_scales", "attention_scale_text", "attention_scale_absent"]


def scale_error(key_dim: int) -> float:
    """``delta``: the relative error of Keras' float32-rounded scale against the exact ``1/sqrt(key_dim)``."""
    exact = 1.0 / math.sqrt(float(key_dim))
    return abs(float(np.float32(exact)) / exact - 1.0)


def native_attention_scales(spec: dict[str, Any]) -> list[tuple[str, float]]:
    """``(spec path, delta)`` of every attention layer whose scale is each framework's own (``semantics: native``),
    nested bodies included (``1.body.0``: the spec's path, shared by every repetition of a repeat)."""
    return [(".".join(map(str, path)), scale_error(layer["key_dim"]))
            for path, layer in nested_layers(spec["model"].get("layers", []))
            if layer["type"] == "attention" and layer["semantics"] == "native"]


def attention_scale_text(scales: list[tuple[str, float]]) -> str:
    """The predicted difference's name and size, for the layers whose scale rounds (``delta > 0``)."""
    shown = [(path, d) for path, d in scales if d > 0.0]
    where = ", ".join(f"model.layers.{path} ({d:.1e})" for path, d in shown)
    return ("float64 attention scale: Keras' MultiHeadAttention rounds 1/sqrt(key_dim) through float32, torch"
            " computes it exactly; the logits differ by that relative rounding of the scale (times their size"
            f" on the weights; {where})")


def attention_scale_absent(dtype: str, scales: list[tuple[str, float]]) -> str:
    """Why the float64 attention-scale difference is not predicted for these values."""
    if dtype != "float64":
        return f"float64 attention scale: the case computes in {dtype}, where both scales are float32 values"
    dims = "every key_dim here is a power of 4" if scales else "no layer"
    return f"float64 attention scale: 1/sqrt(key_dim) is a float32 number exactly ({dims})"
