"""Which Keras optimizers a piece of user code made, and what they hold in float32.

In a float64 run Keras 3 keeps ``learning_rate`` in a variable of the ``keras.config.floatx()``
that was set when the optimizer was made (``parity_tests.protocol.hyper.keras_float32``):
code that calls ``keras.config.set_floatx("float64")`` first keeps its rate exact, code that
does not rounds it to float32. The judge maps the other side onto what the code held, so it
asks the code itself rather than a flag: every optimizer made while :func:`keras_optimizers_seen`
is active is reported with its class and its learning rate's dtype.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

__all__ = ["keras_optimizers_seen"]


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
