"""Plain-numpy float64 oracles of ``param_mean`` and ``async`` for the polynomial model, written independently of both packages.

The model is the seeds' polynomial regression (``helpers.POLY``): a ``poly``
layer of degree d (features ``[x^d, ..., x, 1]``) and a dense layer without
bias, ``out = F w`` with ``w`` the kernel ``[d+1, 1]``; the loss of a shard of
n rows is ``mean((F w - y)^2)`` and its gradient ``2 F^T (F w - y) / n``.

The combine rules are stated here from ``docs/combine-rules.md``, not taken
from ``tfpar`` or ``torchref``; optimizers are torch's published rules
(``sgd``, ``momentum``, ``adam``), stepped one gradient at a time.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["NpOptimizer", "shards", "weights", "poly_loss_grad", "orders", "np_param_mean", "np_async"]


class NpOptimizer:
    """torch's sgd / momentum / adam, one step at a time (state: buffers and the step count t)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec, self.t = spec, 0
        self.m: np.ndarray | None = None
        self.v: np.ndarray | None = None

    def step(self, p: np.ndarray, g: np.ndarray) -> np.ndarray:
        s, lr = self.spec, self.spec["lr"]
        self.t += 1
        if s["name"] == "sgd":
            return p - lr * g
        if s["name"] == "momentum":
            self.m = g.copy() if self.m is None else s["momentum"] * self.m + g
            return p - lr * self.m
        if s["name"] == "adam":
            b1, b2, eps, t = s["beta1"], s["beta2"], s["epsilon"], self.t
            self.m = (1 - b1) * g if self.m is None else b1 * self.m + (1 - b1) * g
            self.v = (1 - b2) * g * g if self.v is None else b2 * self.v + (1 - b2) * g * g
            return p - (lr / (1 - b1**t)) * self.m / (np.sqrt(self.v) / np.sqrt(1 - b2**t) + eps)
        raise ValueError(s["name"])


def shards(batch: int, n: int, shard: str) -> list[np.ndarray]:
    """Row indices of each device's shard: ``np.array_split`` order or rows r, r+n, ..."""
    if shard == "contiguous":
        return np.array_split(np.arange(batch), n)
    return [np.arange(r, batch, n) for r in range(n)]


def weights(rows: list[np.ndarray], weighting: str) -> list[float]:
    batch = sum(len(ix) for ix in rows)
    return [1.0 / len(rows)] * len(rows) if weighting == "equal" else [len(ix) / batch for ix in rows]


def poly_loss_grad(w: np.ndarray, x: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray]:
    """``mean((F w - y)^2)`` and its gradient; ``x``: ``[n]``, ``y``: ``[n, 1]``, ``w``: ``[d+1, 1]``."""
    d = w.shape[0] - 1
    f = np.stack([x**k for k in range(d, -1, -1)], axis=1)  # [n, d+1]
    err = f @ w - y
    return float(np.mean(err**2)), 2.0 * f.T @ err / len(x)


def orders(n: int, steps: int, seed: int) -> list[list[int]]:
    """Step k's application order: the k-th ``permutation(n)`` of one ``default_rng(seed)``."""
    rng = np.random.default_rng(seed)
    return [[int(d) for d in rng.permutation(n)] for _ in range(steps)]


def _setup(case) -> tuple[dict, np.ndarray, np.ndarray, np.ndarray, list[np.ndarray], list[float]]:
    spec = case.spec
    par = spec["parallel"]
    (name,) = case.init  # the kernel of the dense layer: the model's only parameter
    rows = shards(spec["data"]["global_batch"], par["devices"], par["shard"])
    return spec, case.init[name].astype(np.float64), np.asarray(case.x, np.float64), np.asarray(case.y, np.float64), rows, weights(rows, par["weighting"])


def np_param_mean(case) -> tuple[np.ndarray, np.ndarray]:
    """``(loss [steps], kernel [steps+1, d+1, 1])`` of a validated POLY case with ``combine: param_mean``."""
    spec, w0, x, y, rows, w = _setup(case)
    n, period, batch = spec["parallel"]["devices"], spec["parallel"]["period"], spec["data"]["global_batch"]
    copies = [w0.copy() for _ in range(n)]
    opts = [NpOptimizer(spec["optimizer"]) for _ in range(n)]
    params, losses = [w0.copy()], []
    for k in range(spec["steps"]):
        loss = 0.0
        for r in range(n):
            ix = k * batch + rows[r]
            l_r, g_r = poly_loss_grad(copies[r], x[ix], y[ix])
            loss += w[r] * l_r
            copies[r] = opts[r].step(copies[r], g_r)  # own optimizer, own state, never averaged
        mean = sum(w[r] * copies[r] for r in range(n))
        if (k + 1) % period == 0:
            copies = [mean.copy() for _ in range(n)]
        params.append(mean)
        losses.append(loss)
    return np.asarray(losses), np.stack(params)


def np_async(case) -> tuple[np.ndarray, np.ndarray]:
    """``(loss [steps], kernel [steps+1, d+1, 1])`` of a validated POLY case with ``combine: async``."""
    spec, theta, x, y, rows, w = _setup(case)
    par = spec["parallel"]
    n, s, batch = par["devices"], par["staleness"], spec["data"]["global_batch"]
    opt = NpOptimizer(spec["optimizer"])
    params, losses = [theta.copy()], []
    for k, order in enumerate(orders(n, spec["steps"], par["order_seed"])):
        versions = [theta.copy()]  # theta_{k,0}, theta_{k,1}, ...
        loss = 0.0
        for j, r in enumerate(order):
            ix = k * batch + rows[r]
            l_r, g_r = poly_loss_grad(versions[max(0, j - s)], x[ix], y[ix])
            loss += w[r] * l_r
            theta = opt.step(theta, n * w[r] * g_r)
            versions.append(theta.copy())
        params.append(theta.copy())
        losses.append(loss)
    return np.asarray(losses), np.stack(params)
