"""``tfpar.keras_seen.keras_float32_constants_seen``: the Keras regularizer factors a float64 run held rounded.

Keras' ``L1``/``L2``/``L1L2`` ``__call__`` multiplies by ``ops.cast(factor, x.dtype)``, and ``keras.ops.cast``
of a Python float goes through a float32 tensor: the judge's precision-leak rule reads what the run held
(``parity_tests.judging.precision_leak``, "A float32 constant read from the run"). The whole-pair check is
``test_mapping.py::test_a_keras_regularizers_float32_factor_is_read_from_the_run_and_judged_at_the_float32_noise``.
"""

from __future__ import annotations

import numpy as np
import pytest


def test_a_float64_weights_rounded_factor_is_listed_with_what_keras_held():
    import keras

    from tfpar.keras_seen import keras_float32_constants_seen

    w64 = keras.ops.convert_to_tensor(np.ones((2, 2)), dtype="float64")
    w32 = keras.ops.convert_to_tensor(np.ones((2, 2)), dtype="float32")
    with keras_float32_constants_seen() as seen:
        term = keras.regularizers.L2(1e-3)(w64)
        keras.regularizers.L2(1e-3)(w64)                 # the same factor again: listed once
        keras.regularizers.L2(2.0 ** -10)(w64)           # exact in float32: nothing held rounded
        keras.regularizers.L1(1e-3)(w32)                 # float32 weights: float32 arithmetic rounds it anyway
        keras.regularizers.L1L2(l1=0.0, l2=0.1)(w64)     # l1 = 0 is no factor; l2 = 0.1 is rounded
    held = float(np.float32(1e-3))
    assert seen == [
        {"what": "keras.regularizers.L2", "name": "l2", "value": 1e-3, "held": held, "dtype": "float64"},
        {"what": "keras.regularizers.L1L2", "name": "l2", "value": 0.1, "held": float(np.float32(0.1)),
         "dtype": "float64"},
    ]
    # what Keras computed is what was listed: the term is float32(1e-3) * 4, not 1e-3 * 4
    assert float(term) == held * 4 != 1e-3 * 4


def test_keras_is_as_it_was_after_the_block_also_when_it_raises():
    from keras.src.regularizers import regularizers

    from tfpar.keras_seen import keras_float32_constants_seen

    before = {c: c.__call__ for c in (regularizers.L1, regularizers.L2, regularizers.L1L2)}
    with pytest.raises(RuntimeError), keras_float32_constants_seen():
        assert regularizers.L2.__call__ is not before[regularizers.L2]
        raise RuntimeError("the program raised")
    assert all(c.__call__ is f for c, f in before.items())
