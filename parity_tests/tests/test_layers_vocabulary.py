"""The architecture layer vocabulary (first slice): TensorFlow vs torch, each side pinned to its framework's class.

Three levels, as ``test_layers.py`` does for the first layers:

* the case: fields, defaults, nested parameter names (``3.body.1.kernel``, ``5.2.0.kernel``)
  and one-line refusals;
* direct, in this process: ``tfpar.models.forward`` against ``torchref.models.CaseModel``
  (output, and the gradient of a fixed random probe ``sum(out * R)`` with respect to the input
  and every parameter), and each side against its framework's own layer class (Keras
  ``LayerNormalization``, ``RMSNormalization``, ``AveragePooling2D``, ``Add``...; torch
  ``nn.LayerNorm``, ``nn.RMSNorm``, ``nn.AvgPool2d``...);
* end to end: ``tf.towers`` vs ``torch.ddp`` at 2 devices in float64 on a tiny model per
  layer, a wrong layer-norm epsilon detected, and the float64 GELU difference predicted,
  measured and mapped away.

Tolerances (float64): one layer computed by two libraries agrees to about 1e-15 relative
per op (other summation orders); 1e-10 leaves five orders of magnitude for a few layers and
two steps, while the differences tested here are at least 1e-9 (the GELU constants: about
5e-10 on the activation, more on gradients) or 1e-3 (an epsilon).
"""

from __future__ import annotations

import numpy as np
import pytest

from parity_tests.contract.generators import draw_init
from parity_tests.contract.model import validate_model
from parity_tests.contract.specs import param_specs
from parity_tests.judging.compare import assert_trajectories_close, compare_trajectories
from parity_tests.judging.theory import mapping_changes, predict
from parity_tests.protocol.errors import CaseError
from parity_tests.running.harness import run_impl
from parity_tests.tests.helpers import make
from parity_tests.tests.test_layers import _assert_same, _layers, _tf_run, _torch_run

RTOL, ATOL = 1e-10, 1e-12


@pytest.fixture(autouse=True, scope="module")
def _tf_devices():
    """Configure TensorFlow's tower devices before the direct checks run their first op."""
    from parity_tests.running.backends import tf_device_count

    tf_device_count()


def _init(shape: list[int], layers: list[dict], seed: int = 0) -> dict[str, np.ndarray]:
    return draw_init(param_specs(shape, layers), seed, "normal", 0.5)


def _x(shape: list[int], rows: int = 3, scale: float = 1.0) -> np.ndarray:
    return np.random.default_rng(1).normal(size=(rows, *shape)) * scale


# ---------------------------------------------------------------- the case: names and refusals

RESIDUAL_IN_REPEAT = [
    {"type": "dense", "units": 4},
    {"type": "repeat", "count": 3, "body": [
        {"type": "residual", "body": [{"type": "layer_norm", "epsilon": 1e-5}, {"type": "dense", "units": 4, "activation": "gelu",
                                                                              "semantics": "torch"}],
         "shortcut": [{"type": "dense", "units": 4, "use_bias": False}], "activation": "relu"},
        {"type": "rms_norm", "epsilon": 1e-6},
    ]},
    {"type": "dense", "units": 2},
]


def test_nested_parameter_names_follow_the_contract():
    """docs/case-format.md: ``<i>.<r>.<j>`` for a repeat, ``.body.<j>`` / ``.shortcut.<j>`` for a residual."""
    layers = _layers([5], RESIDUAL_IN_REPEAT)
    names = [s.name for s in param_specs([5], layers)]
    want = ["0.kernel", "0.bias"]
    for r in range(3):
        want += [f"1.{r}.0.body.0.gamma", f"1.{r}.0.body.0.beta", f"1.{r}.0.body.1.kernel", f"1.{r}.0.body.1.bias",
                 f"1.{r}.0.shortcut.0.kernel", f"1.{r}.1.scale"]
    want += ["2.kernel", "2.bias"]
    assert names == want
    init = draw_init(param_specs([5], layers), 0, "normal", 0.5)
    assert np.all(init["1.2.0.body.0.gamma"] == 1) and np.all(init["1.0.0.body.0.beta"] == 0)
    assert np.all(init["1.1.1.scale"] == 1)
    assert not np.array_equal(init["1.0.0.body.1.kernel"], init["1.1.0.body.1.kernel"])  # copies, not shared


def test_rewrite_layers_reaches_every_nested_layer_and_leaves_the_original():
    from parity_tests.contract.model import nested_layers, rewrite_layers

    layers = _layers([6], RESIDUAL_IN_REPEAT)
    before = [dict(layer) for _, layer in nested_layers(layers)]

    def mark(layer: dict) -> dict:
        layer["seen"] = True
        return layer

    rewritten = rewrite_layers(layers, mark)
    assert all(layer.get("seen") for _, layer in nested_layers(rewritten))
    assert len(list(nested_layers(rewritten))) == len(before) == 8  # residual body and shortcut, repeat body
    assert [dict(layer) for _, layer in nested_layers(layers)] == before  # the input is untouched


def test_token_layers_parameters_and_init():
    """``position_embedding.embeddings [length, D]`` and ``class_token.token [1, D]``, drawn as dense kernels of that shape."""
    layers = _layers([3, 4], [{"type": "class_token"}, {"type": "position_embedding", "length": 6}, {"type": "take_token"}])
    specs = param_specs([3, 4], layers)
    assert [(s.name, s.shape) for s in specs] == [("0.token", (1, 4)), ("1.embeddings", (6, 4))]
    init = draw_init(specs, 0, "glorot_uniform", 0.0)
    assert np.max(np.abs(init["0.token"])) <= np.sqrt(6 / (1 + 4)) and np.max(np.abs(init["1.embeddings"])) <= np.sqrt(6 / (6 + 4))
    assert np.max(np.abs(init["0.token"])) > np.sqrt(6 / (6 + 4))  # the premise: the token's wider limit is used
    assert validate_model({"input_shape": [3, 4], "layers": layers, "loss": "mse"})[2] == (4,)


def test_both_sides_name_nested_parameters_canonically():
    """Every canonical name has a gradient on both sides, and they agree (residual inside repeat)."""
    layers = _layers([5], RESIDUAL_IN_REPEAT)
    params = _init([5], layers)
    tf_side, torch_side = _tf_run(layers, params, _x([5])), _torch_run(layers, params, _x([5]))
    assert {k for k in tf_side if k.startswith("grad/") and k != "grad/x"} == {f"grad/{k}" for k in params}
    assert set(tf_side) == set(torch_side)
    _assert_same(tf_side, torch_side)


@pytest.mark.parametrize(("shape", "layer", "field", "words"), [
    ([6], {"type": "layer_norm"}, "model.layers[0].epsilon", "missing"),
    ([6], {"type": "rms_norm", "epsilon": 0}, "model.layers[0].epsilon", "> 0"),
    ([6], {"type": "activation", "fn": "elu"}, "model.layers[0].fn", "gelu_tanh"),
    ([6], {"type": "dense", "units": 2, "activation": "relu", "use_bias": False, "semantics": "tf"}, "model.layers[0].semantics", "GELU"),
    ([4, 4, 2], {"type": "conv2d", "filters": 1, "kernel_size": 3, "use_bias": False, "semantics": "torch"}, "model.layers[0].semantics", "bias add"),
    ([6], {"type": "residual", "body": [{"type": "dense", "units": 3}]}, "model.layers[0].shortcut", "[3]"),
    ([6], {"type": "repeat", "count": 0, "body": [{"type": "dense", "units": 6}]}, "model.layers[0].count", ">= 1"),
    ([6], {"type": "reshape", "shape": [4, -1]}, "model.layers[0].shape", "6 per example"),
    ([4, 4, 2], {"type": "avg_pool2d", "padding": [[2, 0], [0, 0]]}, "model.layers[0].padding", "smaller than the pooling"),
    ([4, 4, 2], {"type": "conv2d", "filters": 1, "kernel_size": 3, "padding": [[1], [1, 1]]}, "model.layers[0].padding", "[[top, bottom]"),
    ([6], {"type": "global_avg_pool2d"}, "model.layers[0]", "image input"),
    ([3, 4], {"type": "position_embedding", "length": 2}, "model.layers[0].length", ">= 3"),
    ([3, 4], {"type": "take_token", "index": 3}, "model.layers[0].index", "<= 2"),
    ([12], {"type": "class_token"}, "model.layers[0]", "token input [tokens, width]"),
    ([4, 4, 2], {"type": "depthwise_conv2d", "kernel_size": 2, "strides": [1, 2]}, "model.layers[0].strides", "same stride"),
])
def test_bad_layers_are_refused_in_one_line(shape, layer, field, words):
    with pytest.raises(CaseError) as e:
        validate_model({"input_shape": shape, "layers": [layer], "loss": "mse"})
    assert e.value.field == field and words in str(e.value) and "\n" not in str(e.value)


# ---------------------------------------------------------------- direct: TF vs torch, every layer

DIRECT = {
    "dense gelu semantics torch": ([6], [{"type": "dense", "units": 4, "activation": "gelu", "semantics": "torch"}]),
    "dense gelu_tanh semantics tf": ([6], [{"type": "dense", "units": 4, "activation": "gelu_tanh", "semantics": "tf"}]),
    "dense silu": ([6], [{"type": "dense", "units": 4, "activation": "silu"}]),
    "dense on [T, D]": ([3, 6], [{"type": "dense", "units": 4}]),
    "dense on an image": ([4, 4, 2], [{"type": "dense", "units": 3}]),
    **{f"activation {fn}": ([4, 4, 3], [{"type": "conv2d", "filters": 3, "kernel_size": 1}, {"type": "activation", "fn": fn}])
       for fn in ("relu", "tanh", "sigmoid", "silu", "softmax")},
    "activation gelu semantics tf": ([5], [{"type": "activation", "fn": "gelu", "semantics": "tf"}]),
    "layer_norm": ([3, 6], [{"type": "layer_norm", "epsilon": 1e-3}]),
    "layer_norm no center": ([3, 6], [{"type": "layer_norm", "epsilon": 1e-3, "center": False}]),
    "layer_norm no scale, image": ([4, 4, 3], [{"type": "layer_norm", "epsilon": 1e-5, "scale": False}]),
    "rms_norm": ([3, 6], [{"type": "rms_norm", "epsilon": 1e-6}]),
    "rms_norm image": ([4, 4, 3], [{"type": "rms_norm", "epsilon": 1e-6}]),
    "avg_pool2d valid k3 s2": ([5, 5, 2], [{"type": "avg_pool2d", "pool_size": 3, "strides": 2}]),
    "avg_pool2d same k3 s2": ([6, 5, 2], [{"type": "avg_pool2d", "pool_size": 3, "strides": 2, "padding": "same"}]),
    "avg_pool2d same counted": ([6, 5, 2], [{"type": "avg_pool2d", "pool_size": 3, "strides": 2, "padding": "same", "count_padding": True}]),
    "avg_pool2d explicit": ([5, 5, 2], [{"type": "avg_pool2d", "pool_size": 3, "strides": 2, "padding": [[1, 0], [2, 1]]}]),
    "avg_pool2d explicit counted": ([5, 5, 2], [{"type": "avg_pool2d", "pool_size": 3, "strides": 2, "padding": [[1, 0], [2, 1]], "count_padding": True}]),
    "max_pool2d explicit": ([5, 5, 2], [{"type": "max_pool2d", "pool_size": 3, "strides": 2, "padding": [[2, 0], [1, 1]]}]),
    "conv2d explicit": ([5, 5, 2], [{"type": "conv2d", "filters": 3, "kernel_size": 3, "strides": 2, "padding": [[1, 1], [1, 0]]}]),
    "global_avg_pool2d": ([4, 3, 2], [{"type": "global_avg_pool2d"}, {"type": "dense", "units": 2}]),
    "channel_pad": ([3, 3, 2], [{"type": "channel_pad", "before": 1, "after": 2}, {"type": "conv2d", "filters": 2, "kernel_size": 1}]),
    "reshape": ([4, 4, 2], [{"type": "reshape", "shape": [2, -1]}, {"type": "dense", "units": 3},
                            {"type": "reshape", "shape": [3, 2, 1]}, {"type": "conv2d", "filters": 2, "kernel_size": 1}]),
    "residual, ResNet option A shortcut": ([4, 4, 2], [{"type": "residual", "activation": "relu", "body": [
        {"type": "conv2d", "filters": 4, "kernel_size": 3, "strides": 2, "padding": [[1, 1], [1, 1]]}], "shortcut": [
        {"type": "max_pool2d", "pool_size": 1, "strides": 2}, {"type": "channel_pad", "before": 1, "after": 1}]}]),
    "repeat": ([4], [{"type": "repeat", "count": 2, "body": [{"type": "dense", "units": 4, "activation": "tanh"}]}]),
    "depthwise_conv2d same s2, multiplier 2": ([6, 5, 3], [{"type": "depthwise_conv2d", "kernel_size": 3, "strides": 2,
                                                         "padding": "same", "depth_multiplier": 2, "activation": "relu"}]),
    "depthwise_conv2d explicit, no bias": ([5, 5, 2], [{"type": "depthwise_conv2d", "kernel_size": [2, 3],
                                                       "padding": [[1, 0], [1, 1]], "use_bias": False}]),
    "position_embedding (longer than T)": ([3, 4], [{"type": "position_embedding", "length": 5}]),
    "class_token + take_token": ([3, 4], [{"type": "class_token"}, {"type": "dense", "units": 4, "activation": "tanh"},
                                          {"type": "take_token", "index": 1}]),
}


@pytest.mark.parametrize("name", list(DIRECT))
def test_tf_equals_torch(name):
    shape, raw = DIRECT[name]
    layers = _layers(shape, raw)
    params = _init(shape, layers)
    x = _x(shape)
    _assert_same(_tf_run(layers, params, x), _torch_run(layers, params, x))


def test_direct_check_catches_a_misplaced_padding_row():
    """The direct check can fail: avg pooling padded [[0, 1], ...] on one side, [[1, 0], ...] on the other."""
    a = _layers([5, 5, 2], [{"type": "avg_pool2d", "pool_size": 3, "strides": 2, "padding": [[1, 0], [0, 0]]}])
    b = _layers([5, 5, 2], [{"type": "avg_pool2d", "pool_size": 3, "strides": 2, "padding": [[0, 1], [0, 0]]}])
    x = _x([5, 5, 2])
    with pytest.raises(AssertionError):
        _assert_same(_tf_run(a, {}, x), _torch_run(b, {}, x))


# ---------------------------------------------------------------- each side is its framework's class


def _keras(layer, x, weights=None):
    """A Keras layer (float64) applied to ``x``, with ``weights`` set."""
    import tensorflow as tf

    layer.build(x.shape)
    if weights is not None:
        layer.set_weights(weights)
    return np.asarray(layer(tf.constant(x)))


@pytest.mark.parametrize(("center", "scale"), [(True, True), (False, True), (True, False)])
def test_layer_norm_is_keras_and_torchs(center, scale):
    import keras
    import torch
    from torch import nn

    raw = [{"type": "layer_norm", "epsilon": 1e-3, "center": center, "scale": scale}]
    layers = _layers([3, 6], raw)
    params = {k: v + np.random.default_rng(2).normal(size=v.shape) for k, v in _init([3, 6], layers).items()}
    x = _x([3, 6], scale=3.0)
    ours = _tf_run(layers, params, x)["out"]
    kl = keras.layers.LayerNormalization(epsilon=1e-3, center=center, scale=scale, dtype="float64")
    np.testing.assert_array_equal(ours, _keras(kl, x, [params[k] for k in ("0.gamma", "0.beta") if k in params]))
    if scale:
        tl = nn.LayerNorm(6, eps=1e-3, bias=center, dtype=torch.float64)
        with torch.no_grad():
            tl.weight.copy_(torch.as_tensor(params["0.gamma"]))
            if center:
                tl.bias.copy_(torch.as_tensor(params["0.beta"]))
        want = tl(torch.as_tensor(x)).detach().numpy()
    else:  # nn.LayerNorm has no bias without a weight; its forward is this call
        want = torch.nn.functional.layer_norm(torch.as_tensor(x), (6,), None, torch.as_tensor(params["0.beta"]), 1e-3).numpy()
    np.testing.assert_array_equal(_torch_run(layers, params, x)["out"], want)


def test_rms_norm_is_keras_and_torchs():
    import keras
    import torch
    from torch import nn

    layers = _layers([3, 6], [{"type": "rms_norm", "epsilon": 1e-6}])
    params = {"0.scale": np.random.default_rng(3).normal(size=6)}
    x = _x([3, 6])
    kl = keras.layers.RMSNormalization(epsilon=1e-6, dtype="float64")
    np.testing.assert_array_equal(_tf_run(layers, params, x)["out"], _keras(kl, x, [params["0.scale"]]))
    tl = nn.RMSNorm(6, eps=1e-6, dtype=torch.float64)
    with torch.no_grad():
        tl.weight.copy_(torch.as_tensor(params["0.scale"]))
    np.testing.assert_array_equal(_torch_run(layers, params, x)["out"], tl(torch.as_tensor(x)).detach().numpy())


@pytest.mark.parametrize("padding", ["valid", "same"])
def test_avg_pool_tf_side_is_keras_average_pooling(padding):
    """TensorFlow's average pooling (Keras' ``AveragePooling2D``) does not count SAME padding."""
    import keras

    layers = _layers([6, 5, 2], [{"type": "avg_pool2d", "pool_size": 3, "strides": 2, "padding": padding}])
    x = _x([6, 5, 2])
    kl = keras.layers.AveragePooling2D(3, 2, padding=padding, dtype="float64")
    np.testing.assert_array_equal(_tf_run(layers, {}, x)["out"], _keras(kl, x))


@pytest.mark.parametrize("count_padding", [False, True])
def test_avg_pool_torch_side_is_nn_avg_pool2d(count_padding):
    """Symmetric padding, which torch's ``padding=`` expresses: ``count_padding`` is ``count_include_pad``."""
    import torch
    from torch import nn

    layers = _layers([5, 5, 2], [{"type": "avg_pool2d", "pool_size": 3, "strides": 2, "padding": [[1, 1], [1, 1]],
                                  "count_padding": count_padding}])
    x = _x([5, 5, 2])
    tl = nn.AvgPool2d(3, 2, padding=1, count_include_pad=count_padding)
    want = tl(torch.as_tensor(x).permute(0, 3, 1, 2)).permute(0, 2, 3, 1).numpy()
    np.testing.assert_allclose(_torch_run(layers, {}, x)["out"], want, rtol=1e-15, atol=0)
    # the premise: counting the padding changes the border values here
    other = nn.AvgPool2d(3, 2, padding=1, count_include_pad=not count_padding)
    assert not np.allclose(other(torch.as_tensor(x).permute(0, 3, 1, 2)).permute(0, 2, 3, 1).numpy(), want)


def test_dense_on_tokens_is_keras_dense_and_nn_linear():
    """On ``[B, T, D]``: Keras ``Dense`` bit for bit; ``nn.Linear`` (``addmm`` with the kernel transposed) to rounding."""
    import keras
    import torch
    from torch import nn

    layers = _layers([5, 6], [{"type": "dense", "units": 4}])
    params = _init([5, 6], layers)
    x = _x([5, 6])
    kl = keras.layers.Dense(4, dtype="float64")
    np.testing.assert_array_equal(_tf_run(layers, params, x)["out"], _keras(kl, x, [params["0.kernel"], params["0.bias"]]))
    tl = nn.Linear(6, 4, dtype=torch.float64)
    with torch.no_grad():
        tl.weight.copy_(torch.as_tensor(params["0.kernel"]).T)
        tl.bias.copy_(torch.as_tensor(params["0.bias"]))
    np.testing.assert_allclose(_torch_run(layers, params, x)["out"], tl(torch.as_tensor(x)).detach().numpy(), rtol=1e-14, atol=1e-15)


def test_depthwise_conv2d_is_keras_and_torchs():
    """Keras ``DepthwiseConv2D`` (kernel ``[kh, kw, C, M]``) and ``nn.Conv2d(C, C*M, groups=C)`` with the same weights."""
    import keras
    import torch
    from torch import nn

    layers = _layers([6, 5, 3], [{"type": "depthwise_conv2d", "kernel_size": 3, "strides": 2, "padding": "same",
                                  "depth_multiplier": 2}])
    params = _init([6, 5, 3], layers)
    x = _x([6, 5, 3])
    kl = keras.layers.DepthwiseConv2D(3, 2, padding="same", depth_multiplier=2, dtype="float64")
    np.testing.assert_array_equal(_tf_run(layers, params, x)["out"], _keras(kl, x, [params["0.kernel"], params["0.bias"]]))
    tl = nn.Conv2d(3, 6, 3, stride=2, groups=3, dtype=torch.float64)
    with torch.no_grad():  # output channel c*M + m is input channel c's filter m, in both frameworks
        tl.weight.copy_(torch.as_tensor(params["0.kernel"]).permute(2, 3, 0, 1).reshape(6, 1, 3, 3))
        tl.bias.copy_(torch.as_tensor(params["0.bias"]))
    # TensorFlow's SAME here pads 1 row after (6 rows) and 1 column each side (5 columns): given explicitly to torch
    want = tl(torch.nn.functional.pad(torch.as_tensor(x).permute(0, 3, 1, 2), (1, 1, 0, 1))).permute(0, 2, 3, 1)
    np.testing.assert_allclose(_torch_run(layers, params, x)["out"], want.detach().numpy(), rtol=1e-15, atol=1e-15)


def test_global_pool_residual_and_activations_are_the_frameworks():
    """``GlobalAveragePooling2D`` / ``nn.AdaptiveAvgPool2d``; ``keras.layers.Add``; Keras' and torch's activations."""
    import keras
    import torch
    from torch import nn

    x = _x([4, 3, 2])
    layers = _layers([4, 3, 2], [{"type": "global_avg_pool2d"}])
    np.testing.assert_array_equal(_tf_run(layers, {}, x)["out"], _keras(keras.layers.GlobalAveragePooling2D(dtype="float64"), x))
    want = nn.AdaptiveAvgPool2d(1)(torch.as_tensor(x).permute(0, 3, 1, 2)).flatten(1).numpy()
    np.testing.assert_array_equal(_torch_run(layers, {}, x)["out"], want)
    for fn, keras_fn, torch_fn in (("gelu", "gelu", nn.GELU()), ("gelu_tanh", None, nn.GELU(approximate="tanh")),
                                   ("silu", "silu", nn.SiLU()), ("softmax", "softmax", nn.Softmax(-1))):
        layers = _layers([4, 3, 2], [{"type": "activation", "fn": fn}])
        tf_out = _tf_run(layers, {}, x)["out"]
        if keras_fn is not None:
            np.testing.assert_array_equal(tf_out, _keras(keras.layers.Activation(keras_fn, dtype="float64"), x))
        else:  # keras.ops.gelu's default is the tanh form
            np.testing.assert_array_equal(tf_out, np.asarray(keras.ops.gelu(x)))
        # the same kernel; torchref applies it to NCHW memory (softmax over dim 1), which may round
        # the last bit differently from the contiguous last axis
        np.testing.assert_allclose(_torch_run(layers, {}, x)["out"], torch_fn(torch.as_tensor(x)).numpy(), rtol=1e-15, atol=0)
    layers = _layers([4], [{"type": "residual", "body": [{"type": "dense", "units": 4}]}])
    params = _init([4], layers)
    x = _x([4])
    add = keras.layers.Add(dtype="float64")([np.asarray(x @ params["0.body.0.kernel"] + params["0.body.0.bias"]), x])
    np.testing.assert_allclose(_tf_run(layers, params, x)["out"], np.asarray(add), rtol=1e-15)


# ---------------------------------------------------------------- end to end: tf.towers vs torch.ddp


@pytest.fixture()
def _pool(pool):
    return pool


def _case(input_shape: list[int], layers: list[dict], **changes):
    """A tiny float64 case on 2 devices: 8 rows, 2 SGD steps."""
    if len(input_shape) == 3:
        data = {"generator": "images", "seed": 9, "global_batch": 8}
        loss = "softmax_ce"
    else:
        data = {"generator": "gaussian", "seed": 9, "global_batch": 8}
        loss = "mse"
    raw = {"schema": "parity-case/1", "name": "vocabulary", "dtype": "float64",
           "model": {"input_shape": input_shape, "layers": layers, "loss": loss},
           "init": {"seed": 8, "kind": "glorot_uniform"}, "data": data,
           "optimizer": {"name": "sgd", "lr": 0.1, "semantics": "torch"}, "parallel": {"devices": 2}, "steps": 2}
    return make(raw, **changes)


# per layer, a tiny model; images end in global pooling and a 3-class dense layer
_HEAD = [{"type": "global_avg_pool2d"}, {"type": "dense", "units": 3}]
END_TO_END = {
    "activation + dense on [T, D]": ([3, 4], [{"type": "dense", "units": 4, "activation": "silu"},
                                              {"type": "activation", "fn": "softmax"}, {"type": "flatten"}, {"type": "dense", "units": 1}]),
    "layer_norm + rms_norm": ([5], [{"type": "dense", "units": 4}, {"type": "layer_norm", "epsilon": 1e-5},
                                    {"type": "rms_norm", "epsilon": 1e-6}, {"type": "dense", "units": 1}]),
    "residual in repeat": ([5], [*RESIDUAL_IN_REPEAT[:2], {"type": "dense", "units": 1}]),
    "avg_pool2d + explicit padding": ([8, 8, 1], [
        {"type": "conv2d", "filters": 3, "kernel_size": 3, "strides": 2, "padding": [[0, 1], [1, 0]], "activation": "relu"},
        {"type": "avg_pool2d", "pool_size": 3, "strides": 2, "padding": "same"},
        {"type": "max_pool2d", "pool_size": 2, "strides": 1, "padding": [[1, 0], [0, 1]]}, *_HEAD]),
    "ResNet block: channel_pad shortcut": ([8, 8, 1], [
        {"type": "conv2d", "filters": 2, "kernel_size": 3, "padding": "same", "activation": "relu"},
        {"type": "residual", "activation": "relu", "body": [
            {"type": "conv2d", "filters": 4, "kernel_size": 3, "strides": 2, "padding": [[1, 1], [1, 1]], "activation": "relu"},
            {"type": "conv2d", "filters": 4, "kernel_size": 3, "padding": "same"}],
         "shortcut": [{"type": "max_pool2d", "pool_size": 1, "strides": 2}, {"type": "channel_pad", "before": 1, "after": 1}]},
        *_HEAD]),
    "reshape to tokens": ([8, 8, 1], [{"type": "reshape", "shape": [16, 4]}, {"type": "dense", "units": 4, "activation": "gelu",
                                                                              "semantics": "torch"},
                                      {"type": "layer_norm", "epsilon": 1e-5}, {"type": "reshape", "shape": [-1]},
                                      {"type": "dense", "units": 3}]),
    "depthwise separable block": ([8, 8, 1], [
        {"type": "conv2d", "filters": 2, "kernel_size": 3, "padding": "same", "activation": "relu"},
        {"type": "depthwise_conv2d", "kernel_size": 3, "strides": 2, "padding": "same", "depth_multiplier": 2,
         "activation": "relu"},
        {"type": "dense", "units": 4, "activation": "relu"}, *_HEAD]),
    "tokens: class token, position embedding, take token": ([8, 8, 1], [
        {"type": "reshape", "shape": [16, 4]}, {"type": "dense", "units": 4}, {"type": "class_token"},
        {"type": "position_embedding", "length": 20},
        {"type": "residual", "body": [{"type": "layer_norm", "epsilon": 1e-6},
                                      {"type": "dense", "units": 4, "activation": "gelu", "semantics": "tf"}]},
        {"type": "layer_norm", "epsilon": 1e-6}, {"type": "take_token"}, {"type": "dense", "units": 3}]),
}


@pytest.mark.parametrize("name", list(END_TO_END))
def test_towers_equal_ddp(_pool, name):
    case = _case(*END_TO_END[name])
    tf_side, ddp = run_impl(case, "tf.towers"), run_impl(case, "torch.ddp")
    assert {k for k in tf_side if k.startswith("param/")} == {f"param/{s.name}" for s in param_specs(
        case.spec["model"]["input_shape"], case.spec["model"]["layers"])}
    assert_trajectories_close(tf_side, ddp, rtol=RTOL, atol=ATOL)
    assert predict(case.spec, "tf.towers", "torch.ddp").differences == ()


@pytest.mark.parametrize("impl", ["tf.single", "tf.mirrored", "tf.v1", "torch.single"])
def test_every_engine_runs_the_vocabulary(_pool, impl):
    """The residual-in-repeat model (its GELU on torch's constants): every built-in engine agrees."""
    case = _case(*END_TO_END["residual in repeat"])
    assert_trajectories_close(run_impl(case, "tf.towers"), run_impl(case, impl), rtol=RTOL, atol=ATOL)


def test_wrong_layer_norm_epsilon_is_a_divergence(_pool):
    """A layer norm deep inside the model (repeat 2, residual body 0) with Keras' default epsilon 1e-3 on one
    side and torch's 1e-5 on the other: the trajectories part at step 1 (the loss)."""
    case = _case(*END_TO_END["residual in repeat"])
    mutant = case.replace(**{"model.layers.1.body.0.body.0.epsilon": 1e-3})
    assert case.spec["model"]["layers"][1]["body"][0]["body"][0]["epsilon"] == 1e-5
    result = compare_trajectories(run_impl(case, "tf.towers"), run_impl(mutant, "torch.ddp"), rtol=RTOL, atol=ATOL)
    assert not result.ok and result.mismatch.step == 1


# ---------------------------------------------------------------- the float64 GELU difference


def test_tensorflow_gelu_rounds_its_constants_through_float32():
    """The premise, on the installed TensorFlow: ``tf.nn.gelu`` in float64 is bit for bit the formula with
    float32(1/sqrt(2)) (erf) or float32(0.044715) (tanh), which torchref's ``semantics: tf`` computes."""
    import tensorflow as tf
    import torch

    from torchref.models import gelu

    x = _x([200], rows=1, scale=3.0)[0]
    exact = torch.nn.functional.gelu(torch.as_tensor(x)).numpy()
    for approximate in (False, True):
        ours = tf.nn.gelu(tf.constant(x), approximate=approximate).numpy()
        mapped = gelu(torch.as_tensor(x), approximate, "tf").numpy()  # erfc/tanh kernels differ in the last bits
        assert np.max(np.abs(mapped - ours)) / np.max(np.abs(ours)) < 1e-15
        torchs = torch.nn.functional.gelu(torch.as_tensor(x), approximate="tanh" if approximate else "none").numpy()
        gap = np.max(np.abs(ours - torchs)) / np.max(np.abs(torchs))
        assert gap > 1e-11, gap  # far above float64 rounding (1e-16)
    assert np.max(np.abs(tf.nn.gelu(tf.constant(x)).numpy() - exact)) / np.max(np.abs(exact)) > 1e-10


@pytest.mark.parametrize("semantics", ["native", "tf", "torch"])
def test_gelu_gap_appears_natively_and_vanishes_mapped(semantics):
    """Direct forward and backward: native float64 GELU differs well above rounding; mapped it is at rounding."""
    layers = _layers([6], [{"type": "dense", "units": 4, "activation": "gelu", "semantics": semantics}])
    params = _init([6], layers)
    x = _x([6], scale=3.0)
    a, b = _tf_run(layers, params, x), _torch_run(layers, params, x)
    gap = max(np.max(np.abs(a[k] - b[k])) / np.max(np.abs(b[k])) for k in a)
    if semantics == "native":
        assert 1e-11 < gap < 1e-6, gap
    else:
        assert gap < 1e-14, gap


def test_gelu_difference_is_predicted_where_it_is_real(_pool):
    """Predicted (known, named, mappable) for native float64 GELUs across frameworks, and only there;
    the mapping names the nested layer and, applied, leaves nothing to predict and a run at rounding."""
    layers = [{"type": "dense", "units": 4},
              {"type": "repeat", "count": 2, "body": [{"type": "residual", "body": [
                  {"type": "dense", "units": 4, "activation": "gelu"}]}]},
              {"type": "activation", "fn": "gelu_tanh"}, {"type": "dense", "units": 1}]
    case = _case([5], layers)
    pred = predict(case.spec, "tf.towers", "torch.ddp")
    (d,) = pred.differences
    assert not d.expected and d.mapping == "gelu_semantics" and d.stage == "forward" and "float64 GELU" in d.text
    assert "model.layers.1.body.0.body.0" in d.text and "model.layers.2" in d.text
    assert predict(case.spec, "tf.towers", "tf.single").differences == ()  # one framework: the same constants
    f32 = case.replace(dtype="float32")
    assert predict(f32.spec, "tf.towers", "torch.ddp").differences == ()
    assert any("float64 GELU" in a for a in predict(f32.spec, "tf.towers", "torch.ddp").absent)
    changes = mapping_changes("gelu_semantics", case.spec, "torch.ddp", "tf.towers")
    assert changes == {"model.layers.1.body.0.body.0.semantics": "tf", "model.layers.2.semantics": "tf"}
    mapped = case.replace(**changes)
    assert predict(mapped.spec, "tf.towers", "torch.ddp").differences == ()
    tf_side = run_impl(case, "tf.towers")
    native, mapped_gap = (_normwise_gap(tf_side, run_impl(c, "torch.ddp")) for c in (case, mapped))
    assert native > 1e-11 and mapped_gap < 1e-13, (native, mapped_gap)  # measured: 2.3e-08 and 6.2e-15


def _normwise_gap(a: dict, b: dict) -> float:
    """Largest per-key ``max |a - b| / max |b|`` over two trajectories (rounding: about 1e-15 per op)."""
    return max(float(np.max(np.abs(a[k] - b[k])) / max(np.max(np.abs(b[k])), 1e-300)) for k in a)


# ---------------------------------------------------------------- the measured table of docs/layers.md


def _direct_gaps(shape: list[int], raw: list[dict]) -> dict[str, float]:
    layers = _layers(shape, raw)
    params = _init(shape, layers)
    x = _x(shape, scale=3.0)
    a, b = _tf_run(layers, params, x), _torch_run(layers, params, x)
    return {k: float(np.max(np.abs(a[k] - b[k])) / max(np.max(np.abs(b[k])), 1e-300)) for k in a}


GELU_PROBES = {f"dense {fn}, semantics {sem}": ([6], [{"type": "dense", "units": 4, "activation": fn, "semantics": sem}])
               for fn in ("gelu", "gelu_tanh") for sem in ("native", "tf", "torch")}


def main() -> None:
    """Print each probe's largest normwise relative gap, TF vs torch, float64 (docs/layers.md)."""
    from parity_tests.running.backends import tf_device_count

    tf_device_count()
    print("| architecture layer (probe) | largest gap TF vs torch (where) |")
    print("| --- | --- |")
    for name, (shape, raw) in {**DIRECT, **GELU_PROBES}.items():
        gaps = _direct_gaps(shape, raw)
        worst = max(gaps, key=gaps.get)
        print(f"| {name} | {gaps[worst]:.2g} ({worst}) |")


if __name__ == "__main__":
    main()
