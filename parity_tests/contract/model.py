"""Validation of the ``model`` section: input shape, layers, loss and its options.

Layers (fields, defaults):

``dense``       ``units``, ``activation`` (none), ``use_bias`` (true); needs a 1-D input.
``poly``        ``degree``; needs a scalar input.
``conv2d``      ``filters``, ``kernel_size`` (n or [kh, kw]), ``strides`` (1), ``padding``
                (``valid``, Keras' default), ``activation`` (none), ``use_bias`` (true), ``semantics``
                (native; with a bias: whose bias add ``mixed_bfloat16`` uses, docs/mixed-precision.md);
                needs an image input ``[height, width, channels]``.
``max_pool2d``  ``pool_size`` (2), ``strides`` (= pool_size), ``padding`` (``valid``).
``flatten``     no fields; channels-last order, as TensorFlow flattens.
``batch_norm``  ``momentum`` (0.99, TensorFlow's convention: ``moving = m moving + (1-m) batch``),
                ``epsilon`` (1e-3), ``semantics`` (``native``: each framework's own moving-variance
                update, ``tf``: both use the biased batch variance, ``torch``: both the unbiased).
``dropout``     ``rate``; the masks are data drawn from the case ``seed``.

Architecture layers (``docs/case-format.md``, ``docs/layers.md``):

``activation``  ``fn``: relu, tanh, sigmoid, gelu (erf), gelu_tanh, silu, softmax (last axis);
                ``semantics`` (native) for the GELUs: which framework's constants both use.
``dense``       acts on the last axis of any rank; ``activation`` also gelu, gelu_tanh, silu; ``semantics``
                (native) for a GELU's constants and, with a bias, the bias add under ``mixed_bfloat16``.
``layer_norm``  ``epsilon`` (required), ``center`` (true), ``scale`` (true); last axis.
``rms_norm``    ``epsilon`` (required); last axis.
``residual``    ``body`` (layers), ``shortcut`` (layers, [] = identity), ``activation`` (none):
                ``act(body(x) + shortcut(x))``; parameters ``<i>.body.<j>.*``, ``<i>.shortcut.<j>.*``;
                ``semantics`` (native): under ``mixed_bfloat16`` whose add both use (Keras' ``Add`` in
                bfloat16, or torch's float32 promotion).
``repeat``      ``count``, ``body``: independent copies; parameters ``<i>.<r>.<j>.*``.
``avg_pool2d``  ``pool_size`` (2), ``strides`` (= pool_size), ``padding`` (valid), ``count_padding`` (false).
``global_avg_pool2d``  mean over height and width.
``channel_pad`` ``before``, ``after``: zero channels appended on the last axis.
``reshape``     ``shape`` per example (one -1 allowed), channels-last order.
``position_embedding``  ``length`` (>= T): learned ``[length, D]``, its first T rows added to ``[T, D]``.
``class_token`` prepends a learned token ``[1, D]``: ``[T, D] -> [T + 1, D]``.
``take_token``  ``index`` (0): ``[T, D] -> [D]``.
``depthwise_conv2d``  ``kernel_size``, ``strides`` (1, equal along both axes: TensorFlow's kernel
                needs it), ``padding`` (valid), ``depth_multiplier`` (1), ``use_bias`` (true), ``activation``,
                ``semantics`` (native; as conv2d's).
``attention``   ``num_heads``, ``key_dim``, ``value_dim`` (key_dim), ``use_bias`` (true), ``causal`` (false),
                ``dropout`` (0), ``semantics`` (native): self-attention on ``[T, D]`` (``contract.attention``).

``embedding``   ``input_dim``, ``output_dim``, ``gradient`` (native: TensorFlow's sparse ``IndexedSlices``,
                or dense); only as ``model.layers[0]``: it reads the integer token ids of ``data.x``.
``tied_logits`` ``embedding``: the path of an embedding layer (``"0"``); logits ``h @ embeddings.T``.
                Top level only.

``conv2d``, ``max_pool2d`` and ``avg_pool2d`` take an explicit ``padding``
``[[top, bottom], [left, right]]`` too. ``batch_norm`` and ``dropout`` may sit inside a
``residual`` or ``repeat`` body: their state and masks are keyed by path (``3.body.1.moving_mean``).

Loss options (model level): ``ignore_label`` (null: an integer label of ``softmax_ce`` whose
positions the loss excludes; per-token ``softmax_ce`` takes logits ``[..., k]``), ``from_logits`` (true), ``label_smoothing`` (0), ``class_weights``
(null, or one positive weight per class, ``softmax_ce`` only), ``loss_semantics`` (``native``:
each framework's own loss function, ``tf`` / ``torch``: both follow that framework's formula).
See ``docs/layers.md`` for the formulas.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from parity_tests.contract import tokens
from parity_tests.contract.attention import validate_attention
from parity_tests.contract.fields import choice, integer, need, no_extra, number, obj, shape_of
from parity_tests.contract.specs import axis_paddings, output_shape, reshape_target, spatial_output
from parity_tests.protocol.errors import CaseError
from parity_tests.protocol.specs import nested_layers
from parity_tests.protocol.vocabulary import ARCHITECTURE_TYPES, LAYER_TYPES

__all__ = [
    "nested_layers",  # re-exported from protocol.specs: the judge's side imports it from here
    "rewrite_layers",
    "validate_external_model",
    "is_external",
    "LAYER_TYPES",
    "ACTIVATIONS",
    "LOSSES",
    "REDUCTIONS",
    "PADDINGS",
    "LAYER_SEMANTICS",
    "DENSE_ACTIVATIONS",
    "ACTIVATION_FNS",
    "GELUS",
    "ARCHITECTURE_TYPES",
    "validate_model",
]

ACTIVATIONS = ("none", "relu", "tanh", "sigmoid")
GELUS = ("gelu", "gelu_tanh")
DENSE_ACTIVATIONS = (*ACTIVATIONS, *GELUS, "silu")
ACTIVATION_FNS = ("relu", "tanh", "sigmoid", *GELUS, "silu", "softmax")
MAX_REPEAT = 1000
LOSSES = ("mse", "sigmoid_ce", "softmax_ce")
REDUCTIONS = ("mean", "sum")
PADDINGS = ("valid", "same")
LAYER_SEMANTICS = ("native", "tf", "torch")
_MODEL_KEYS = {"input_shape", "layers", "loss", "reduction", "from_logits", "label_smoothing", "class_weights",
               "loss_semantics", "placement", "ignore_label"}
MAX_PLACEMENT_DEVICE = 63


def _flag(v: Any, path: str) -> bool:
    if not isinstance(v, bool):
        raise CaseError(path, "true or false", v)
    return v


def _pair(v: Any, path: str, what: str) -> list[int]:
    """``n`` or ``[a, b]`` (positive integers) -> ``[a, b]``."""
    if isinstance(v, int) and not isinstance(v, bool):
        v = [v, v]
    ok = isinstance(v, list) and len(v) == 2 and all(isinstance(s, int) and not isinstance(s, bool) and 1 <= s <= 10_000 for s in v)
    if not ok:
        raise CaseError(path, f"a positive integer or a list of two ({what})", v)
    return list(v)


def _image(shape: tuple[int, ...], p: str, kind: str) -> None:
    if len(shape) != 3:
        raise CaseError(p, f"an image input [height, width, channels] for a {kind} layer; the input here has shape {list(shape)}")


def _window(shape, win, strides, padding, p: str, field: str, kind: str) -> None:
    """A 'valid' (or explicitly padded) window must fit the input along both axes."""
    for axis, n, k, s, pad in zip(("height", "width"), shape[:2], win, strides, axis_paddings(padding), strict=True):
        if spatial_output(n, k, s, pad) < 1:
            with_pad = f"padding {padding!r}" if isinstance(padding, str) else f"padding {list(pad)}"
            raise CaseError(f"{p}.{field}", f"a {kind} window that fits the input {axis} {n} with {with_pad} (or padding 'same')", list(win))


def _padding(v: Any, p: str, window: list[int] | None = None) -> str | list[list[int]]:
    """``valid``, ``same`` or explicit ``[[top, bottom], [left, right]]`` (non-negative integers).

    For a pooling ``window``, each explicit padding must be smaller than the window
    along its axis, so that no window covers padding only.
    """
    if isinstance(v, str):
        return choice(v, p, PADDINGS)
    ok = (isinstance(v, list) and len(v) == 2 and all(
        isinstance(a, list) and len(a) == 2 and all(isinstance(q, int) and not isinstance(q, bool) and 0 <= q <= 10_000 for q in a)
        for a in v))
    if not ok:
        raise CaseError(p, "valid, same, or explicit padding [[top, bottom], [left, right]] (non-negative integers)", v)
    if window is not None and any(q >= k for a, k in zip(v, window, strict=True) for q in a):
        raise CaseError(p, f"explicit padding smaller than the pooling window {window} along each axis", v)
    return [list(a) for a in v]


def _gelu_semantics(layer: dict, fn: str, p: str, bias: bool = False) -> dict:
    """``semantics`` of a layer whose activation is ``fn``: kept for a GELU (whose constants TensorFlow
    rounds through float32 in float64) and, on a layer with a bias (``bias``), when not ``native`` (under
    ``mixed_bfloat16`` it chooses whose bias add both use: Keras' ``bias_add``, whose gradient sums in
    bfloat16, or torch's float32 sum); ``native`` elsewhere, and then not stored, so specs stay as they were."""
    sem = choice(layer.get("semantics", "native"), f"{p}.semantics", LAYER_SEMANTICS)
    if fn in GELUS or (bias and sem != "native"):
        return {"semantics": sem}
    if sem != "native":
        raise CaseError(f"{p}.semantics", f"native for activation {fn!r} without a bias (semantics chooses whose GELU"
                        " constants, or whose bias add under mixed_bfloat16, both sides use)", sem)
    return {}


def _bias_semantics(layer: dict, p: str) -> dict:
    """A conv layer's ``semantics`` (native, not stored): under ``mixed_bfloat16``, whose bias add both use
    (Keras' ``bias_add``, or torch's float32 gradient sum); it needs a bias."""
    sem = choice(layer.get("semantics", "native"), f"{p}.semantics", LAYER_SEMANTICS)
    if sem == "native":
        return {}
    if not layer.get("use_bias", True):
        raise CaseError(f"{p}.semantics", "native for a layer without a bias (semantics chooses whose bias add both"
                        " sides use under mixed_bfloat16)", sem)
    return {"semantics": sem}


def _dense(layer: dict, shape: tuple[int, ...], p: str) -> dict:
    no_extra(layer, {"type", "units", "activation", "use_bias", "semantics"}, p)
    if not shape:
        raise CaseError(p, "an input with at least one axis for a dense layer (it acts on the last axis); the input here is a scalar")
    act = choice(layer.get("activation", "none"), f"{p}.activation", DENSE_ACTIVATIONS)
    use_bias = _flag(layer.get("use_bias", True), f"{p}.use_bias")
    return {
        "type": "dense",
        "units": integer(need(layer, "units", p), f"{p}.units", 1, 100_000),
        "activation": act,
        "use_bias": use_bias,
        **_gelu_semantics(layer, act, p, use_bias),
    }


def _activation(layer: dict, shape: tuple[int, ...], p: str) -> dict:
    no_extra(layer, {"type", "fn", "semantics"}, p)
    fn = choice(need(layer, "fn", p), f"{p}.fn", ACTIVATION_FNS)
    if fn == "softmax" and not shape:
        raise CaseError(p, "an input with at least one axis for a softmax activation (it acts on the last axis); the input here is a scalar")
    return {"type": "activation", "fn": fn, **_gelu_semantics(layer, fn, p)}


def _last_axis(shape: tuple[int, ...], p: str, kind: str) -> None:
    if not shape:
        raise CaseError(p, f"an input with a last axis for a {kind} layer; the input here is a scalar")


def _layer_norm(layer: dict, shape: tuple[int, ...], p: str) -> dict:
    no_extra(layer, {"type", "epsilon", "center", "scale"}, p)
    _last_axis(shape, p, "layer_norm")
    return {
        "type": "layer_norm",
        # required: Keras' default is 1e-3, torch's 1e-5 (a 7e-4 to 0.3 gap; docs/layers.md)
        "epsilon": number(need(layer, "epsilon", p), f"{p}.epsilon", lo=0.0, lo_open=True),
        "center": _flag(layer.get("center", True), f"{p}.center"),
        "scale": _flag(layer.get("scale", True), f"{p}.scale"),
    }


def _rms_norm(layer: dict, shape: tuple[int, ...], p: str) -> dict:
    no_extra(layer, {"type", "epsilon"}, p)
    _last_axis(shape, p, "rms_norm")
    return {"type": "rms_norm", "epsilon": number(need(layer, "epsilon", p), f"{p}.epsilon", lo=0.0, lo_open=True)}


def _layer_list(v: Any, shape: tuple[int, ...], p: str, *, empty: bool = False) -> tuple[list[dict], tuple[int, ...]]:
    """A nested layer list (a ``residual``'s body or shortcut, a ``repeat``'s body) on inputs of ``shape``.

    Returns the normalised layers and their output shape.
    """
    if not isinstance(v, list) or (not v and not empty):
        raise CaseError(p, "a list of layers" + ("" if empty else " (at least one)"), v)
    out: list[dict] = []
    for j, layer in enumerate(v):
        q = f"{p}[{j}]"
        layer = obj(layer, q)
        kind = choice(need(layer, "type", q), f"{q}.type", LAYER_TYPES)
        if kind in tokens.TOP_LEVEL_ONLY:
            raise CaseError(f"{q}.type", tokens.TOP_LEVEL_ONLY[kind], kind)
        out.append(_LAYERS[kind](layer, output_shape(shape, out) if out else shape, q))
    return out, output_shape(shape, out) if out else shape


def _tokens(shape: tuple[int, ...], p: str, kind: str) -> None:
    if len(shape) != 2:
        raise CaseError(p, f"a token input [tokens, width] for a {kind} layer (a reshape layer makes one); the input"
                        f" here has shape {list(shape)}")


def _position_embedding(layer: dict, shape: tuple[int, ...], p: str) -> dict:
    no_extra(layer, {"type", "length"}, p)
    _tokens(shape, p, "position_embedding")
    return {"type": "position_embedding", "length": integer(need(layer, "length", p), f"{p}.length", shape[0], 1_000_000)}


def _class_token(layer: dict, shape: tuple[int, ...], p: str) -> dict:
    no_extra(layer, {"type"}, p)
    _tokens(shape, p, "class_token")
    return {"type": "class_token"}


def _take_token(layer: dict, shape: tuple[int, ...], p: str) -> dict:
    no_extra(layer, {"type", "index"}, p)
    _tokens(shape, p, "take_token")
    return {"type": "take_token", "index": integer(layer.get("index", 0), f"{p}.index", 0, shape[0] - 1)}


def _residual(layer: dict, shape: tuple[int, ...], p: str) -> dict:
    no_extra(layer, {"type", "body", "shortcut", "activation", "semantics"}, p)
    body, body_shape = _layer_list(need(layer, "body", p), shape, f"{p}.body")
    shortcut, short_shape = _layer_list(layer.get("shortcut", []), shape, f"{p}.shortcut", empty=True)
    if body_shape != short_shape:
        raise CaseError(f"{p}.shortcut", f"layers whose output shape equals the body's {list(body_shape)} (an empty "
                        f"shortcut is the identity); the shortcut gives {list(short_shape)}")
    # semantics (native, stored only otherwise): under mixed_bfloat16, the dtype of the add (tf: Keras' Add,
    # bfloat16; torch: autocast's promotion, float32)
    sem = choice(layer.get("semantics", "native"), f"{p}.semantics", LAYER_SEMANTICS)
    return {"type": "residual", "body": body, "shortcut": shortcut,
            "activation": choice(layer.get("activation", "none"), f"{p}.activation", ACTIVATIONS),
            **({"semantics": sem} if sem != "native" else {})}


def _repeat(layer: dict, shape: tuple[int, ...], p: str) -> dict:
    no_extra(layer, {"type", "count", "body"}, p)
    count = integer(need(layer, "count", p), f"{p}.count", 1, MAX_REPEAT)
    body, h = _layer_list(need(layer, "body", p), shape, f"{p}.body")
    for _ in range(count - 1):  # every copy must fit the shape the previous one gives
        again, h = _layer_list(layer["body"], h, f"{p}.body")
        if again != body:  # cannot happen today (no field normalises by shape); kept as a guard
            raise CaseError(f"{p}.body", "layers that normalise the same in every repetition", layer["body"])
    return {"type": "repeat", "count": count, "body": body}


def _poly(layer: dict, shape: tuple[int, ...], p: str) -> dict:
    no_extra(layer, {"type", "degree"}, p)
    if shape != ():
        raise CaseError(p, f"a scalar input (input_shape []) for a poly layer; the input here has shape {list(shape)}")
    return {"type": "poly", "degree": integer(need(layer, "degree", p), f"{p}.degree", 1, 12)}


def _conv2d(layer: dict, shape: tuple[int, ...], p: str) -> dict:
    no_extra(layer, {"type", "filters", "kernel_size", "strides", "padding", "activation", "use_bias", "semantics"}, p)
    _image(shape, p, "conv2d")
    out = {
        "type": "conv2d",
        "filters": integer(need(layer, "filters", p), f"{p}.filters", 1, 100_000),
        "kernel_size": _pair(need(layer, "kernel_size", p), f"{p}.kernel_size", "[kernel height, kernel width]"),
        "strides": _pair(layer.get("strides", 1), f"{p}.strides", "[stride along height, along width]"),
        "padding": _padding(layer.get("padding", "valid"), f"{p}.padding"),
        "activation": choice(layer.get("activation", "none"), f"{p}.activation", ACTIVATIONS),
        "use_bias": _flag(layer.get("use_bias", True), f"{p}.use_bias"),
        **_bias_semantics(layer, p),
    }
    _window(shape, out["kernel_size"], out["strides"], out["padding"], p, "kernel_size", "kernel")
    return out


def _pool2d(layer: dict, shape: tuple[int, ...], p: str, kind: str) -> dict:
    extra = {"count_padding"} if kind == "avg_pool2d" else set()
    no_extra(layer, {"type", "pool_size", "strides", "padding", *extra}, p)
    _image(shape, p, kind)
    pool = _pair(layer.get("pool_size", 2), f"{p}.pool_size", "[pool height, pool width]")
    out = {
        "type": kind,
        "pool_size": pool,
        "strides": _pair(layer.get("strides", pool), f"{p}.strides", "[stride along height, along width]"),
        "padding": _padding(layer.get("padding", "valid"), f"{p}.padding", pool),
    }
    if kind == "avg_pool2d":  # TensorFlow's default (padding not counted); torch's count_include_pad is True
        out["count_padding"] = _flag(layer.get("count_padding", False), f"{p}.count_padding")
    _window(shape, pool, out["strides"], out["padding"], p, "pool_size", "pooling")
    return out


def _depthwise_conv2d(layer: dict, shape: tuple[int, ...], p: str) -> dict:
    no_extra(layer, {"type", "kernel_size", "strides", "padding", "depth_multiplier", "use_bias", "activation", "semantics"}, p)
    _image(shape, p, "depthwise_conv2d")
    out = {
        "type": "depthwise_conv2d",
        "kernel_size": _pair(need(layer, "kernel_size", p), f"{p}.kernel_size", "[kernel height, kernel width]"),
        "strides": _pair(layer.get("strides", 1), f"{p}.strides", "[stride along height, along width]"),
        "padding": _padding(layer.get("padding", "valid"), f"{p}.padding"),
        "depth_multiplier": integer(layer.get("depth_multiplier", 1), f"{p}.depth_multiplier", 1, 10_000),
        "use_bias": _flag(layer.get("use_bias", True), f"{p}.use_bias"),
        "activation": choice(layer.get("activation", "none"), f"{p}.activation", ACTIVATIONS),
        **_bias_semantics(layer, p),
    }
    if out["strides"][0] != out["strides"][1]:  # tf.nn.depthwise_conv2d refuses unequal strides
        raise CaseError(f"{p}.strides", "the same stride along height and width for a depthwise_conv2d layer", out["strides"])
    _window(shape, out["kernel_size"], out["strides"], out["padding"], p, "kernel_size", "kernel")
    return out


def _max_pool2d(layer: dict, shape: tuple[int, ...], p: str) -> dict:
    return _pool2d(layer, shape, p, "max_pool2d")


def _avg_pool2d(layer: dict, shape: tuple[int, ...], p: str) -> dict:
    return _pool2d(layer, shape, p, "avg_pool2d")


def _global_avg_pool2d(layer: dict, shape: tuple[int, ...], p: str) -> dict:
    no_extra(layer, {"type"}, p)
    _image(shape, p, "global_avg_pool2d")
    return {"type": "global_avg_pool2d"}


def _channel_pad(layer: dict, shape: tuple[int, ...], p: str) -> dict:
    no_extra(layer, {"type", "before", "after"}, p)
    _last_axis(shape, p, "channel_pad")
    return {"type": "channel_pad", "before": integer(need(layer, "before", p), f"{p}.before", 0, 100_000),
            "after": integer(need(layer, "after", p), f"{p}.after", 0, 100_000)}


def _reshape(layer: dict, shape: tuple[int, ...], p: str) -> dict:
    no_extra(layer, {"type", "shape"}, p)
    target = need(layer, "shape", p)
    ok = (isinstance(target, list) and target and all(isinstance(d, int) and not isinstance(d, bool) and (d >= 1 or d == -1)
                                                      for d in target) and target.count(-1) <= 1)
    if not ok:
        raise CaseError(f"{p}.shape", "a non-empty list of positive integers per example, at most one -1", target)
    if reshape_target(shape, target) is None:
        raise CaseError(f"{p}.shape", f"a shape with as many values as the input {list(shape)} "
                        f"({math.prod(shape)} per example)", target)
    return {"type": "reshape", "shape": list(target)}


def _flatten(layer: dict, shape: tuple[int, ...], p: str) -> dict:
    no_extra(layer, {"type"}, p)
    if not shape:
        raise CaseError(p, "an input with at least one axis for a flatten layer; the input here is a scalar")
    return {"type": "flatten"}


def _batch_norm(layer: dict, shape: tuple[int, ...], p: str) -> dict:
    no_extra(layer, {"type", "momentum", "epsilon", "semantics"}, p)
    if not shape:
        raise CaseError(p, "an input with a channel (last) axis for a batch_norm layer; the input here is a scalar")
    return {
        "type": "batch_norm",
        "momentum": number(layer.get("momentum", 0.99), f"{p}.momentum", lo=0.0, hi=1.0),
        "epsilon": number(layer.get("epsilon", 1e-3), f"{p}.epsilon", lo=0.0, lo_open=True),
        "semantics": choice(layer.get("semantics", "native"), f"{p}.semantics", LAYER_SEMANTICS),
    }


def _dropout(layer: dict, shape: tuple[int, ...], p: str) -> dict:
    no_extra(layer, {"type", "rate"}, p)
    return {"type": "dropout", "rate": number(need(layer, "rate", p), f"{p}.rate", lo=0.0, hi=1.0, hi_open=True)}


_LAYERS = {
    "dense": _dense,
    "poly": _poly,
    "conv2d": _conv2d,
    "max_pool2d": _max_pool2d,
    "flatten": _flatten,
    "batch_norm": _batch_norm,
    "dropout": _dropout,
    "activation": _activation,
    "layer_norm": _layer_norm,
    "rms_norm": _rms_norm,
    "residual": _residual,
    "repeat": _repeat,
    "avg_pool2d": _avg_pool2d,
    "global_avg_pool2d": _global_avg_pool2d,
    "channel_pad": _channel_pad,
    "reshape": _reshape,
    "position_embedding": _position_embedding,
    "class_token": _class_token,
    "take_token": _take_token,
    "depthwise_conv2d": _depthwise_conv2d,
    "attention": validate_attention,
    "embedding": tokens.embedding,
    "tied_logits": tokens.tied_logits,
}


def _loss_options(m: dict, loss: str, layers: list[dict], out_shape: tuple[int, ...]) -> dict:
    from_logits = _flag(m.get("from_logits", True), "model.from_logits")
    if not from_logits:
        if loss != "sigmoid_ce":
            raise CaseError("model.from_logits", f"true for {loss} (probability inputs are supported for sigmoid_ce)", False)
        last = layers[-1]
        if last.get("activation") != "sigmoid":
            raise CaseError(
                "model.from_logits",
                f"true, or a last layer with activation 'sigmoid' so the model outputs probabilities (model.layers[{len(layers) - 1}] is a {last['type']}"
                + (f" with activation {last.get('activation')!r})" if "activation" in last else ")"),
                False,
            )
    smoothing = number(m.get("label_smoothing", 0.0), "model.label_smoothing", lo=0.0, hi=1.0, hi_open=True)
    if smoothing and loss == "mse":
        raise CaseError("model.label_smoothing", "0 for mse (label smoothing applies to sigmoid_ce and softmax_ce)", smoothing)
    weights = m.get("class_weights")
    if weights is not None:
        if loss != "softmax_ce":
            raise CaseError("model.class_weights", f"null for {loss} (class weights apply to softmax_ce)", weights)
        k = out_shape[-1]
        if not isinstance(weights, list) or len(weights) != k:
            raise CaseError("model.class_weights", f"a list of {k} positive numbers, one per class", weights)
        weights = [number(w, f"model.class_weights[{j}]", lo=0.0, lo_open=True) for j, w in enumerate(weights)]
    return {
        "from_logits": from_logits,
        "label_smoothing": smoothing,
        "class_weights": weights,
        "loss_semantics": choice(m.get("loss_semantics", "native"), "model.loss_semantics", LAYER_SEMANTICS),
    }


def is_external(m: Any) -> bool:
    """True for ``{"external": ...}``: the model lives in the plugins (docs/plugins.md)."""
    return isinstance(m, dict) and "external" in m


def validate_external_model(m: Any) -> dict:
    """``{"external": "free text", "loss"?: ..., "reduction"?: ...}``, normalised.

    The model lives in the plugins; the tool knows its parameters only by the
    names and shapes of ``init.npz``. ``loss`` and ``reduction``, when given,
    say what the plugins compute (the loss channel's bound uses them: an
    ``mse`` or cross-entropy mean is a mean of non-negative terms). The
    normalised model has an empty ``layers`` list, so that every rule keyed on
    layers (batch norm, dropout, placement) sees none.
    """
    # layers and input_shape: what normalising added (an empty list; the data's per-example shape)
    no_extra(m, {"external", "loss", "reduction", "layers", "input_shape"}, "model")
    if m.get("layers", []) != []:  # a normalised external model carries an empty list; nothing else may
        raise CaseError("model.layers", "no layers with model.external (the model lives in the plugins)", m["layers"])
    text = m["external"]
    if not isinstance(text, str) or not text.strip() or len(text) > 1000:
        raise CaseError("model.external", "a short description of the plugins' model (free text, at most 1000 characters)", text)
    out: dict[str, Any] = {"external": text, "layers": [], "reduction": choice(m.get("reduction", "mean"), "model.reduction", REDUCTIONS)}
    if m.get("loss", "external") != "external":
        out["loss"] = choice(m["loss"], "model.loss", LOSSES)
    else:
        out["loss"] = "external"
    return out


def validate_model(m: Any) -> tuple[dict, tuple[int, ...], tuple[int, ...]]:
    """Check the ``model`` section and fill in its defaults.

    Returns:
        the normalised model dict, the per-example input shape and output shape.
    Raises:
        CaseError: naming the field, e.g. ``model.layers[2].kernel_size``.
    """
    m = obj(m, "model")
    no_extra(m, _MODEL_KEYS, "model")
    in_shape = shape_of(need(m, "input_shape", "model"), "model.input_shape")
    layers_in = need(m, "layers", "model")
    if not isinstance(layers_in, list) or not layers_in:
        raise CaseError("model.layers", "a non-empty list of layers", layers_in)
    layers: list[dict] = []
    given_devices: dict[int, Any] = {}  # a normalised spec's "device" (derived from placement), validated again
    for i, layer in enumerate(layers_in):
        p = f"model.layers[{i}]"
        layer = obj(layer, p)
        if "device" in layer and "placement" in m:
            layer = dict(layer)
            given_devices[i] = layer.pop("device")
        kind = choice(need(layer, "type", p), f"{p}.type", LAYER_TYPES)
        shape = output_shape(in_shape, layers) if layers else in_shape
        tokens.check_place(kind, i, p)
        if kind == "tied_logits":
            layers.append(tokens.tied_logits(layer, shape, p, layers))
        else:
            layers.append(_LAYERS[kind](layer, shape, p))
    loss = choice(need(m, "loss", "model"), "model.loss", LOSSES)
    reduction = choice(m.get("reduction", "mean"), "model.reduction", REDUCTIONS)
    out_shape = output_shape(in_shape, layers)
    if loss == "softmax_ce":
        if len(out_shape) < 1 or out_shape[-1] < 2:
            raise CaseError("model.loss", f"an output of shape [..., k] with k >= 2 classes for softmax_ce (one"
                            f" distribution per example, or per token); the model outputs {list(out_shape)}")
    model = {"input_shape": list(in_shape), "layers": layers, "loss": loss, "reduction": reduction}
    model.update(_loss_options(m, loss, layers, out_shape))
    model.update(tokens.loss_options(m, model, out_shape))
    if "placement" in m:
        model["placement"] = _placement(m["placement"], layers)
    for i, device in given_devices.items():  # what Case.replace re-validates: it must say what placement says
        if device != layers[i].get("device"):
            raise CaseError(f"model.layers[{i}].device", f"no such field, or the device model.placement gives "
                            f"this layer ({layers[i].get('device', 'none')})", device)
    return model, in_shape, out_shape


def _placement(v: Any, layers: list[dict]) -> list[list[int]]:
    """``model.placement``: model parallelism, ``[[first_layer, last_layer, device], ...]``.

    Layers ``first..last`` (inclusive) run on logical device ``device`` (an index
    into the process's tower devices) whatever tower they belong to; layers no
    range covers run on their tower's device. Ranges may not overlap. Each placed
    layer also gets ``"device": index`` in the normalised layer list, which is
    what the TensorFlow side reads. The torch reference has one device per
    process here (the CPU), so placement changes nothing there: the property is
    that placement never changes the trajectory.
    """
    path = "model.placement"
    if not isinstance(v, list):
        raise CaseError(path, "a list of [first_layer, last_layer, device] triples", v)
    taken: dict[int, int] = {}
    out = []
    for j, item in enumerate(v):
        p = f"{path}[{j}]"
        if not isinstance(item, list) or len(item) != 3:
            raise CaseError(p, "[first_layer, last_layer, device]", item)
        first = integer(item[0], f"{p}[0]", 0, len(layers) - 1)
        last = integer(item[1], f"{p}[1]", first, len(layers) - 1)
        device = integer(item[2], f"{p}[2]", 0, MAX_PLACEMENT_DEVICE)
        for i in range(first, last + 1):
            if i in taken:
                raise CaseError(p, f"ranges that do not overlap (layer {i} is already placed by {path}[{taken[i]}])", item)
            taken[i] = j
            layers[i]["device"] = device
        out.append([first, last, device])
    return out


def rewrite_layers(layers: list[dict], change: Callable[[dict], dict]) -> list[dict]:
    """A copy of ``layers`` with ``change`` applied to a copy of every layer, nested bodies and shortcuts
    included (``change`` returns the layer to keep; the original list is untouched)."""
    out = []
    for layer in layers:
        layer = change(dict(layer))
        for field in ("body", "shortcut"):
            if field in layer:
                layer[field] = rewrite_layers(layer[field], change)
        out.append(layer)
    return out
