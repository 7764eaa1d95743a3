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
from parity_tests.judging.theory import predict
from parity_tests.tests.helpers import make
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


# ---------------------------------------------------------------- torch: the nn classes under autocast


def _torch_grads(module_fn, params: list, x: np.ndarray, x_dtype=None):
    """Output (float32) and gradients of ``sum(out * R)`` wrt ``x`` (floating) and ``params``, under CPU autocast."""
    import torch

    tx = torch.tensor(x, requires_grad=x.dtype.kind == "f")
    if x_dtype is not None:
        tx = tx.detach().to(x_dtype).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = module_fn(tx)
    out = out.float()
    (out * torch.as_tensor(_probe(tuple(out.shape)))).sum().backward()
    result = {"out": out.detach().numpy()}
    if x.dtype.kind == "f":
        result["grad/x"] = tx.grad.float().numpy()
    result.update({f"grad/{i}": p.grad.numpy() for i, p in enumerate(params)})
    return result


def _ours_torch(layers: list[dict], params: dict[str, np.ndarray], x: np.ndarray, names: list[str], x_dtype=None):
    """torchref's CaseModel (float32 parameters) under autocast; gradients in canonical layouts, in ``names``' order."""
    from torchref.models import CaseModel

    model = CaseModel(layers, params, __import__("torch").float32)
    result = _torch_grads(lambda tx: model(tx, None), [], x, x_dtype)
    canonical = model.canonical()
    result.update({f"grad/{i}": canonical[n].grad.numpy() for i, n in enumerate(names)})
    return result


def _torch_case(name: str, params: dict[str, np.ndarray]):
    """(the torch module with the case's weights, its parameters in the canonical names' order, to canonical layout)."""
    import torch
    from torch import nn

    def load(module, pairs):
        with torch.no_grad():
            for p, v in pairs:
                p.copy_(torch.as_tensor(v))
        return module

    if name == "layer_norm":
        m = nn.LayerNorm(6, eps=1e-3)
        return load(m, [(m.weight, params["0.gamma"]), (m.bias, params["0.beta"])]), [m.weight, m.bias], [None, None]
    if name == "rms_norm":
        m = nn.RMSNorm(6, eps=1e-6)
        return load(m, [(m.weight, params["0.scale"])]), [m.weight], [None]
    if name in ("dense gelu", "dense gelu_tanh"):
        lin = nn.Linear(6, 4)
        load(lin, [(lin.weight, params["0.kernel"].T), (lin.bias, params["0.bias"])])
        approx = "tanh" if name.endswith("tanh") else "none"
        return (lambda h: torch.nn.functional.gelu(lin(h), approximate=approx)), [lin.weight, lin.bias], [np.transpose, None]
    if name == "activation silu":
        return torch.nn.functional.silu, [], []
    raise KeyError(name)


@pytest.mark.parametrize("name", ["layer_norm", "rms_norm", "dense gelu", "dense gelu_tanh", "activation silu"])
@pytest.mark.parametrize("input_dtype", ["float32", "bfloat16"])
def test_torch_side_is_the_nn_class_under_autocast(name, input_dtype):
    """Bit for bit: torchref runs the classes' own functional calls, and autocast casts the same operands."""
    import torch

    raw, shape, _, names, _ = _keras_case(name)
    layers = _layers(shape, raw)
    params = {k: v + np.float32(0.3) * _x(list(v.shape), 1, 5)[0] for k, v in _init(shape, layers).items()}
    x = _x(shape)
    x_dtype = torch.bfloat16 if input_dtype == "bfloat16" else None
    module, tparams, layout = _torch_case(name, params)
    theirs = _torch_grads(module, tparams, x, x_dtype)
    for i, f in enumerate(layout):  # the class's layouts back to canonical
        if f is not None:
            theirs[f"grad/{i}"] = f(theirs[f"grad/{i}"])
    _assert_bitwise(_ours_torch(layers, params, x, names, x_dtype), theirs)


def test_torch_attention_is_nn_multihead_attention_under_autocast():
    """``nn.MultiheadAttention(batch_first=True)``, its SDPA path (``need_weights=False``), causal, under autocast."""
    import torch
    from torch import nn

    layers = _layers(SHAPE, [{"type": "attention", "num_heads": 2, "key_dim": 3, "causal": True}])
    params = _init(SHAPE, layers)
    mha = nn.MultiheadAttention(6, 2, batch_first=True)
    with torch.no_grad():
        mha.in_proj_weight.copy_(torch.as_tensor(np.concatenate([params[f"0.{n}.kernel"].reshape(6, 6) for n in "qkv"], 1).T))
        mha.in_proj_bias.copy_(torch.as_tensor(np.concatenate([params[f"0.{n}.bias"].reshape(6) for n in "qkv"])))
        mha.out_proj.weight.copy_(torch.as_tensor(params["0.o.kernel"].reshape(6, 6).T))
        mha.out_proj.bias.copy_(torch.as_tensor(params["0.o.bias"]))
    mask = torch.ones(5, 5, dtype=torch.bool).triu(1)
    x = _x(SHAPE)
    theirs = _torch_grads(lambda h: mha(h, h, h, attn_mask=mask, is_causal=True, need_weights=False)[0],
                          [mha.out_proj.weight, mha.out_proj.bias], x, torch.bfloat16)
    theirs["grad/0"] = theirs["grad/0"].T.reshape(2, 3, 6)
    ours = _ours_torch(layers, params, x, ["0.o.kernel", "0.o.bias"], torch.bfloat16)
    _assert_bitwise(ours, theirs)


def test_torch_embedding_is_nn_embedding_under_autocast():
    import torch
    from torch import nn

    layers = _layers([5], [{"type": "embedding", "input_dim": 7, "output_dim": 6}])
    params = _init([5], layers)
    ids = np.random.default_rng(3).integers(0, 7, size=(3, 5)).astype(np.int64)
    emb = nn.Embedding(7, 6)
    with torch.no_grad():
        emb.weight.copy_(torch.as_tensor(params["0.embeddings"]))
    theirs = _torch_grads(emb, [emb.weight], ids)
    _assert_bitwise(_ours_torch(layers, params, ids, ["0.embeddings"]), theirs)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the premise of the named difference: float32 rows out
        assert emb(torch.as_tensor(ids)).dtype == torch.float32


# ---------------------------------------------------------------- the bfloat16 residual stream


def _stream_gap(tf_semantics: str | None, torch_semantics: str | None, blocks: int = 12) -> float:
    """Direct forward, mixed precision: TensorFlow's recipe against torch's on ``blocks`` residual blocks
    ``h + dense(h)`` (width 64, no bias: the blocks' only recipe difference is the add), relative max gap."""
    import tensorflow as tf
    import torch

    from tfpar.models import forward
    from torchref.models import CaseModel

    def layers(sem):
        block = {"type": "residual", "body": [{"type": "dense", "units": 64, "use_bias": False}]}
        return _layers([64], [{"type": "repeat", "count": blocks, "body": [{**block, **({"semantics": sem} if sem else {})}]}])

    params = {k: v * np.float32(0.3) for k, v in _init([64], layers(None), 3).items()}
    x = _x([64], 8)
    ours = forward(layers(tf_semantics), {k: tf.constant(v) for k, v in params.items()}, tf.constant(x), compute=tf.bfloat16)
    model = CaseModel(layers(torch_semantics), params, torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        theirs = model(torch.tensor(x), None).float().detach().numpy()
    return float(np.abs(tf.cast(ours, tf.float32).numpy() - theirs).max() / np.abs(theirs).max())


def test_the_bfloat16_residual_stream_appears_natively_and_vanishes_mapped():
    """Keras' Add rounds the stream to bfloat16 at every block, torch's promotion keeps it float32: over 12
    blocks the outputs part by about sqrt(12) bfloat16 roundings (at least one, 2^-9 relative, at most one
    per block, 12 x 2^-8). Either side adding as the other does (the residual's ``semantics``) leaves the two
    recipes the same ops on the same values: equal bit for bit."""
    native = _stream_gap(None, None)
    assert 2.0**-9 < native < 12 * 2.0**-8, native
    assert _stream_gap("torch", None) == 0.0 and _stream_gap(None, "tf") == 0.0


def test_theory_names_the_residual_stream_where_there_is_one():
    from parity_tests.tests.helpers import MLP

    block = {"type": "residual", "body": [{"type": "dense", "units": 5}]}
    with_residual = make(MLP, dtype="mixed_bfloat16", model__layers=[block, {"type": "dense", "units": 1}])
    named = [t for t in predict(with_residual.spec, "tf.towers", "torch.ddp").known if "residual stream" in t]
    assert len(named) == 1 and "float32 + bfloat16 promotes to float32" in named[0]
    assert not [t for t in predict(make(MLP, dtype="mixed_bfloat16").spec, "tf.towers", "torch.ddp").known
                if "residual stream" in t]
    assert not [t for t in predict(with_residual.spec, "tf.towers", "tf.single").known if "mixed precision" in t]
    assert not [t for t in predict(with_residual.replace(dtype="float32").spec, "tf.towers", "torch.ddp").known
                if "mixed precision" in t]
