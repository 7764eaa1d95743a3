"""Parameter names and shapes implied by a layer list (numpy only).

Canonical names are ``<layer index>.<kind>``, and inside the nesting layers
(``docs/case-format.md``) ``<path>.<kind>``: layer 3's body layer 1 is
``3.body.1.kernel``, its shortcut layer 0 ``3.shortcut.0.kernel``, repetition 2
of a ``repeat`` at index 5, body layer 0, ``5.2.0.kernel``. Canonical layouts are
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
express;
explicit ``[[top, bottom], [left, right]]``: ``out = floor((n + before + after - k) / s) + 1``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = [
    "ParamSpec",
    "param_specs",
    "output_shape",
    "layer_shapes",
    "nested_inputs",
    "nested_layers",
    "spatial_output",
    "same_padding",
    "axis_paddings",
    "reshape_target",
    "STATE_KINDS",
]

STATE_KINDS = ("moving_mean", "moving_variance")


@dataclass(frozen=True)
class ParamSpec:
    """One parameter: canonical ``name``, ``shape``, and whether it is trainable."""

    name: str
    shape: tuple[int, ...]
    trainable: bool = True
    kind: str = "kernel"  # kernel, bias, gamma, beta, scale, embeddings, token, moving_mean, moving_variance
    #: glorot's ``(fan_in, fan_out)`` where the shape does not say it (attention kernels: those of a dense layer)
    fans: tuple[int, int] | None = None


def spatial_output(n: int, k: int, s: int, padding: str | tuple[int, int] | list[int]) -> int:
    """Output length along one spatial axis of a conv or pool (TensorFlow's rule).

    Args:
        n: input length; k: window (kernel) length; s: stride; padding: ``same``, ``valid``
        or this axis's explicit ``(before, after)``.
    Returns:
        the output length; 0 when a ``valid`` window does not fit (``n < k``).
    """
    if padding == "same":
        return math.ceil(n / s)
    if not isinstance(padding, str):
        n = n + padding[0] + padding[1]
    return (n - k) // s + 1 if n >= k else 0


def axis_paddings(padding: str | list[list[int]]) -> tuple:
    """A layer's ``padding`` per spatial axis: ``(p, p)`` for ``same``/``valid``, else ``((top, bottom), (left, right))``."""
    if isinstance(padding, str):
        return padding, padding
    return tuple(tuple(a) for a in padding)


def reshape_target(shape: tuple[int, ...], target: list[int]) -> tuple[int, ...] | None:
    """A ``reshape`` layer's output shape per example (its one ``-1`` resolved), or ``None`` when it cannot hold ``shape``."""
    size, known = math.prod(shape), math.prod(d for d in target if d != -1)
    if -1 in target:
        if size % known:
            return None
        return tuple(size // known if d == -1 else d for d in target)
    return tuple(target) if known == size else None


def same_padding(n: int, k: int, s: int) -> tuple[int, int]:
    """TensorFlow's SAME padding ``(before, after)`` along one axis: the extra row goes after."""
    total = max((math.ceil(n / s) - 1) * s + k - n, 0)
    return total // 2, total - total // 2


def _spatial(shape: tuple[int, ...], win: list[int], strides: list[int], padding, channels: int) -> tuple[int, ...]:
    h, w, _ = shape
    ph, pw = axis_paddings(padding)
    return (spatial_output(h, win[0], strides[0], ph), spatial_output(w, win[1], strides[1], pw), channels)


def _layer(path: str, layer: dict, shape: tuple[int, ...], top: list[dict] | None = None) -> tuple[list[ParamSpec], tuple[int, ...]]:
    """Layer at ``path`` (``3``, ``3.body.1``, ``5.2.0``) on per-example inputs ``shape``: its parameters and output shape.

    ``top``: the model's top-level layers (a ``tied_logits`` reads its embedding's vocabulary there).
    """
    kind = layer["type"]
    params: list[ParamSpec] = []
    if kind == "embedding":  # token ids [...] -> [..., D]; Keras' Embedding: embeddings [V, D]
        params.append(ParamSpec(f"{path}.embeddings", (layer["input_dim"], layer["output_dim"]), True, "embeddings"))
        shape = tuple(shape) + (layer["output_dim"],)
    elif kind == "tied_logits":  # [..., D] -> [..., V], the named embedding's parameters
        shape = tuple(shape[:-1]) + (top[int(layer["embedding"])]["input_dim"],)
    elif kind == "poly":
        # a scalar becomes [x^d, ..., x, 1]; no parameters of its own
        shape = (layer["degree"] + 1,)
    elif kind == "dense":
        fan_in = shape[-1]
        params.append(ParamSpec(f"{path}.kernel", (fan_in, layer["units"]), True, "kernel"))
        if layer.get("use_bias", True):
            params.append(ParamSpec(f"{path}.bias", (layer["units"],), True, "bias"))
        shape = shape[:-1] + (layer["units"],)
    elif kind == "conv2d":
        kh, kw = layer["kernel_size"]
        params.append(ParamSpec(f"{path}.kernel", (kh, kw, shape[2], layer["filters"]), True, "kernel"))
        if layer.get("use_bias", True):
            params.append(ParamSpec(f"{path}.bias", (layer["filters"],), True, "bias"))
        shape = _spatial(shape, layer["kernel_size"], layer["strides"], layer["padding"], layer["filters"])
    elif kind == "depthwise_conv2d":  # Keras' DepthwiseConv2D: kernel [kh, kw, C, M], bias [C*M]
        (kh, kw), c, m = layer["kernel_size"], shape[2], layer["depth_multiplier"]
        params.append(ParamSpec(f"{path}.kernel", (kh, kw, c, m), True, "kernel"))
        if layer["use_bias"]:
            params.append(ParamSpec(f"{path}.bias", (c * m,), True, "bias"))
        shape = _spatial(shape, layer["kernel_size"], layer["strides"], layer["padding"], c * m)
    elif kind in ("max_pool2d", "avg_pool2d"):
        shape = _spatial(shape, layer["pool_size"], layer["strides"], layer["padding"], shape[2])
    elif kind == "flatten":
        shape = (math.prod(shape),)
    elif kind == "batch_norm":
        # Keras creates them in this order: gamma, beta, then the two moving statistics
        c = shape[-1]
        params.append(ParamSpec(f"{path}.gamma", (c,), True, "gamma"))
        params.append(ParamSpec(f"{path}.beta", (c,), True, "beta"))
        params.append(ParamSpec(f"{path}.moving_mean", (c,), False, "moving_mean"))
        params.append(ParamSpec(f"{path}.moving_variance", (c,), False, "moving_variance"))
    elif kind == "layer_norm":  # Keras' LayerNormalization creates gamma, then beta
        if layer["scale"]:
            params.append(ParamSpec(f"{path}.gamma", (shape[-1],), True, "gamma"))
        if layer["center"]:
            params.append(ParamSpec(f"{path}.beta", (shape[-1],), True, "beta"))
    elif kind == "rms_norm":
        params.append(ParamSpec(f"{path}.scale", (shape[-1],), True, "scale"))
    elif kind == "residual":
        body, out = _list(f"{path}.body", layer["body"], shape)
        short, _ = _list(f"{path}.shortcut", layer["shortcut"], shape)
        params, shape = body + short, out
    elif kind == "repeat":
        for r in range(layer["count"]):
            more, shape = _list(f"{path}.{r}", layer["body"], shape)
            params += more
    elif kind == "global_avg_pool2d":
        shape = (shape[-1],)
    elif kind == "channel_pad":
        shape = shape[:-1] + (shape[-1] + layer["before"] + layer["after"],)
    elif kind == "reshape":
        shape = reshape_target(shape, layer["shape"])
    elif kind == "position_embedding":  # drawn as a dense kernel [length, D] (docs/layers.md)
        params.append(ParamSpec(f"{path}.embeddings", (layer["length"], shape[-1]), True, "embeddings"))
    elif kind == "class_token":
        params.append(ParamSpec(f"{path}.token", (1, shape[-1]), True, "token"))
        shape = (shape[0] + 1, shape[1])
    elif kind == "take_token":
        shape = (shape[-1],)
    elif kind == "attention":  # Keras' MultiHeadAttention creates query, key, value, then the output dense
        d, h, dk, dv = shape[-1], layer["num_heads"], layer["key_dim"], layer["value_dim"]
        for name, width in (("q", dk), ("k", dk), ("v", dv)):
            params.append(ParamSpec(f"{path}.{name}.kernel", (d, h, width), True, "kernel", (d, h * width)))
            if layer["use_bias"]:
                params.append(ParamSpec(f"{path}.{name}.bias", (h, width), True, "bias"))
        params.append(ParamSpec(f"{path}.o.kernel", (h, dv, d), True, "kernel", (h * dv, d)))
        if layer["use_bias"]:
            params.append(ParamSpec(f"{path}.o.bias", (d,), True, "bias"))
    elif kind in ("dropout", "activation"):
        pass  # no parameters (dropout's masks are data: generators.dropout_masks)
    else:  # validated earlier; a new layer type must be added here and in both packages
        raise AssertionError(f"unhandled layer type {kind!r}")
    return params, tuple(shape)


def _list(prefix: str, layers: list[dict], shape: tuple[int, ...]) -> tuple[list[ParamSpec], tuple[int, ...]]:
    params: list[ParamSpec] = []
    for j, layer in enumerate(layers):
        more, shape = _layer(f"{prefix}.{j}", layer, shape)
        params += more
    return params, shape


def _walk(input_shape: tuple[int, ...], layers: list[dict]):
    shape = tuple(input_shape)
    for i, layer in enumerate(layers):
        params, shape = _layer(str(i), layer, shape, layers)
        yield i, params, shape


def nested_layers(layers: list[dict], path: tuple = ()) -> Iterator[tuple[tuple, dict]]:
    """Every layer of a validated list with its path, in order, nested bodies and shortcuts included.

    The path is the layer's place as a tuple: ``(3,)``, ``(1, "body", 0)``, ``(5, "shortcut", 0)``;
    ``".".join`` of it is the spec path of parameter names, and an error message writes it as
    ``model.layers[1].body[0]``.
    """
    for i, layer in enumerate(layers):
        here = (*path, i)
        yield here, layer
        for field in ("body", "shortcut"):
            yield from nested_layers(layer.get(field) or [], (*here, field))


def nested_inputs(input_shape: tuple[int, ...] | list[int], layers: list[dict],
                  prefix: str = "") -> list[tuple[str, dict, tuple[int, ...]]]:
    """Every layer as it runs, nested ones included, with its runtime path and per-example input shape.

    Paths are those of parameter names: ``3``, ``3.body.1``, ``3.shortcut.0``, and one per
    repetition of a ``repeat`` (``5.0.1``, ``5.1.1``, ...); a layer comes before the layers
    nested in it. Batch-norm state and dropout masks are keyed by these paths.
    """
    out: list[tuple[str, dict, tuple[int, ...]]] = []
    shape = tuple(input_shape)
    for j, layer in enumerate(layers):
        path = f"{prefix}{j}"
        out.append((path, layer, shape))
        if layer["type"] == "residual":
            out += nested_inputs(shape, layer["body"], f"{path}.body.")
            out += nested_inputs(shape, layer["shortcut"], f"{path}.shortcut.")
        elif layer["type"] == "repeat":
            h = shape
            for r in range(layer["count"]):
                out += nested_inputs(h, layer["body"], f"{path}.{r}.")
                h = _list(f"{path}.{r}", layer["body"], h)[1]
        shape = _layer(path, layer, shape, None if prefix else list(layers))[1]  # tied_logits: top level only
    return out


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
