"""Optimizers for the torch reference.

``native`` and ``torch`` semantics use torch's own classes
(``torch.optim.SGD`` / ``Adam``, single-tensor path): torch computes in the
parameter's dtype with Python-float hyperparameters, so its published rule is
exact in float64. ``tf`` semantics runs Keras' rule, written out here
(see ``tfpar.optimizers`` for both formulas):

momentum, tf:  v <- mu v - lr g;  p <- p + v
adam, tf:      m <- m + (g-m)(1-b1);  v <- v + (g^2-v)(1-b2)
               p <- p - lr sqrt(1-b2^t)/(1-b1^t) m / (sqrt(v) + eps)

.. warning:: torch's Adam adds eps to sqrt(v)/sqrt(1-b2^t); Keras adds it to sqrt(v).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["make_optimizer", "KerasRule"]


class KerasRule(torch.optim.Optimizer):
    """Keras' SGD (with optional momentum) and Adam update rules, exact in the parameter dtype."""

    def __init__(self, params: Iterable[torch.Tensor], spec: dict[str, Any]) -> None:
        super().__init__(params, {"lr": spec["lr"]})
        self.spec = spec

    @torch.no_grad()
    def step(self, closure=None):
        s = self.spec
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                st = self.state[p]
                if s["name"] == "sgd":
                    p.sub_(g * s["lr"])
                elif s["name"] == "momentum":
                    v = st.setdefault("v", torch.zeros_like(p))
                    v.copy_(v * s["momentum"] - g * s["lr"])
                    p.add_(v)
                elif s["name"] == "adam":
                    t = st["t"] = st.get("t", 0) + 1
                    m = st.setdefault("m", torch.zeros_like(p))
                    v = st.setdefault("v", torch.zeros_like(p))
                    m.add_((g - m) * (1.0 - s["beta1"]))
                    v.add_((g * g - v) * (1.0 - s["beta2"]))
                    # computed as tensors of p's dtype, like tfpar's rule (pow in the case dtype)
                    b1 = torch.tensor(s["beta1"], dtype=p.dtype)
                    b2 = torch.tensor(s["beta2"], dtype=p.dtype)
                    tt = torch.tensor(float(t), dtype=p.dtype)
                    alpha = s["lr"] * torch.sqrt(1.0 - torch.pow(b2, tt)) / (1.0 - torch.pow(b1, tt))
                    p.sub_((m * alpha) / (torch.sqrt(v) + s["epsilon"]))
                else:
                    raise ValueError(f"unknown optimizer {s['name']!r}")


def make_optimizer(spec: dict[str, Any], params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
    """Build the optimizer a validated case's ``optimizer`` section asks for."""
    params = list(params)
    name, sem = spec["name"], spec["semantics"]
    if sem == "tf":
        return KerasRule(params, spec)
    if name == "sgd":
        return torch.optim.SGD(params, lr=spec["lr"], foreach=False)
    if name == "momentum":
        return torch.optim.SGD(params, lr=spec["lr"], momentum=spec["momentum"], foreach=False)
    if name == "adam":
        return torch.optim.Adam(
            params, lr=spec["lr"], betas=(spec["beta1"], spec["beta2"]), eps=spec["epsilon"], foreach=False
        )
    raise ValueError(f"unknown optimizer {name!r}")


