"""``tfpar.bias``: which bias add a mixed-precision layer uses, and which gradient kernel each runs.

Keras' ``ops.add`` is ``tf.nn.bias_add`` for a bias (its gradient is ``BiasAddGrad``); the layer's
``semantics: torch`` takes a broadcasting add (its gradient is a ``Sum``). Read from the traced graphs
of the gradients themselves, so the premise of the bias-gradient prediction is checked where it runs.
"""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True, scope="module")
def _tf_devices():
    from parity_tests.running.backends import tf_device_count

    tf_device_count()


def _gradient_ops(fn) -> set[str]:
    import tensorflow as tf

    bias = tf.Variable(tf.zeros([3]))

    @tf.function
    def grad():
        with tf.GradientTape() as tape:
            y = fn(tf.zeros([4, 3], tf.bfloat16), tf.cast(bias, tf.bfloat16))
        return tape.gradient(y, bias)

    return {op.type for op in grad.get_concrete_function().graph.get_operations()}


def test_each_semantics_picks_its_add_and_its_gradient_kernel():
    from tfpar.bias import bias_add_fn, keras_bias_add, torch_bias_add

    assert bias_add_fn({"type": "dense"}) is keras_bias_add
    assert bias_add_fn({"type": "dense", "semantics": "tf"}) is keras_bias_add
    assert bias_add_fn({"type": "dense", "semantics": "torch"}) is torch_bias_add
    keras_ops, torch_ops = _gradient_ops(keras_bias_add), _gradient_ops(torch_bias_add)
    assert "BiasAddGrad" in keras_ops and "BiasAddGrad" not in torch_ops
    assert "Sum" in torch_ops
