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
the schedule's value by one float64 rounding (about 1e-16 relative). Under ``native``
a ``warmup_cosine`` schedule is what a torch user writes with torch's own classes
(:func:`warmup_cosine_scheduler`: ``SequentialLR`` of ``LinearLR``, ``CosineAnnealingLR``
and ``ConstantLR``).

.. warning:: ``LinearLR`` and ``CosineAnnealingLR`` are recursive (torch 2.13,
   ``torch/optim/lr_scheduler.py``: each ``get_lr`` scales the group's current ``lr``, e.g.
   ``(1 + cos(pi e / T)) / (1 + cos(pi (e - 1) / T)) (lr - eta_min) + eta_min``), so
   they drift from the closed form by rounding: measured 4.3e-16 relative over 110 steps,
   1.7e-14 over 2,100 (float64 Python arithmetic, so in every case dtype).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

from parity_tests.protocol.hyper import cosine_lr, keras_float32, keras_lr
from parity_tests.protocol.optimizer_state import flat_state, no_decay_names, slot_names

__all__ = ["make_optimizer", "make_scheduler", "warmup_cosine_scheduler", "advance", "lr_at", "KerasRule", "clip_grads", "export_state",
           "load_state", "exported"]


def lr_at(schedule: Mapping[str, Any], lr: float, t: int) -> float:
    """The learning rate of step ``t`` (``t = 1, 2, ...``).

    constant: ``lr``; step: ``values[i]``, ``i`` = the number of boundaries ``b < t``;
    warmup_linear: ``lr * min(1, t / k)``; warmup_cosine: ``protocol.hyper.cosine_lr``.
    """
    kind = schedule["kind"]
    if kind == "constant":
        return lr
    if kind == "step":
        return schedule["values"][sum(1 for b in schedule["boundaries"] if b < t)]
    if kind == "warmup_linear":
        return lr * min(1.0, t / schedule["warmup_steps"])
    if kind == "warmup_cosine":
        return cosine_lr(schedule, lr, t)
    raise ValueError(f"unknown schedule kind {kind!r}")


class KerasRule(torch.optim.Optimizer):
    """Keras' update rules (module docstring), exact in the parameter dtype.

    Reads the learning rate from ``param_groups[0]["lr"]`` at every step, so a
    torch LR scheduler drives it like any torch optimizer.
    """

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict], spec: Mapping[str, Any]) -> None:
        # a group's own weight_decay (optimizer.no_decay: 0) overrides the case's, as in torch.optim
        super().__init__(params, {"lr": spec["lr"], "weight_decay": spec.get("weight_decay", 0.0)})
        self.spec = dict(spec)

    def _h(self, value: float, use: str) -> float:
        """A hyperparameter as Keras holds it: rounded to float32 where ``keras_rounding`` says Keras does."""
        return float(np.float32(value)) if keras_float32(self.spec, use) else value

    @torch.no_grad()
    def step(self, closure=None):
        s = self.spec
        name = s["name"]
        for group in self.param_groups:
            wd = self._h(group["weight_decay"], "weight_decay")
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                st = self.state[p]
                t = st["t"] = st.get("t", 0) + 1
                # as Keras holds it: float32 (the variable, or the schedule's float32 arithmetic)
                lr = keras_lr(s["schedule"], s["lr"], t) if keras_float32(s, "lr") else group["lr"]
                if wd:
                    p.sub_(p * wd * lr)  # Keras: variable.assign_sub(variable * wd * lr)
                if name == "sgd":
                    p.sub_(g * lr)
                elif name in ("momentum", "nesterov"):
                    mu = self._h(s["momentum"], "momentum")
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
                    b1 = torch.tensor(self._h(s["beta1"], "beta_power"), dtype=p.dtype)
                    b2 = torch.tensor(self._h(s["beta2"], "beta_power"), dtype=p.dtype)
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
                    acc = st.setdefault("accumulator", torch.full_like(p, self._h(s["initial_accumulator"],
                                                                                  "initial_accumulator")))
                    acc.add_(g * g)
                    p.sub_(lr * g / torch.sqrt(acc + s["epsilon"]))
                else:
                    raise ValueError(f"unknown optimizer {name!r}")


def make_optimizer(spec: Mapping[str, Any], params: Iterable[torch.Tensor],
                   named: Mapping[str, torch.Tensor] | None = None) -> torch.optim.Optimizer:
    """Build the optimizer a validated case's ``optimizer`` section asks for.

    ``named`` (canonical name -> parameter), needed when the section has ``no_decay``: the
    parameters it names go in a second parameter group with ``weight_decay=0``, what a torch
    user writes for decay / no-decay groups (``[{"params": decay}, {"params": no_decay,
    "weight_decay": 0.0}]``); ``params`` keeps its order within each group.
    """
    params = list(params)
    name, sem = spec["name"], spec["semantics"]
    if spec.get("no_decay"):
        if named is None:
            raise ValueError("optimizer.no_decay needs the parameters' names: make_optimizer(spec, params, named)")
        skip = {id(named[n]) for n in no_decay_names(spec, list(named))}
        decay = [p for p in params if id(p) not in skip]
        groups = [g for g in ({"params": decay}, {"params": [p for p in params if id(p) in skip], "weight_decay": 0.0})
                  if g["params"]]
        params = groups  # torch.optim and KerasRule take groups where they take a list of parameters
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
    ``warmup_cosine`` under ``native``: torch's own classes (:func:`warmup_cosine_scheduler`).
    """
    schedule, lr = spec.get("schedule") or {"kind": "constant"}, spec["lr"]
    if schedule["kind"] == "constant":
        return None
    if schedule["kind"] == "warmup_cosine" and spec["semantics"] == "native":
        return warmup_cosine_scheduler(opt, schedule, lr)
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda k: lr_at(schedule, lr, k + 1) / lr)


def warmup_cosine_scheduler(opt: torch.optim.Optimizer, schedule: Mapping[str, Any],
                            lr: float) -> torch.optim.lr_scheduler.SequentialLR:
    """The contract's ``warmup_cosine`` with torch's own schedulers (stepped once after each ``opt.step()``).

    After ``n`` scheduler steps (step ``t = n + 1`` of the case), with ``k``, ``d``, ``m`` the
    schedule's ``warmup_steps``, ``decay_steps``, ``min_lr``:

    * ``LinearLR(start_factor=1/k, end_factor=1, total_iters=k-1)`` for ``n < k - 1``:
      ``lr (n + 1) / k = lr t / k``;
    * ``CosineAnnealingLR(T_max=d, eta_min=m)`` from milestone ``k - 1`` (``SequentialLR`` restarts it
      at epoch 0 there): ``m + (lr - m)(1 + cos(pi (t - k) / d)) / 2`` for ``t = k .. k + d``;
    * ``ConstantLR(factor=m/lr)`` from milestone ``k - 1 + d``: ``lr (m / lr)``. Without it
      ``CosineAnnealingLR`` would climb back to ``lr`` after ``T_max`` (it is periodic).

    Equal to ``protocol.hyper.cosine_lr`` up to the recursive formulas' rounding (module docstring).
    """
    sched = torch.optim.lr_scheduler
    k, d, m = schedule["warmup_steps"], schedule["decay_steps"], schedule["min_lr"]
    warm = sched.LinearLR(opt, start_factor=1.0 / k, end_factor=1.0, total_iters=k - 1)
    cosine = sched.CosineAnnealingLR(opt, T_max=d, eta_min=m)
    hold = sched.ConstantLR(opt, factor=m / lr, total_iters=2**62)  # never ends: ConstantLR restores lr at total_iters
    return sched.SequentialLR(opt, [warm, cosine, hold], milestones=[k - 1, k - 1 + d])


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


# ---------------------------------------------------------------- optimizer state (lockstep)


def _state_keys(opt: torch.optim.Optimizer, spec: Mapping[str, Any]) -> dict[str, str]:
    """Canonical slot name -> the key of ``opt.state[p]`` that holds it (torch's classes or :class:`KerasRule`)."""
    if isinstance(opt, KerasRule):
        keys = {"momentum": "momentum" if spec["name"] == "rmsprop" else "v", "m": "m", "v": "v", "v_max": "v_hat",
                "square_avg": "square_avg", "grad_avg": "grad_avg", "accumulator": "accumulator"}
    else:
        keys = {"momentum": "momentum_buffer", "m": "exp_avg", "v": "exp_avg_sq", "v_max": "max_exp_avg_sq",
                "square_avg": "square_avg", "grad_avg": "grad_avg", "accumulator": "sum"}
    return {s: keys[s] for s in slot_names(spec)}


def export_state(opt: torch.optim.Optimizer, named: Mapping[str, torch.Tensor], spec: Mapping[str, Any],
                 step: int) -> dict[str, Any]:
    """The optimizer's state after ``step`` updates, as plain numpy data.

    Args:
        opt: the optimizer of :func:`make_optimizer` over ``named``'s parameters.
        named: canonical name -> parameter (the torch models keep TensorFlow layouts).
        spec: the validated ``optimizer`` section.
        step: the updates applied so far (``torch.optim.SGD`` keeps no counter of its own).
    Returns:
        ``{"step": step, "slots": {slot: {name: array}}}``, the layout of ``tfpar.optimizers.export_state``.
    """
    slots: dict[str, dict[str, Any]] = {}
    for s, key in _state_keys(opt, spec).items():
        slots[s] = {n: opt.state[p][key].detach().numpy().copy() for n, p in named.items() if key in opt.state[p]}
    return {"step": int(step), "slots": {s: v for s, v in slots.items() if v}}


@torch.no_grad()
def load_state(opt: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LRScheduler | None,
               named: Mapping[str, torch.Tensor], spec: Mapping[str, Any], state: Mapping[str, Any] | None) -> None:
    """Set a fresh optimizer (and its scheduler) to ``state`` after ``state["step"] = t`` updates.

    Slots become ``opt.state[p]`` entries in the parameter's dtype; torch's step counters
    (Adam, RMSprop, Adagrad: a float tensor ``step``; :class:`KerasRule`: ``t``) are set to ``t``;
    the scheduler is moved to where ``t`` calls of ``sched.step()`` leave it, so the next
    update runs with ``lr_at(schedule, lr, t + 1)``. ``None`` or ``t = 0`` keeps the fresh state.
    """
    if state is None or not state["step"]:
        return
    t = int(state["step"])
    keys = _state_keys(opt, spec)
    counted = not isinstance(opt, (torch.optim.SGD, KerasRule))
    for n, p in named.items():
        st = opt.state[p]
        for s, key in keys.items():
            st[key] = torch.as_tensor(state["slots"][s][n], dtype=p.dtype).clone()
        if isinstance(opt, KerasRule):
            st["t"] = t
        elif counted:
            # torch keeps a float32 tensor (float64 under a float64 default dtype); t is exact in both
            st["step"] = torch.tensor(float(t), dtype=torch.get_default_dtype())
    if isinstance(sched, torch.optim.lr_scheduler.LambdaLR):
        sched.last_epoch = t
        for g, base, fn in zip(opt.param_groups, sched.base_lrs, sched.lr_lambdas, strict=True):
            g["lr"] = base * fn(t)  # what LambdaLR.get_lr gives after t steps
        sched._last_lr = [g["lr"] for g in opt.param_groups]
    elif sched is not None:
        advance(sched, t)


def advance(sched: torch.optim.lr_scheduler.LRScheduler, t: int) -> None:
    """Step a fresh recursive scheduler (``SequentialLR`` and its parts) ``t`` times: where ``t`` updates leave it.

    Recursive schedulers have no closed form to jump with (the rate after ``t`` steps is the one
    ``t`` steps of the recursion give, rounding included), so they are replayed; torch's warning
    about ``scheduler.step()`` before ``optimizer.step()`` is about a fresh run, not a restart.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)`")
        for _ in range(t):
            sched.step()


def exported(opt: torch.optim.Optimizer, named: Mapping[str, torch.Tensor], payload: Mapping[str, Any]) -> dict[str, Any]:
    """Trajectory entries with the optimizer's final state, when the payload asks (``export_opt_state``), else ``{}``.

    ``opt/step`` (the updates applied, counting those of the start state ``payload["opt_state"]``)
    and ``opt/<slot>/<name>``, flat so that they travel with the trajectory's arrays.
    """
    if not payload.get("export_opt_state"):
        return {}
    spec = payload["spec"]
    st = export_state(opt, named, spec["optimizer"], (payload.get("opt_state") or {}).get("step", 0) + spec["steps"])
    return flat_state(st)
