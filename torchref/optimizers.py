"""Optimizers, learning-rate schedules and gradient clipping for the torch reference.

``native`` and ``torch`` semantics use torch's own classes (``torch.optim.SGD``
/ ``Adam`` / ``AdamW`` / ``RMSprop`` / ``Adagrad``, single-tensor path):
torch computes in the parameter's dtype with Python-float hyperparameters, so
its published rule is exact in float64. ``tf`` semantics runs Keras' rule,
written out here (:class:`KerasRule`; ``tfpar.optimizers`` states both
frameworks' formulas side by side):

weight decay:   p <- p - p wd lr  (before the update, every optimizer)
momentum:       v <- mu v - lr g;  p <- p + v
nesterov:       v <- mu v - lr g;  p <- p + mu v - lr g
adam, amsgrad, adamw:
                m <- m + (g-m)(1-b1);  v <- v + (g^2-v)(1-b2)  (amsgrad: v <- max(v_hat, v))
                p <- p - lr sqrt(1-b2^t)/(1-b1^t) m / (sqrt(v) + eps)
rmsprop:        s <- rho s + (1-rho) g^2; [a <- rho a + (1-rho) g];
                u = lr g / sqrt(s [- a^2] + eps);  m <- mu m + u; p <- p - m  (mu = 0: p <- p - u)
adagrad:        s <- s + g^2 (s starts at initial_accumulator);  p <- p - lr g / sqrt(s + eps)

.. warning:: torch's rules differ: Adam adds eps to sqrt(v)/sqrt(1-b2^t);
   RMSprop and Adagrad add eps outside the sqrt; torch's momentum buffers do
   not hold lr (same result only for a constant lr); torch's ``weight_decay``
   is L2 in the gradient except in AdamW.

Schedules: :func:`make_scheduler` gives a ``torch.optim.lr_scheduler.LambdaLR``
stepped once after every optimizer step, so step ``t`` (from 1) runs with
``lr_at(schedule, lr, t)``. LambdaLR sets ``lr * factor``, which can differ from
the schedule's value by one float64 rounding (about 1e-16 relative).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

__all__ = ["make_optimizer", "make_scheduler", "lr_at", "KerasRule", "clip_grads"]


def lr_at(schedule: Mapping[str, Any], lr: float, t: int) -> float:
    """The learning rate of step ``t`` (``t = 1, 2, ...``).

    constant: ``lr``; step: ``values[i]``, ``i`` = the number of boundaries ``b < t``;
    warmup_linear: ``lr * min(1, t / k)``.
    """
    kind = schedule["kind"]
    if kind == "constant":
        return lr
    if kind == "step":
        return schedule["values"][sum(1 for b in schedule["boundaries"] if b < t)]
    if kind == "warmup_linear":
        return lr * min(1.0, t / schedule["warmup_steps"])
    raise ValueError(f"unknown schedule kind {kind!r}")


class KerasRule(torch.optim.Optimizer):
    """Keras' update rules (module docstring), exact in the parameter dtype.

    Reads the learning rate from ``param_groups[0]["lr"]`` at every step, so a
    torch LR scheduler drives it like any torch optimizer.
    """

    def __init__(self, params: Iterable[torch.Tensor], spec: Mapping[str, Any]) -> None:
        super().__init__(params, {"lr": spec["lr"]})
        self.spec = dict(spec)

    @torch.no_grad()
    def step(self, closure=None):
        s = self.spec
        name = s["name"]
        wd = s.get("weight_decay", 0.0)
        for group in self.param_groups:
            lr = group["lr"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                st = self.state[p]
                t = st["t"] = st.get("t", 0) + 1
                if wd:
                    p.sub_(p * wd * lr)  # Keras: variable.assign_sub(variable * wd * lr)
                if name == "sgd":
                    p.sub_(g * lr)
                elif name in ("momentum", "nesterov"):
                    mu = s["momentum"]
                    v = st.setdefault("v", torch.zeros_like(p))
                    v.copy_(v * mu - g * lr)
                    p.add_(v * mu - g * lr if name == "nesterov" else v)
                elif name in ("adam", "amsgrad", "adamw"):
                    m = st.setdefault("m", torch.zeros_like(p))
                    v = st.setdefault("v", torch.zeros_like(p))
                    m.add_((g - m) * (1.0 - s["beta1"]))
                    v.add_((g * g - v) * (1.0 - s["beta2"]))
                    if name == "amsgrad":
                        vh = st.setdefault("v_hat", torch.zeros_like(p))
                        torch.maximum(vh, v, out=vh)
                        v = vh
                    # computed as tensors of p's dtype, like tfpar's rule (pow in the case dtype)
                    b1 = torch.tensor(s["beta1"], dtype=p.dtype)
                    b2 = torch.tensor(s["beta2"], dtype=p.dtype)
                    tt = torch.tensor(float(t), dtype=p.dtype)
                    alpha = lr * torch.sqrt(1.0 - torch.pow(b2, tt)) / (1.0 - torch.pow(b1, tt))
                    p.sub_((m * alpha) / (torch.sqrt(v) + s["epsilon"]))
                elif name == "rmsprop":
                    rho, mu = s["rho"], s["momentum"]
                    sq = st.setdefault("square_avg", torch.zeros_like(p))
                    sq.copy_(rho * sq + (1.0 - rho) * (g * g))
                    if s["centered"]:
                        a = st.setdefault("grad_avg", torch.zeros_like(p))
                        a.copy_(rho * a + (1.0 - rho) * g)
                        inc = lr * g / torch.sqrt(sq - a * a + s["epsilon"])
                    else:
                        inc = lr * g / torch.sqrt(sq + s["epsilon"])
                    if mu > 0:
                        buf = st.setdefault("momentum", torch.zeros_like(p))
                        buf.copy_(mu * buf + inc)
                        p.sub_(buf)
                    else:
                        p.sub_(inc)
                elif name == "adagrad":
                    acc = st.setdefault("accumulator", torch.full_like(p, s["initial_accumulator"]))
                    acc.add_(g * g)
                    p.sub_(lr * g / torch.sqrt(acc + s["epsilon"]))
                else:
                    raise ValueError(f"unknown optimizer {name!r}")


def make_optimizer(spec: Mapping[str, Any], params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
    """Build the optimizer a validated case's ``optimizer`` section asks for."""
    params = list(params)
    name, sem = spec["name"], spec["semantics"]
    if sem == "tf":
        return KerasRule(params, spec)
    lr, wd = spec["lr"], spec.get("weight_decay", 0.0)
    if name in ("sgd", "momentum", "nesterov"):
        return torch.optim.SGD(params, lr=lr, momentum=spec.get("momentum", 0.0), nesterov=name == "nesterov",
                               weight_decay=wd, foreach=False)
    if name in ("adam", "amsgrad"):
        return torch.optim.Adam(params, lr=lr, betas=(spec["beta1"], spec["beta2"]), eps=spec["epsilon"],
                                weight_decay=wd, amsgrad=name == "amsgrad", foreach=False)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, betas=(spec["beta1"], spec["beta2"]), eps=spec["epsilon"],
                                 weight_decay=wd, foreach=False)
    if name == "rmsprop":
        return torch.optim.RMSprop(params, lr=lr, alpha=spec["rho"], eps=spec["epsilon"], weight_decay=wd,
                                   momentum=spec["momentum"], centered=spec["centered"], foreach=False)
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=lr, initial_accumulator_value=spec["initial_accumulator"],
                                   eps=spec["epsilon"], weight_decay=wd, foreach=False)
    raise ValueError(f"unknown optimizer {name!r}")


def make_scheduler(spec: Mapping[str, Any], opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler | None:
    """A ``LambdaLR`` for the case's schedule (``None`` for a constant rate); call ``.step()`` after each ``opt.step()``.

    LambdaLR sets ``lr * f(k)`` after ``k`` scheduler steps, and step ``t`` of the
    case comes after ``t - 1`` of them: ``f(k) = lr_at(schedule, lr, k + 1) / lr``.
    """
    schedule, lr = spec.get("schedule") or {"kind": "constant"}, spec["lr"]
    if schedule["kind"] == "constant":
        return None
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda k: lr_at(schedule, lr, k + 1) / lr)


def clip_grads(params: Iterable[torch.Tensor], clip_norm: float, semantics: str) -> None:
    """Clip the ``.grad`` of ``params`` in place by their global L2 norm ``n``.

    ``tf`` semantics: TensorFlow's ``tf.clip_by_global_norm`` rule,
    ``g * c * min(1/n, 1/c)``; otherwise torch's own
    ``torch.nn.utils.clip_grad_norm_``, which scales by ``min(c / (n + 1e-6), 1)``.

    .. warning:: the 1e-6 makes the two differ by about ``1e-6 / n`` relative
       whenever clipping is active.
    """
    params = [p for p in params if p.grad is not None]
    if semantics != "tf":
        torch.nn.utils.clip_grad_norm_(params, clip_norm)
        return
    grads = [p.grad for p in params]
    norm = torch.sqrt(sum(torch.sum(g * g) for g in grads))
    scale = clip_norm * torch.minimum(1.0 / norm, torch.tensor(1.0 / clip_norm, dtype=norm.dtype))
    for g in grads:
        g.mul_(scale)
