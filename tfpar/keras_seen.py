"""Which Keras optimizers a piece of user code made, and what they hold in float32.

In a float64 run Keras 3 keeps ``learning_rate`` in a variable of the ``keras.config.floatx()``
that was set when the optimizer was made (``parity_tests.protocol.hyper.keras_float32``):
code that calls ``keras.config.set_floatx("float64")`` first keeps its rate exact, code that
does not rounds it to float32. The judge maps the other side onto what the code held, so it
asks the code itself rather than a flag: every optimizer made while :func:`keras_optimizers_seen`
is active is reported with its class and its learning rate's dtype.

Keras also scales a loss for a ``tf.distribute`` strategy in a precision of its own:
``keras/src/losses/loss.py`` ``scale_loss_for_distribution`` (Keras 3.15.1; every loss
``compute_loss``/``fit`` reduces, and the regularization losses through the TensorFlow trainer's
``_aggregate_additional_loss``) multiplies the loss by ``ops.cast(1.0 / num_replicas, loss.dtype)``,
and ``keras.ops.cast`` of a Python float goes through a float32 tensor:
``keras.ops.cast(1.0 / 3, "float64")`` is ``0.3333333432674408``, float32(1/3). A float64
``model.fit`` on N replicas, N not a power of two, so trains on the loss and every gradient times
``float32(1/N) N`` (``1 + 2^-25`` at N = 3), and logs that loss too (the loss tracker undoes the
scale with an exact ``N``). :func:`keras_loss_scales_seen` reads which factor a run applied, and
can make it the exact one for the judge's mapped rerun of the same program.

Keras' regularizers hold their factor the same way: ``L2.__call__`` (and ``L1``'s, ``L1L2``'s) is
``ops.cast(self.l2, x.dtype) * ops.sum(ops.square(x))``, so ``L2(1e-3)`` on a float64 kernel adds
``float32(1e-3) |w|^2`` (``1e-3 (1 + 4.7e-8)``), whatever floatx says. A float64 run of such a program
is not float64 throughout, and no user code can reach the cast: :func:`keras_float32_constants_seen`
lists every factor a run's float64 regularizer held rounded, for the judge's precision-leak rule
(``parity_tests.judging.precision_leak``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

__all__ = ["keras_optimizers_seen", "keras_loss_scales_seen", "keras_float32_constants_seen"]


def _lr_dtype(opt: Any) -> str | None:
    """The dtype a Keras optimizer's learning rate is computed in: its variable's, or float32 for a schedule."""
    import keras

    lr = getattr(opt, "_learning_rate", None)
    if isinstance(lr, keras.optimizers.schedules.LearningRateSchedule) or (callable(lr) and not hasattr(lr, "dtype")):
        return "float32"  # Keras' schedules compute their rate in float32 tensors
    dtype = getattr(lr, "dtype", None)
    return None if dtype is None else str(getattr(dtype, "name", dtype))


@contextlib.contextmanager
def keras_optimizers_seen() -> Iterator[list[dict[str, Any]]]:
    """Record every Keras optimizer made inside the block: ``[{"class": "Adam", "lr_dtype": "float32"}, ...]``,
    and every ``tf.compat.v1`` one (``{"class": "MomentumOptimizer", "family": "tf.compat.v1", ...}``).

    ``BaseOptimizer.__init__`` (every Keras 3 optimizer's) is wrapped for the block and
    restored after it, also when the block raises. A ``LossScaleOptimizer`` is a wrapper
    whose inner optimizer is what updates the variables: only the inner one is listed.
    """
    from keras.src.optimizers import base_optimizer

    seen: list[dict[str, Any]] = []
    cls = base_optimizer.BaseOptimizer
    original = cls.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if type(self).__name__ != "LossScaleOptimizer":
            seen.append({"class": type(self).__name__, "lr_dtype": _lr_dtype(self)})

    # tf.compat.v1's optimizers (a slim-style program's) are no Keras class, and follow a rule of a
    # framework all the same: listed with their family, so that the judge does not take the program
    # for one that writes its own rule out (parity_tests.session.comparison.writes_own_rule)
    from tensorflow.python.training import optimizer as v1_optimizer

    v1 = v1_optimizer.Optimizer
    v1_original = v1.__init__

    def v1_init(self: Any, *args: Any, **kwargs: Any) -> None:
        v1_original(self, *args, **kwargs)
        seen.append({"class": type(self).__name__, "family": "tf.compat.v1", "lr_dtype": None})

    cls.__init__ = __init__
    v1.__init__ = v1_init
    try:
        yield seen
    finally:
        cls.__init__ = original
        v1.__init__ = v1_original


@contextlib.contextmanager
def keras_loss_scales_seen(*, exact: bool = False) -> Iterator[list[dict[str, Any]]]:
    """Record the factor of every distributed loss scale Keras applies inside the block.

    Yields ``[{"replicas": 3, "dtype": "float64", "factor": 0.3333333432674408, "exact": False}, ...]``:
    one entry per replica count and loss dtype, ``factor`` the number Keras' own
    ``ops.cast(1.0 / replicas, dtype)`` makes (evaluated eagerly, as Keras computes it in the traced
    step), ``exact`` whether this block replaced it. Nothing is recorded where Keras scales nothing
    (one replica, or no strategy).

    Args:
        exact: multiply a float64 loss by ``1/replicas`` rounded once to float64 (what a port that
            divides by N in float64 computes) in place of Keras' float32-rounded factor: the judge's
            mapped rerun of the same program (``session.comparison``, "Keras' distribution loss scale").
            Other dtypes keep Keras' own (float32(1/N) is what float32 arithmetic computes anyway).

    ``keras.src.losses.loss.scale_loss_for_distribution`` is replaced for the block and restored
    after it, also when the block raises; its callers look it up in the module at call time
    (``reduce_values`` as a module global, the TensorFlow trainer as ``loss_module.``).
    """
    import tensorflow as tf
    from keras import ops
    from keras.src import backend
    from keras.src.losses import loss as loss_module

    seen: list[dict[str, Any]] = []
    original = loss_module.scale_loss_for_distribution

    def scale_loss_for_distribution(value: Any) -> Any:
        if backend.backend() != "tensorflow":
            return original(value)
        n = tf.distribute.get_strategy().num_replicas_in_sync
        if n <= 1:
            return original(value)
        dtype = str(getattr(value.dtype, "name", value.dtype))
        swap = exact and dtype == "float64"
        if not any(e["replicas"] == n and e["dtype"] == dtype for e in seen):
            with tf.init_scope():  # Keras' own factor, as a number (the step being traced holds a symbolic one)
                factor = float(ops.convert_to_numpy(ops.cast(1.0 / n, dtype)))
            seen.append({"replicas": int(n), "dtype": dtype, "factor": factor, "exact": swap})
        if swap:
            return ops.multiply(value, tf.constant(1.0 / n, dtype=tf.float64))
        return original(value)

    loss_module.scale_loss_for_distribution = scale_loss_for_distribution
    try:
        yield seen
    finally:
        loss_module.scale_loss_for_distribution = original


#: the Keras regularizers whose ``__call__`` casts a Python-float factor (attribute) to the weight's dtype
_REGULARIZER_FACTORS = {"L1": ("l1",), "L2": ("l2",), "L1L2": ("l1", "l2")}


@contextlib.contextmanager
def keras_float32_constants_seen() -> Iterator[list[dict[str, Any]]]:
    """Record every regularizer factor Keras holds rounded in a float64 computation inside the block.

    Yields ``[{"what": "keras.regularizers.L2", "name": "l2", "value": 0.001, "held": 0.0010000000474974513,
    "dtype": "float64"}, ...]``: one entry per class, factor and value, ``held`` the number Keras' own
    ``ops.cast(value, dtype)`` makes (evaluated eagerly, as the traced step computes it). A factor that
    the cast keeps exact (``2**-10``, or any float32 number) is not listed, nor is one applied to float32
    weights (float32 arithmetic rounds it there anyway).

    The ``__call__`` of ``keras.regularizers.L1``, ``L2`` and ``L1L2`` is wrapped for the block and
    restored after it, also when the block raises; a subclass with its own ``__call__`` is not seen.
    """
    import numpy as np
    import tensorflow as tf
    from keras import ops
    from keras.src.regularizers import regularizers

    seen: list[dict[str, Any]] = []
    originals: dict[type, Any] = {}

    def wrap(cls: type, names: tuple[str, ...]) -> Any:
        original = cls.__call__

        def __call__(self: Any, x: Any) -> Any:
            dtype = str(getattr(getattr(x, "dtype", None), "name", getattr(x, "dtype", "")))
            if dtype == "float64":
                for name in names:
                    value = getattr(self, name, None)
                    if not isinstance(value, float) or value == 0.0:
                        continue
                    what = f"keras.regularizers.{cls.__name__}"
                    if any(e["what"] == what and e["name"] == name and e["value"] == value for e in seen):
                        continue
                    with tf.init_scope():  # Keras' own cast, as a number (the step being traced holds a symbolic one)
                        held = float(np.asarray(ops.convert_to_numpy(ops.cast(value, dtype))))
                    if held != value:
                        seen.append({"what": what, "name": name, "value": value, "held": held, "dtype": dtype})
            return original(self, x)

        return __call__

    for cls_name, names in _REGULARIZER_FACTORS.items():
        cls = getattr(regularizers, cls_name, None)
        if isinstance(cls, type) and "__call__" in vars(cls):
            originals[cls] = cls.__call__
            cls.__call__ = wrap(cls, names)
    try:
        yield seen
    finally:
        for cls, original in originals.items():
            cls.__call__ = original
