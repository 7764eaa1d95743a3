"""TensorFlow's half of the bfloat16 kernel probe (``parity_tests.running.kernels``): run each op here.

Every op is run as ``tfpar.models`` runs it under mixed precision (float32 values cast to
bfloat16, then the op), inside a ``tf.function`` as the tower steps are, because that is
where TensorFlow's graph passes hand bfloat16 ops to oneDNN and fuse them (a conv's
``BiasAddGrad`` is fused into its filter gradient: alone, the same op sums in bfloat16
where the fused one does not). Gradients are taken with ``tf.GradientTape`` with the
probe's ``g`` as the output gradient, as in a training step. Outputs come back as float32
(bfloat16 widens exactly).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import tensorflow as tf

__all__ = ["run_probe"]

_BF = tf.bfloat16


def _bf(a: tf.Tensor) -> tf.Tensor:
    return tf.cast(a, _BF)


@tf.function(reduce_retracing=True)
def _matmul(a: tf.Tensor, b: tf.Tensor) -> tf.Tensor:
    return tf.matmul(_bf(a), _bf(b))


@tf.function(reduce_retracing=True)
def _dense_grads(x: tf.Tensor, g: tf.Tensor, g_bias: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """The weight gradient ``x^T g`` and the bias gradient of ``h + bias`` (Keras' dense, bfloat16 add)."""
    w = tf.ones([x.shape[1], g.shape[1]])
    bias = tf.ones([g_bias.shape[1]])
    h = tf.zeros(g_bias.shape, _BF)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch([w, bias])
        y = tf.matmul(_bf(x), _bf(w))
        z = h + _bf(bias)
    return tape.gradient(y, w, output_gradients=_bf(g)), tape.gradient(z, bias, output_gradients=_bf(g_bias))


@tf.function(reduce_retracing=True)
def _dense_bias_add(x: tf.Tensor, g: tf.Tensor) -> tf.Tensor:
    """The bias gradient of ``tf.nn.bias_add(x @ w, bias)`` (``BiasAddGrad`` after a matmul)."""
    w = tf.ones([x.shape[1], g.shape[1]])
    bias = tf.ones([g.shape[1]])
    with tf.GradientTape() as tape:
        tape.watch(bias)
        y = tf.nn.bias_add(tf.matmul(_bf(x), _bf(w)), _bf(bias))
    return tape.gradient(y, bias, output_gradients=_bf(g))


@tf.function(reduce_retracing=True)
def _input_grad(g: tf.Tensor, w: tf.Tensor) -> tf.Tensor:
    """The gradient ``g w^T`` a dense layer ``x @ w`` passes back to ``x``."""
    x = tf.ones([g.shape[0], w.shape[0]])
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = tf.matmul(_bf(x), _bf(w))
    return tape.gradient(y, x, output_gradients=_bf(g))


@tf.function(reduce_retracing=True)
def _conv(x: tf.Tensor, k: tf.Tensor) -> tf.Tensor:
    return tf.nn.conv2d(_bf(x), _bf(k), strides=1, padding="VALID")


def _conv_grads(add: Callable[[tf.Tensor, tf.Tensor], tf.Tensor]) -> Callable:
    @tf.function(reduce_retracing=True)
    def grads(x: tf.Tensor, g: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        k = tf.ones([3, 3, x.shape[3], g.shape[3]])
        bias = tf.ones([g.shape[3]])
        with tf.GradientTape() as tape:
            tape.watch([k, bias])
            y = add(tf.nn.conv2d(_bf(x), _bf(k), strides=1, padding="SAME"), _bf(bias))
        dk, db = tape.gradient(y, [k, bias], output_gradients=_bf(g))
        return dk[1, 1], db

    return grads


_keras_add = _conv_grads(lambda h, b: h + b)  # tfpar.bias.torch_bias_add: a broadcasting add (semantics torch)
_bias_add = _conv_grads(tf.nn.bias_add)


@tf.function(reduce_retracing=True)
def _conv_input_grad(k: tf.Tensor, g: tf.Tensor) -> tf.Tensor:
    x = tf.ones([1, 3, 3, k.shape[2]])
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = tf.nn.conv2d(_bf(x), _bf(k), strides=1, padding="SAME")
    return tape.gradient(y, x, output_gradients=_bf(g))[0, 1, 1]


@tf.function(reduce_retracing=True)
def _sum(g: tf.Tensor) -> tf.Tensor:
    return tf.reduce_sum(_bf(g), axis=0)


@tf.function(reduce_retracing=True)
def _batch_matmul(a: tf.Tensor, b: tf.Tensor) -> tf.Tensor:
    return tf.matmul(_bf(a), _bf(b))


@tf.function(reduce_retracing=True)
def _softmax(x: tf.Tensor) -> tf.Tensor:
    return tf.nn.softmax(_bf(x), axis=-1)


@tf.function(reduce_retracing=True)
def _depthwise(x: tf.Tensor, k: tf.Tensor) -> tf.Tensor:
    return tf.nn.depthwise_conv2d(_bf(x), _bf(k), strides=[1, 1, 1, 1], padding="VALID")[0, 0, 0]


@tf.function(reduce_retracing=True)
def _depthwise_filter_grad(x: tf.Tensor, g: tf.Tensor) -> tf.Tensor:
    k = tf.ones([3, 3, x.shape[3], 1])
    with tf.GradientTape() as tape:
        tape.watch(k)
        y = tf.nn.depthwise_conv2d(_bf(x), _bf(k), strides=[1, 1, 1, 1], padding="SAME")
    return tape.gradient(y, k, output_gradients=_bf(g))[1, 1, :, 0]


def run_probe(inputs: Mapping[str, Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Each op of ``parity_tests.running.kernels.OPS`` on its ``inputs``, as float32 numpy."""
    i = {op: {k: tf.constant(v) for k, v in arrays.items()} for op, arrays in inputs.items()}
    dw, db = _dense_grads(i["matmul weight gradient"]["x"], i["matmul weight gradient"]["g"],
                             i["dense bias gradient"]["g"])
    fk, fb = _keras_add(i["conv2d filter gradient"]["x"], i["conv2d filter gradient"]["g"])
    _, bb = _bias_add(i["conv2d filter gradient"]["x"], i["conv2d filter gradient"]["g"])
    out = {
        "matmul": _matmul(i["matmul"]["a"], i["matmul"]["b"]),
        "matmul weight gradient": dw,
        "matmul input gradient": _input_grad(i["matmul input gradient"]["g"], i["matmul input gradient"]["w"]),
        "dense bias gradient": db,
        "dense bias_add gradient": _dense_bias_add(i["matmul weight gradient"]["x"], i["dense bias gradient"]["g"]),
        "conv2d": _conv(i["conv2d"]["x"], i["conv2d"]["k"])[0, 0, 0],
        "conv2d filter gradient": fk,
        "conv2d input gradient": _conv_input_grad(i["conv2d input gradient"]["k"], i["conv2d input gradient"]["g"]),
        "conv2d bias gradient": fb,
        "conv2d bias_add gradient": bb,
        "sum": _sum(i["sum"]["g"]),
        "batch matmul": _batch_matmul(i["batch matmul"]["a"], i["batch matmul"]["b"]),
        "softmax": _softmax(i["softmax"]["x"]),
        "depthwise conv2d": _depthwise(i["depthwise conv2d"]["x"], i["depthwise conv2d"]["k"]),
        "depthwise conv2d filter gradient": _depthwise_filter_grad(i["depthwise conv2d filter gradient"]["x"],
                                                                   i["depthwise conv2d filter gradient"]["g"]),
    }
    return {op: tf.cast(v, tf.float32).numpy() for op, v in out.items()}
