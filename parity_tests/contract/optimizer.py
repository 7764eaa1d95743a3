"""Validation of the ``optimizer`` section: name, hyperparameters with defaults, semantics, schedule.

Hyperparameters use the contract's names (``lr``, ``momentum``, ``beta1``,
``beta2``, ``epsilon``, ``weight_decay``, ``rho``, ``centered``,
``initial_accumulator``); an optimizer rejects a hyperparameter it does not
take. Where the frameworks' defaults differ, the default follows the semantics:
torch's under ``torch``, Keras' under ``tf`` and ``native`` (see
:data:`DEFAULTS` and ``docs/optimizers.md``).

``weight_decay`` means what the semantics' framework means by it:

* ``torch``: L2 added to the gradient (``g <- g + wd p``) for every optimizer
  except ``adamw``, whose decay is decoupled (``p <- p (1 - lr wd)``);
* ``tf``: Keras' decoupled decay on every optimizer (``p <- p - p wd lr``
  before the update);
* ``native``: each framework's own class with the same nominal value, so the
  two sides differ wherever the two meanings do (every optimizer but ``sgd`` and
  ``adamw``): ``parity_tests.judging.theory.predict`` lists it.

``schedule`` (the learning rate of step ``t``, counting steps from 1):

* ``{"kind": "constant"}`` (default): ``lr``;
* ``{"kind": "step", "boundaries": [b0, b1, ...], "values": [v0, v1, ...]}``:
  steps ``1..b0`` use ``v0``, steps ``b0+1..b1`` use ``v1``, ..., steps after
  the last boundary the last value. ``lr`` may be left out (it is ``v0``);
  given, it must equal ``v0``;
* ``{"kind": "warmup_linear", "warmup_steps": k}``: ``lr * min(1, t / k)``.
"""

from __future__ import annotations

from typing import Any

from parity_tests.contract.errors import CaseError
from parity_tests.contract.fields import choice, integer, need, no_extra, number, obj

__all__ = ["OPTIMIZERS", "SEMANTICS", "SCHEDULES", "HYPERPARAMETERS", "DEFAULTS", "validate_optimizer",
           "validate_schedule", "lr_at"]

OPTIMIZERS = ("sgd", "momentum", "nesterov", "adam", "amsgrad", "adamw", "rmsprop", "adagrad")
SEMANTICS = ("native", "torch", "tf")
SCHEDULES = ("constant", "step", "warmup_linear")

# the hyperparameters each optimizer takes besides lr, in the order they are listed
HYPERPARAMETERS: dict[str, tuple[str, ...]] = {
    "sgd": ("weight_decay",),
    "momentum": ("momentum", "weight_decay"),
    "nesterov": ("momentum", "weight_decay"),
    "adam": ("beta1", "beta2", "epsilon", "weight_decay"),
    "amsgrad": ("beta1", "beta2", "epsilon", "weight_decay"),
    "adamw": ("beta1", "beta2", "epsilon", "weight_decay"),
    "rmsprop": ("rho", "epsilon", "centered", "momentum", "weight_decay"),
    "adagrad": ("initial_accumulator", "epsilon", "weight_decay"),
}
_ALL_HP = ("momentum", "beta1", "beta2", "epsilon", "weight_decay", "rho", "centered", "initial_accumulator")
_OPT_KEYS = {"name", "lr", "semantics", "schedule", *_ALL_HP}

_ADAM_TORCH = {"beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8, "weight_decay": 0.0}
_ADAM_KERAS = {"beta1": 0.9, "beta2": 0.999, "epsilon": 1e-7, "weight_decay": 0.0}
# defaults per optimizer: "torch" under torch semantics, "tf" under tf and native.
# torch.optim and keras.optimizers defaults, except momentum (both frameworks
# default to 0, which would make "momentum" plain SGD): 0.9 on both sides.
DEFAULTS: dict[str, dict[str, dict[str, Any]]] = {
    "sgd": {"torch": {"weight_decay": 0.0}, "tf": {"weight_decay": 0.0}},
    "momentum": {"torch": {"momentum": 0.9, "weight_decay": 0.0}, "tf": {"momentum": 0.9, "weight_decay": 0.0}},
    "nesterov": {"torch": {"momentum": 0.9, "weight_decay": 0.0}, "tf": {"momentum": 0.9, "weight_decay": 0.0}},
    "adam": {"torch": _ADAM_TORCH, "tf": _ADAM_KERAS},
    "amsgrad": {"torch": _ADAM_TORCH, "tf": _ADAM_KERAS},
    "adamw": {"torch": dict(_ADAM_TORCH, weight_decay=0.01), "tf": dict(_ADAM_KERAS, weight_decay=0.004)},
    "rmsprop": {
        "torch": {"rho": 0.99, "epsilon": 1e-8, "centered": False, "momentum": 0.0, "weight_decay": 0.0},
        "tf": {"rho": 0.9, "epsilon": 1e-7, "centered": False, "momentum": 0.0, "weight_decay": 0.0},
    },
    "adagrad": {
        "torch": {"initial_accumulator": 0.0, "epsilon": 1e-10, "weight_decay": 0.0},
        "tf": {"initial_accumulator": 0.1, "epsilon": 1e-7, "weight_decay": 0.0},
    },
}


def _boolean(v: Any, path: str) -> bool:
    if not isinstance(v, bool):
        raise CaseError(path, "true or false", v)
    return v


def _hyperparameter(key: str, value: Any, name: str) -> Any:
    path = f"optimizer.{key}"
    if key == "centered":
        return _boolean(value, path)
    if key == "momentum" and name == "nesterov":
        # torch refuses Nesterov without momentum; Keras would silently run plain SGD
        return number(value, path, lo=0.0, lo_open=True, hi=1.0, hi_open=True)
    if key in ("momentum", "beta1", "beta2", "rho"):
        return number(value, path, lo=0.0, hi=1.0, hi_open=True)
    if key == "epsilon":
        return number(value, path, lo=0.0, lo_open=True)
    return number(value, path, lo=0.0)  # weight_decay, initial_accumulator


def validate_schedule(s: Any) -> dict:
    """Validate ``optimizer.schedule`` and return it normalised (see the module docstring)."""
    s = obj(s, "optimizer.schedule")
    kind = choice(need(s, "kind", "optimizer.schedule"), "optimizer.schedule.kind", SCHEDULES)
    if kind == "constant":
        no_extra(s, {"kind"}, "optimizer.schedule")
        return {"kind": "constant"}
    if kind == "warmup_linear":
        no_extra(s, {"kind", "warmup_steps"}, "optimizer.schedule")
        k = integer(need(s, "warmup_steps", "optimizer.schedule"), "optimizer.schedule.warmup_steps", 1, 10_000_000)
        return {"kind": "warmup_linear", "warmup_steps": k}
    no_extra(s, {"kind", "boundaries", "values"}, "optimizer.schedule")
    bounds = need(s, "boundaries", "optimizer.schedule")
    if not isinstance(bounds, list) or not bounds:
        raise CaseError("optimizer.schedule.boundaries", "a non-empty list of step counts", bounds)
    out_b: list[int] = []
    for i, b in enumerate(bounds):
        path = f"optimizer.schedule.boundaries[{i}]"
        lo = out_b[-1] + 1 if out_b else 1
        if isinstance(b, bool) or not isinstance(b, int) or b < lo:
            raise CaseError(path, f"an integer >= {lo} (boundaries are positive step counts, strictly increasing)", b)
        out_b.append(b)
    values = need(s, "values", "optimizer.schedule")
    if not isinstance(values, list) or len(values) != len(out_b) + 1:
        raise CaseError("optimizer.schedule.values", f"a list of {len(out_b) + 1} learning rates (one more than boundaries)",
                        values)
    out_v = [number(v, f"optimizer.schedule.values[{i}]", lo=0.0, lo_open=True) for i, v in enumerate(values)]
    return {"kind": "step", "boundaries": out_b, "values": out_v}


def lr_at(schedule: dict, lr: float, t: int) -> float:
    """The learning rate of step ``t`` (``t = 1, 2, ...``) under a normalised schedule, in float64."""
    if schedule["kind"] == "constant":
        return lr
    if schedule["kind"] == "step":
        return schedule["values"][sum(1 for b in schedule["boundaries"] if b < t)]
    return lr * min(1.0, t / schedule["warmup_steps"])


def validate_optimizer(o: Any) -> dict:
    """Validate the ``optimizer`` section and fill in every default (see the module docstring)."""
    o = obj(o, "optimizer")
    no_extra(o, _OPT_KEYS, "optimizer")
    name = choice(need(o, "name", "optimizer"), "optimizer.name", OPTIMIZERS)
    semantics = choice(o.get("semantics", "native"), "optimizer.semantics", SEMANTICS)
    allowed = HYPERPARAMETERS[name]
    for key in _ALL_HP:
        if key in o and key not in allowed:
            raise CaseError(f"optimizer.{key}", f"no such hyperparameter for {name} (it takes: " + ", ".join(["lr", *allowed]) + ")")
    schedule = validate_schedule(o.get("schedule", {"kind": "constant"}))
    if schedule["kind"] == "step":
        v0 = schedule["values"][0]
        lr = number(o.get("lr", v0), "optimizer.lr", lo=0.0, lo_open=True)
        if lr != v0:
            raise CaseError("optimizer.lr", f"the step schedule's first value {v0!r} (or leave lr out)", lr)
    else:
        lr = number(need(o, "lr", "optimizer"), "optimizer.lr", lo=0.0, lo_open=True)
    out: dict[str, Any] = {"name": name, "semantics": semantics, "lr": lr}
    defaults = DEFAULTS[name]["torch" if semantics == "torch" else "tf"]
    for key in allowed:
        out[key] = _hyperparameter(key, o.get(key, defaults[key]), name)
    out["schedule"] = schedule
    return out
