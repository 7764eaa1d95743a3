"""Models built from the case's layer list, as plain functions over named variables.

Parameters are ``tf.Variable`` objects keyed by canonical name (``0.kernel``),
in canonical layouts (dense kernel ``[in, out]``, conv kernel ``[kh, kw, in, out]``,
images NHWC); the forward pass is a pure function of the parameters and the
input (plus the batch-norm moving statistics it updates), so each tower calls
it under its own ``tf.device`` while sharing the one set of variables.

The layers use TensorFlow's own ops, the ones Keras 3's layers call
(``tf.nn.conv2d``, ``tf.nn.max_pool2d``, ``tf.nn.moments``,
``tf.nn.batch_normalization``); ``tests/test_layers.py`` pins each against
the Keras layer.

Layer formulas (x: ``[B, ...]`` the layer input; shapes per example in ``parity_tests.protocol.specs``):

conv2d
    ``y = act(conv(x, kernel) + bias)``, SAME padding puts the odd extra row
    bottom/right.
max_pool2d
    window maximum; SAME padding never selects a padded position.
flatten
    ``[B, H, W, C] -> [B, H*W*C]`` in channels-last (row-major NHWC) order.
batch_norm (training)
    ``mu, var = mean and biased variance over every axis but the last``;
    ``y = gamma (x - mu) / sqrt(var + eps) + beta``;
    ``moving_mean <- m moving_mean + (1 - m) mu``;
    ``moving_variance <- m moving_variance + (1 - m) var'`` with ``var' = var``
    (Keras, ``semantics`` native/tf) or ``var n/(n-1)`` (torch's rule, ``semantics: torch``;
    n = the values per channel the statistics were taken over).
dropout
    ``y = where(keep, x * (1 / (1 - rate)), 0)``, ``tf.nn.dropout``'s arithmetic,
    with the keep-mask given as data.

Architecture layers (``docs/layers.md``; each the arithmetic of the Keras layer named,
pinned equal to it by ``tests/test_layers_vocabulary.py``):

dense
    on the last axis of any rank: ``tf.matmul(x, kernel) + bias`` (Keras ``Dense``).
activation
    ``tf.nn.relu``, ``tf.tanh``, ``tf.sigmoid``, ``tf.nn.gelu`` (``approximate`` False for
    ``gelu``, True for ``gelu_tanh``), ``tf.nn.silu``, ``tf.nn.softmax`` (last axis): what
    ``keras.activations`` calls. In float64 ``tf.nn.gelu`` rounds its constant
    ``1/sqrt(2)`` (erf) or ``0.044715`` (tanh) through float32 (``math_ops.cast`` of a
    Python float makes a float32 tensor first); ``semantics: torch`` uses exact constants.
layer_norm
    ``keras.ops.layer_normalization`` (Keras ``LayerNormalization``): ``mu, var`` over the
    last axis, ``inv = rsqrt(var + eps) gamma``, ``y = x inv + (beta - mu inv)``.
rms_norm
    ``keras.ops.rms_normalization`` (Keras ``RMSNormalization``): ``y = x rsqrt(mean(x^2) + eps) scale``.
residual
    ``act(body(x) + shortcut(x))``, the sum of Keras ``Add``.
repeat
    the body ``count`` times, each copy with its own parameters (``<i>.<r>.<j>.*``).
avg_pool2d
    ``tf.nn.avg_pool2d`` (Keras ``AveragePooling2D``): SAME divides by the real values in
    the window; ``count_padding`` pads with zeros first and divides by the window size;
    explicit padding without ``count_padding`` divides the window sum by its real count.
global_avg_pool2d
    ``reduce_mean`` over height and width (Keras ``GlobalAveragePooling2D``).
channel_pad
    zeros before and after on the last axis (``tf.pad``).
reshape
    ``tf.reshape`` to ``[batch, *shape]`` (channels-last order).
depthwise_conv2d
    ``tf.nn.depthwise_conv2d`` + ``tf.nn.bias_add`` (Keras ``DepthwiseConv2D``); output channel
    ``c M + m`` is input channel ``c``'s filter ``m``.
attention
    Keras' ``MultiHeadAttention``, op for op (:mod:`tfpar.attention`).
embedding, tied_logits
    ``keras.ops.take(embeddings, ids, axis=0)`` (sparse ``IndexedSlices`` gradient, or dense under
    ``gradient: dense``) and ``h @ embeddings^T``: :mod:`tfpar.tokens`.
position_embedding, class_token, take_token
    ``x + embeddings[:T]``; ``concat([token] * B, x)`` on the token axis; ``x[:, index]``.
explicit padding
    ``tf.pad`` (zeros for conv and average pooling, ``-inf`` for max pooling), then a
    'VALID' op: Keras' ``ZeroPadding2D`` followed by the layer.

Batch norm across towers (:func:`forward_towers`): ``local`` normalises every
tower with its own shard's statistics and keeps the *first* tower's update of
the moving statistics (what DDP keeps: it broadcasts rank 0's buffers at every
forward); ``sync`` sums ``sum x``, ``sum x^2`` and the counts over the towers,
``mu = S / n``, ``var = max(Q / n - mu^2, 0)`` (Keras' synchronized moments),
and normalises every tower with those; under the layer's ``semantics: torch`` it merges
each tower's ``tf.nn.moments`` with the counts instead, as torch's ``SyncBatchNorm`` does
(``mu = sum n_r m_r / n``, ``var = sum n_r (v_r + (m_r - mu)^2) / n``). A ``residual`` or ``repeat`` whose bodies hold
batch norm or dropout is walked in the same lockstep, its inner layers keyed by path
(``3.body.1.gamma``, ``3.body.1.moving_mean``, the mask of ``5.2.0``).

Mixed precision (``compute=tf.bfloat16``, the case dtype ``mixed_bfloat16``) follows
Keras 3.15's ``mixed_bfloat16`` policy, read in the installed ``keras/src``:

* ``dtype_policies/dtype_policy.py`` 84-85: ``mixed_bfloat16`` is compute ``bfloat16``,
  variables ``float32``; the variables stay float32 here (:func:`build_variables`);
* ``layers/layer.py`` 882-900: a layer casts its floating inputs to its compute dtype
  (``convert_input``), so the model's input is rounded to bfloat16 once, at the first layer;
* ``layers/layer.py`` 983-995 and ``backend/common/variables.py`` 245-248: inside the
  layer's ``AutocastScope`` every variable read is cast to bfloat16 (:func:`_param`);
* ``layers/core/dense.py`` 221-227: ``matmul(x, kernel)`` (``tf.tensordot`` on ``[B, T, D]``),
  ``add(x, bias)`` and the activation, all on bfloat16 tensors (each op's result rounded to
  bfloat16); ``layers/convolutional/base_conv.py`` 256-263 likewise for ``conv2d`` + bias; the
  backend's ``add`` is ``tf.nn.bias_add`` for a bias (:func:`tfpar.bias.keras_bias_add`, whose gradient sums
  in bfloat16 here; a layer's ``semantics: torch`` takes a broadcasting add instead);
* the architecture layers (``tests/test_mixed_architectures.py`` pins each to its Keras class):
  ``LayerNormalization`` does not cast its input (``autocast = False``) and returns bfloat16 from a
  float32 computation; ``RMSNormalization`` casts input and scale; ``Add`` casts both inputs (the
  residual stream is bfloat16; :func:`_add_inputs`); ``Embedding`` casts the gathered float32 rows;
  ``MultiHeadAttention`` (:mod:`tfpar.attention`); ``ops.mean`` averages in float32;
* ``layers/normalization/batch_normalization.py`` 345-348 and 405: batch norm casts its
  input up to float32, computes statistics, normalisation and the moving-average update
  in float32 (gamma, beta and the moving statistics are float32), and casts the output
  back to bfloat16;
* ``losses/loss.py`` 59-62: the loss converts ``y_pred`` to its own dtype, float32
  (:func:`tfpar.losses.model_loss`), so the logits are rounded to bfloat16 by the last
  layer and the loss is computed in float32.

Max pooling, flatten and dropout run on the bfloat16 activations (dropout's scale
``1 / (1 - rate)`` is rounded to bfloat16, as ``tf.nn.dropout`` makes it in ``x.dtype``).
Gradients flow back through the casts, so every gradient arrives in float32.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping, Sequence

import numpy as np
import tensorflow as tf

from . import tokens
from .bias import bias_add_fn as _bias_add_fn

__all__ = [
    "STATE_KINDS",
    "apply_layer",
    "build_variables",
    "update_moving",
    "forward",
    "forward_towers",
    "is_state",
    "layer_device",
    "layer_mask",
    "needs_towers_fn",
    "recording_activations",
    "residual_output",
]

STATE_KINDS = ("moving_mean", "moving_variance")
# when a list: forward_towers appends (layer index, [tower outputs]) after every layer, and a nested
# layer list (path such as "3.body.1", parity_tests.contract.paths) (path, [this tower's output]) (the capture step)
_ACTIVATIONS: list[tuple[int | str, list[tf.Tensor]]] | None = None
_ACT = {"none": lambda t: t, "relu": tf.nn.relu, "tanh": tf.tanh, "sigmoid": tf.sigmoid, "silu": tf.nn.silu,
        "softmax": lambda t: tf.nn.softmax(t, axis=-1)}
_SQRT_HALF = 0.7071067811865476  # 1/sqrt(2), as tf.nn.gelu spells it
_SQRT_2_OVER_PI = 0.7978845608028654
_GELU_CUBIC = 0.044715


def gelu(h: tf.Tensor, approximate: bool, semantics: str = "native") -> tf.Tensor:
    """GELU: ``tf.nn.gelu`` under ``native`` and ``tf``; under ``torch`` the same formula with the
    constants in ``h``'s dtype exactly (what ``F.gelu`` computes), instead of through float32.

    ``gelu``: ``0.5 x erfc(-x / sqrt(2))``; ``gelu_tanh``: ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``.
    """
    if semantics != "torch":
        return tf.nn.gelu(h, approximate=approximate)
    if approximate:
        inner = tf.constant(_SQRT_2_OVER_PI, h.dtype) * (h + tf.constant(_GELU_CUBIC, h.dtype) * tf.pow(h, 3))
        return 0.5 * h * (1.0 + tf.tanh(inner))
    return 0.5 * h * tf.math.erfc(-h * tf.constant(_SQRT_HALF, h.dtype))


def _activate(h: tf.Tensor, fn: str, layer: Mapping) -> tf.Tensor:
    if fn in ("gelu", "gelu_tanh"):
        return gelu(h, fn == "gelu_tanh", layer.get("semantics", "native"))
    return _ACT[fn](h)


def _same_padding(n: int, k: int, s: int) -> list[int]:
    """TensorFlow's SAME padding ``[before, after]`` along one axis (the odd extra row after)."""
    total = max((math.ceil(n / s) - 1) * s + k - n, 0)
    return [total // 2, total - total // 2]


def _explicit_pad(h: tf.Tensor, padding, value: float = 0.0) -> tf.Tensor:
    """NHWC ``h`` padded ``[[top, bottom], [left, right]]`` with ``value``."""
    return tf.pad(h, [[0, 0], list(padding[0]), list(padding[1]), [0, 0]], constant_values=value)


def _avg_pool(h: tf.Tensor, layer: Mapping) -> tf.Tensor:
    pool, strides, padding = layer["pool_size"], layer["strides"], layer["padding"]
    if padding == "valid" or (padding == "same" and not layer["count_padding"]):
        return tf.nn.avg_pool2d(h, ksize=pool, strides=strides, padding=padding.upper())
    if padding == "same":  # counted: zeros in the window count as values
        padding = [_same_padding(h.shape[1], pool[0], strides[0]), _same_padding(h.shape[2], pool[1], strides[1])]
    padded = tf.nn.avg_pool2d(_explicit_pad(h, padding), ksize=pool, strides=strides, padding="VALID")
    if layer["count_padding"]:
        return padded
    ones = _explicit_pad(tf.ones_like(h[:1, :, :, :1]), padding)
    real = tf.nn.avg_pool2d(ones, ksize=pool, strides=strides, padding="VALID")  # real values / window size
    return padded / real


def _apply_list(prefix: str, layers: Sequence[Mapping], params: Mapping[str, tf.Tensor], h: tf.Tensor,
                compute: tf.DType | None, masks: Mapping[str, tf.Tensor] | None = None) -> tf.Tensor:
    """A nested layer list without batch_norm or dropout (those run through :func:`forward_towers`) at path ``prefix``;
    ``masks``: the tower's keep-masks by path (a nested attention layer's)."""
    for j, layer in enumerate(layers):
        h = _apply(f"{prefix}.{j}", layer, params, h, layer_mask(masks, f"{prefix}.{j}", layer), compute)
        if _ACTIVATIONS is not None:  # the forward stage at block granularity: one tower's call, by path
            _ACTIVATIONS.append((f"{prefix}.{j}", [tf.cast(h, tf.float32) if h.dtype == tf.bfloat16 else h]))
    return h


def layer_mask(masks: Mapping[str, tf.Tensor] | None, path: str, layer: Mapping):
    """What layer ``path`` takes as its ``mask``: a residual or repeat all the masks (its nested attention
    layers find theirs by path), any other layer its own keep-mask, or ``None``."""
    if masks is None:
        return None
    return masks if layer["type"] in ("residual", "repeat") else masks.get(path)


def is_state(name: str) -> bool:
    """True for non-trainable state (``3.moving_mean``), False for trainable parameters."""
    return name.rsplit(".", 1)[-1] in STATE_KINDS


def needs_towers_fn(layers: Sequence[Mapping]) -> bool:
    """True when towers must run in lockstep (batch norm, whose state and statistics cross towers, or dropout
    masks, an attention layer's included), at the top level or inside a ``residual`` or ``repeat`` body."""
    return any(layer["type"] in ("batch_norm", "dropout") or (layer["type"] == "attention" and layer["dropout"] > 0)
               or (layer["type"] in ("residual", "repeat") and needs_towers_fn([*layer["body"], *layer.get("shortcut", [])]))
               for layer in layers)


def _add_inputs(layer: Mapping, body: tf.Tensor, shortcut: tf.Tensor,
                compute: tf.DType | None) -> tuple[tf.Tensor, tf.Tensor]:
    """A residual's two branches as its add reads them under mixed precision.

    ``keras.layers.Add`` autocasts both inputs to bfloat16 (an identity shortcut may carry
    float32), so the stream between blocks is bfloat16. **Warning, where TensorFlow and torch
    differ:** torch's autocast promotes ``float32 + bfloat16`` to float32, so its stream stays
    float32; the residual's ``semantics: torch`` adds in float32 as torch does (what
    ``keras.layers.Add(dtype="float32")`` computes).
    """
    if compute is None:
        return body, shortcut
    to = tf.float32 if layer.get("semantics", "native") == "torch" else compute
    return tf.cast(body, to), tf.cast(shortcut, to)


def residual_output(layer: Mapping, body: tf.Tensor, shortcut: tf.Tensor) -> tf.Tensor:
    """A ``residual`` layer's output from its body's and shortcut's: ``act(body + shortcut)`` (Keras ``Add``)."""
    return _ACT[layer["activation"]](body + shortcut)


def build_variables(init: Mapping[str, np.ndarray], dtype: tf.DType, *, device: str = "/device:CPU:0") -> dict[str, tf.Variable]:
    """One variable per canonical name, on ``device`` (the classic tower programs keep variables on the CPU).

    Batch-norm moving statistics become non-trainable variables (see :func:`is_state`).
    """
    with tf.device(device):
        return {
            k: tf.Variable(np.asarray(v), dtype=dtype, name=k.replace(".", "_"), trainable=not is_state(k))
            for k, v in init.items()
        }


def layer_device(layer: Mapping, device: str | None = None) -> str | None:
    """Where layer ``layer`` runs: its own device when ``model.placement`` placed it (an index
    into the tower devices: model parallelism, whichever tower it belongs to), else ``device``."""
    if "device" not in layer:
        return device
    from .devices import tower_devices

    return tower_devices(layer["device"] + 1)[layer["device"]]


def _on(device: str | None):
    return tf.device(device) if device else contextlib.nullcontext()


#: layers whose input is not cast to the compute dtype on entry: Keras' ``LayerNormalization`` sets
#: ``autocast = False`` (layer_normalization.py 151; it computes in float32 and casts its output), and
#: ``residual``/``repeat`` are no Keras layers (each inner layer casts its own input; ``Add`` casts both of its)
_NO_AUTOCAST = ("layer_norm", "residual", "repeat")


def _param(params: Mapping[str, tf.Tensor], name: str, compute: tf.DType | None) -> tf.Tensor:
    """Parameter ``name`` as the layer reads it: cast to ``compute`` (Keras' autocast of a variable read)."""
    p = params[name]
    return p if compute is None or p.dtype == compute else tf.cast(p, compute)


def _apply(i: int | str, layer: Mapping, params: Mapping[str, tf.Tensor], h: tf.Tensor, mask: tf.Tensor | None,
           compute: tf.DType | None = None) -> tf.Tensor:
    """Layer ``i`` (its index, or its path ``3.body.1``) on one tower's activations (every type but
    batch_norm), in ``compute`` when given."""
    kind = layer["type"]
    if kind in tokens.TOKEN_LAYERS:  # embedding, tied_logits (tfpar.tokens; docs/layers.md "Token layers")
        return tokens.layer(kind, str(i), layer, params, h, compute)
    if compute is not None and h.dtype.is_floating and h.dtype != compute and kind not in _NO_AUTOCAST:
        h = tf.cast(h, compute)  # Layer.__call__'s convert_input: floating inputs in the compute dtype
    if kind == "poly":
        d = layer["degree"]
        powers = tf.constant(np.arange(d, -1, -1, dtype=np.float64), dtype=h.dtype)
        return tf.pow(h[:, None], powers)  # [batch, d+1]: x^d ... x^1, x^0 = 1
    if kind == "dense":  # Keras Dense's ops.matmul: tf.matmul, or tf.tensordot for [B, T, D] (one MatMul over B*T rows)
        import keras

        h = keras.ops.matmul(h, _param(params, f"{i}.kernel", compute))
        if layer["use_bias"] and compute is not None:
            h = _bias_add_fn(layer)(h, _param(params, f"{i}.bias", compute))
        elif layer["use_bias"]:
            h = h + params[f"{i}.bias"]
        return _activate(h, layer["activation"], layer)
    if kind == "conv2d":
        (sh, sw) = layer["strides"]
        padding = layer["padding"]
        if not isinstance(padding, str):
            h, padding = _explicit_pad(h, padding), "valid"
        h = tf.nn.conv2d(h, _param(params, f"{i}.kernel", compute), strides=[1, sh, sw, 1],
                         padding=padding.upper())
        if layer["use_bias"] and compute is not None:
            h = _bias_add_fn(layer)(h, _param(params, f"{i}.bias", compute))
        elif layer["use_bias"]:
            h = tf.nn.bias_add(h, params[f"{i}.bias"])
        return _ACT[layer["activation"]](h)
    if kind == "depthwise_conv2d":  # Keras' DepthwiseConv2D: tf.nn.depthwise_conv2d, then bias_add
        (sh, sw) = layer["strides"]
        padding = layer["padding"]
        if not isinstance(padding, str):
            h, padding = _explicit_pad(h, padding), "valid"
        h = tf.nn.depthwise_conv2d(h, _param(params, f"{i}.kernel", compute), strides=[1, sh, sw, 1],
                                   padding=padding.upper())
        if layer["use_bias"] and compute is not None:  # base_depthwise_conv.py 215: ops.add
            h = _bias_add_fn(layer)(h, _param(params, f"{i}.bias", compute))
        elif layer["use_bias"]:
            h = tf.nn.bias_add(h, params[f"{i}.bias"])
        return _ACT[layer["activation"]](h)
    if kind == "max_pool2d":
        padding = layer["padding"]
        if not isinstance(padding, str):  # -inf: a padded position is never the maximum
            h, padding = _explicit_pad(h, padding, -math.inf), "valid"
        return tf.nn.max_pool2d(h, ksize=layer["pool_size"], strides=layer["strides"], padding=padding.upper())
    if kind == "avg_pool2d":
        return _avg_pool(h, layer)
    if kind == "global_avg_pool2d":
        if compute is not None:  # keras ops.mean: float32 inside, the input's dtype out (tensorflow/numpy.py mean)
            return tf.cast(tf.reduce_mean(tf.cast(h, tf.float32), axis=[1, 2]), compute)
        return tf.reduce_mean(h, axis=[1, 2])
    if kind == "activation":
        return _activate(h, layer["fn"], layer)
    if kind == "layer_norm":
        import keras

        gamma = params[f"{i}.gamma"] if layer["scale"] else None  # autocast=False: float32 under mixed precision
        beta = params[f"{i}.beta"] if layer["center"] else None
        out = keras.ops.layer_normalization(h, gamma, beta, axis=-1, epsilon=layer["epsilon"])
        return out if compute is None else tf.cast(out, compute)  # LayerNormalization.call: the compute dtype out
    if kind == "rms_norm":  # RMSNormalization autocasts: bfloat16 input and scale, float32 inside, bfloat16 out
        import keras

        return keras.ops.rms_normalization(h, _param(params, f"{i}.scale", compute), axis=-1, epsilon=layer["epsilon"])
    if kind == "attention":  # Keras' MultiHeadAttention (tfpar.attention)
        from .attention import attention

        return attention(str(i), layer, params, h, mask, compute)
    if kind == "residual":
        body = _apply_list(f"{i}.body", layer["body"], params, h, compute, mask)
        shortcut = _apply_list(f"{i}.shortcut", layer["shortcut"], params, h, compute, mask)
        body, shortcut = _add_inputs(layer, body, shortcut, compute)
        return residual_output(layer, body, shortcut)  # keras.layers.Add: the sum of its inputs
    if kind == "repeat":
        for r in range(layer["count"]):
            h = _apply_list(f"{i}.{r}", layer["body"], params, h, compute, mask)
        return h
    if kind == "channel_pad":
        return tf.pad(h, [[0, 0]] * (h.shape.rank - 1) + [[layer["before"], layer["after"]]])
    if kind == "position_embedding":  # the first T rows of [length, D], added (keras.layers.Add)
        return h + _param(params, f"{i}.embeddings", compute)[: h.shape[1]]
    if kind == "class_token":  # the learned token, broadcast over the batch, before the tokens
        token = _param(params, f"{i}.token", compute)
        return tf.concat([tf.broadcast_to(token[None], [tf.shape(h)[0], 1, token.shape[-1]]), h], axis=1)
    if kind == "take_token":
        return h[:, layer["index"]]
    if kind == "reshape":  # the case's one -1 resolved from the static shape (the batch axis is the other -1)
        target = layer["shape"]
        known = math.prod(d for d in target if d != -1)
        return tf.reshape(h, [-1, *(math.prod(h.shape[1:]) // known if d == -1 else d for d in target)])
    if kind == "flatten":
        return tf.reshape(h, [-1, math.prod(h.shape[1:])])  # row-major over [H, W, C]: channels fastest
    if kind == "dropout":
        if layer["rate"] == 0.0:
            return h
        if mask is None:
            raise ValueError(f"layer {i}: a dropout layer needs its keep-mask (payload['masks'][{str(i)!r}])")
        scale = tf.constant(1.0 / (1.0 - layer["rate"]), dtype=h.dtype)  # as tf.nn.dropout: 1 / keep_prob
        return tf.where(mask, h * scale, tf.zeros_like(h))
    raise ValueError(f"layer {i}: unknown type {kind!r}")


def apply_layer(i: int, layer: Mapping, params: Mapping[str, tf.Tensor], h: tf.Tensor,
                mask: tf.Tensor | None = None, device: str | None = None, compute: tf.DType | None = None) -> tf.Tensor:
    """Layer ``i`` (any type but ``batch_norm``) on one device's activations ``[n, ...]``.

    A layer placed by ``model.placement`` runs on its own device, whatever
    ``device`` says; ``mask`` is a dropout layer's keep-mask ``[n, ...]``,
    an attention layer's ``[n, H, T, T]``, and a residual's or repeat's the tower's masks by path;
    ``compute``: the mixed-precision compute dtype (``tf.bfloat16``), or ``None``
    to compute in the variables' dtype (module docstring).
    """
    with _on(layer_device(layer, device)):
        return _apply(i, layer, params, h, mask, compute)


def update_moving(state: Mapping[str, tf.Variable], i: int | str, layer: Mapping, mean: tf.Tensor, var: tf.Tensor,
                  count: int) -> None:
    """Batch-norm layer ``i``'s moving statistics from a batch's ``mean`` and biased ``var`` over ``count`` values.

    ``moving <- m moving + (1 - m) batch`` (Keras' rule), the variance taken
    unbiased (``var count / (count - 1)``) with ``semantics: torch``.
    """
    if layer["semantics"] == "torch":
        if count < 2:
            raise ValueError(f"layer {i}: batch_norm with semantics 'torch' needs more than 1 value per channel per device, got {count}")
        var = var * (count / (count - 1))
    m = layer["momentum"]
    mm, mv = state[f"{i}.moving_mean"], state[f"{i}.moving_variance"]
    ops = [mm.assign(mm * m + tf.stop_gradient(mean) * (1.0 - m)),
           mv.assign(mv * m + tf.stop_gradient(var) * (1.0 - m))]
    if not tf.executing_eagerly() and not tf.inside_function():
        # a tf.compat.v1 graph runs only what is fetched: register the updates where the
        # classic code looks for them (tf.layers.batch_normalization does the same), so
        # that tfpar.v1.build_towers runs the first tower's with the train op
        for op in ops:
            tf.compat.v1.add_to_collection(tf.compat.v1.GraphKeys.UPDATE_OPS, op)


@contextlib.contextmanager
def recording_activations():
    """Within it, every layer's output of every tower is appended to the yielded list.

    Yields ``[(layer index, [tower outputs])]`` in call order: :func:`forward_towers`
    appends once per layer with all its towers; a tower engine that calls
    :func:`forward` once per tower appends ``(i, [h_r])`` per tower, in tower order.
    Layers inside a ``residual`` or ``repeat`` append ``(path, [h_r])`` (``"3.body.1"``,
    ``"5.2.0"``) per tower call, in tower order, so consumers that group by key get
    every nested layer's output on every tower too.
    Used inside the traced capture step (symbolic tensors it returns as outputs).
    """
    global _ACTIVATIONS
    previous, _ACTIVATIONS = _ACTIVATIONS, []
    try:
        yield _ACTIVATIONS
    finally:
        _ACTIVATIONS = previous


def _batch_norm(i: int | str, layer: Mapping, params: Mapping[str, tf.Tensor], hs: list[tf.Tensor], devices: list[str | None],
                state: Mapping[str, tf.Variable] | None, mode: str, reduce_device: str | None,
                compute: tf.DType | None = None) -> list[tf.Tensor]:
    gamma, beta, eps = params[f"{i}.gamma"], params[f"{i}.beta"], layer["epsilon"]
    if compute is not None:  # Keras' BatchNormalization: float32 inside, the compute dtype out
        hs = [tf.cast(h, gamma.dtype) for h in hs]
    axes = list(range(hs[0].shape.rank - 1))
    counts = [math.prod(h.shape[:-1]) for h in hs]
    if mode == "sync" and layer["semantics"] == "torch":  # SyncBatchNorm's: per-tower moments merged with counts
        moments = []
        for h, dev in zip(hs, devices, strict=True):
            with _on(dev):
                moments.append(tf.nn.moments(h, axes))
        with _on(reduce_device):
            total = sum(counts)
            mean = tf.add_n([m * c for (m, _), c in zip(moments, counts, strict=True)]) / total
            var = tf.add_n([(v + tf.square(m - mean)) * c for (m, v), c in zip(moments, counts, strict=True)]) / total
        stats = [(mean, var)] * len(hs)
        update = (mean, var, total)
    elif mode == "sync":
        sums, squares = [], []
        for h, dev in zip(hs, devices, strict=True):
            with _on(dev):
                sums.append(tf.reduce_sum(h, axes))
                squares.append(tf.reduce_sum(tf.square(h), axes))
        with _on(reduce_device):
            total = sum(counts)
            mean = tf.add_n(sums) / total
            var = tf.maximum(tf.add_n(squares) / total - tf.square(mean), 0.0)
        stats = [(mean, var)] * len(hs)
        update = (mean, var, total)
    elif mode == "local":
        stats = []
        for h, dev in zip(hs, devices, strict=True):
            with _on(dev):
                stats.append(tf.nn.moments(h, axes))
        update = (*stats[0], counts[0])  # the first tower's update wins, as rank 0's buffers do under DDP
    else:
        raise ValueError(f"unknown batch_norm mode {mode!r}")
    outs = []
    for h, dev, (mean, var) in zip(hs, devices, stats, strict=True):
        with _on(dev):
            out = tf.nn.batch_normalization(h, mean, var, offset=beta, scale=gamma, variance_epsilon=eps)
            outs.append(out if compute is None else tf.cast(out, compute))
    if state is not None:
        with _on(reduce_device):
            update_moving(state, i, layer, *update)
    return outs


def forward_towers(
    layers: Sequence[Mapping],
    params: Mapping[str, tf.Tensor],
    xs: Sequence[tf.Tensor],
    *,
    devices: Sequence[str | None] | None = None,
    masks: Sequence[Mapping[str, tf.Tensor]] | None = None,
    state: Mapping[str, tf.Variable] | None = None,
    batch_norm: str = "local",
    reduce_device: str | None = None,
    compute: tf.DType | None = None,
) -> list[tf.Tensor]:
    """Apply the layer list to every tower's shard, layer by layer (in lockstep).

    Args:
        layers: validated ``model.layers``.
        params: canonical name -> tensor (trainable parameters).
        xs: N shards, ``[n_r, *input_shape]`` each.
        devices: the tower devices (``None``: no placement).
        masks: per tower, layer path (``"3"``, ``"3.body.1"``) -> bool keep-mask ``[n_r, *layer_input_shape]``.
        state: canonical name -> moving-statistics variable, updated in place
            (``None``: not updated).
        batch_norm: ``local`` or ``sync`` (see the module docstring).
        reduce_device: where synchronized statistics and state updates are computed.
        compute: ``tf.bfloat16`` for mixed precision (Keras' ``mixed_bfloat16``, module
            docstring), ``None`` to compute in the parameters' dtype.
    Returns:
        N outputs, ``[n_r, *output_shape]`` (logits for the cross-entropy losses,
        or probabilities after a final sigmoid), in ``compute`` when given.
    """
    hs = list(xs)
    towers = list(devices) if devices is not None else [None] * len(hs)

    def run(path: str, layer: Mapping, hs: list[tf.Tensor], towers: list[str | None]) -> list[tf.Tensor]:
        """Layer ``path`` on every tower; a residual or repeat holding batch norm or dropout recurses
        into its bodies in lockstep (statistics and state by path: ``3.body.1.moving_mean``)."""
        outs = step(path, layer, hs, towers)
        if _ACTIVATIONS is not None and "." in path:  # a layer of a walked body: every tower's output, by path
            _ACTIVATIONS.append((path, [tf.cast(h, tf.float32) if h.dtype == tf.bfloat16 else h for h in outs]))
        return outs

    def step(path: str, layer: Mapping, hs: list[tf.Tensor], towers: list[str | None]) -> list[tf.Tensor]:
        if layer["type"] == "batch_norm":
            devices = [layer_device(layer, dev) for dev in towers]
            return _batch_norm(path, layer, params, hs, devices, state, batch_norm, reduce_device, compute)
        if layer["type"] in ("residual", "repeat") and needs_towers_fn([layer]):
            towers = [layer_device(layer, dev) for dev in towers]  # a placed block: all of it on its device
            if layer["type"] == "repeat":
                for r in range(layer["count"]):
                    for j, inner in enumerate(layer["body"]):
                        hs = run(f"{path}.{r}.{j}", inner, hs, towers)
                return hs
            body, short = hs, hs
            for j, inner in enumerate(layer["body"]):
                body = run(f"{path}.body.{j}", inner, body, towers)
            for j, inner in enumerate(layer["shortcut"]):
                short = run(f"{path}.shortcut.{j}", inner, short, towers)
            outs = []
            for b, sc, dev in zip(body, short, towers, strict=True):
                with _on(dev):
                    b, sc = _add_inputs(layer, b, sc, compute)
                    outs.append(residual_output(layer, b, sc))
            return outs
        return [apply_layer(path, layer, params, h, None if masks is None else layer_mask(masks[r], path, layer), towers[r], compute)
                for r, h in enumerate(hs)]

    for i, layer in enumerate(layers):
        hs = run(str(i), layer, hs, towers)
        if _ACTIVATIONS is not None:  # bfloat16 activations recorded as float32 (exact), so numpy reads them
            _ACTIVATIONS.append((i, [tf.cast(h, tf.float32) if h.dtype == tf.bfloat16 else h for h in hs]))
    return hs


def forward(layers: list[dict], params: Mapping[str, tf.Tensor], x: tf.Tensor, *,
            masks: Mapping[str, tf.Tensor] | None = None, state: Mapping[str, tf.Variable] | None = None,
            batch_norm: str = "local", compute: tf.DType | None = None) -> tf.Tensor:
    """Apply the layer list to one batch (one device).

    Args:
        layers: validated ``model.layers``.
        params: canonical name -> tensor.
        x: ``[batch, *input_shape]``.
        masks: layer index (str) -> keep-mask, for dropout layers.
        state: moving statistics to update (``None``: batch norm still uses batch
            statistics, but nothing is updated).
        batch_norm: ``local`` (``tf.nn.moments``) or ``sync`` (the summed-moments formula).
        compute: ``tf.bfloat16`` for mixed precision, ``None`` to compute in the parameters' dtype.
    Returns:
        ``[batch, *output_shape]`` (logits for the cross-entropy losses).
    """
    return forward_towers(layers, params, [x], masks=None if masks is None else [masks], state=state, batch_norm=batch_norm,
                          compute=compute)[0]
