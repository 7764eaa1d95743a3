"""``tfpar.v1_losses_seen.v1_losses_seen``: the float64 losses a run reduced in float32 inside ``tf.compat.v1.losses``.

``compute_weighted_loss`` casts to float32 whatever the graph's dtype; the judge's precision-leak rule reads the
record (``parity_tests.judging.precision_leak``, "A float32 reduction read from the run"). The whole-pair check is
``test_mapping.py::test_a_float64_run_whose_loss_is_float32_is_detected_and_judged_at_the_float32_noise`` (its
6-clone case: the clone losses times 1/6 spread the loss's low bits, so only the record tells).
"""

from __future__ import annotations

import numpy as np
import pytest


def _mse(dtype) -> float:
    import tensorflow as tf

    y = tf.constant(np.array([[0.1], [0.7], [0.3]]), dtype=dtype)
    p = tf.constant(np.array([[0.2], [0.4], [0.9]]), dtype=dtype)
    return float(tf.compat.v1.losses.mean_squared_error(y, p))


def test_a_float64_loss_reduced_in_float32_is_listed_and_a_float32_one_is_not():
    import tensorflow as tf

    from tfpar.v1_losses_seen import V1_WEIGHTED_LOSS, v1_losses_seen

    with v1_losses_seen() as seen:
        _mse(tf.float32)                              # float32 in, float32 arithmetic: nothing leaks
        assert seen == []
        value = _mse(tf.float64)
        _mse(tf.float64)                              # listed once
        tf.compat.v1.losses.compute_weighted_loss(tf.constant([1.0, 2.0], tf.float64))  # called directly: seen too
    assert seen == [{"what": V1_WEIGHTED_LOSS, "dtype": "float64", "computes_in": "float32"}]
    # what TensorFlow computed is a float32 number, not the float64 mean: the leak the record names
    exact = np.mean((np.array([0.1, 0.7, 0.3]) - np.array([0.2, 0.4, 0.9])) ** 2)
    assert value == float(np.float32(value)) != exact


def test_tensorflow_is_as_it_was_after_the_block_also_when_it_raises():
    import tensorflow as tf
    from tensorflow.python.ops.losses import losses_impl

    from tfpar.v1_losses_seen import v1_losses_seen

    before, exported = losses_impl.compute_weighted_loss, tf.compat.v1.losses.compute_weighted_loss
    with pytest.raises(RuntimeError), v1_losses_seen():
        raise RuntimeError("the plugin failed")
    assert losses_impl.compute_weighted_loss is before and tf.compat.v1.losses.compute_weighted_loss is exported
    with v1_losses_seen() as seen:
        pass
    _mse(tf.float64)                                  # after the block: not recorded
    assert seen == []
