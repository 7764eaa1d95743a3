"""Plain-numpy float64 statements of every update rule, written independently of both packages.

These are the tests' own oracle: each framework's optimizer (native class or
exact rule) must reproduce them step by step. The tables at the end
(:data:`OPTIMIZER_TABLE`, :data:`DIFFERENCES`, :data:`CLIP_TABLE`) are what
``docs/optimizers.md`` is generated from (``python -m parity_tests.reporting.docs_optimizers``)
and what the tests iterate over, so the page and the tests cannot drift apart.

Step numbering: ``t`` counts optimizer steps from 1; the learning rate of step
``t`` is ``np_lr(schedule, lr, t)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "f32",
    "np_lr",
    "np_update",
    "np_clip",
    "clip_then_mean",
    "gap",
    "typical_case",
    "KERAS_FLOAT32",
    "OptimizerRow",
    "OPTIMIZER_TABLE",
    "Difference",
    "DIFFERENCES",
    "ClipRow",
    "CLIP_TABLE",
    "TYPICAL_HP",
]


def f32(v: float) -> float:
    """``v`` rounded to float32 (and back to a Python float)."""
    return float(np.float32(v))


# ---------------------------------------------------------------- schedules


def np_lr(schedule: dict | None, lr: float, t: int, *, keras_float32: bool = False) -> float:
    """The learning rate of step ``t`` (``t = 1, 2, ...``).

    constant: ``lr``; step: ``values[i]`` with ``i`` the number of boundaries
    ``b < t`` (steps ``1..b0`` use ``values[0]``); warmup_linear: ``lr * min(1, t / k)``;
    warmup_cosine: :func:`_np_cosine`.

    ``keras_float32=True``: what native Keras computes. A float ``learning_rate``
    lives in a float32 variable; ``PiecewiseConstantDecay`` converts its values
    to float32 tensors; the warmup schedule (tfpar's ``WarmupLinear``, written
    like Keras' own schedules) computes in float32.
    """
    kind = (schedule or {"kind": "constant"})["kind"]
    if kind == "constant":
        return f32(lr) if keras_float32 else lr
    if kind == "step":
        i = sum(1 for b in schedule["boundaries"] if b < t)
        v = schedule["values"][i]
        return f32(v) if keras_float32 else v
    if kind == "warmup_linear":
        k = schedule["warmup_steps"]
        if keras_float32:
            frac = np.minimum(np.float32(1.0), np.float32(t) / np.float32(k))
            return float(np.float32(lr) * frac)
        return lr * min(1.0, t / k)
    if kind == "warmup_cosine":
        return _np_cosine(schedule, lr, t, keras_float32)
    raise ValueError(kind)


def _np_cosine(schedule: dict, lr: float, t: int, keras_float32: bool) -> float:
    """``warmup_cosine``: linear to ``lr`` at step ``k``, a half cosine to ``min_lr`` at step ``k + d``, then flat.

    ``keras_float32``: Keras' ``CosineDecay(0.0, d, alpha=min_lr/lr, warmup_target=lr, warmup_steps=k)``,
    which evaluates the same curve at ``iterations = t - 1`` in float32 arithmetic (its cosine
    within one float32 rounding of TensorFlow's kernel).
    """
    k, d, m = schedule["warmup_steps"], schedule["decay_steps"], schedule["min_lr"]
    if not keras_float32:
        x = min(float(t), float(k + d))
        if x <= k:
            return lr * x / k
        return m + 0.5 * (lr - m) * (1.0 + np.cos(np.pi * (x - k) / d))
    f = np.float32
    x = min(f(t - 1), f(k) + f(d))
    if x < k:
        return float(f(lr) * (x / f(k)))
    c = f(np.cos(np.float64(f(np.pi) * ((x - f(k)) / f(d)))))
    alpha = m / lr
    return float(f(lr) * (f(1.0 - alpha) * (f(0.5) * (f(1.0) + c)) + f(alpha)))


# ---------------------------------------------------------------- update rules

# What Keras 3 rounds to float32 in a float64 run, per optimizer (found by
# experiment: with exactly these roundings the oracle reproduces Keras to
# ~1e-16; leaving any one out moves it by > 1e-11). ``lr`` is always rounded
# (a float32 variable, or a float32 schedule). ``ops.cast(python_float, float64)``
# passes through float32, which is how ``momentum`` (SGD), the weight decay and
# the betas *inside Adam's bias correction* get rounded; operands that enter as
# Python floats (``1 - beta``, ``epsilon``, RMSprop's ``rho`` and ``momentum``)
# stay exact. Adagrad's initial accumulator goes through
# ``initializers.Constant``, i.e. ``ops.cast(0.1, float64)``: rounded.
KERAS_FLOAT32: dict[str, tuple[str, ...]] = {
    "sgd": ("lr", "weight_decay"),
    "momentum": ("lr", "momentum", "weight_decay"),
    "nesterov": ("lr", "momentum", "weight_decay"),
    "adam": ("lr", "bias_correction_betas", "weight_decay"),
    "amsgrad": ("lr", "bias_correction_betas", "weight_decay"),
    "adamw": ("lr", "bias_correction_betas", "weight_decay"),
    "rmsprop": ("lr", "weight_decay"),
    "adagrad": ("lr", "initial_accumulator", "weight_decay"),
}


def np_update(name: str, semantics: str, hp: dict, p0: np.ndarray, grads: Sequence[np.ndarray], *,
              keras_float32: bool = False) -> list[np.ndarray]:
    """Parameters after each step, ``[steps][*shape]``. ``semantics`` is ``torch`` or ``tf``.

    ``hp`` uses the case's names (``lr``, ``momentum``, ``beta1``, ``beta2``,
    ``epsilon``, ``weight_decay``, ``rho``, ``centered``, ``initial_accumulator``,
    ``schedule``). ``keras_float32=True`` (with ``semantics="tf"``) models what
    Keras 3 really does in a float64 run: see :data:`KERAS_FLOAT32`.
    """
    p = np.asarray(p0, dtype=np.float64).copy()
    rounded = KERAS_FLOAT32[name] if keras_float32 else ()

    def hpv(key: str, default: Any = None) -> Any:
        v = hp.get(key, default)
        return f32(v) if key in rounded and v is not None else v

    sched = hp.get("schedule")
    wd = hpv("weight_decay", 0.0)
    mu = hpv("momentum", 0.0)
    b1, b2, eps = hp.get("beta1"), hp.get("beta2"), hp.get("epsilon")
    cb1 = f32(b1) if "bias_correction_betas" in rounded else b1
    cb2 = f32(b2) if "bias_correction_betas" in rounded else b2
    m = np.zeros_like(p)
    v = np.zeros_like(p)
    vmax = np.zeros_like(p)
    if name == "adagrad":
        v = np.full_like(p, hpv("initial_accumulator"))
    out = []
    for t, g in enumerate(grads, start=1):
        g = np.asarray(g, dtype=np.float64)
        lr = np_lr(sched, hp["lr"], t, keras_float32="lr" in rounded)
        # weight decay: torch adds wd*p to the gradient (L2), except AdamW, which
        # scales p by 1 - lr*wd; Keras always decays p by p*wd*lr before the update
        if wd:
            if semantics == "torch" and name == "adamw":
                p = p * (1 - lr * wd)
            elif semantics == "torch":
                g = g + wd * p
            else:
                p = p - p * wd * lr
        if name == "sgd":
            p = p - lr * g
        elif name in ("momentum", "nesterov") and semantics == "torch":
            m = g.copy() if t == 1 else mu * m + g  # torch's buffer starts at g
            p = p - lr * (g + mu * m if name == "nesterov" else m)
        elif name in ("momentum", "nesterov"):
            m = mu * m - lr * g  # Keras' velocity holds lr
            p = p + (mu * m - lr * g if name == "nesterov" else m)
        elif name in ("adam", "amsgrad", "adamw"):
            if semantics == "torch":
                m = b1 * m + (1 - b1) * g
                v = b2 * v + (1 - b2) * g * g
            else:
                m = m + (g - m) * (1 - b1)
                v = v + (g * g - v) * (1 - b2)
            vv = v
            if name == "amsgrad":
                vmax = np.maximum(vmax, v)  # both frameworks: the max of the uncorrected v
                vv = vmax
            if semantics == "torch":
                p = p - (lr / (1 - b1**t)) * m / (np.sqrt(vv) / np.sqrt(1 - b2**t) + eps)
            else:
                p = p - m * (lr * np.sqrt(1 - cb2**t) / (1 - cb1**t)) / (np.sqrt(vv) + eps)
        elif name == "rmsprop":
            rho, centered = hp["rho"], hp.get("centered", False)
            v = rho * v + (1 - rho) * g * g
            if centered and semantics == "torch":
                m = m + (1 - rho) * (g - m)  # torch: grad_avg.lerp_(g, 1 - alpha)
            elif centered:
                m = rho * m + (1 - rho) * g
            if semantics == "torch":
                den = np.sqrt(v - m * m if centered else v) + eps  # eps outside the sqrt
                if mu:
                    vmax = mu * vmax + g / den  # torch's momentum buffer: no lr inside
                    p = p - lr * vmax
                else:
                    p = p - lr * g / den
            else:
                inc = lr * g / np.sqrt((v - m * m if centered else v) + eps)  # eps inside
                if mu:
                    vmax = mu * vmax + inc  # Keras' momentum holds lr
                    p = p - vmax
                else:
                    p = p - inc
        elif name == "adagrad":
            v = v + g * g
            if semantics == "torch":
                p = p - lr * g / (np.sqrt(v) + eps)
            else:
                p = p - lr * g / np.sqrt(v + eps)
        else:
            raise ValueError(name)
        out.append(p.copy())
    return out


# ---------------------------------------------------------------- clipping


def np_clip(grads: Sequence[np.ndarray], c: float, semantics: str) -> list[np.ndarray]:
    """Clip a list of arrays by their global L2 norm ``n = sqrt(sum_i ||g_i||^2)``.

    torch (``clip_grad_norm_``): ``g * min(c / (n + 1e-6), 1)``;
    tf (``tf.clip_by_global_norm``): ``g * c / max(n, c)``.
    """
    n = float(np.sqrt(sum(float(np.sum(np.square(g))) for g in grads)))
    scale = min(c / (n + 1e-6), 1.0) if semantics == "torch" else c / max(n, c)
    return [np.asarray(g) * scale for g in grads]


def clip_then_mean(device_grads: Sequence[Sequence[np.ndarray]], c: float, semantics: str) -> list[np.ndarray]:
    """Per-device clipping, then the plain mean over devices: ``(1/N) sum_r clip(g_r)``."""
    clipped = [np_clip(gs, c, semantics) for gs in device_grads]
    return [np.mean([cl[i] for cl in clipped], axis=0) for i in range(len(device_grads[0]))]


# ---------------------------------------------------------------- measuring


def gap(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> float:
    """Greatest per-step normwise relative gap ``max_t ||a_t - b_t||_inf / ||b_t||_inf``.

    The comparator's metric (:func:`parity_tests.judging.compare.relative_gap`), over steps.
    """
    from parity_tests.judging.compare import relative_gap

    return float(np.max(relative_gap(np.stack(a), np.stack(b))))


def typical_case() -> tuple[np.ndarray, list[np.ndarray]]:
    """The fixed small case every rule is measured on: ``p0 [3, 4]`` and 6 gradients ``[3, 4]``.

    Varied signs and scales; small gradients (1e-3, 1e-4) make epsilon placement visible.
    """
    rng = np.random.default_rng(0)
    p0 = rng.normal(size=(3, 4))
    grads = [rng.normal(size=(3, 4)) * s for s in (1.0, 1e-3, 0.5, 1e-4, 2.0, 0.3)]
    return p0, grads


# ---------------------------------------------------------------- tables (the docs page is built from these)

# Hyperparameters of the typical case (case names). Every value is a float32
# number (a dyadic fraction or a float32-rounded value) where that makes native
# Keras reproducible in float64; the rest are the common defaults.
TYPICAL_HP: dict[str, dict[str, Any]] = {
    "sgd": {"lr": 0.01},
    "momentum": {"lr": 0.01, "momentum": 0.9},
    "nesterov": {"lr": 0.01, "momentum": 0.9},
    "adam": {"lr": 0.01, "beta1": 0.9, "beta2": 0.999, "epsilon": 1e-7},
    "amsgrad": {"lr": 0.01, "beta1": 0.9, "beta2": 0.999, "epsilon": 1e-7},
    "adamw": {"lr": 0.01, "beta1": 0.9, "beta2": 0.999, "epsilon": 1e-7, "weight_decay": 0.01},
    "rmsprop": {"lr": 0.01, "rho": 0.9, "epsilon": 1e-7, "momentum": 0.0, "centered": False},
    "adagrad": {"lr": 0.01, "initial_accumulator": 0.1, "epsilon": 1e-7},
}


@dataclass(frozen=True)
class OptimizerRow:
    """One optimizer: its formula on each side, its defaults, its classes.

    ``torch_defaults`` / ``tf_defaults`` are the case defaults under ``torch`` /
    ``tf`` (and ``native``) semantics, in case names; the tests check them against
    both ``parity_tests.contract.optimizer`` and the installed classes' signatures.
    """

    name: str
    hyperparameters: tuple[str, ...]
    torch_class: str
    keras_class: str
    torch_formula: str
    tf_formula: str
    torch_defaults: dict[str, Any] = field(default_factory=dict)
    tf_defaults: dict[str, Any] = field(default_factory=dict)
    mapping: str = ""


OPTIMIZER_TABLE: tuple[OptimizerRow, ...] = (
    OptimizerRow(
        "sgd", ("weight_decay",), "torch.optim.SGD", "keras.optimizers.SGD",
        "p <- p - lr g",
        "p <- p - lr g",
        {"weight_decay": 0.0}, {"weight_decay": 0.0},
        "identical rules",
    ),
    OptimizerRow(
        "momentum", ("momentum", "weight_decay"), "torch.optim.SGD(momentum=mu)", "keras.optimizers.SGD(momentum=mu)",
        "b <- mu b + g (b = g at t = 1); p <- p - lr b",
        "v <- mu v - lr g; p <- p + v",
        {"momentum": 0.9, "weight_decay": 0.0}, {"momentum": 0.9, "weight_decay": 0.0},
        "equal for a constant lr (v = -lr b); they differ once lr changes: semantics torch or tf",
    ),
    OptimizerRow(
        "nesterov", ("momentum", "weight_decay"), "torch.optim.SGD(momentum=mu, nesterov=True)",
        "keras.optimizers.SGD(momentum=mu, nesterov=True)",
        "b <- mu b + g (b = g at t = 1); p <- p - lr (g + mu b)",
        "v <- mu v - lr g; p <- p + mu v - lr g",
        {"momentum": 0.9, "weight_decay": 0.0}, {"momentum": 0.9, "weight_decay": 0.0},
        "equal for a constant lr; they differ once lr changes: semantics torch or tf",
    ),
    OptimizerRow(
        "adam", ("beta1", "beta2", "epsilon", "weight_decay"), "torch.optim.Adam", "keras.optimizers.Adam",
        "m <- b1 m + (1-b1) g; v <- b2 v + (1-b2) g^2; p <- p - lr/(1-b1^t) m / (sqrt(v)/sqrt(1-b2^t) + eps)",
        "m <- m + (g-m)(1-b1); v <- v + (g^2-v)(1-b2); p <- p - lr sqrt(1-b2^t)/(1-b1^t) m / (sqrt(v) + eps)",
        {"beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8, "weight_decay": 0.0},
        {"beta1": 0.9, "beta2": 0.999, "epsilon": 1e-7, "weight_decay": 0.0},
        "Keras' rule is torch's with eps_torch = eps / sqrt(1-b2^t), a different value each step: "
        "no constant maps one onto the other; semantics torch or tf",
    ),
    OptimizerRow(
        "amsgrad", ("beta1", "beta2", "epsilon", "weight_decay"), "torch.optim.Adam(amsgrad=True)",
        "keras.optimizers.Adam(amsgrad=True)",
        "as adam with v_max <- max(v_max, v) in place of v (the uncorrected v)",
        "as adam with v_hat <- max(v_hat, v) in place of v (the uncorrected v)",
        {"beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8, "weight_decay": 0.0},
        {"beta1": 0.9, "beta2": 0.999, "epsilon": 1e-7, "weight_decay": 0.0},
        "the max rule is the same (both take the max of the uncorrected second moment); "
        "epsilon placement differs as in adam: semantics torch or tf",
    ),
    OptimizerRow(
        "adamw", ("beta1", "beta2", "epsilon", "weight_decay"), "torch.optim.AdamW", "keras.optimizers.AdamW",
        "p <- p (1 - lr wd); then adam",
        "p <- p - p wd lr; then adam",
        {"beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8, "weight_decay": 0.01},
        {"beta1": 0.9, "beta2": 0.999, "epsilon": 1e-7, "weight_decay": 0.004},
        "the decoupled decay is the same; epsilon placement differs as in adam: semantics torch or tf",
    ),
    OptimizerRow(
        "rmsprop", ("rho", "epsilon", "centered", "momentum", "weight_decay"),
        "torch.optim.RMSprop(alpha=rho)", "keras.optimizers.RMSprop",
        "v <- rho v + (1-rho) g^2; [a <- a + (1-rho)(g-a)]; d = sqrt(v [- a^2]) + eps; "
        "b <- mu b + g/d; p <- p - lr b (mu = 0: p <- p - lr g/d)",
        "v <- rho v + (1-rho) g^2; [a <- rho a + (1-rho) g]; s = lr g / sqrt(v [- a^2] + eps); "
        "m <- mu m + s; p <- p - m (mu = 0: p <- p - s)",
        {"rho": 0.99, "epsilon": 1e-8, "centered": False, "momentum": 0.0, "weight_decay": 0.0},
        {"rho": 0.9, "epsilon": 1e-7, "centered": False, "momentum": 0.0, "weight_decay": 0.0},
        "epsilon inside (Keras) vs outside (torch) the sqrt, no constant maps one onto the other; "
        "with momentum, Keras' buffer holds lr: semantics torch or tf",
    ),
    OptimizerRow(
        "adagrad", ("initial_accumulator", "epsilon", "weight_decay"), "torch.optim.Adagrad",
        "keras.optimizers.Adagrad",
        "s <- s + g^2 (s0 = initial_accumulator); p <- p - lr g / (sqrt(s) + eps)",
        "s <- s + g^2 (s0 = initial_accumulator); p <- p - lr g / sqrt(s + eps)",
        {"initial_accumulator": 0.0, "epsilon": 1e-10, "weight_decay": 0.0},
        {"initial_accumulator": 0.1, "epsilon": 1e-7, "weight_decay": 0.0},
        "epsilon inside (Keras) vs outside (torch) the sqrt: semantics torch or tf",
    ),
)


@dataclass(frozen=True)
class Difference:
    """One difference between the frameworks' native optimizers, measured on :func:`typical_case`.

    Side A follows torch's rule and side B Keras' rule (``np_update``), with the
    same nominal hyperparameters ``hp`` (``name`` picks the optimizer); the
    tests assert the gap is above ``min_gap`` and that the real native classes show it.
    """

    key: str
    name: str
    hp: dict[str, Any]
    what: str
    keras_float32: bool = False  # side B is native Keras in float64 against the exact Keras rule
    # the gap the tests require: 1e-9 (four orders above float64 noise), or the judge's own
    # float64 bound 1e-10 for a difference that is real but small on the typical case
    min_gap: float = 1e-9

    def measure(self) -> float:
        p0, grads = typical_case()
        if self.keras_float32:
            return gap(np_update(self.name, "tf", self.hp, p0, grads, keras_float32=True),
                       np_update(self.name, "tf", self.hp, p0, grads))
        return gap(np_update(self.name, "torch", self.hp, p0, grads), np_update(self.name, "tf", self.hp, p0, grads))


_STEP = {"kind": "step", "boundaries": [2, 4], "values": [0.01, 0.005, 0.0025]}

DIFFERENCES: tuple[Difference, ...] = (
    Difference("adam-epsilon", "adam", TYPICAL_HP["adam"],
               "Adam epsilon placement: Keras adds eps to sqrt(v), torch to sqrt(v)/sqrt(1-b2^t)"),
    Difference("amsgrad-epsilon", "amsgrad", TYPICAL_HP["amsgrad"], "AMSGrad epsilon placement (as Adam)"),
    Difference("adamw-epsilon", "adamw", TYPICAL_HP["adamw"], "AdamW epsilon placement (as Adam; the decay agrees)"),
    Difference("rmsprop-epsilon", "rmsprop", TYPICAL_HP["rmsprop"],
               "RMSprop epsilon: Keras sqrt(v + eps), torch sqrt(v) + eps"),
    Difference("rmsprop-centered-epsilon", "rmsprop", dict(TYPICAL_HP["rmsprop"], centered=True),
               "centered RMSprop epsilon: Keras sqrt(v - a^2 + eps), torch sqrt(v - a^2) + eps"),
    Difference("rmsprop-momentum-schedule", "rmsprop",
               dict(TYPICAL_HP["rmsprop"], momentum=0.9, epsilon=1e-30, schedule=_STEP),
               "RMSprop momentum: Keras' buffer holds lr, torch's does not (differs once lr changes; "
               "epsilon made negligible to isolate it)"),
    Difference("adagrad-epsilon", "adagrad", dict(TYPICAL_HP["adagrad"], initial_accumulator=0.0),
               "Adagrad epsilon: Keras sqrt(s + eps), torch sqrt(s) + eps (accumulator from 0, torch's default)"),
    Difference("adagrad-epsilon-keras-start", "adagrad", TYPICAL_HP["adagrad"],
               "Adagrad epsilon with Keras' initial accumulator 0.1: the same difference, much smaller",
               min_gap=1e-10),
    Difference("momentum-schedule", "momentum", dict(TYPICAL_HP["momentum"], schedule=_STEP),
               "momentum: Keras' velocity holds lr, torch's buffer does not (differs once lr changes)"),
    Difference("nesterov-schedule", "nesterov", dict(TYPICAL_HP["nesterov"], schedule=_STEP),
               "Nesterov momentum: Keras' velocity holds lr (differs once lr changes)"),
    Difference("momentum-weight-decay", "momentum", dict(TYPICAL_HP["momentum"], weight_decay=0.01),
               "weight decay on momentum: torch L2 in the gradient (enters the buffer), Keras decoupled"),
    Difference("adam-weight-decay", "adam", dict(TYPICAL_HP["adam"], epsilon=1e-30, weight_decay=0.01),
               "weight decay on Adam: torch L2 (normalised by sqrt(v)), Keras decoupled "
               "(epsilon made negligible to isolate it)"),
    Difference("rmsprop-weight-decay", "rmsprop", dict(TYPICAL_HP["rmsprop"], epsilon=1e-30, weight_decay=0.01),
               "weight decay on RMSprop: torch L2, Keras decoupled (epsilon made negligible to isolate it)"),
    Difference("adagrad-weight-decay", "adagrad", dict(TYPICAL_HP["adagrad"], epsilon=1e-30, weight_decay=0.01),
               "weight decay on Adagrad: torch L2, Keras decoupled (epsilon made negligible to isolate it)"),
    Difference("keras-float32-adam", "adam", TYPICAL_HP["adam"],
               "native Keras in float64: lr and the bias-correction betas rounded to float32", keras_float32=True),
    Difference("keras-float32-momentum", "momentum", TYPICAL_HP["momentum"],
               "native Keras in float64: lr and momentum rounded to float32", keras_float32=True),
)


@dataclass(frozen=True)
class ClipRow:
    """One clipping rule (``parallel.clip``) and its measured gap on :func:`typical_case`'s gradients."""

    key: str
    torch: str
    tf: str
    what: str


CLIP_TABLE: tuple[ClipRow, ...] = (
    ClipRow("formula",
            "torch.nn.utils.clip_grad_norm_: g * min(c / (norm + 1e-6), 1)",
            "tf.clip_by_global_norm: g * c * min(1/norm, 1/c) = g * c / max(norm, c)",
            "torch adds 1e-6 to the norm: a relative gap of about 1e-6 / norm whenever clipping is active"),
    ClipRow("placement",
            "after_combine: clip_grad_norm_ after DDP's allreduce (the usual torch order)",
            "per_device: tf.clip_by_global_norm on each tower's gradients, then average (the classic tower order)",
            "clipping each device's gradient then averaging is not clipping the average; "
            "with one device the two are the same"),
)
