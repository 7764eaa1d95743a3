"""The optimizer vocabulary the built-ins know and the layout of optimizer state between engines.

One table for both frameworks: ``slot_names`` gives the canonical slots of an
optimizer section, and a trajectory carries an exported state as flat arrays,
``opt/step`` (updates applied) and ``opt/<slot>/<name>`` (one per parameter),
which ``--lockstep`` hands to the next one-step run as
``{"step": t, "slots": {slot: {name: array}}}`` (:func:`flat_state`,
:func:`nested_state`). Which framework variable holds each slot is the engine's
(``tfpar.optimizers``, ``torchref.optimizers``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from fnmatch import fnmatchcase
from typing import Any

import numpy as np

__all__ = ["OPTIMIZERS", "HYPERPARAMETERS", "plugins_only", "slot_names", "flat_state", "nested_state",
           "no_decay_names", "pattern_matches"]

#: the optimizers the built-in implementations run (a case may name others for plugins only)
OPTIMIZERS = ("sgd", "momentum", "nesterov", "adam", "amsgrad", "adamw", "rmsprop", "adagrad")
#: the hyperparameters each built-in optimizer takes (besides ``lr``, ``semantics``, ``schedule``, ``keras_rounding``)
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
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]{0,63}$")


def _unknown_to_builtins(o: dict) -> bool:
    """A well-formed name or hyperparameter the built-ins do not know (a typo among known names stays an error
    where a built-in runs: :func:`builtin_refusal`)."""
    name = o.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        return False  # not even a name: the strict path says what is expected
    if name not in OPTIMIZERS:
        return True
    allowed = {"name", "lr", "semantics", "schedule", "keras_rounding", "no_decay", *HYPERPARAMETERS[name]}
    return any(k not in allowed for k in o)


def plugins_only(optimizer: dict) -> bool:
    """Whether a validated ``optimizer`` section names an optimizer or hyperparameter the built-ins do not know."""
    return _unknown_to_builtins(optimizer)


def pattern_matches(pattern: str, name: str) -> bool:
    """Whether an ``optimizer.no_decay`` pattern names the parameter ``name`` (a canonical or plugin name).

    A pattern is the parameter's kind, its last dotted part (``bias``, ``gamma``, ``beta``,
    ``embeddings``: every such parameter, as Hugging Face's ``no_decay = ["bias", ...]`` and Keras'
    ``exclude_from_weight_decay(var_names=["bias"])`` are used), or a shell-style glob over the
    whole name (``3.*``, ``*.attention.*.bias``, ``0.kernel``; :func:`fnmatch.fnmatchcase`).
    """
    return name.rsplit(".", 1)[-1] == pattern or fnmatchcase(name, pattern)


def no_decay_names(spec: Mapping[str, Any], names: Iterable[str]) -> frozenset[str]:
    """The parameters of ``names`` that a validated ``optimizer`` section excludes from weight decay.

    ``optimizer.no_decay`` (an extension beyond the contract, docs/optimizers.md "Parameter groups"):
    a list of :func:`pattern_matches` patterns; the parameters they name get weight decay 0 (torch:
    a parameter group with ``weight_decay=0``; Keras: ``exclude_from_weight_decay``), every other
    parameter the case's ``weight_decay``. Empty when the section has none.
    """
    patterns = spec.get("no_decay") or ()
    return frozenset(n for n in names if any(pattern_matches(p, n) for p in patterns))


def slot_names(spec: Mapping[str, Any]) -> tuple[str, ...]:
    """The canonical slot names of a validated ``optimizer`` section (both frameworks use this table).

    ``sgd``: none; ``momentum``/``nesterov``: ``momentum``; ``adam``/``adamw``: ``m``, ``v``
    (``amsgrad``: also ``v_max``); ``rmsprop``: ``square_avg`` (centered: ``grad_avg``; momentum
    > 0: ``momentum``); ``adagrad``: ``accumulator``. Under ``semantics: torch`` a slot holds
    torch's quantity and under ``tf`` Keras', so both frameworks load the same numbers for
    the same case. Under ``native`` the two frameworks' momentum buffers differ by a factor
    ``-lr`` (Keras' velocity holds the learning rate): ``--lockstep`` refuses those cases
    rather than convert.
    """
    name = spec["name"]
    if name in ("momentum", "nesterov"):
        return ("momentum",)
    if name in ("adam", "adamw"):
        return ("m", "v")
    if name == "amsgrad":
        return ("m", "v", "v_max")
    if name == "rmsprop":
        return ("square_avg",) + (("grad_avg",) if spec["centered"] else ()) + (("momentum",) if spec["momentum"] else ())
    if name == "adagrad":
        return ("accumulator",)
    return ()


def flat_state(state: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """``{"step": t, "slots": {slot: {name: a}}}`` -> ``{"opt/step": t, "opt/<slot>/<name>": a}``."""
    out = {"opt/step": np.asarray(state["step"], np.int64)}
    out.update({f"opt/{s}/{n}": a for s, arrays in state["slots"].items() for n, a in arrays.items()})
    return out


def nested_state(traj: Mapping[str, Any]) -> dict[str, Any] | None:
    """The inverse of :func:`flat_state` over a trajectory's ``opt/`` entries (``None`` when it has none)."""
    if "opt/step" not in traj:
        return None
    slots: dict[str, dict[str, np.ndarray]] = {}
    for k, v in traj.items():
        if k.startswith("opt/") and k != "opt/step":
            _, slot, name = k.split("/", 2)
            slots.setdefault(slot, {})[name] = np.asarray(v)
    return {"step": int(traj["opt/step"]), "slots": slots}
