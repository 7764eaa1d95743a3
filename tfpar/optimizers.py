"""Optimizers for the tower engine: Keras' own classes, or an exact update rule.

``semantics`` (from the case):

``native``
    Keras' own optimizer class (``keras.optimizers.SGD`` / ``Adam``) with the
    case's nominal hyperparameters: what a TensorFlow user runs.

    .. warning:: In a float64 run Keras 3 rounds some hyperparameters to
       float32 (measured: the rule below with these roundings reproduces Keras
       to the last bit): ``learning_rate`` lives in a float32 variable, and
       ``ops.cast(python_float, float64)`` passes through float32, which rounds
       ``momentum`` and the betas *inside Adam's bias correction*; ``1 - beta``
       and ``epsilon`` enter as weakly typed Python floats and stay exact.
       ``semantics: tf`` computes Keras' formula with every hyperparameter exact.
``tf``
    Keras' published rule, written out here and computed entirely in the case
    dtype (hyperparameters included).
``torch``
    torch's published rule (``torch.optim``), written out here in TensorFlow
    ops, computed in the case dtype.

The rules (g: the combined gradient, t: the step, counting from 1):

sgd (both):
    p <- p - lr g
momentum, torch:
    b <- mu b + g  (b = g at t = 1);  p <- p - lr b
momentum, tf (Keras):
    v <- mu v - lr g;  p <- p + v
    (equal to torch's for a constant lr, since v = -lr b; they differ once lr changes)
adam, torch:
    m <- b1 m + (1-b1) g;  v <- b2 v + (1-b2) g^2
    p <- p - (lr / (1-b1^t)) m / (sqrt(v) / sqrt(1-b2^t) + eps)
adam, tf (Keras):
    m <- m + (g-m)(1-b1);  v <- v + (g^2-v)(1-b2)
    p <- p - lr sqrt(1-b2^t)/(1-b1^t) m / (sqrt(v) + eps)

.. warning:: Adam's epsilon: torch adds eps to the bias-corrected sqrt(v_hat);
   Keras adds it to the uncorrected sqrt(v), which equals torch's rule with
   eps_torch = eps / sqrt(1-b2^t). The two differ most in the first steps and
   for small gradients.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import keras
import tensorflow as tf

__all__ = ["Optimizer", "make_optimizer", "KerasOptimizer", "SGDRule", "MomentumRule", "AdamRule"]


class Optimizer(Protocol):
    """What the tower engine needs: build slots once, then apply combined gradients."""

    def build(self, variables: Sequence[tf.Variable]) -> None: ...

    def apply(self, grads: Sequence[tf.Tensor], variables: Sequence[tf.Variable]) -> None: ...


class KerasOptimizer:
    """A Keras optimizer class used as it is (``native`` semantics)."""

    def __init__(self, opt: keras.optimizers.Optimizer) -> None:
        self.opt = opt

    def build(self, variables: Sequence[tf.Variable]) -> None:
        self.opt.build(list(variables))

    def apply(self, grads: Sequence[tf.Tensor], variables: Sequence[tf.Variable]) -> None:
        self.opt.apply_gradients(zip(grads, variables, strict=True))


class _Rule:
    """Base for exact rules: slots are variables of the parameter's dtype, beside it."""

    slot_names: tuple[str, ...] = ()

    def build(self, variables: Sequence[tf.Variable]) -> None:
        self.slots: dict[str, list[tf.Variable]] = {}
        for s in self.slot_names:
            lst = []
            for v in variables:
                with tf.device(v.device):
                    lst.append(tf.Variable(tf.zeros_like(v), trainable=False, name=f"{s}_{v.name.split(':')[0]}"))
            self.slots[s] = lst
        with tf.device(variables[0].device):
            self.t = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")

    def apply(self, grads: Sequence[tf.Tensor], variables: Sequence[tf.Variable]) -> None:
        self.t.assign_add(1)
        for i, (g, v) in enumerate(zip(grads, variables, strict=True)):
            self._update(i, tf.cast(g, v.dtype), v)

    def _c(self, value: float, v: tf.Variable) -> tf.Tensor:
        # hyperparameters become constants of the variable's dtype: exact in float64
        return tf.constant(value, dtype=v.dtype)

    def _update(self, i: int, g: tf.Tensor, v: tf.Variable) -> None:
        raise NotImplementedError


class SGDRule(_Rule):
    """``p <- p - lr g`` (identical in both frameworks)."""

    def __init__(self, lr: float) -> None:
        self.lr = lr

    def _update(self, i, g, v):
        v.assign_sub(self._c(self.lr, v) * g)


class MomentumRule(_Rule):
    """Heavy-ball momentum in torch's (``b <- mu b + g; p -= lr b``) or Keras' (``v <- mu v - lr g; p += v``) form."""

    slot_names = ("momentum",)

    def __init__(self, lr: float, momentum: float, semantics: str) -> None:
        self.lr, self.mu, self.semantics = lr, momentum, semantics

    def _update(self, i, g, v):
        s = self.slots["momentum"][i]
        lr, mu = self._c(self.lr, v), self._c(self.mu, v)
        if self.semantics == "torch":
            # torch starts the buffer at g itself; mu*0 + g is the same number
            s.assign(mu * s + g)
            v.assign_sub(lr * s)
        else:
            s.assign(s * mu - g * lr)
            v.assign_add(s)


class AdamRule(_Rule):
    """Adam in torch's or Keras' formulation (see the module docstring for both formulas)."""

    slot_names = ("m", "v")

    def __init__(self, lr: float, beta1: float, beta2: float, epsilon: float, semantics: str) -> None:
        self.lr, self.b1, self.b2, self.eps, self.semantics = lr, beta1, beta2, epsilon, semantics

    def _update(self, i, g, v):
        m, s = self.slots["m"][i], self.slots["v"][i]
        t = tf.cast(self.t, v.dtype)
        b1, b2 = self._c(self.b1, v), self._c(self.b2, v)
        one = self._c(1.0, v)
        bc1 = one - tf.pow(b1, t)
        bc2 = one - tf.pow(b2, t)
        if self.semantics == "torch":
            # torch: exp_avg.lerp_(g, 1-b1) == m + (1-b1)(g-m); exp_avg_sq.mul_(b2).addcmul_(g, g, 1-b2)
            m.assign(m + self._c(1.0 - self.b1, v) * (g - m))
            s.assign(s * b2 + self._c(1.0 - self.b2, v) * g * g)
            denom = tf.sqrt(s) / tf.sqrt(bc2) + self._c(self.eps, v)
            v.assign_sub((self._c(self.lr, v) / bc1) * (m / denom))
        else:
            m.assign_add((g - m) * self._c(1.0 - self.b1, v))
            s.assign_add((tf.square(g) - s) * self._c(1.0 - self.b2, v))
            alpha = self._c(self.lr, v) * tf.sqrt(bc2) / bc1
            v.assign_sub((m * alpha) / (tf.sqrt(s) + self._c(self.eps, v)))


def make_optimizer(spec: dict[str, Any]) -> Optimizer:
    """Build the optimizer a validated case's ``optimizer`` section asks for."""
    name, sem, lr = spec["name"], spec["semantics"], spec["lr"]
    if sem == "native":
        if name == "sgd":
            return KerasOptimizer(keras.optimizers.SGD(learning_rate=lr))
        if name == "momentum":
            return KerasOptimizer(keras.optimizers.SGD(learning_rate=lr, momentum=spec["momentum"]))
        if name == "adam":
            return KerasOptimizer(
                keras.optimizers.Adam(learning_rate=lr, beta_1=spec["beta1"], beta_2=spec["beta2"], epsilon=spec["epsilon"])
            )
    else:
        if name == "sgd":
            return SGDRule(lr)
        if name == "momentum":
            return MomentumRule(lr, spec["momentum"], sem)
        if name == "adam":
            return AdamRule(lr, spec["beta1"], spec["beta2"], spec["epsilon"], sem)
    raise ValueError(f"unknown optimizer {name!r} with semantics {sem!r}")
