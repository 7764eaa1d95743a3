"""Rows "GELU" and "GELU in float64": which formula each entry point computes, and TensorFlow's
float32-rounded constant in float64.

    .venv/bin/python benchmarks/framework_differences/gelu.py

Code paths (installed versions):
  Keras 3.15  keras/src/activations/activations.py:338 ``gelu(x, approximate=False)`` (erf; what
              ``Dense(activation="gelu")`` and ``Activation("gelu")`` use);
              keras/src/ops/nn.py:635 ``ops.gelu(x, approximate=True)`` (tanh by default);
              both -> keras/src/backend/tensorflow/nn.py:129 -> ``tf.nn.gelu``.
  TF 2.21     tensorflow/python/ops/nn_ops.py:3705 ``tf.nn.gelu(approximate=False)``:
              erf form ``0.5 x erfc(-x * math_ops.cast(0.7071067811865476, dtype))`` (line 3755);
              tanh form ``coeff = math_ops.cast(0.044715, dtype)`` (line 3747).
              ``math_ops.cast`` of a Python float converts it to a float32 tensor first, so in
              float64 the constants are float32's: 1/sqrt(2) becomes 0.70710676908493042.
  torch 2.13  ``F.gelu(x, approximate="none")`` (erf, exact constant), ``approximate="tanh"``.
  Note: ``keras.layers.Activation("gelu")`` fed float64 computes in float32 (the layer's dtype
  policy is float32 unless ``keras.config.set_floatx("float64")``): 5.7e-7 from the exact form.

Closed forms:
  erf vs tanh: ``max_x |gelu_erf(x) - gelu_tanh(x)|`` (a property of the two formulas).
  float64 constant: ``f(x) = x/2 erfc(-c x)`` has ``df/dc = x^2 exp(-c^2 x^2) / sqrt(pi)``, at most
  ``2 / (e sqrt(pi)) = 0.415`` (at x = sqrt 2), so the gap is ``0.415 |fl32(c) - c| = 0.415 x
  1.21e-8 = 5.0e-9``. It vanishes in float32 (both sides use the float32 constant) and for
  ``semantics: torch`` (exact constant on the TensorFlow side).
"""

from __future__ import annotations

import math

import numpy as np
from _common import max_abs, on_side, result

X = np.arange(-8.0, 8.0, 1e-3)
TORCH_TANH = "F.gelu(approximate='tanh')"


def tf_side() -> dict:
    import keras
    import tensorflow as tf
    from _common import versions_tf

    out = {}
    for dt in ("float32", "float64"):
        x = tf.constant(X, dtype=dt)
        out[dt] = {
            "activations.gelu": keras.activations.gelu(x).numpy(),
            "Dense(activation='gelu')": keras.layers.Dense(1, activation="gelu").activation(x).numpy(),
            "Activation('gelu')": keras.layers.Activation("gelu")(x).numpy(),
            "ops.gelu": keras.ops.gelu(x).numpy(),
            "tf.nn.gelu": tf.nn.gelu(x).numpy(),
            "tf.nn.gelu(approximate=True)": tf.nn.gelu(x, approximate=True).numpy(),
        }
    c = tf.cast(0.7071067811865476, tf.float64).numpy()
    return {"out": out, "c_cast": float(c), **versions_tf()}


def torch_side() -> dict:
    import torch
    import torch.nn.functional as F
    from _common import versions_torch

    out = {}
    for dt in (torch.float32, torch.float64):
        x = torch.from_numpy(X).to(dt)
        out[str(dt).split(".")[1]] = {
            "F.gelu": F.gelu(x).numpy(),
            TORCH_TANH: F.gelu(x, approximate="tanh").numpy(),
        }
    return {"out": out, **versions_torch()}


def exact_erf(x: np.ndarray) -> np.ndarray:
    return np.array([0.5 * v * math.erfc(-v / math.sqrt(2.0)) for v in x])


def exact_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def main() -> None:
    tf_r = on_side(tf_side)
    to_r = on_side(torch_side)
    erf64, tanh64 = exact_erf(X), exact_tanh(X)
    print(f"keras {tf_r['keras']}, tensorflow {tf_r['tensorflow']}, torch {to_r['torch']}; x in [-8, 8) step 1e-3")
    print("which formula (float64, distance to the exact erf form / the exact tanh form):")
    for side in (tf_r, to_r):
        for name, y in side["out"]["float64"].items():
            print(f"  {name:32s} erf {max_abs(y, erf64):8.2g}   tanh {max_abs(y, tanh64):8.2g}")
    formula_gap = max_abs(erf64, tanh64)
    at = X[np.argmax(np.abs(erf64 - tanh64))]
    print(f"max |gelu_erf - gelu_tanh| = {formula_gap:.3g} at x = {at:.3f} (exact formulas, float64)")
    k32 = tf_r["out"]["float32"]
    t32 = to_r["out"]["float32"]
    native = max_abs(k32["ops.gelu"], t32["F.gelu"])
    print(f"float32: keras.ops.gelu vs F.gelu {native:.3g}; activations.gelu vs F.gelu "
          f"{max_abs(k32['activations.gelu'], t32['F.gelu']):.2g}; ops.gelu vs F.gelu(tanh) "
          f"{max_abs(k32['ops.gelu'], t32[TORCH_TANH]):.2g}")
    k64 = tf_r["out"]["float64"]
    t64 = to_r["out"]["float64"]
    g_erf = max_abs(k64["tf.nn.gelu"], t64["F.gelu"])
    g_tanh = max_abs(k64["tf.nn.gelu(approximate=True)"], t64[TORCH_TANH])
    c = 1 / math.sqrt(2)
    pred = 2 / (math.e * math.sqrt(math.pi)) * abs(tf_r["c_cast"] - c)
    print(f"float64: tf.nn.gelu vs F.gelu {g_erf:.3g} (closed form {pred:.3g}; tf vs exact "
          f"{max_abs(k64['tf.nn.gelu'], erf64):.2g}, torch vs exact {max_abs(t64['F.gelu'], erf64):.2g})")
    print(f"float64: tanh forms {g_tanh:.2g}; tf.cast(0.7071067811865476, float64) = {tf_r['c_cast']!r} "
          f"(off by {tf_r['c_cast'] - c:.3g})")
    result(
        "gelu erf vs tanh",
        True,
        f"{formula_gap:.2g} (max over x, at x = {at:.2f})",
        "same formula on both sides",
        "activation gelu (erf) / gelu_tanh: torch F.gelu(approximate='tanh') for Keras ops.gelu's default",
    )
    result(
        "gelu float64 constant",
        True,
        f"{g_erf:.2g} (closed form {pred:.2g}); tanh form {g_tanh:.2g}",
        "float32 compute, or exact constants on the TensorFlow side",
        "semantics tf or torch on the layer; framework bug (examples/framework-bugs/tf_gelu_float64_constant.py)",
    )


if __name__ == "__main__":
    main()
