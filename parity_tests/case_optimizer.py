"""Validation of the ``optimizer`` section: name, hyperparameters with defaults, semantics."""

from __future__ import annotations

from typing import Any

from .errors import CaseError
from .fields import choice, need, no_extra, number, obj

__all__ = ["OPTIMIZERS", "SEMANTICS", "validate_optimizer"]

OPTIMIZERS = ("sgd", "momentum", "adam")
SEMANTICS = ("native", "torch", "tf")
_OPT_KEYS = {"name", "lr", "momentum", "beta1", "beta2", "epsilon", "weight_decay", "rho", "semantics"}

def validate_optimizer(o: Any) -> dict:
    o = obj(o, "optimizer")
    no_extra(o, _OPT_KEYS, "optimizer")
    name = choice(need(o, "name", "optimizer"), "optimizer.name", OPTIMIZERS)
    semantics = choice(o.get("semantics", "native"), "optimizer.semantics", SEMANTICS)
    out: dict[str, Any] = {"name": name, "semantics": semantics}
    out["lr"] = number(need(o, "lr", "optimizer"), "optimizer.lr", lo=0.0, lo_open=True)
    allowed = {"sgd": set(), "momentum": {"momentum"}, "adam": {"beta1", "beta2", "epsilon"}}[name]
    for key in ("momentum", "beta1", "beta2", "epsilon", "weight_decay", "rho"):
        if key in o and key not in allowed:
            raise CaseError(f"optimizer.{key}", f"no such hyperparameter for {name} (it takes: " + ", ".join(["lr", *sorted(allowed)]) + ")")
    if name == "momentum":
        out["momentum"] = number(o.get("momentum", 0.9), "optimizer.momentum", lo=0.0, hi=1.0, hi_open=True)
    if name == "adam":
        out["beta1"] = number(o.get("beta1", 0.9), "optimizer.beta1", lo=0.0, hi=1.0, hi_open=True)
        out["beta2"] = number(o.get("beta2", 0.999), "optimizer.beta2", lo=0.0, hi=1.0, hi_open=True)
        # framework defaults differ (Keras 1e-7, torch 1e-8): the default follows the semantics
        default_eps = 1e-8 if semantics == "torch" else 1e-7
        out["epsilon"] = number(o.get("epsilon", default_eps), "optimizer.epsilon", lo=0.0, lo_open=True)
    return out
