"""Parameter names and shapes implied by a layer list (numpy only).

Canonical names are ``<layer index>.<kind>``; canonical layouts are
TensorFlow's (dense kernel ``[in, out]``, conv kernel ``[kh, kw, in, out]``,
images ``[H, W, C]`` per example, channels last). Both framework packages
build their models from the same layer list and must produce exactly these
names.

Shape arithmetic of the spatial layers (TensorFlow's, which the torch side
reproduces):

``valid``: ``out = floor((n - k) / s) + 1`` (needs ``n >= k``);
``same``:  ``out = ceil(n / s)``, padded with ``p = max((out - 1) s + k - n, 0)``
rows, ``floor(p / 2)`` before and the rest after: when ``p`` is odd the extra
row goes to the bottom (right), which torch's symmetric ``padding=`` cannot
express.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = [
    "ParamSpec",
    "param_specs",
    "output_shape",
    "layer_shapes",
    "spatial_output",
    "same_padding",
    "STATE_KINDS",
]

STATE_KINDS = ("moving_mean", "moving_variance")


@dataclass(frozen=True)
class ParamSpec:
    """One parameter: canonical ``name``, ``shape``, and whether it is trainable."""

    name: str
    shape: tuple[int, ...]
    trainable: bool = True
    kind: str = "kernel"  # kernel, bias, gamma, beta, moving_mean, moving_variance


def spatial_output(n: int, k: int, s: int, padding: str) -> int:
    """Output length along one spatial axis of a conv or pool (TensorFlow's rule).

    Args:
        n: input length; k: window (kernel) length; s: stride; padding: ``same`` or ``valid``.
    Returns:
        the output length; 0 when a ``valid`` window does not fit (``n < k``).
    """
    if padding == "same":
        return math.ceil(n / s)
    return (n - k) // s + 1 if n >= k else 0


def same_padding(n: int, k: int, s: int) -> tuple[int, int]:
    """TensorFlow's SAME padding ``(before, after)`` along one axis: the extra row goes after."""
    total = max((math.ceil(n / s) - 1) * s + k - n, 0)
    return total // 2, total - total // 2


def _walk(input_shape: tuple[int, ...], layers: list[dict]):
    shape = tuple(input_shape)
    for i, layer in enumerate(layers):
        kind = layer["type"]
        params: list[ParamSpec] = []
        if kind == "poly":
            # a scalar becomes [x^d, ..., x, 1]; no parameters of its own
            shape = (layer["degree"] + 1,)
        elif kind == "dense":
            fan_in = shape[-1]
            params.append(ParamSpec(f"{i}.kernel", (fan_in, layer["units"]), True, "kernel"))
            if layer.get("use_bias", True):
                params.append(ParamSpec(f"{i}.bias", (layer["units"],), True, "bias"))
            shape = shape[:-1] + (layer["units"],)
        elif kind == "conv2d":
            (kh, kw), (sh, sw) = layer["kernel_size"], layer["strides"]
            h, w, c = shape
            params.append(ParamSpec(f"{i}.kernel", (kh, kw, c, layer["filters"]), True, "kernel"))
            if layer.get("use_bias", True):
                params.append(ParamSpec(f"{i}.bias", (layer["filters"],), True, "bias"))
            shape = (spatial_output(h, kh, sh, layer["padding"]), spatial_output(w, kw, sw, layer["padding"]), layer["filters"])
        elif kind == "max_pool2d":
            (ph, pw), (sh, sw) = layer["pool_size"], layer["strides"]
            h, w, c = shape
            shape = (spatial_output(h, ph, sh, layer["padding"]), spatial_output(w, pw, sw, layer["padding"]), c)
        elif kind == "flatten":
            shape = (math.prod(shape),)
        elif kind == "batch_norm":
            # Keras creates them in this order: gamma, beta, then the two moving statistics
            c = shape[-1]
            params.append(ParamSpec(f"{i}.gamma", (c,), True, "gamma"))
            params.append(ParamSpec(f"{i}.beta", (c,), True, "beta"))
            params.append(ParamSpec(f"{i}.moving_mean", (c,), False, "moving_mean"))
            params.append(ParamSpec(f"{i}.moving_variance", (c,), False, "moving_variance"))
        elif kind == "dropout":
            pass  # no parameters; the masks are data (see generators.dropout_masks)
        else:  # validated earlier; a new layer type must be added here and in both packages
            raise AssertionError(f"unhandled layer type {kind!r}")
        yield i, params, shape


def param_specs(input_shape: tuple[int, ...] | list[int], layers: list[dict]) -> list[ParamSpec]:
    """All parameters of the model, in layer order (trainable and state).

    Args:
        input_shape: per-example input shape, e.g. ``[5]``, ``[]`` or ``[8, 8, 1]``.
        layers: the validated ``model.layers`` list.
    Returns:
        a list of :class:`ParamSpec`, in the order the layers create them.
    """
    out: list[ParamSpec] = []
    for _, params, _ in _walk(tuple(input_shape), layers):
        out.extend(params)
    return out


def layer_shapes(input_shape: tuple[int, ...] | list[int], layers: list[dict]) -> list[tuple[int, ...]]:
    """Per-example shapes between layers: ``[input, after layer 0, ..., after the last]`` (``len(layers) + 1``)."""
    shapes = [tuple(input_shape)]
    for _, _, layer_out in _walk(tuple(input_shape), layers):
        shapes.append(layer_out)
    return shapes


def output_shape(input_shape: tuple[int, ...] | list[int], layers: list[dict]) -> tuple[int, ...]:
    """Per-example output shape of the model (no batch axis)."""
    return layer_shapes(input_shape, layers)[-1]
