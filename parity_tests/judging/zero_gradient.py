"""Parameters whose exact gradient is zero: judged against the drift rounding can make, not the float64 bound.

**Which** (from the case, no measurement): an ``attention`` layer's key bias ``k.bias``. The logits of
query ``i`` are ``s_ij = q_i . (W_k x_j + b_k) / sqrt(d) = q_i . W_k x_j / sqrt(d) + q_i . b_k / sqrt(d)``;
the second term is the same for every key ``j`` of the row, and softmax ignores a shift shared by a
row, so ``dL/db_k = 0`` exactly (a causal mask drops keys, not the shift of those left; dropout acts
after the softmax). Computed, the gradient ``sum_{b,j} dK_bj`` cancels only up to rounding, different
in every implementation (docs/framework-differences.md, "The attention key bias").

**What Adam makes of it.** An update normalised by the gradient's own size turns that rounding into
steps of full size. Per element, with ``M_t = max_{s<=t} |g_s|`` (the recorded gradients)::

    Adam, AMSGrad, AdamW  |step_t| <= lr_t min(M_t / eps, B_t)
                          B_t = (1-b1) sqrt(1-b2^t) / ((1-b1^t) sqrt(1-b2)) sqrt(sum_{j<t} (b1^2/b2)^j)
    RMSprop               |step_t| <= lr_t sum_{s<=t} mu^(t-s) min(|g_s| / eps', 1/sqrt(1-rho))   (centered: eps' term only)
    Adagrad               |step_t| <= lr_t min(|g_t| / eps', 1)
    SGD, momentum,        |step_t| <= lr_t (1 + mu) sum_{s<=t} mu^(t-s) |g_s|
    Nesterov

``|m_hat| <= M_t`` because ``m_hat`` is a weighted mean of past gradients; ``B_t`` is Cauchy-Schwarz
over Adam's two averages (``|m_hat| / sqrt(v_hat) <= B_t``; ``B_1 = 1``, ``B_4 = 1.0068`` at 0.9,
0.999); RMSprop's ``v_s >= (1-rho) g_s^2`` and Adagrad's ``acc_t >= g_t^2`` bound the ratio by
``1/sqrt(1-rho)`` and 1. ``eps' = min(eps, sqrt(eps))`` covers both placements (torch adds ``eps`` to
the root, Keras' RMSprop and Adagrad put it under the root); Keras' Adam epsilon-hat
``eps / sqrt(1 - b2^t)`` is larger than ``eps``, so ``eps`` bounds both. ``lr_t`` is the larger of the
schedule's float64 rate and Keras' float32 one, the largest so far (Keras' momentum forms accumulate
``lr_s g_s``). AdamW's decoupled decay multiplies both sides' parameter by the same ``1 - lr wd``; each
side's arithmetic on the parameter itself (the decay's product, the update's sum) rounds by at most
``2 u |p|`` a step. Two correct runs therefore part by at most::

    |pA_T - pB_T| <= sum_{t<=T} (|stepA_t| + |stepB_t|) + 4 T u max|p|

elementwise (each step's bound times ``1 + D u`` for the optimizer's own arithmetic on it), from each
side's own recorded gradients (where a side records none, its gradients are
taken at the rounding bound ``gamma_t`` below). In float64 (``eps = 1e-8``) rounding is far below
``eps`` and the bound is ``lr |g| / eps``-sized: 7.2e-12 measured against 4.6e-12 observed after 4
steps of a tiny ViT, where the float64 rule (``1e-10`` of a ``1e-2`` floor: ``1e-12`` absolute) fails.

**Evidence, so a bug still fires.** The exemption holds only while both sides' recorded gradients
of the parameter are at rounding level at every step::

    |g_t| <= gamma_t = D n u G_t

``n`` the terms summed into it (global batch x tokens), ``u = 2^-53``, ``G_t`` the largest gradient
entry of the same layer's other parameters at step ``t`` and ``D = 20`` dependent rounding stages,
the float64 bound's envelope (docs/tolerance.md). Measured: ``|g| <= 2.5e-17`` against
``n u G = 1e-16``. An implementation that makes the key bias matter (a bias not shared by the row's
keys) has a gradient of the size of ``G`` there and is judged by the float64 rule as every other
parameter. A wrong update of the parameter (decayed, stepped twice, not stepped at all while the
other side moves it) parts the sides by far more than the bound, and is a divergence at that
parameter.

Only the float64 rule needs this: under the float32 rule each side's floor ``gap(X32, X64)``
contains its own full-size steps, and ``gap(A32, B32) <= floorA + floorB + gap64`` still holds
(docs/tolerance.md, "Rule 2").
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from parity_tests.contract.attention import attention_layers
from parity_tests.protocol.hyper import keras_lr, lr_at
from parity_tests.protocol.rows import row_norms

__all__ = ["ZeroGradient", "ZeroGradients", "zero_gradients", "ROUNDING_STAGES"]

U64 = 2.0**-53
#: dependent rounding stages of one step: the float64 bound's envelope (``bounds.py``, docs/tolerance.md)
ROUNDING_STAGES = 20


@dataclass(frozen=True)
class ZeroGradient:
    """One parameter whose exact gradient is zero.

    Attributes:
        name: canonical name (``4.body.1.k.bias``).
        why: the reason, one phrase.
        terms: ``n``, the terms summed into its gradient per step (global batch x tokens).
        layer: the canonical names of the same layer's other parameters (``G_t``'s gradients).
    """

    name: str
    why: str
    terms: int
    layer: tuple[str, ...]


@dataclass(frozen=True)
class Check:
    """What :meth:`ZeroGradients.check` found for one pair of float64 runs.

    ``exempt``: the ``param/*`` keys judged here instead of by the float64 rule; ``over``: the first
    exempt key over its bound, as ``(key, row, gap, bound)``, or ``None``; ``lines``: one per exempt key.
    """

    exempt: tuple[str, ...]
    over: tuple[str, int, float, float] | None
    lines: tuple[str, ...]


def _rows(traj: Mapping[str, Any], key: str) -> np.ndarray:
    arr = traj[key]
    return np.stack([np.asarray(arr[i], np.float64) for i in range(len(arr))])


@dataclass(frozen=True)
class ZeroGradients:
    """The case's zero-gradient parameters and the optimizer that moves them (:func:`zero_gradients`)."""

    params: tuple[ZeroGradient, ...]
    optimizer: dict[str, Any]

    def _ratios(self, g: np.ndarray) -> np.ndarray | None:
        """Per step ``t`` (rows of ``g``, ``|g_t|`` elementwise), the bound of ``|step_t| / lr_t``; ``None``: no bound."""
        opt = self.optimizer
        name, eps = opt["name"], float(opt.get("epsilon", 0.0))
        eps1 = min(eps, math.sqrt(eps))
        out = np.empty_like(g)
        if name in ("adam", "amsgrad", "adamw"):
            b1, b2 = opt["beta1"], opt["beta2"]
            running = np.zeros_like(g[0])
            for t in range(len(g)):
                running = np.maximum(running, g[t])
                by_eps = running / eps if eps > 0 else np.full_like(running, np.inf)
                if b2 > 0.0 and b1 < 1.0:
                    s = t + 1
                    bt = ((1 - b1) * math.sqrt(1 - b2**s) / ((1 - b1**s) * math.sqrt(1 - b2))
                          * math.sqrt(sum((b1 * b1 / b2) ** j for j in range(s))))
                    by_eps = np.minimum(by_eps, bt)
                out[t] = by_eps
        elif name == "rmsprop":
            rho, mu = opt["rho"], opt.get("momentum", 0.0)
            own = g / eps1 if eps1 > 0 else np.full_like(g, np.inf)
            if not opt.get("centered") and rho < 1.0:
                own = np.minimum(own, 1.0 / math.sqrt(1.0 - rho))
            buf = np.zeros_like(g[0])
            for t in range(len(g)):
                buf = mu * buf + own[t]
                out[t] = buf
        elif name == "adagrad":
            own = g / eps1 if eps1 > 0 else np.full_like(g, np.inf)
            out = np.minimum(own, 1.0)
        elif name in ("sgd", "momentum", "nesterov"):
            mu = opt.get("momentum", 0.0)
            buf = np.zeros_like(g[0])
            for t in range(len(g)):
                buf = mu * buf + g[t]
                out[t] = (1.0 + mu) * buf
        else:
            return None
        return None if not np.all(np.isfinite(out)) else out

    def _lrs(self, steps: int) -> np.ndarray:
        opt = self.optimizer
        lrs = [max(lr_at(opt["schedule"], opt["lr"], t), keras_lr(opt["schedule"], opt["lr"], t)) for t in range(1, steps + 1)]
        # the largest rate so far: Keras' momentum forms accumulate lr_s g_s, torch's lr_t times the sum
        return np.maximum.accumulate(np.array(lrs))

    def check(self, a: Mapping[str, Any], b: Mapping[str, Any], keys: list[str]) -> Check | None:
        """Judge each zero-gradient parameter among ``keys`` in the float64 runs ``a``, ``b`` (module docstring).

        A parameter is exempt from the float64 rule only where the evidence holds (both sides' recorded
        gradients at rounding level at every step, at least one side recording them); it is then over
        when the two parameters part by more than the drift bound at some step.
        """
        exempt, lines, over = [], [], None
        for z in self.params:
            key = f"param/{z.name}"
            if key not in keys:
                continue
            found = self._one(a, b, z)
            if found is None:
                continue
            (row, gap, bound), glimit, gmax = found
            exempt.append(key)
            ok = gap <= bound
            lines.append(f"{z.name}: exact gradient zero ({z.why}); recorded gradients <= {gmax:.2g} (rounding bound"
                         f" {glimit:.2g}); drift {gap:.2g} {'<=' if ok else '>'} bound {bound:.2g} (at step {row})")
            if not ok and over is None:
                over = (key, row, gap, bound)
        return Check(tuple(exempt), over, tuple(lines)) if exempt else None

    def _one(self, a: Mapping[str, Any], b: Mapping[str, Any], z: ZeroGradient):
        gkey = f"grad/{z.name}"
        sides = [t for t in (a, b) if gkey in t]
        if not sides:
            return None
        pa, pb = _rows(a, f"param/{z.name}"), _rows(b, f"param/{z.name}")
        steps = len(pa) - 1
        if steps < 1 or len(pb) != len(pa):
            return None
        # G_t: the same layer's largest gradient entry at step t, over the sides that record it
        big = np.zeros(steps)
        for t in sides:
            for name in z.layer:
                if f"grad/{name}" in t:
                    big = np.maximum(big, row_norms(t[f"grad/{name}"])[:steps])
        gamma = ROUNDING_STAGES * z.terms * U64 * big  # [steps]
        lrs = self._lrs(steps)
        drift = np.zeros_like(pa[1:])
        gmax = 0.0
        for t in (a, b):
            if gkey in t:
                g = np.abs(_rows(t, gkey))[:steps]
                gmax = max(gmax, float(np.max(g)))
                if np.any(g.reshape(steps, -1).max(axis=1) > gamma):
                    return None  # not rounding: judged by the float64 rule
            else:  # unrecorded: at the rounding bound
                g = np.broadcast_to(gamma.reshape((steps,) + (1,) * (pa.ndim - 1)), pa[1:].shape).copy()
            ratios = self._ratios(g)
            if ratios is None:
                return None
            # (1 + D u): the optimizer's own arithmetic rounds each step by a few units of its size
            drift += np.cumsum(lrs.reshape((steps,) + (1,) * (pa.ndim - 1)) * ratios, axis=0) * (1 + ROUNDING_STAGES * U64)
        scale = np.maximum(np.abs(pa), np.abs(pb)).max()
        bound = drift + 4 * np.arange(1, steps + 1).reshape((steps,) + (1,) * (pa.ndim - 1)) * U64 * scale
        diff = np.abs(pa[1:] - pb[1:])
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(diff > 0, diff / bound, 0.0).reshape(steps, -1).max(axis=1)
        row = int(np.argmax(ratio))
        return (row + 1, float(diff[row].max()), float(bound[row].max())), float(gamma.max()), gmax


def zero_gradients(spec: Mapping[str, Any]) -> ZeroGradients | None:
    """The parameters of ``spec`` whose exact gradient is zero, or ``None`` when it has none or its
    optimizer's rule gives no bound (an L2 weight decay puts ``wd p`` in the applied gradient)."""
    model, opt = spec["model"], spec["optimizer"]
    if "layers" not in model or "input_shape" not in model:
        return None
    if opt.get("weight_decay", 0.0) and opt["name"] != "adamw":
        return None
    batch = spec["data"]["global_batch"]
    found = []
    for path, layer, shape in attention_layers(model["input_shape"], model["layers"]):
        if layer["use_bias"]:
            others = tuple(f"{path}.{n}.{k}" for n in "qkvo" for k in ("kernel", "bias") if (n, k) != ("k", "bias"))
            found.append(ZeroGradient(f"{path}.k.bias", "softmax ignores a shift shared by a row",
                                      batch * shape[0], others))
    return ZeroGradients(tuple(found), dict(opt)) if found else None
