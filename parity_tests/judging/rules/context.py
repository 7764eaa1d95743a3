"""What a rule of ``judging.rules`` is handed: before the runs, what each side declares (:class:`Planned`, from
which the rule says the runs it needs); after them, one pair's runs (:class:`Side` each) and what the session
knows of it (:class:`PairRuns`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from parity_tests.judging.zero_gradient import ZeroGradients

__all__ = ["Side", "PairRuns", "Can", "Planned"]


@dataclass(frozen=True)
class Can:
    """What one side of a pair declares it can run (its ``EngineSpec``), all a rule reads before any run is made."""

    float64: bool = True  # it runs the case in float64
    rerunnable: bool = True  # it can be run again from moved numbers (not a recorded run)
    #: it makes the case's float64 run that rounds the gradients as its mixed recipe does (``protocol.grad_rounding``:
    #: a built-in that runs mixed_bfloat16, on a case that run covers): known only where the session plans a case
    grads_bf16: bool = False


@dataclass(frozen=True)
class Planned:
    """One pair before its runs: the case dtype, how the session measures a float32 case's floor (``rule``:
    ``float64`` or ``perturbation``) and what each side declares (``a`` the reference, ``b`` the judged side)."""

    dtype: str
    rule: str
    a: Can
    b: Can


@dataclass(frozen=True)
class Side:
    """One side's runs of a case, as the pair's rule needs them.

    Attributes:
        run: the case dtype's trajectory (float32, float64 or mixed_bfloat16).
        f64: the same case in float64 (the float64 and float32 rules), or ``None``.
        perturbed: the perturbed rerun (the perturbation rules), or ``None``.
    """

    run: Mapping[str, Any]
    f64: Mapping[str, Any] | None = None
    perturbed: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class PairRuns:
    """The pair ``(a, b)`` as ``pair.judge_sides`` hands it to each rule and check (its arguments, by name)."""

    dtype: str
    a: Side
    b: Side
    rule: str  # ``float64`` or ``perturbation``: how the session measures a float32 case's floor
    known: tuple[str, ...] = ()
    grads: tuple[Mapping[str, Any], ...] = ()
    perturbation: Mapping[str, Any] | None = None
    bfloat16: tuple[Any, Any] | None = None
    zero: ZeroGradients | None = None
