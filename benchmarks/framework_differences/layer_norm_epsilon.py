"""Row "LayerNormalization / nn.LayerNorm defaults": Keras' epsilon 1e-3 against torch's 1e-5.

    .venv/bin/python benchmarks/framework_differences/layer_norm_epsilon.py

Code paths (installed versions):
  Keras 3.15  keras/src/layers/normalization/layer_normalization.py:108  ``epsilon=1e-3``;
              call() -> keras/src/ops/nn.py:3137 ``_layer_normalization``: ``moments`` then
              ``rsqrt(variance + epsilon)`` (nn.py:3185-3187), in at least float32.
  torch 2.13  torch/nn/modules/normalization.py:191  ``eps: float = 1e-5`` -> ``F.layer_norm``.

Both normalise with the biased variance ``v`` of the row, so with ``z = (x - mean) / sqrt(v)``
    y_tf - y_torch = z * (1 / sqrt(1 + 1e-3 / v) - 1 / sqrt(1 + 1e-5 / v))      (gamma 1, beta 0)
exactly: the gap is ``|z| c(v)`` with ``c(1) = 4.95e-4`` and ``c(1e-3) = 0.288``. It vanishes
when the epsilons are equal (the mapping: set ``epsilon`` on one side; issue 27 makes
``layer_norm.epsilon`` required). Measured on rows of variance 1, 1e-2 and 1e-3, both frameworks'
default layer classes in float32, and again with torch's ``eps=1e-3`` (the mapping).
"""

from __future__ import annotations

import numpy as np
from _common import max_abs, on_side, result

D = 64
VARIANCES = (1.0, 1e-2, 1e-3)


def inputs() -> np.ndarray:
    rng = np.random.default_rng(0)
    rows = [np.sqrt(v) * rng.standard_normal((8, D)) + 0.5 for v in VARIANCES]
    return np.stack(rows).astype(np.float32)  # [len(VARIANCES), 8, D]


def keras_side(x: np.ndarray) -> dict:
    import keras
    from _common import versions_tf

    layer = keras.layers.LayerNormalization()  # default epsilon
    return {"y": np.asarray(layer(x)), "epsilon": layer.epsilon, **versions_tf()}


def torch_side(x: np.ndarray, eps: float | None) -> dict:
    import torch
    from _common import versions_torch

    layer = torch.nn.LayerNorm(D) if eps is None else torch.nn.LayerNorm(D, eps=eps)
    with torch.no_grad():
        y = layer(torch.from_numpy(x)).numpy()
    return {"y": y, "eps": layer.eps, **versions_torch()}


def predicted(x: np.ndarray, e_tf: float, e_torch: float) -> np.ndarray:
    """The closed form above, in float64."""
    x = x.astype(np.float64)
    v = x.var(axis=-1, keepdims=True)
    z = (x - x.mean(axis=-1, keepdims=True)) / np.sqrt(v)
    return z * (1 / np.sqrt(1 + e_tf / v) - 1 / np.sqrt(1 + e_torch / v))


def main() -> None:
    x = inputs()
    k = on_side(keras_side, x)
    t = on_side(torch_side, x, None)
    t_mapped = on_side(torch_side, x, k["epsilon"])
    print(f"keras {k['keras']} LayerNormalization epsilon={k['epsilon']}; torch {t['torch']} nn.LayerNorm eps={t['eps']}")
    gaps = {}
    for i, v in enumerate(VARIANCES):
        gap = max_abs(k["y"][i], t["y"][i])
        pred = predicted(x[i], k["epsilon"], t["eps"])
        err = max_abs(k["y"][i] - t["y"][i], pred)
        c = 1 / np.sqrt(1 + t["eps"] / v) - 1 / np.sqrt(1 + k["epsilon"] / v)
        mapped = max_abs(k["y"][i], t_mapped["y"][i])
        gaps[v] = gap
        print(
            f"variance {v:g}: max|y_keras - y_torch| = {gap:.3g} (max |z| {np.abs(pred / c).max():.2f}, "
            f"c(v) = {c:.3g}); closed form off by {err:.2g}; with torch eps = {k['epsilon']:g}: {mapped:.2g}"
        )
    result(
        "layer_norm epsilon",
        True,
        f"|z| x 4.9e-4 (variance 1) to |z| x 0.29 (variance 1e-3); max over {x[0].size} N(0,1) "
        f"rows: {gaps[1.0]:.2g}, {gaps[1e-3]:.2g}",
        "epsilons equal",
        "layer_norm.epsilon on both sides (required field)",
    )


if __name__ == "__main__":
    main()
