"""Optimizers, learning-rate schedules and gradient clipping for the tower engine.

``semantics`` (from the case):

``native``
    Keras' own optimizer class (``keras.optimizers.SGD`` / ``Adam`` / ``AdamW``
    / ``RMSprop`` / ``Adagrad``) with the case's nominal hyperparameters, and a
    Keras ``LearningRateSchedule`` for a schedule: what a TensorFlow user runs.

    .. warning:: In a float64 run Keras 3 rounds some hyperparameters to
       float32 (measured: the rules below with these roundings reproduce Keras
       to ~1e-16): ``learning_rate`` lives in a float32 variable (Keras'
       schedules compute in float32 too), and ``ops.cast(python_float, float64)``
       passes through float32, which rounds SGD's ``momentum``, ``weight_decay``,
       Adagrad's initial accumulator and the betas *inside Adam's bias
       correction*. ``1 - beta``, ``epsilon`` and RMSprop's ``rho`` and
       ``momentum`` enter as weakly typed Python floats and stay exact.
       ``semantics: tf`` computes Keras' formula with every hyperparameter exact.
``tf``
    Keras' published rule, written out here and computed entirely in the case
    dtype (hyperparameters included).
``torch``
    torch's published rule (``torch.optim``), written out here in TensorFlow
    ops, computed in the case dtype.

The rules (g: the combined gradient, t: the step counting from 1, lr: the
learning rate of step t, see :func:`schedule_lr`):

weight decay (wd), applied first:
    torch: ``g <- g + wd p`` (L2), except adamw: ``p <- p (1 - lr wd)``;
    tf (Keras, every optimizer): ``p <- p - p wd lr``.
sgd (both):
    ``p <- p - lr g``
momentum / nesterov, torch:
    ``b <- mu b + g`` (``b = g`` at t = 1); ``p <- p - lr b`` / ``p <- p - lr (g + mu b)``
momentum / nesterov, tf (Keras):
    ``v <- mu v - lr g``; ``p <- p + v`` / ``p <- p + mu v - lr g``
adam / amsgrad / adamw, torch:
    ``m <- b1 m + (1-b1) g;  v <- b2 v + (1-b2) g^2``  (amsgrad: ``v <- max(v_max, v)``)
    ``p <- p - (lr / (1-b1^t)) m / (sqrt(v) / sqrt(1-b2^t) + eps)``
adam / amsgrad / adamw, tf (Keras):
    ``m <- m + (g-m)(1-b1);  v <- v + (g^2-v)(1-b2)``  (amsgrad: ``v <- max(v_hat, v)``)
    ``p <- p - lr sqrt(1-b2^t)/(1-b1^t) m / (sqrt(v) + eps)``
rmsprop, torch (``alpha`` = rho):
    ``s <- rho s + (1-rho) g^2``; centered: ``a <- a + (1-rho)(g-a)``, ``d = sqrt(s - a^2) + eps``,
    else ``d = sqrt(s) + eps``; momentum mu > 0: ``b <- mu b + g/d; p <- p - lr b``, else ``p <- p - lr g/d``
rmsprop, tf (Keras):
    ``s <- rho s + (1-rho) g^2``; centered: ``a <- rho a + (1-rho) g``, ``u = lr g / sqrt(s - a^2 + eps)``,
    else ``u = lr g / sqrt(s + eps)``; mu > 0: ``m <- mu m + u; p <- p - m``, else ``p <- p - u``
adagrad (``s`` starts at ``initial_accumulator``):
    torch: ``s <- s + g^2; p <- p - lr g / (sqrt(s) + eps)``;
    tf: ``s <- s + g^2; p <- p - lr g / sqrt(s + eps)``

.. warning:: Where TensorFlow (Keras) and torch differ:

   * Adam/AMSGrad/AdamW epsilon: torch adds eps to the bias-corrected
     sqrt(v)/sqrt(1-b2^t), Keras to the uncorrected sqrt(v) (Keras' rule is
     torch's with eps_torch = eps / sqrt(1-b2^t), a different value each step);
   * RMSprop and Adagrad epsilon: inside the sqrt in Keras, outside in torch;
   * momentum, Nesterov and RMSprop momentum: Keras' velocity holds lr, torch's
     buffer does not: equal for a constant lr, different once lr changes;
   * weight decay: Keras decouples it on every optimizer, torch adds it to the
     gradient except in AdamW (plain SGD is the same either way);
   * defaults: RMSprop rho 0.9 (Keras) vs alpha 0.99 (torch), epsilons 1e-7 vs
     1e-8 (Adam, RMSprop) and 1e-10 (Adagrad), Adagrad's initial accumulator
     0.1 vs 0, AdamW's weight decay 0.004 vs 0.01.

Gradient clipping by global norm ``n = sqrt(sum_i ||g_i||^2)`` (:func:`clip_by_global_norm`):
``tf.clip_by_global_norm`` scales by ``c / max(n, c)``; torch's
``clip_grad_norm_`` by ``min(c / (n + 1e-6), 1)``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import keras
import tensorflow as tf

from parity_tests.protocol.optimizer_state import no_decay_names, slot_names

__all__ = [
    "Optimizer",
    "make_optimizer",
    "KerasOptimizer",
    "WarmupLinear",
    "keras_schedule",
    "schedule_lr",
    "SGDRule",
    "MomentumRule",
    "AdamRule",
    "RMSpropRule",
    "AdagradRule",
    "GradientClip",
    "clip_by_global_norm",
    "make_clip",
    "export_state",
    "load_state",
]


class Optimizer(Protocol):
    """What the tower engine needs: build slots once, then apply combined gradients."""

    def build(self, variables: Sequence[tf.Variable]) -> None: ...

    def apply(self, grads: Sequence[tf.Tensor], variables: Sequence[tf.Variable]) -> None: ...


class KerasOptimizer:
    """A Keras optimizer class used as it is (``native`` semantics).

    ``names`` (canonical, in the order :meth:`build` gets the variables) and ``exclude`` (those of
    ``optimizer.no_decay``): the excluded variables are handed to Keras'
    ``exclude_from_weight_decay(var_list=...)`` before the build, as a Keras user excludes them.
    """

    def __init__(self, opt: keras.optimizers.Optimizer, names: Sequence[str] | None = None,
                 exclude: frozenset[str] = frozenset()) -> None:
        self.opt, self.names, self.exclude = opt, names, exclude

    def build(self, variables: Sequence[tf.Variable]) -> None:
        variables = list(variables)
        if self.exclude:
            self.opt.exclude_from_weight_decay(
                var_list=[v for n, v in zip(self.names, variables, strict=True) if n in self.exclude])
        self.opt.build(variables)

    def apply(self, grads: Sequence[tf.Tensor], variables: Sequence[tf.Variable]) -> None:
        self.opt.apply_gradients(zip(grads, variables, strict=True))


# ---------------------------------------------------------------- schedules


class WarmupLinear(keras.optimizers.schedules.LearningRateSchedule):
    """Linear warm-up: ``lr * min(1, t / k)`` for step ``t = iterations + 1``.

    Keras calls a schedule with ``iterations``, the number of updates already
    applied (0 at the first step), so step ``t`` is ``iterations + 1``: the
    first step uses ``lr / k``, never 0. Computed in float32, like Keras'
    built-in schedules (which convert their Python-float arguments to float32
    tensors). No built-in fits: ``CosineDecay``'s warm-up starts at its
    initial rate at iteration 0.
    """

    def __init__(self, lr: float, warmup_steps: int) -> None:
        self.lr = lr
        self.warmup_steps = warmup_steps

    def __call__(self, step: tf.Tensor) -> tf.Tensor:
        t = tf.cast(step, tf.float32) + 1.0
        frac = tf.minimum(tf.constant(1.0, tf.float32), t / tf.constant(float(self.warmup_steps), tf.float32))
        return tf.constant(self.lr, tf.float32) * frac

    def get_config(self) -> dict[str, Any]:
        return {"lr": self.lr, "warmup_steps": self.warmup_steps}


def keras_schedule(schedule: Mapping[str, Any], lr: float) -> float | keras.optimizers.schedules.LearningRateSchedule:
    """The ``learning_rate`` argument a Keras optimizer gets for a normalised case schedule.

    ``step`` maps onto ``PiecewiseConstantDecay`` with every boundary minus one:
    Keras switches to ``values[i+1]`` when ``iterations > boundaries[i]``, and
    the case's boundary ``b`` means "steps 1..b use the old value", i.e.
    ``iterations = t - 1 >= b``, i.e. ``iterations > b - 1``.

    ``warmup_cosine`` is Keras' own ``CosineDecay(0.0, d, alpha=min_lr / lr, warmup_target=lr,
    warmup_steps=k)``, as a Keras user writes it (``alpha`` is a fraction of the target).

    .. warning:: ``CosineDecay`` is the case's schedule *one step late*: it reads ``iterations``
       (0 at the first update), so step ``t`` runs at the contract's rate of step ``t - 1``
       (step 1 at 0, ``lr`` first at step ``k + 1``, ``min_lr`` from step ``k + d + 1``), in
       float32 (``protocol.hyper.keras_cosine_lr``, Keras 3.15
       ``keras/src/optimizers/schedules/learning_rate_schedule.py``). A predicted difference
       against torch (docs/framework-differences.md); the exact rules use the contract's rate.
    """
    kind = schedule["kind"]
    if kind == "constant":
        return lr
    if kind == "step":
        return keras.optimizers.schedules.PiecewiseConstantDecay(
            [b - 1 for b in schedule["boundaries"]], list(schedule["values"])
        )
    if kind == "warmup_linear":
        return WarmupLinear(lr, schedule["warmup_steps"])
    if kind == "warmup_cosine":
        return keras.optimizers.schedules.CosineDecay(
            0.0, schedule["decay_steps"], alpha=schedule["min_lr"] / lr, warmup_target=lr,
            warmup_steps=schedule["warmup_steps"])
    raise ValueError(f"unknown schedule kind {kind!r}")


def schedule_lr(schedule: Mapping[str, Any], lr: float, t: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
    """The learning rate of step ``t`` (int64 scalar, counting from 1), exact in ``dtype``.

    constant: ``lr``; step: ``values[i]``, ``i`` = the number of boundaries ``b < t``;
    warmup_linear: ``lr * min(1, t / k)``; warmup_cosine (``protocol.hyper.cosine_lr``):
    ``lr t / k`` for ``t <= k``, ``m + (lr - m)(1 + cos(pi (t - k) / d)) / 2`` for ``k < t < k + d``,
    ``m`` from ``t = k + d`` on.
    """
    kind = schedule["kind"]
    if kind == "constant":
        return tf.constant(lr, dtype)
    if kind == "warmup_cosine":
        k, d, m = schedule["warmup_steps"], schedule["decay_steps"], schedule["min_lr"]
        tt = tf.cast(t, dtype)
        c = lambda v: tf.constant(v, dtype)  # noqa: E731
        warm = c(lr) * tt / c(float(k))
        frac = (tt - c(float(k))) / c(float(d))
        cosine = c(m) + (c(lr) - c(m)) * (c(1.0) + tf.cos(c(math.pi) * frac)) / c(2.0)
        return tf.where(t <= k, warm, tf.where(t >= k + d, c(m), cosine))
    if kind == "step":
        i = tf.reduce_sum(tf.cast(t > tf.constant(schedule["boundaries"], tf.int64), tf.int32))
        return tf.gather(tf.constant(schedule["values"], dtype), i)
    if kind == "warmup_linear":
        frac = tf.cast(t, dtype) / tf.constant(float(schedule["warmup_steps"]), dtype)
        return tf.constant(lr, dtype) * tf.minimum(tf.constant(1.0, dtype), frac)
    raise ValueError(f"unknown schedule kind {kind!r}")


# ---------------------------------------------------------------- exact rules


class _Rule:
    """Base for exact rules: slots are variables of the parameter's dtype, beside it.

    Args:
        lr: the base learning rate; schedule: a normalised case schedule.
        weight_decay: applied as the semantics says (module docstring).
        semantics: ``torch`` or ``tf``.
        decoupled_torch: torch's decay is decoupled (AdamW) rather than L2.
    """

    slot_names: tuple[str, ...] = ()

    def __init__(self, lr: float, semantics: str, *, schedule: Mapping[str, Any] | None = None,
                 weight_decay: float = 0.0, decoupled_torch: bool = False, names: Sequence[str] | None = None,
                 exclude: frozenset[str] = frozenset()) -> None:
        if semantics not in ("torch", "tf"):
            raise ValueError(f"an exact rule needs semantics torch or tf, got {semantics!r}")
        self.lr, self.semantics = lr, semantics
        self.schedule = dict(schedule or {"kind": "constant"})
        self.wd, self.decoupled_torch = weight_decay, decoupled_torch
        # optimizer.no_decay: the variables (by canonical name, in build order) that take no weight decay
        self.names, self.exclude = names, exclude

    def _slot_init(self, name: str, v: tf.Variable) -> tf.Tensor:
        return tf.zeros_like(v)

    def build(self, variables: Sequence[tf.Variable]) -> None:
        self.slots: dict[str, list[tf.Variable]] = {}
        for s in self.slot_names:
            lst = []
            for v in variables:
                with tf.device(v.device):
                    lst.append(tf.Variable(self._slot_init(s, v), trainable=False, name=f"{s}_{v.name.split(':')[0]}"))
            self.slots[s] = lst
        with tf.device(variables[0].device):
            self.t = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
        names = self.names if self.names is not None else [None] * len(variables)
        self.decays = [n not in self.exclude for n in names]

    def apply(self, grads: Sequence[tf.Tensor], variables: Sequence[tf.Variable]) -> None:
        self.t.assign_add(1)
        # an embedding's IndexedSlices made dense (duplicates summed): the exact rule is the formula on G
        grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
        for i, (g, v) in enumerate(zip(grads, variables, strict=True)):
            g = tf.cast(g, v.dtype)
            lr = schedule_lr(self.schedule, self.lr, self.t, v.dtype)
            if self.wd and self.decays[i]:
                wd = self._c(self.wd, v)
                if self.semantics == "torch" and self.decoupled_torch:
                    v.assign(v * (self._c(1.0, v) - lr * wd))
                elif self.semantics == "torch":
                    g = g + wd * v
                else:
                    v.assign_sub(v * wd * lr)
            self._update(i, g, v, lr)

    def _c(self, value: float, v: tf.Variable) -> tf.Tensor:
        # hyperparameters become constants of the variable's dtype: exact in float64
        return tf.constant(value, dtype=v.dtype)

    def _update(self, i: int, g: tf.Tensor, v: tf.Variable, lr: tf.Tensor) -> None:
        raise NotImplementedError


class SGDRule(_Rule):
    """``p <- p - lr g`` (identical in both frameworks)."""

    def _update(self, i, g, v, lr):
        v.assign_sub(lr * g)


class MomentumRule(_Rule):
    """Heavy-ball or Nesterov momentum in torch's or Keras' form (module docstring)."""

    slot_names = ("momentum",)

    def __init__(self, lr: float, momentum: float, semantics: str, *, nesterov: bool = False, **kw: Any) -> None:
        super().__init__(lr, semantics, **kw)
        self.mu, self.nesterov = momentum, nesterov

    def _update(self, i, g, v, lr):
        s = self.slots["momentum"][i]
        mu = self._c(self.mu, v)
        if self.semantics == "torch":
            # torch starts the buffer at g itself; mu*0 + g is the same number
            s.assign(mu * s + g)
            v.assign_sub(lr * (g + mu * s) if self.nesterov else lr * s)
        else:
            s.assign(s * mu - g * lr)
            v.assign_add(s * mu - g * lr if self.nesterov else s)


class AdamRule(_Rule):
    """Adam (or AMSGrad) in torch's or Keras' formulation (module docstring)."""

    slot_names = ("m", "v", "v_max")

    def __init__(self, lr: float, beta1: float, beta2: float, epsilon: float, semantics: str, *,
                 amsgrad: bool = False, **kw: Any) -> None:
        super().__init__(lr, semantics, **kw)
        self.b1, self.b2, self.eps, self.amsgrad = beta1, beta2, epsilon, amsgrad

    def _update(self, i, g, v, lr):
        m, s, smax = self.slots["m"][i], self.slots["v"][i], self.slots["v_max"][i]
        t = tf.cast(self.t, v.dtype)
        b1, b2 = self._c(self.b1, v), self._c(self.b2, v)
        one = self._c(1.0, v)
        bc1 = one - tf.pow(b1, t)
        bc2 = one - tf.pow(b2, t)
        if self.semantics == "torch":
            # torch: exp_avg.lerp_(g, 1-b1) == m + (1-b1)(g-m); exp_avg_sq.mul_(b2).addcmul_(g, g, 1-b2)
            m.assign(m + self._c(1.0 - self.b1, v) * (g - m))
            s.assign(s * b2 + self._c(1.0 - self.b2, v) * g * g)
        else:
            m.assign_add((g - m) * self._c(1.0 - self.b1, v))
            s.assign_add((tf.square(g) - s) * self._c(1.0 - self.b2, v))
        second = s
        if self.amsgrad:
            # both frameworks keep the max of the *uncorrected* second moment
            smax.assign(tf.maximum(smax, s))
            second = smax
        if self.semantics == "torch":
            denom = tf.sqrt(second) / tf.sqrt(bc2) + self._c(self.eps, v)
            v.assign_sub((lr / bc1) * (m / denom))
        else:
            alpha = lr * tf.sqrt(bc2) / bc1
            v.assign_sub((m * alpha) / (tf.sqrt(second) + self._c(self.eps, v)))


class RMSpropRule(_Rule):
    """RMSprop (optionally centered, with momentum) in torch's or Keras' form (module docstring)."""

    slot_names = ("square_avg", "grad_avg", "momentum")

    def __init__(self, lr: float, rho: float, epsilon: float, semantics: str, *, centered: bool = False,
                 momentum: float = 0.0, **kw: Any) -> None:
        super().__init__(lr, semantics, **kw)
        self.rho, self.eps, self.centered, self.mu = rho, epsilon, centered, momentum

    def _update(self, i, g, v, lr):
        sq, avg, buf = self.slots["square_avg"][i], self.slots["grad_avg"][i], self.slots["momentum"][i]
        rho, one_m = self._c(self.rho, v), self._c(1.0 - self.rho, v)
        eps = self._c(self.eps, v)
        if self.semantics == "torch":
            sq.assign(sq * rho + one_m * g * g)  # square_avg.mul_(alpha).addcmul_(g, g, value=1 - alpha)
        else:
            sq.assign(rho * sq + one_m * tf.square(g))
        if self.semantics == "torch":
            if self.centered:
                avg.assign(avg + one_m * (g - avg))  # grad_avg.lerp_(g, 1 - alpha)
                d = tf.sqrt(sq - avg * avg) + eps
            else:
                d = tf.sqrt(sq) + eps
            if self.mu:
                buf.assign(self._c(self.mu, v) * buf + g / d)
                v.assign_sub(lr * buf)
            else:
                v.assign_sub(lr * g / d)
        else:
            if self.centered:
                avg.assign(rho * avg + one_m * g)
                inc = lr * g / tf.sqrt(sq - tf.square(avg) + eps)
            else:
                inc = lr * g / tf.sqrt(sq + eps)
            if self.mu:
                buf.assign(self._c(self.mu, v) * buf + inc)
                v.assign_sub(buf)
            else:
                v.assign_sub(inc)


class AdagradRule(_Rule):
    """Adagrad in torch's (eps outside the sqrt) or Keras' (inside) form."""

    slot_names = ("accumulator",)

    def __init__(self, lr: float, initial_accumulator: float, epsilon: float, semantics: str, **kw: Any) -> None:
        super().__init__(lr, semantics, **kw)
        self.init_acc, self.eps = initial_accumulator, epsilon

    def _slot_init(self, name, v):
        return tf.fill(tf.shape(v), tf.constant(self.init_acc, v.dtype))

    def _update(self, i, g, v, lr):
        acc = self.slots["accumulator"][i]
        acc.assign_add(g * g)
        if self.semantics == "torch":
            v.assign_sub(lr * g / (tf.sqrt(acc) + self._c(self.eps, v)))
        else:
            v.assign_sub(lr * g / tf.sqrt(acc + self._c(self.eps, v)))


def _keras(spec: Mapping[str, Any]) -> keras.optimizers.Optimizer:
    name = spec["name"]
    lr = keras_schedule(spec["schedule"], spec["lr"])
    # None, not 0.0: Keras skips the decay pass entirely for None (AdamW keeps its value)
    wd = spec["weight_decay"] or None
    if name in ("sgd", "momentum", "nesterov"):
        return keras.optimizers.SGD(learning_rate=lr, momentum=spec.get("momentum", 0.0),
                                    nesterov=name == "nesterov", weight_decay=wd)
    if name in ("adam", "amsgrad"):
        return keras.optimizers.Adam(learning_rate=lr, beta_1=spec["beta1"], beta_2=spec["beta2"],
                                     epsilon=spec["epsilon"], amsgrad=name == "amsgrad", weight_decay=wd)
    if name == "adamw":
        return keras.optimizers.AdamW(learning_rate=lr, weight_decay=spec["weight_decay"], beta_1=spec["beta1"],
                                      beta_2=spec["beta2"], epsilon=spec["epsilon"])
    if name == "rmsprop":
        return keras.optimizers.RMSprop(learning_rate=lr, rho=spec["rho"], momentum=spec["momentum"],
                                        epsilon=spec["epsilon"], centered=spec["centered"], weight_decay=wd)
    if name == "adagrad":
        return keras.optimizers.Adagrad(learning_rate=lr, initial_accumulator_value=spec["initial_accumulator"],
                                        epsilon=spec["epsilon"], weight_decay=wd)
    raise ValueError(f"unknown optimizer {name!r}")


def make_optimizer(spec: Mapping[str, Any], names: Sequence[str] | None = None) -> Optimizer:
    """Build the optimizer a validated case's ``optimizer`` section asks for.

    ``names``: the canonical names of the variables :meth:`Optimizer.build` will get, in its order;
    needed when the section has ``no_decay`` (those parameters take no weight decay: Keras'
    ``exclude_from_weight_decay`` under ``native``, a mask in the exact rules).
    """
    name, sem, lr = spec["name"], spec["semantics"], spec["lr"]
    exclude = frozenset()
    if spec.get("no_decay"):
        if names is None:
            raise ValueError("optimizer.no_decay needs the parameter names: make_optimizer(spec, names)")
        exclude = no_decay_names(spec, names)
    if sem == "native":
        return KerasOptimizer(_keras(spec), names, exclude)
    rounding = spec.get("keras_rounding", "none")
    if rounding != "none":
        # Keras' rule with Keras' own float32 roundings: Keras' own class, made under that floatx
        # (its learning-rate variable takes the floatx of its construction; contract.optimizer.keras_float32)
        floatx = keras.config.floatx()
        keras.config.set_floatx("float32" if rounding == "floatx_float32" else "float64")
        try:
            return KerasOptimizer(_keras(spec), names, exclude)
        finally:
            keras.config.set_floatx(floatx)
    kw = {"schedule": spec.get("schedule"), "weight_decay": spec.get("weight_decay", 0.0),
          "decoupled_torch": name == "adamw", "names": names, "exclude": exclude}
    if name == "sgd":
        return SGDRule(lr, sem, **kw)
    if name in ("momentum", "nesterov"):
        return MomentumRule(lr, spec["momentum"], sem, nesterov=name == "nesterov", **kw)
    if name in ("adam", "amsgrad", "adamw"):
        return AdamRule(lr, spec["beta1"], spec["beta2"], spec["epsilon"], sem, amsgrad=name == "amsgrad", **kw)
    if name == "rmsprop":
        return RMSpropRule(lr, spec["rho"], spec["epsilon"], sem, centered=spec["centered"],
                           momentum=spec["momentum"], **kw)
    if name == "adagrad":
        return AdagradRule(lr, spec["initial_accumulator"], spec["epsilon"], sem, **kw)
    raise ValueError(f"unknown optimizer {name!r} with semantics {sem!r}")


# ---------------------------------------------------------------- clipping


def clip_by_global_norm(grads: Sequence[tf.Tensor], clip_norm: float, semantics: str) -> list[tf.Tensor]:
    """Scale ``grads`` so that their global L2 norm is at most ``clip_norm``.

    Args:
        grads: tensors of any shapes (one dtype).
        clip_norm: ``c > 0``.
        semantics: ``torch``: torch's ``clip_grad_norm_`` rule,
            ``g * min(c / (n + 1e-6), 1)`` with ``n`` the norm of the per-tensor
            norms; otherwise (``tf``, ``native``) ``tf.clip_by_global_norm``
            itself, ``g * c * min(1/n, 1/c)``.
    Returns:
        the clipped tensors, same shapes.

    .. warning:: torch adds 1e-6 to the norm: when clipping is active the two
       rules differ by about ``1e-6 / n`` relative.
    """
    grads = list(grads)
    if semantics != "torch":
        return list(tf.clip_by_global_norm(grads, clip_norm)[0])
    grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
    dtype = grads[0].dtype
    norm = tf.norm(tf.stack([tf.norm(tf.reshape(g, [-1])) for g in grads]))
    coef = tf.minimum(tf.constant(clip_norm, dtype) / (norm + tf.constant(1e-6, dtype)), tf.constant(1.0, dtype))
    return [g * coef for g in grads]


@dataclass(frozen=True)
class GradientClip:
    """A case's ``parallel.clip``: clip at ``global_norm``, ``where`` = ``after_combine`` or ``per_device``."""

    global_norm: float
    where: str
    semantics: str

    def __call__(self, grads: Sequence[tf.Tensor]) -> list[tf.Tensor]:
        return clip_by_global_norm(grads, self.global_norm, self.semantics)


def make_clip(spec: Mapping[str, Any]) -> GradientClip | None:
    """The clipping a validated case asks for (``None``: no clipping)."""
    clip = spec["parallel"].get("clip")
    if clip is None:
        return None
    return GradientClip(clip["global_norm"], clip["where"], spec["optimizer"]["semantics"])


# ---------------------------------------------------------------- optimizer state (lockstep)

#: Keras 3's slot lists by canonical slot name (``native`` semantics): the same quantities as
#: the exact rules' slots of the same name (module docstring), in ``build``'s variable order.
_KERAS_SLOTS = {"momentum": "momentums", "m": "_momentums", "v": "_velocities", "v_max": "_velocity_hats",
                "square_avg": "_velocities", "grad_avg": "_average_gradients", "accumulator": "_accumulators"}


def _slot_vars(opt: Optimizer, slot: str) -> list[tf.Variable]:
    if isinstance(opt, KerasOptimizer):
        return list(getattr(opt.opt, _KERAS_SLOTS[slot]))
    return opt.slots[slot]


def _counter(opt: Optimizer) -> tf.Variable:
    return opt.opt.iterations if isinstance(opt, KerasOptimizer) else opt.t


def export_state(opt: Optimizer, names: Sequence[str], spec: Mapping[str, Any]) -> dict[str, Any]:
    """The optimizer's state after its last update, as plain numpy data.

    Args:
        opt: a built optimizer of :func:`make_optimizer`.
        names: the canonical parameter names, in the order ``opt.build`` got the variables.
        spec: the validated ``optimizer`` section.
    Returns:
        ``{"step": t, "slots": {slot: {name: array}}}``: ``t`` updates applied so far (the
        schedule's position: the next update is step ``t + 1``), slots in canonical (TensorFlow)
        layouts, the parameters' dtype.
    """
    slots = {s: {n: v.numpy() for n, v in zip(names, _slot_vars(opt, s), strict=True)} for s in slot_names(spec)}
    return {"step": int(_counter(opt).numpy()), "slots": slots}


def load_state(opt: Optimizer, names: Sequence[str], spec: Mapping[str, Any], state: Mapping[str, Any] | None) -> None:
    """Set a built optimizer to ``state`` (as :func:`export_state` gives it, in any float dtype).

    ``None`` leaves the fresh state (step 0, slots at their initial values). Every slot
    :func:`slot_names` lists must be given when ``step > 0``.
    """
    if state is None:
        return
    _counter(opt).assign(int(state["step"]))
    for s in slot_names(spec):
        given = state["slots"].get(s)
        if given is None:
            if state["step"]:
                raise ValueError(f"optimizer state at step {state['step']} lacks slot {s!r}")
            continue
        for n, v in zip(names, _slot_vars(opt, s), strict=True):
            v.assign(tf.cast(given[n], v.dtype))
