"""Parameter names and shapes implied by a layer list (numpy only).

Canonical names are ``<layer index>.<kind>``; canonical layouts are
TensorFlow's (dense kernel ``[in, out]``). Both framework packages build
their models from the same layer list and must produce exactly these names.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ParamSpec", "param_specs", "output_shape"]


@dataclass(frozen=True)
class ParamSpec:
    """One parameter: canonical ``name``, ``shape``, and whether it is trainable."""

    name: str
    shape: tuple[int, ...]
    trainable: bool = True
    kind: str = "kernel"  # kernel, bias, gamma, beta, moving_mean, moving_variance


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
        else:  # validated earlier; a new layer type must be added here and in both packages
            raise AssertionError(f"unhandled layer type {kind!r}")
        yield i, params, shape


def param_specs(input_shape: tuple[int, ...] | list[int], layers: list[dict]) -> list[ParamSpec]:
    """All parameters of the model, in layer order (trainable and state).

    Args:
        input_shape: per-example input shape, e.g. ``[5]`` or ``[]``.
        layers: the validated ``model.layers`` list.
    Returns:
        a list of :class:`ParamSpec`, in the order the layers create them.
    """
    out: list[ParamSpec] = []
    for _, params, _ in _walk(tuple(input_shape), layers):
        out.extend(params)
    return out


def output_shape(input_shape: tuple[int, ...] | list[int], layers: list[dict]) -> tuple[int, ...]:
    """Per-example output shape of the model (no batch axis)."""
    out = tuple(input_shape)
    for _, _, layer_out in _walk(tuple(input_shape), layers):
        out = layer_out
    return out
