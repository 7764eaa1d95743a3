"""Hyperparameters as a Keras optimizer holds them, and the learning rate of a step.

Numbers only (numpy, no framework): the torch reference reproduces Keras' float32
rounding from these (``torchref.optimizers.KerasRule``), the judge predicts it
(``parity_tests.judging.theory``), and the case validates ``keras_rounding``
against the same table.
"""

from __future__ import annotations

import numpy as np

__all__ = ["keras_float32", "keras_lr", "lr_at"]


def keras_float32(opt: dict, use: str) -> bool:
    """Whether the hyperparameter use ``use`` is rounded to float32 under ``opt["keras_rounding"]``.

    ``use``: ``lr`` (the learning rate, also where weight decay reads it), ``momentum`` (SGD's),
    ``weight_decay``, ``beta_power`` (the betas inside Adam's bias correction only; ``1 - beta``
    stays exact), ``initial_accumulator``. Measured against Keras 3.15 bit for bit
    (``tests/test_keras_rounding.py``): ``lr`` lives in a variable of the floatx the optimizer was
    made under; the others go through ``ops.cast(python_float, dtype)``, which passes float32.
    RMSprop's ``rho``/``momentum``, every ``epsilon`` and ``1 - beta`` are never rounded.
    """
    rounding = opt.get("keras_rounding", "none")
    if rounding == "none":
        return False
    if use == "lr":
        return rounding == "floatx_float32"
    if use == "momentum":
        return opt["name"] in ("momentum", "nesterov", "sgd")
    return use in ("weight_decay", "beta_power", "initial_accumulator")


def keras_lr(schedule: dict, lr: float, t: int) -> float:
    """The learning rate of step ``t`` as a Keras optimizer made under floatx float32 holds it: float32.

    A constant rate is the float32 variable's value; a schedule computes in float32, as Keras'
    built-in schedules do and as ``tfpar.optimizers.keras_schedule`` makes them
    (``PiecewiseConstantDecay`` holds its values as float32 tensors; the warm-up is
    ``float32(lr) * min(1, float32(t) / float32(k))`` in float32 arithmetic).
    """
    f = np.float32
    if schedule["kind"] == "constant":
        return float(f(lr))
    if schedule["kind"] == "step":
        return float(f(lr_at(schedule, lr, t)))
    return float(f(lr) * np.minimum(f(1.0), f(t) / f(schedule["warmup_steps"])))


def lr_at(schedule: dict, lr: float, t: int) -> float:
    """The learning rate of step ``t`` (``t = 1, 2, ...``) under a normalised schedule, in float64."""
    if schedule["kind"] == "constant":
        return lr
    if schedule["kind"] == "step":
        return schedule["values"][sum(1 for b in schedule["boundaries"] if b < t)]
    return lr * min(1.0, t / schedule["warmup_steps"])
