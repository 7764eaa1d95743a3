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
* ``{"kind": "warmup_linear", "warmup_steps": k}``: ``lr * min(1, t / k)``;
* ``{"kind": "warmup_cosine", "warmup_steps": k, "decay_steps": d, "min_lr": m}``: ``lr t / k`` for
  ``t <= k``, then ``m + (lr - m) (1 + cos(pi (t - k) / d)) / 2`` up to step ``k + d`` (which is at
  ``m``), ``m`` after (``protocol.hyper.cosine_lr``). ``k >= 1``, ``d >= 1``, ``0 <= m <= lr``
  (a decay: the tool's limit, from ``torch.optim.lr_scheduler.ConstantLR``'s factor ``m / lr``
  in [0, 1], which holds the rate at ``m`` after the decay under ``native``).

``no_decay`` (an extension beyond the case contract; docs/optimizers.md "Parameter groups"): a list
of patterns naming parameters that take no weight decay, each a parameter kind (``bias``,
``gamma``: the last part of a canonical name) or a glob over the whole name (``3.*``),
``protocol.optimizer_state.pattern_matches``: what a GPT trainer's decay / no-decay parameter
groups say. Every pattern must name a trainable parameter of the model (the case checks it,
``check_no_decay``). Kept in the spec only when given.

Accepted ranges (:data:`CHECKS`, :func:`accepted_range`): a value is accepted
exactly when both frameworks' own classes accept it (``torch.optim.*``'s and
``keras.optimizers.*``'s argument checks, copied here with their messages and
probed against the installed classes by ``parity_tests/tests/test_optimizer_ranges.py``),
and the tool's exact rules are defined for it. The same ranges hold under every
semantics. Where neither framework checks, the tool's own limit is named
``tfpar`` with its reason:

* ``rho > 1`` (RMSprop): ``1 - rho < 0`` makes the square average negative,
  and torch's ``sqrt(s) + eps`` is NaN from the first nonzero gradient;
* RMSprop with ``epsilon == 0`` and ``rho == 1`` (the square average stays 0),
  or ``centered`` with ``rho == 0`` (``s - a^2 = g^2 - g^2 = 0``): every update
  divides by zero, for every gradient;
* ``lr == 0`` (or a first step value of 0) with a ``step``, ``warmup_linear`` or ``warmup_cosine``
  schedule: the torch side's ``LambdaLR`` factor is ``lr_t / lr``
  (``torchref.optimizers.make_scheduler``).

Both frameworks accept, and so does the tool: ``epsilon == 0``, ``lr == 0``
(constant schedule), ``momentum == 1`` (momentum, nesterov) and any RMSprop
``momentum >= 0``. With epsilon 0 an update divides by zero only for a
parameter element whose gradient has been exactly 0 at every step so far (a
dead ReLU unit, say), and the NaN it gives is the same in both frameworks'
rules; the frameworks' epsilon placements then coincide (Adam, RMSprop, Adagrad).

A refusal names the framework and its words, e.g. ``optimizer.epsilon:
expected a number >= 0 (torch.optim.Adam refuses eps < 0: 'Invalid epsilon
value'), got -1.0``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from parity_tests.contract.fields import choice, integer, need, no_extra, obj
from parity_tests.protocol.errors import CaseError
from parity_tests.protocol.optimizer_state import (
    HYPERPARAMETERS,
    OPTIMIZERS,
    pattern_matches,
    plugins_only,
)

__all__ = ["SEMANTICS", "SCHEDULES", "DEFAULTS", "Check", "CHECKS", "TORCH_CLASS", "KERAS_CLASS", "KERAS_ROUNDING",
           "accepted_range", "validate_optimizer", "validate_schedule", "builtin_refusal", "check_no_decay",
           "case_fields_for"]

SEMANTICS = ("native", "torch", "tf")
SCHEDULES = ("constant", "step", "warmup_linear", "warmup_cosine")

# the hyperparameters each optimizer takes besides lr, in the order they are listed
_ALL_HP = ("momentum", "beta1", "beta2", "epsilon", "weight_decay", "rho", "centered", "initial_accumulator")
_OPT_KEYS = {"name", "lr", "semantics", "schedule", "keras_rounding", "no_decay", *_ALL_HP}
#: ``keras_rounding`` (``semantics: tf`` only): which hyperparameters pass through float32 in a float64
#: run, as a Keras optimizer made under that ``keras.config.floatx()`` rounds them (the judge's mapping
#: of a Keras side: ``judging.theory.KERAS_ROUNDED``); ``none``: every hyperparameter exact
KERAS_ROUNDING = ("none", "floatx_float32", "floatx_float64")

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


# ---------------------------------------------------------------- accepted ranges

TORCH_CLASS = {"sgd": "torch.optim.SGD", "momentum": "torch.optim.SGD", "nesterov": "torch.optim.SGD",
               "adam": "torch.optim.Adam", "amsgrad": "torch.optim.Adam", "adamw": "torch.optim.AdamW",
               "rmsprop": "torch.optim.RMSprop", "adagrad": "torch.optim.Adagrad"}
KERAS_CLASS = {"sgd": "keras.optimizers.SGD", "momentum": "keras.optimizers.SGD", "nesterov": "keras.optimizers.SGD",
               "adam": "keras.optimizers.Adam", "amsgrad": "keras.optimizers.Adam", "adamw": "keras.optimizers.AdamW",
               "rmsprop": "keras.optimizers.RMSprop", "adagrad": "keras.optimizers.Adagrad"}


@dataclass(frozen=True)
class Check:
    """One refusal: ``who`` refuses its argument ``arg`` when it is ``op limit``, saying ``says``.

    ``who`` is a framework class (``torch.optim.Adam``, ``keras.optimizers.SGD``)
    quoting the start of its own ``ValueError``, or ``tfpar`` for the tool's own
    limit where neither framework checks (``says`` is then the reason).
    """

    who: str
    arg: str
    op: str  # "<", "<=", ">" or ">="
    limit: float
    says: str

    def refuses(self, v: float) -> bool:
        return {"<": v < self.limit, "<=": v <= self.limit, ">": v > self.limit, ">=": v >= self.limit}[self.op]

    def text(self) -> str:
        return f"{self.who} refuses {self.arg} {self.op} {self.limit:g}: {self.says!r}"


_TORCH_ARG = {"lr": "lr", "momentum": "momentum", "beta1": "betas[0]", "beta2": "betas[1]", "epsilon": "eps",
              "weight_decay": "weight_decay", "rho": "alpha", "initial_accumulator": "initial_accumulator_value"}
_TORCH_SAYS = {"lr": "Invalid learning rate", "momentum": "Invalid momentum value",
               "beta1": "Invalid beta parameter at index 0", "beta2": "Invalid beta parameter at index 1",
               "epsilon": "Invalid epsilon value", "weight_decay": "Invalid weight_decay value",
               "rho": "Invalid alpha value", "initial_accumulator": "Invalid initial_accumulator_value value"}
_KERAS_SGD_SAYS = "`momentum` must be a float between [0, 1]."


def _checks(name: str, key: str) -> tuple[Check, ...]:
    torch_cls, keras_cls = TORCH_CLASS[name], KERAS_CLASS[name]
    # every torch.optim constructor refuses a negative value of each numeric argument it takes
    out = [Check(torch_cls, _TORCH_ARG[key], "<", 0.0, _TORCH_SAYS[key])]
    if key in ("beta1", "beta2"):
        out.append(Check(torch_cls, _TORCH_ARG[key], ">=", 1.0, _TORCH_SAYS[key]))
    if key == "momentum" and name == "nesterov":
        out.append(Check(f"{torch_cls}(nesterov=True)", "momentum", "<=", 0.0,
                         "Nesterov momentum requires a momentum and zero dampening"))
    if key == "momentum" and name in ("momentum", "nesterov"):
        out += [Check(keras_cls, "momentum", "<", 0.0, _KERAS_SGD_SAYS),
                Check(keras_cls, "momentum", ">", 1.0, _KERAS_SGD_SAYS)]
    if key == "rho":
        out.append(Check("tfpar", "rho", ">", 1.0, "neither framework checks; 1 - rho < 0 makes the square average"
                         " negative, and sqrt(s) + eps (torch) is NaN from the first nonzero gradient"))
    return tuple(out)


# CHECKS[name][key]: every check on hyperparameter ``key`` (``lr`` included) of optimizer ``name``.
# Keras 3 checks only SGD's momentum (and that learning_rate is a float); torch.optim checks the rest.
CHECKS: dict[str, dict[str, tuple[Check, ...]]] = {
    name: {key: _checks(name, key) for key in ("lr", *HYPERPARAMETERS[name]) if key != "centered"}
    for name in OPTIMIZERS
}


def accepted_range(checks: tuple[Check, ...]) -> str:
    """The values no check refuses, as text: ``>= 0``, ``> 0 and <= 1``."""
    lows = [(c.limit, c.op == "<=") for c in checks if c.op in ("<", "<=")]
    highs = [(c.limit, c.op == ">=") for c in checks if c.op in (">", ">=")]
    text = ""
    if lows:
        lo, lo_open = max(lows)
        text = f"{'>' if lo_open else '>='} {lo:g}"
    if highs:
        hi, hi_open = min(highs, key=lambda h: (h[0], not h[1]))
        text += (" and " if text else "") + f"{'<' if hi_open else '<='} {hi:g}"
    return text or "any"


def _checked(v: Any, path: str, checks: tuple[Check, ...]) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise CaseError(path, "a finite number", v)
    v = float(v)
    refused = [c.text() for c in checks if c.refuses(v)]
    if refused:
        raise CaseError(path, f"a number {accepted_range(checks)} (" + "; ".join(refused) + ")", v)
    return v


def _boolean(v: Any, path: str) -> bool:
    if not isinstance(v, bool):
        raise CaseError(path, "true or false", v)
    return v


def _hyperparameter(key: str, value: Any, name: str) -> Any:
    path = f"optimizer.{key}"
    if key == "centered":
        return _boolean(value, path)
    return _checked(value, path, CHECKS[name][key])


def _rmsprop_divides_by_zero(out: dict) -> None:
    """Refuse an RMSprop whose every update divides by zero, for every gradient (module docstring)."""
    if out["epsilon"] != 0.0:
        return
    if out["rho"] == 1.0:
        why = "rho 1 keeps the square average at 0"
    elif out["centered"] and out["rho"] == 0.0:
        why = "centered with rho 0 makes s - a^2 = g^2 - g^2 = 0"
    else:
        return
    raise CaseError("optimizer.epsilon", f"a number > 0 here (tfpar refuses epsilon 0: {why}, so every update divides"
                    " by zero for every gradient; torch.optim.RMSprop and keras.optimizers.RMSprop accept it)", 0.0)


def validate_schedule(s: Any, name: str = "sgd") -> dict:  # noqa: C901
    """Validate ``optimizer.schedule`` of optimizer ``name`` and return it normalised (see the module docstring).

    Every value of a ``step`` schedule is a learning rate: the checks on ``lr`` apply to each.
    """
    s = obj(s, "optimizer.schedule")
    kind = choice(need(s, "kind", "optimizer.schedule"), "optimizer.schedule.kind", SCHEDULES)
    if kind == "constant":
        no_extra(s, {"kind"}, "optimizer.schedule")
        return {"kind": "constant"}
    if kind == "warmup_linear":
        no_extra(s, {"kind", "warmup_steps"}, "optimizer.schedule")
        k = integer(need(s, "warmup_steps", "optimizer.schedule"), "optimizer.schedule.warmup_steps", 1, 10_000_000)
        return {"kind": "warmup_linear", "warmup_steps": k}
    if kind == "warmup_cosine":
        no_extra(s, {"kind", "warmup_steps", "decay_steps", "min_lr"}, "optimizer.schedule")
        k = integer(need(s, "warmup_steps", "optimizer.schedule"), "optimizer.schedule.warmup_steps", 1, 10_000_000)
        d = integer(need(s, "decay_steps", "optimizer.schedule"), "optimizer.schedule.decay_steps", 1, 10_000_000)
        m = _checked(need(s, "min_lr", "optimizer.schedule"), "optimizer.schedule.min_lr", _MIN_LR)
        return {"kind": "warmup_cosine", "warmup_steps": k, "decay_steps": d, "min_lr": m}
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
    lr_checks = CHECKS[name]["lr"] if name in CHECKS else _PLUGIN_LR
    out_v = [_checked(v, f"optimizer.schedule.values[{i}]", lr_checks) for i, v in enumerate(values)]
    return {"kind": "step", "boundaries": out_b, "values": out_v}


#: the checks on ``warmup_cosine``'s ``min_lr`` (its upper limit, ``lr``, is checked with the case's lr)
_MIN_LR = (Check("tfpar", "min_lr", "<", 0.0, "a learning rate is a number >= 0"),)


def _min_lr_at_most_lr(schedule: dict, lr: float) -> None:
    """``warmup_cosine`` decays: ``min_lr <= lr`` (the module docstring says why)."""
    if schedule["kind"] == "warmup_cosine" and schedule["min_lr"] > lr:
        raise CaseError("optimizer.schedule.min_lr", f"a number <= lr {lr!r} (tfpar: warmup_cosine decays from lr to"
                        " min_lr; under native the torch side holds min_lr with ConstantLR(factor=min_lr / lr), and"
                        " torch.optim.lr_scheduler.ConstantLR refuses a factor > 1: 'Constant multiplicative factor"
                        " expected to be between 0 and 1')", schedule["min_lr"])


def validate_optimizer(o: Any) -> dict:
    """Validate the ``optimizer`` section and fill in every default (see the module docstring).

    An optimizer the built-ins do not know (a name outside :data:`OPTIMIZERS`, or a
    hyperparameter its name does not take) is kept as data for plugins
    (:func:`plugins_only`); the built-ins refuse it when they are asked to run it
    (:func:`builtin_refusal`), with the line this function would have given.
    """
    o = obj(o, "optimizer")
    if plugins_only(o):
        return _as_data(o)
    return _strict(o)


def _strict(o: dict) -> dict:
    no_extra(o, _OPT_KEYS, "optimizer")
    name = choice(need(o, "name", "optimizer"), "optimizer.name", OPTIMIZERS)
    semantics = choice(o.get("semantics", "native"), "optimizer.semantics", SEMANTICS)
    allowed = HYPERPARAMETERS[name]
    for key in _ALL_HP:
        if key in o and key not in allowed:
            raise CaseError(f"optimizer.{key}", f"no such hyperparameter for {name} (it takes: " + ", ".join(["lr", *allowed]) + ")")
    schedule = validate_schedule(o.get("schedule", {"kind": "constant"}), name)
    if schedule["kind"] == "step":
        v0 = schedule["values"][0]
        lr = _checked(o.get("lr", v0), "optimizer.lr", CHECKS[name]["lr"])
        if lr != v0:
            raise CaseError("optimizer.lr", f"the step schedule's first value {v0!r} (or leave lr out)", lr)
    else:
        lr = _checked(need(o, "lr", "optimizer"), "optimizer.lr", CHECKS[name]["lr"])
    if lr == 0.0 and schedule["kind"] != "constant":
        where = "optimizer.lr" if "lr" in o or schedule["kind"] != "step" else "optimizer.schedule.values[0]"
        raise CaseError(where, f"a number > 0 with a {schedule['kind']} schedule (tfpar refuses lr 0 there: the torch"
                        " side's LambdaLR factor is lr_t / lr, torchref.optimizers.make_scheduler; torch.optim and"
                        " Keras accept 0, and a constant schedule takes it)", lr)
    _min_lr_at_most_lr(schedule, lr)
    out: dict[str, Any] = {"name": name, "semantics": semantics, "lr": lr}
    defaults = DEFAULTS[name]["torch" if semantics == "torch" else "tf"]
    for key in allowed:
        out[key] = _hyperparameter(key, o.get(key, defaults[key]), name)
    if name == "rmsprop":
        _rmsprop_divides_by_zero(out)
    out["schedule"] = schedule
    if "no_decay" in o:
        out["no_decay"] = _no_decay(o["no_decay"])
    rounding = choice(o.get("keras_rounding", "none"), "optimizer.keras_rounding", KERAS_ROUNDING)
    if rounding != "none":  # carried only when it changes something, so other cases keep their spec
        if semantics != "tf":
            raise CaseError("optimizer.keras_rounding", "none unless semantics is tf (it says how a Keras optimizer"
                            " rounds Keras' own rule)", rounding)
        out["keras_rounding"] = rounding
    return out


# ------------------------------------------------------ optimizers only plugins know

#: the one check on a plugins-only optimizer's learning rate (no framework class to quote)
_PLUGIN_LR = (Check("tfpar", "lr", "<", 0.0, "a learning rate is a number >= 0"),)


def _as_data(o: dict) -> dict:
    """A plugins-only optimizer: ``name``, ``semantics``, ``lr``, ``schedule`` checked, every other key kept as given.

    Other hyperparameters must be named like identifiers and hold a finite number, ``true``/``false``
    or a short string; the plugins read them from ``run.spec["optimizer"]``.
    """
    name = o["name"]
    semantics = choice(o.get("semantics", "native"), "optimizer.semantics", SEMANTICS)
    schedule = validate_schedule(o.get("schedule", {"kind": "constant"}), name)
    lr_default = schedule["values"][0] if schedule["kind"] == "step" else None
    lr = _checked(o["lr"] if "lr" in o else (lr_default if lr_default is not None else need(o, "lr", "optimizer")),
                  "optimizer.lr", _PLUGIN_LR)
    _min_lr_at_most_lr(schedule, lr)
    out: dict[str, Any] = {"name": name, "semantics": semantics, "lr": lr}
    if "no_decay" in o:
        out["no_decay"] = _no_decay(o["no_decay"])
    for key in sorted(set(o) - {"name", "semantics", "lr", "schedule", "no_decay"}):
        v, path = o[key], f"optimizer.{key}"
        if not isinstance(key, str) or not key.isidentifier():
            raise CaseError("optimizer", "hyperparameter names like identifiers", key)
        if isinstance(v, bool) or (isinstance(v, str) and len(v) <= 200):
            out[key] = v
        elif isinstance(v, (int, float)) and math.isfinite(v):
            out[key] = v
        else:
            raise CaseError(path, "a finite number, true/false or a short string (kept as data for the plugins)", v)
    out["schedule"] = schedule
    return out


def _no_decay(v: Any) -> list[str]:
    """``optimizer.no_decay``: a non-empty list of distinct, non-empty patterns (module docstring)."""
    if not isinstance(v, list) or not v or len(v) > 64:
        raise CaseError("optimizer.no_decay", "a list of 1 to 64 parameter patterns (a kind such as \"bias\", or a"
                        " glob over canonical names such as \"3.*\")", v)
    for i, p in enumerate(v):
        if not isinstance(p, str) or not p or len(p) > 200 or p != p.strip():
            raise CaseError(f"optimizer.no_decay[{i}]", "a non-empty pattern without surrounding spaces", p)
    if len(set(v)) != len(v):
        raise CaseError("optimizer.no_decay", "distinct patterns", v)
    return list(v)


def check_no_decay(optimizer: dict, names: list[str]) -> None:
    """Every ``optimizer.no_decay`` pattern names at least one of the model's trainable parameters ``names``.

    A pattern that names none is a typo (``biases``), not a decision: one line naming it and the names there are.
    """
    for i, p in enumerate(optimizer.get("no_decay") or ()):
        if not any(pattern_matches(p, n) for n in names):
            shown = ", ".join(names[:12]) + (f" and {len(names) - 12} more" if len(names) > 12 else "")
            raise CaseError(f"optimizer.no_decay[{i}]", f"a pattern naming a trainable parameter (the model's: {shown})",
                            p)


#: hyperparameter names of a plugins-only optimizer that say what a case field already says (GPT trainers'
#: ``grad_clip``, ``gradient_accumulation_steps``, ``no_decay_params``, ``warmup_iters``): the field, and how
_CASE_FIELDS = (
    (("clip",), 'parallel.clip {"global_norm": c, "where": "after_combine"}'),
    (("accum", "micro_batch", "microbatch"), "parallel.accumulate: k"),
    (("decay_exclude", "exclude_from", "no_decay", "nodecay", "param_group"), 'optimizer.no_decay: ["bias", ...]'),
    (("warmup", "cosine", "decay_steps", "decay_iters", "min_lr"),
     'optimizer.schedule {"kind": "warmup_cosine", "warmup_steps": k, "decay_steps": d, "min_lr": m}'),
)


def case_fields_for(optimizer: dict) -> list[str]:
    """For a plugins-only ``optimizer``, each key that a case field expresses, with that field (one text each).

    ``{"name": "adamw", ..., "grad_clip": 1.0}`` gives ``['optimizer.grad_clip: parallel.clip {...}']``: said
    there, the optimizer is one the tool knows and theory predicts what it does.
    """
    known = {"name", "lr", "semantics", "schedule", "keras_rounding", "no_decay"}
    out = []
    for key in sorted(set(optimizer) - known):
        low = key.lower()
        for words, field in _CASE_FIELDS:
            if any(w in low for w in words):
                out.append(f"optimizer.{key}: {field}")
                break
    return out


def builtin_refusal(optimizer: dict, impl: str) -> CaseError | None:
    """The one-line error a built-in ``impl`` gives for a plugins-only ``optimizer`` (``None`` when it can run it)."""
    if not plugins_only(optimizer):
        return None
    try:
        _strict(dict(optimizer))
    except CaseError as e:
        out = CaseError(e.field, f"{e.expected} for the built-in {impl} (a case whose implementations are all"
                                 " plugins may name any optimizer and hyperparameter: they are kept as data)")
        text = str(e)
        if ", got " in text:
            out.args = (f"{out}, got {text.split(', got ', 1)[1]}",)
        return out
    return None
