"""Which ``torch.optim`` optimizers a torch plugin's run made, and whether each is torch's rule for the case.

The judge predicts the frameworks' optimizer differences (Adam's epsilon placement, ...) for a
torch plugin only where its run updates with torch's own class for the case's optimizer, at the
case's values; a plugin that writes its update rule out (Keras' Adam by hand, say, or a
``torch.optim.Optimizer`` subclass with a ``step`` of its own such as
:class:`torchref.optimizers.KerasRule`) follows its own rule, and one that makes
``torch.optim.Adam`` where the case says ``adamw`` (or another ``eps``) follows another. So the
judge asks the run, as ``tfpar.keras_seen`` does on the TensorFlow side: every optimizer made while
:func:`torch_optimizers_seen` is active is reported with the class whose ``step`` it runs and every
parameter group's hyperparameters (value and type), and :func:`check_against_case` says whether
it is what :func:`torchref.optimizers.make_optimizer` makes for the case under ``native``.

What the record holds, per optimizer (plain Python values: it travels from the rank to the judge)::

    {"class": "AdamW", "rule": "torch.optim.Adam", "family": "torch.optim",
     "groups": [{"lr": 0.001, "lr_type": "float", "betas": [0.9, 0.999], "eps": 1e-08, ...}],
     "handed": True, "case_rule": True, "differs": ""}

``rule``: the class that defines the ``step`` it runs (``torch.optim.AdamW`` steps with Adam's,
``decoupled_weight_decay=True`` in its groups); ``family``: ``torch.optim`` where that class is
torch's, ``own`` where the user's code defines it; ``handed``: given to ``run.use_optimizer``.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Mapping
from typing import Any

import torch

__all__ = ["RULE_KEYS", "torch_optimizers_seen", "describe", "check_against_case", "mark_handed"]

#: the group entries that change the update rule, compared with the case's (the learning rate is not: a
#: program may make its optimizer with any rate and set ``group["lr"]`` every step, as GPT trainers do;
#: ``foreach``/``fused``/``capturable``/``differentiable`` choose kernels, not the formula)
RULE_KEYS = ("betas", "eps", "weight_decay", "momentum", "dampening", "nesterov", "amsgrad", "maximize",
             "decoupled_weight_decay", "alpha", "centered", "lr_decay", "initial_accumulator_value")
#: wrappers whose inner optimizer (made by them, and seen) is what updates the parameters
_WRAPPERS = ("ZeroRedundancyOptimizer",)


def _plain(v: Any) -> Any:
    """A hyperparameter as a plain Python value (a tensor's number; a tuple of betas as a list)."""
    if isinstance(v, torch.Tensor):
        return v.item() if v.numel() == 1 else v.tolist()
    if isinstance(v, (tuple, list)):
        return [_plain(x) for x in v]
    return v


def _type(v: Any) -> str:
    """``float`` for a Python number (torch computes with it in the parameter's dtype), else a tensor's dtype."""
    if isinstance(v, torch.Tensor):
        return str(v.dtype).removeprefix("torch.")
    return type(v).__name__


def _rule(opt: torch.optim.Optimizer) -> tuple[str, str]:
    """``(module, class)`` of the ``step`` ``opt`` runs.

    Read from the function itself, under its decorators (``inspect.unwrap``), not from the class
    that holds it: ``Optimizer.__init__`` patches a profiling wrapper of the inherited ``step`` into
    the subclass itself (``_patch_step_function``), so after the first ``AdamW`` is made ``AdamW``
    holds a ``step`` of its own that is Adam's.
    """
    fn = inspect.unwrap(type(opt).step)
    owner = getattr(fn, "__qualname__", "").rpartition(".")[0] or type(opt).__name__
    return getattr(fn, "__module__", "") or type(opt).__module__, owner


def describe(opt: torch.optim.Optimizer) -> dict[str, Any]:
    """One optimizer's record (module docstring), without ``handed`` / ``case_rule`` / ``differs``."""
    module, owner = _rule(opt)
    torch_own = module.startswith("torch.optim.")
    groups = [{**{k: _plain(v) for k, v in g.items() if k != "params"}, "lr_type": _type(g.get("lr"))}
              for g in opt.param_groups]
    return {"class": type(opt).__name__, "rule": f"torch.optim.{owner}" if torch_own else f"{module}.{owner}",
            "family": "torch.optim" if torch_own else "own", "groups": groups}


def check_against_case(record: Mapping[str, Any], case_optimizer: Mapping[str, Any]) -> tuple[bool, str]:
    """Whether ``record`` runs torch's class for the case's optimizer with the case's values; else what differs.

    The case's class is what :func:`torchref.optimizers.make_optimizer` makes under ``native``
    (one parameter, its first group); each of the record's groups must hold every :data:`RULE_KEYS`
    entry the case's does, a group's ``weight_decay`` 0 allowed where the case has ``no_decay``.
    An optimizer only plugins know (no class here for it) is never the case's rule.
    """
    from .optimizers import make_optimizer

    if record["family"] != "torch.optim":
        return False, f"{record['rule']} (its own step)"
    try:
        want = describe(make_optimizer({**case_optimizer, "semantics": "native", "no_decay": []},
                                       [torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))]))
    except (KeyError, ValueError, TypeError):
        return False, f"{record['class']}, and the case's {case_optimizer.get('name')!r} has no torch.optim class here"
    if want["rule"] != record["rule"]:
        return False, f"{record['class']} (steps with {record['rule']}), where the case's" \
                      f" {case_optimizer['name']} is {want['class']} ({want['rule']})"
    expected = want["groups"][0]
    for i, group in enumerate(record["groups"]):
        for k in RULE_KEYS:
            if k not in expected:
                continue
            got = group.get(k)
            if k == "weight_decay" and got == 0 and case_optimizer.get("no_decay"):
                continue
            if got != expected[k]:
                where = f" (group {i})" if len(record["groups"]) > 1 else ""
                return False, f"{record['class']} with {k}={got!r}{where}, where the case's" \
                              f" {case_optimizer['name']} makes {k}={expected[k]!r}"
    return True, ""


def mark_handed(seen: list[dict[str, Any]], objects: list[torch.optim.Optimizer],
                handed: torch.optim.Optimizer | None, case_optimizer: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The records of ``seen`` (made from ``objects``), each with ``handed`` and :func:`check_against_case`'s answer."""
    out = []
    for record, opt in zip(seen, objects, strict=True):
        ok, why = check_against_case(record, case_optimizer)
        out.append({**record, "handed": opt is handed, "case_rule": ok, "differs": why})
    return out


@contextlib.contextmanager
def torch_optimizers_seen() -> Iterator[tuple[list[dict[str, Any]], list[torch.optim.Optimizer]]]:
    """Record every ``torch.optim.Optimizer`` made inside the block: ``(records, the optimizers)``, in order.

    ``Optimizer.__init__`` (every torch optimizer's, and every subclass's that calls it) is
    wrapped for the block and restored after it, also when the block raises. A wrapper
    (``ZeroRedundancyOptimizer``) is left out: the inner optimizer it makes is what steps. The
    optimizers themselves are held only for the block's caller (:func:`mark_handed`), never sent.
    """
    seen: list[dict[str, Any]] = []
    objects: list[torch.optim.Optimizer] = []
    cls = torch.optim.Optimizer
    original = cls.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if type(self).__name__ not in _WRAPPERS:
            seen.append(describe(self))
            objects.append(self)

    cls.__init__ = __init__
    try:
        yield seen, objects
    finally:
        cls.__init__ = original
