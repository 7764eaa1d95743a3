"""Validation of the ``model`` section: input shape, layers, loss, reduction."""

from __future__ import annotations

from typing import Any

from .errors import CaseError
from .fields import choice, integer, need, no_extra, obj, shape_of
from .specs import output_shape

__all__ = ["LAYER_TYPES", "ACTIVATIONS", "LOSSES", "REDUCTIONS", "validate_model"]

LAYER_TYPES = ("dense", "poly")
ACTIVATIONS = ("none", "relu", "tanh", "sigmoid")
LOSSES = ("mse", "sigmoid_ce", "softmax_ce")
REDUCTIONS = ("mean", "sum")



def validate_model(m: Any) -> tuple[dict, tuple[int, ...], tuple[int, ...]]:
    m = obj(m, "model")
    no_extra(m, {"input_shape", "layers", "loss", "reduction"}, "model")
    in_shape = shape_of(need(m, "input_shape", "model"), "model.input_shape")
    layers_in = need(m, "layers", "model")
    if not isinstance(layers_in, list) or not layers_in:
        raise CaseError("model.layers", "a non-empty list of layers", layers_in)
    layers = []
    shape = in_shape
    for i, layer in enumerate(layers_in):
        p = f"model.layers[{i}]"
        layer = obj(layer, p)
        kind = choice(need(layer, "type", p), f"{p}.type", LAYER_TYPES)
        if kind == "dense":
            no_extra(layer, {"type", "units", "activation", "use_bias"}, p)
            if len(shape) != 1:
                raise CaseError(p, f"a 1-D input for a dense layer (add a flatten layer first); the input here has shape {list(shape)}")
            use_bias = layer.get("use_bias", True)
            if not isinstance(use_bias, bool):
                raise CaseError(f"{p}.use_bias", "true or false", use_bias)
            out = {
                "type": "dense",
                "units": integer(need(layer, "units", p), f"{p}.units", 1, 100_000),
                "activation": choice(layer.get("activation", "none"), f"{p}.activation", ACTIVATIONS),
                "use_bias": use_bias,
            }
            shape = (out["units"],)
        else:  # poly
            no_extra(layer, {"type", "degree"}, p)
            if shape != ():
                raise CaseError(p, f"a scalar input (input_shape []) for a poly layer; the input here has shape {list(shape)}")
            out = {"type": "poly", "degree": integer(need(layer, "degree", p), f"{p}.degree", 1, 12)}
            shape = (out["degree"] + 1,)
        layers.append(out)
    loss = choice(need(m, "loss", "model"), "model.loss", LOSSES)
    reduction = choice(m.get("reduction", "mean"), "model.reduction", REDUCTIONS)
    out_shape = output_shape(in_shape, layers)
    if loss == "softmax_ce":
        if len(out_shape) != 1 or out_shape[0] < 2:
            raise CaseError("model.loss", f"an output of shape [k] with k >= 2 classes for softmax_ce; the model outputs {list(out_shape)}")
    model = {"input_shape": list(in_shape), "layers": layers, "loss": loss, "reduction": reduction}
    return model, in_shape, out_shape
