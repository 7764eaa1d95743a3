"""Hyperparameters as a Keras optimizer holds them, and the learning rate of a step.

Numbers only (numpy, no framework): the torch reference reproduces Keras' float32
rounding from these (``torchref.optimizers.KerasRule``), the judge predicts it
(``parity_tests.judging.theory``), and the case validates ``keras_rounding``
against the same table.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["keras_float32", "keras_lr", "lr_at", "cosine_lr", "keras_cosine_lr", "keras_scale_factor"]


def keras_scale_factor(seen: list[dict] | None) -> float | None:
    """``float32(1/N) N``: the factor a run's float64 losses and gradients carry from Keras' distributed loss scale.

    ``seen``: what the run's Keras scaled (``tfpar.keras_seen.keras_loss_scales_seen``). ``None`` where
    it scaled no float64 loss, or scaled it by ``1/N`` exactly in float64 (N a power of two, or the
    mapped rerun): nothing differs from a port that divides by N in float64. Several replica counts in
    one run (the largest departure wins) do not occur in one program as the hunt writes them.
    """
    factors = [float(np.float64(e["factor"]) * np.float64(e["replicas"])) for e in seen or ()
               if e.get("dtype") == "float64" and not e.get("exact")
               and np.float64(e["factor"]) != np.float64(1.0) / np.float64(e["replicas"])]
    return max(factors, key=lambda f: abs(f - 1.0)) if factors else None


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
    ``warmup_cosine``: Keras' own ``CosineDecay`` (:func:`keras_cosine_lr`), one step late against
    :func:`lr_at` and within one float32 rounding of what TensorFlow's float32 ``cos`` gives.
    """
    f = np.float32
    if schedule["kind"] == "constant":
        return float(f(lr))
    if schedule["kind"] == "step":
        return float(f(lr_at(schedule, lr, t)))
    if schedule["kind"] == "warmup_cosine":
        return keras_cosine_lr(schedule, lr, t)
    return float(f(lr) * np.minimum(f(1.0), f(t) / f(schedule["warmup_steps"])))


def lr_at(schedule: dict, lr: float, t: int) -> float:
    """The learning rate of step ``t`` (``t = 1, 2, ...``) under a normalised schedule, in float64."""
    if schedule["kind"] == "constant":
        return lr
    if schedule["kind"] == "step":
        return schedule["values"][sum(1 for b in schedule["boundaries"] if b < t)]
    if schedule["kind"] == "warmup_cosine":
        return cosine_lr(schedule, lr, t)
    return lr * min(1.0, t / schedule["warmup_steps"])


def cosine_lr(schedule: dict, lr: float, t: float) -> float:
    """The contract's ``warmup_cosine`` rate of step ``t``, in float64: ``f(t)`` with ``f`` continuous.

    With ``k`` = ``warmup_steps``, ``d`` = ``decay_steps``, ``m`` = ``min_lr``::

        f(t) = lr t / k                                      t <= k   (step 1: lr / k; step k: lr)
        f(t) = m + (lr - m) (1 + cos(pi (t - k) / d)) / 2     k < t <= k + d   (step k + d: m)
        f(t) = m                                             t > k + d

    The warm-up is ``warmup_linear``'s with the same ``k``. Keras' ``CosineDecay`` and Hugging
    Face's ``get_cosine_schedule_with_warmup`` give step ``t`` the rate ``f(t - 1)`` (they read
    the number of updates already applied: step 1 at rate 0); docs/framework-differences.md.
    """
    k, d, m = schedule["warmup_steps"], schedule["decay_steps"], schedule["min_lr"]
    if t <= k:
        return lr * t / k
    if t >= k + d:
        return m
    return m + (lr - m) * (1.0 + math.cos(math.pi * (t - k) / d)) / 2.0


def keras_cosine_lr(schedule: dict, lr: float, t: int) -> float:
    """What ``keras.optimizers.schedules.CosineDecay(0.0, d, alpha=m / lr, warmup_target=lr, warmup_steps=k)``
    gives at step ``t``: its formula at ``iterations = t - 1``, in float32.

    Keras 3.15 (``keras/src/optimizers/schedules/learning_rate_schedule.py``, ``CosineDecay.__call__``):
    ``initial_learning_rate`` 0.0 makes every tensor float32 (under either floatx); with
    ``s = min(iterations, d + k)``: ``s < k``: ``(lr - 0) * (s / k) + 0``; else
    ``lr * ((1 - alpha) * 0.5 * (1 + cos(pi * ((s - k) / d))) + alpha)``, where ``1 - alpha``,
    ``0.5`` and ``alpha`` are Python floats rounded to float32. The cosine here is the float32
    rounding of the exact cosine of the float32 argument; TensorFlow's float32 ``cos`` kernel is
    not correctly rounded (measured: 14 of 1,372 arguments one float32 ulp apart, and its scalar
    and vectorised paths disagree), so this is Keras' rate to within one float32 rounding, not bit
    for bit: the judge never maps a side onto Keras' ``CosineDecay`` (``theory.mapping_changes``).
    """
    f = np.float32
    k, d = schedule["warmup_steps"], schedule["decay_steps"]
    alpha = schedule["min_lr"] / lr
    s = min(f(t - 1), f(d) + f(k))
    target = f(lr)
    if s < f(k):
        return float((target - f(0.0)) * (s / f(k)) + f(0.0))
    frac = (s - f(k)) / f(d)
    arg = f(np.pi) * frac
    cos = f(math.cos(float(arg)))
    decayed = f(1.0 - alpha) * (f(0.5) * (f(1.0) + cos)) + f(alpha)
    return float(target * decayed)
