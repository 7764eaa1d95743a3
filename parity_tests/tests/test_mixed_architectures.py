"""Mixed precision on the architecture layers: each side is its framework's own class under its own recipe.

``dtype: mixed_bfloat16`` with the vocabulary of CONTRACT section 7 (docs/mixed-precision.md,
"Architecture layers"). Two levels:

* direct, in this process: ``tfpar.models.forward(..., compute=tf.bfloat16)`` against the Keras
  class built with ``dtype="mixed_bfloat16"`` (output and the gradients of a fixed probe
  ``sum(float32(out) * R)`` with respect to the input and every float32 variable), **bit for bit**:
  the recipe is Keras' op for op, so anything but equality is a different computation; and
  ``torchref.models.CaseModel`` under ``torch.autocast("cpu", dtype=torch.bfloat16)`` against the torch
  class (``nn.LayerNorm``, ``nn.MultiheadAttention``...) under the same autocast;
* the premise of each named difference (which dtype each framework's op returns), read from the
  frameworks themselves, and the theory naming it only where it is real.

The end-to-end verdicts on mixed architecture cases are in ``test_mixed_architecture_verdicts.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

from parity_tests.contract.generators import draw_init
from parity_tests.contract.specs import param_specs
from parity_tests.tests.test_layers import _layers

SHAPE = [5, 6]  # T = 5 tokens of width D = 6


@pytest.fixture(autouse=True, scope="module")
def _tf_devices():
    from parity_tests.running.backends import tf_device_count

    tf_device_count()


def _init(shape: list[int], layers: list[dict], seed: int = 0) -> dict[str, np.ndarray]:
    return {k: v.astype(np.float32) for k, v in draw_init(param_specs(shape, layers), seed, "normal", 0.5).items()}


def _x(shape: list[int], rows: int = 3, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(rows, *shape)).astype(np.float32)


def _probe(shape: tuple[int, ...]) -> np.ndarray:
    return np.random.default_rng(7).normal(size=shape).astype(np.float32)


def _tf_grads(fn, variables: list, x, x_dtype: str = "float32") -> dict[str, np.ndarray]:
    """``fn(x)``'s output (as float32) and the gradients of ``sum(out * R)`` wrt ``x`` (when floating; held in
    ``x_dtype``: ``bfloat16`` as a previous layer's output is) and ``variables``."""
    import tensorflow as tf

    tx = tf.Variable(tf.cast(x, x_dtype)) if x.dtype.kind == "f" else tf.constant(x)
    with tf.GradientTape() as tape:
        out = tf.cast(fn(tx), tf.float32)
        probe = tf.reduce_sum(out * _probe(tuple(out.shape)))
    sources = ([tx] if x.dtype.kind == "f" else []) + list(variables)
    grads = tape.gradient(probe, sources)
    result = {"out": out.numpy()}
    if x.dtype.kind == "f":
        result["grad/x"], grads = tf.cast(grads[0], tf.float32).numpy(), grads[1:]
    result.update({f"grad/{i}": tf.convert_to_tensor(g).numpy() for i, g in enumerate(grads)})
    return result


def _ours_tf(layers: list[dict], params: dict[str, np.ndarray], x: np.ndarray, names: list[str], masks=None,
            x_dtype: str = "float32"):
    """tfpar's recipe under ``compute=tf.bfloat16``; gradients in the order of ``names``."""
    import tensorflow as tf

    from tfpar.models import forward

    tparams = {k: tf.Variable(v) for k, v in params.items()}
    tmasks = None if masks is None else {k: tf.constant(m) for k, m in masks.items()}
    return _tf_grads(lambda tx: forward(layers, tparams, tx, masks=tmasks, compute=tf.bfloat16),
                     [tparams[n] for n in names], x, x_dtype)


def _keras_tf(layer, weights: list[np.ndarray], x: np.ndarray, call=None):
    """A Keras layer built with ``dtype="mixed_bfloat16"`` on ``x``; gradients wrt its trainable variables in build order."""
    layer.build(x.shape)
    if weights:
        layer.set_weights(weights)
    return _tf_grads(call or layer, layer.trainable_variables, x)


def _assert_bitwise(ours: dict, theirs: dict) -> None:
    assert set(ours) == set(theirs), (sorted(ours), sorted(theirs))
    for k in ours:
        np.testing.assert_array_equal(ours[k], theirs[k], err_msg=k)


# ---------------------------------------------------------------- TensorFlow: the Keras classes, bit for bit


def _keras_case(name: str):
    """(layers as the case gives them, input shape, the Keras layer, canonical names in its weight order, call)."""
    import keras

    mixed = "mixed_bfloat16"
    if name == "layer_norm":
        return ([{"type": "layer_norm", "epsilon": 1e-3}], SHAPE,
                keras.layers.LayerNormalization(epsilon=1e-3, dtype=mixed), ["0.gamma", "0.beta"], None)
    if name == "rms_norm":
        return ([{"type": "rms_norm", "epsilon": 1e-6}], SHAPE,
                keras.layers.RMSNormalization(epsilon=1e-6, dtype=mixed), ["0.scale"], None)
    if name in ("dense gelu", "dense gelu_tanh"):
        act = name.split()[1]
        fn = "gelu" if act == "gelu" else (lambda h: keras.activations.gelu(h, approximate=True))
        return ([{"type": "dense", "units": 4, "activation": act}], SHAPE,
                keras.layers.Dense(4, activation=fn, dtype=mixed), ["0.kernel", "0.bias"], None)
    if name == "activation silu":
        return ([{"type": "activation", "fn": "silu"}], SHAPE, keras.layers.Activation("silu", dtype=mixed), [], None)
    if name == "depthwise_conv2d":
        return ([{"type": "depthwise_conv2d", "kernel_size": 3, "strides": 2, "padding": "same", "depth_multiplier": 2}],
                [6, 5, 3], keras.layers.DepthwiseConv2D(3, 2, padding="same", depth_multiplier=2, dtype=mixed),
                ["0.kernel", "0.bias"], None)
    if name == "avg_pool2d":
        return ([{"type": "avg_pool2d", "pool_size": 3, "strides": 2, "padding": "same"}], [6, 5, 2],
                keras.layers.AveragePooling2D(3, 2, padding="same", dtype=mixed), [], None)
    if name == "global_avg_pool2d":
        return ([{"type": "global_avg_pool2d"}], [6, 5, 2], keras.layers.GlobalAveragePooling2D(dtype=mixed), [], None)
    raise KeyError(name)


@pytest.mark.parametrize("name", ["layer_norm", "rms_norm", "dense gelu", "dense gelu_tanh", "activation silu",
                                  "depthwise_conv2d", "avg_pool2d", "global_avg_pool2d"])
@pytest.mark.parametrize("input_dtype", ["float32", "bfloat16"])
def test_tf_side_is_the_keras_layer_under_mixed_bfloat16(name, input_dtype):
    """The first layer of a model reads the float32 data; a later one reads bfloat16 activations. Keras'
    ``LayerNormalization`` does not cast its input (``autocast = False``): both must match."""
    raw, shape, layer, names, call = _keras_case(name)
    layers = _layers(shape, raw)
    params = {k: v + np.float32(0.3) * _x(list(v.shape), 1, 5)[0] for k, v in _init(shape, layers).items()}
    x = _x(shape)
    if input_dtype == "bfloat16":  # exact in bfloat16, as the previous layer's output is
        x = (x.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    _assert_bitwise(_ours_tf(layers, params, x, names), _keras_tf(layer, [params[n] for n in names], x, call))


def test_layer_norm_reads_float32_data_unrounded_and_rms_norm_rounds_it():
    """The premise of the layer-norm rows: Keras' LayerNormalization normalises the float32 input as it is
    (autocast off) and keeps gamma float32; RMSNormalization rounds input and scale to bfloat16 first."""
    import keras
    import tensorflow as tf

    x = _x(SHAPE)
    ln = keras.layers.LayerNormalization(epsilon=1e-3, dtype="mixed_bfloat16")
    f32 = keras.layers.LayerNormalization(epsilon=1e-3, dtype="float32")
    rounded_first = f32(tf.cast(tf.cast(x, tf.bfloat16), tf.float32))
    assert ln(x).dtype == tf.bfloat16
    np.testing.assert_array_equal(np.asarray(tf.cast(ln(x), tf.float32)), np.asarray(tf.cast(tf.cast(f32(x), tf.bfloat16), tf.float32)))
    assert not np.array_equal(np.asarray(tf.cast(ln(x), tf.float32)), np.asarray(tf.cast(tf.cast(rounded_first, tf.bfloat16), tf.float32)))
    assert ln.gamma.dtype == "float32" and not ln.gamma._autocast


def _keras_mha(layer: dict, params: dict[str, np.ndarray], x: np.ndarray, keep: np.ndarray | None):
    import keras
    import tensorflow as tf

    mha = keras.layers.MultiHeadAttention(layer["num_heads"], layer["key_dim"], dropout=layer["dropout"],
                                          dtype="mixed_bfloat16")
    mha.build(x.shape, x.shape)
    mha.set_weights([params[f"0.{n}.{k}"] for n in "qkvo" for k in ("kernel", "bias")])
    if keep is not None:  # the layer's own Dropout, drawing from the case's mask (in the weights' dtype)
        rate = layer["dropout"]
        mha._dropout_layer.call = lambda w, training=None: tf.where(
            tf.constant(keep), w * tf.cast(1.0 / (1.0 - rate), w.dtype), tf.zeros_like(w))
    names = [f"0.{n}.{k}" for n in "qkvo" for k in ("kernel", "bias")]
    return _tf_grads(lambda tx: mha(tx, tx, use_causal_mask=layer["causal"], training=True),
                     mha.trainable_variables, x, "bfloat16"), names


@pytest.mark.parametrize("fields", [{"causal": True}, {"causal": True, "dropout": 0.3}, {"key_dim": 4}],
                         ids=["causal", "causal + dropout", "key_dim 4"])
def test_tf_side_is_keras_multi_head_attention_under_mixed_bfloat16(fields):
    """Both of Keras' paths: ``dot_product_attention`` (float32 logits and softmax) and the explicit one
    (everything in bfloat16, the scale rounded to bfloat16). The input is bfloat16, as in a model (a layer
    norm's output): given float32, Keras casts the query and the value arguments separately, so their
    gradients would meet in float32, where a model's meet in bfloat16."""
    layers = _layers(SHAPE, [{"type": "attention", "num_heads": 2, "key_dim": 3, **fields}])
    params = _init(SHAPE, layers)
    x = (_x(SHAPE).view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    layer = layers[0]
    keep = None
    if layer["dropout"] > 0:
        keep = np.random.default_rng(2).random((3, layer["num_heads"], 5, 5)) >= layer["dropout"]
    theirs, names = _keras_mha(layer, params, x, keep)
    ours = _ours_tf(layers, params, x, names, masks=None if keep is None else {"0": keep}, x_dtype="bfloat16")
    _assert_bitwise(ours, theirs)


def test_tf_embedding_and_residual_add_are_keras():
    """``Embedding`` (autocast off: float32 rows cast to bfloat16) and a residual block, ``Dense`` then ``Add``
    then ``Activation("relu")``, all ``mixed_bfloat16``."""
    import keras

    layers = _layers([5], [{"type": "embedding", "input_dim": 7, "output_dim": 6}])
    params = _init([5], layers)
    ids = np.random.default_rng(3).integers(0, 7, size=(3, 5)).astype(np.int64)
    emb = keras.layers.Embedding(7, 6, dtype="mixed_bfloat16")
    _assert_bitwise(_ours_tf(layers, params, ids, ["0.embeddings"]), _keras_tf(emb, [params["0.embeddings"]], ids))

    raw = [{"type": "residual", "body": [{"type": "dense", "units": 6}], "activation": "relu"}]
    layers = _layers(SHAPE, raw)
    params = _init(SHAPE, layers)
    dense = keras.layers.Dense(6, dtype="mixed_bfloat16")
    add, relu = keras.layers.Add(dtype="mixed_bfloat16"), keras.layers.Activation("relu", dtype="mixed_bfloat16")
    x = _x(SHAPE)
    theirs = _keras_tf(dense, [params["0.body.0.kernel"], params["0.body.0.bias"]], x,
                       call=lambda tx: relu(add([dense(tx), tx])))
    _assert_bitwise(_ours_tf(layers, params, x, ["0.body.0.kernel", "0.body.0.bias"]), theirs)
