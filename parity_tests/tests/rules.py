"""Plain-numpy float64 statements of every update rule, written independently of both packages.

These are the tests' own oracle: each framework's optimizer (native class or
exact rule) must reproduce them step by step.
"""

from __future__ import annotations

import numpy as np


def f32(v: float) -> float:
    """``v`` rounded to float32 (and back to a Python float)."""
    return float(np.float32(v))


def np_update(name: str, semantics: str, hp: dict, p0: np.ndarray, grads: list[np.ndarray], *,
              keras_float32: bool = False) -> list[np.ndarray]:
    """Parameters after each step, ``[steps][*shape]``. ``semantics`` is ``torch`` or ``tf``.

    ``keras_float32=True`` models what Keras 3 really does in a float64 run
    (found by experiment, gap 0.0): ``learning_rate`` lives in a float32
    variable, and ``ops.cast(python_float, float64)`` goes through float32, so
    ``momentum`` and the betas *inside Adam's bias correction* are rounded to
    float32, while ``1 - beta`` and ``epsilon`` (weakly typed operands) stay exact.
    """
    p = p0.astype(np.float64).copy()
    lr = f32(hp["lr"]) if keras_float32 else hp["lr"]
    hp = dict(hp)
    if keras_float32 and "momentum" in hp:
        hp["momentum"] = f32(hp["momentum"])
    cb1 = f32(hp["beta1"]) if keras_float32 and "beta1" in hp else hp.get("beta1")
    cb2 = f32(hp["beta2"]) if keras_float32 and "beta2" in hp else hp.get("beta2")
    m = np.zeros_like(p)
    v = np.zeros_like(p)
    out = []
    for t, g in enumerate(grads, start=1):
        if name == "sgd":
            p = p - lr * g
        elif name == "momentum" and semantics == "torch":
            m = hp["momentum"] * m + g  # torch's buffer; starts at g
            p = p - lr * m
        elif name == "momentum":
            m = hp["momentum"] * m - lr * g  # Keras' velocity holds lr
            p = p + m
        elif name == "adam" and semantics == "torch":
            b1, b2, eps = hp["beta1"], hp["beta2"], hp["epsilon"]
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * g * g
            p = p - (lr / (1 - b1**t)) * m / (np.sqrt(v) / np.sqrt(1 - b2**t) + eps)
        elif name == "adam":
            b1, b2, eps = hp["beta1"], hp["beta2"], hp["epsilon"]
            m = m + (g - m) * (1 - b1)
            v = v + (g * g - v) * (1 - b2)
            alpha = lr * np.sqrt(1 - cb2**t) / (1 - cb1**t)
            p = p - m * alpha / (np.sqrt(v) + eps)
        else:
            raise ValueError(name)
        out.append(p.copy())
    return out
