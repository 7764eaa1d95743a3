"""The verdict: a judge's decision, the rule that made it, and the figures behind it.

:class:`Verdict` is what every rule returns (:mod:`parity_tests.judging.rules`,
:mod:`parity_tests.judging.perturbation`, :mod:`parity_tests.judging.bfloat16`) and what
``report.json`` holds (:meth:`Verdict.to_dict`). The statuses and the rules' names are the
ones docs/tolerance.md lists ("The verdict"); the helpers below apply what the caller said
before judging (an expected difference, documented known differences) the same way for
every rule.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

__all__ = [
    "STATUSES",
    "RULE_FLOAT64",
    "RULE_FLOAT32",
    "RULE_PERTURBATION",
    "RULE_BF16_PERTURBATION",
    "RULE_BF16_SIGNATURE",
    "RULE_NONFINITE",
    "RULE_STRUCTURE",
    "RULE_CONDITIONING",
    "Verdict",
    "EXIT_STATUS",
    "exit_status",
]

#: docs/tolerance.md, "The verdict". ``inconclusive``: nothing was really compared (``judging.pair.vacuity``)
STATUSES = ("parity", "divergence", "expected_difference", "unexpected_parity", "inconclusive", "error")
RULE_FLOAT64 = "float64 bound"
RULE_FLOAT32 = "float32 noise floor"
RULE_PERTURBATION = "float32 perturbation floor"
#: the perturbation rule for dtype mixed_bfloat16: inputs moved by one bfloat16 ulp (:mod:`parity_tests.judging.perturbation`)
RULE_BF16_PERTURBATION = "bfloat16 perturbation floor"
#: a mixed_bfloat16 run that does not compute in bfloat16 (:mod:`parity_tests.judging.perturbation`, "The bfloat16 signature")
RULE_BF16_SIGNATURE = "bfloat16 computation"
RULE_NONFINITE = "non-finite values"
RULE_STRUCTURE = "structure"
#: a float64 divergence that a one-ulp move of the inputs reproduces: an ill-conditioned run (``session.comparison``)
RULE_CONDITIONING = "float64 conditioning floor"

#: ``tfpar compare``'s exit status for each status (docs/tolerance.md, "The verdict"): 0 the
#: implementations agree as theory says; 1 something wrong was shown; 3 nothing could be judged
#: (nothing compared, or an implementation failed): neither right nor wrong was shown
EXIT_STATUS = {"parity": 0, "expected_difference": 0, "divergence": 1, "unexpected_parity": 1,
               "inconclusive": 3, "error": 3}


def exit_status(statuses: Iterable[str]) -> int:
    """The exit status for the pairs' ``statuses``: the worst one's, where 1 is worse than 3.

    A divergence beside an inconclusive pair is exit 1 (something wrong was shown); 3 only when
    nothing wrong was shown and some pair could not be judged. A status outside :data:`EXIT_STATUS`
    (``unsupported``: an implementation that does not run the case) is 1, as it was.
    """
    codes = {EXIT_STATUS.get(s, 1) for s in statuses}
    return 1 if 1 in codes else 3 if 3 in codes else 0


def _json(value: Any) -> Any:
    """JSON-ready: numpy to Python, non-finite floats as the strings "nan", "inf", "-inf"."""
    if isinstance(value, np.ndarray):
        return [_json(v) for v in value.tolist()]
    if isinstance(value, (list, tuple)):
        return [_json(v) for v in value]
    if isinstance(value, (float, np.floating)):
        v = float(value)
        return v if math.isfinite(v) else ("nan" if math.isnan(v) else ("inf" if v > 0 else "-inf"))
    if isinstance(value, np.integer):
        return int(value)
    return value


@dataclass(frozen=True, eq=False)
class Verdict:
    """A judge's decision with the figures that support it.

    Attributes:
        status: one of :data:`STATUSES`. ``"divergence"``: a difference beyond what
            rounding explains; ``"expected_difference"``: such a difference, where the
            caller said theory predicts one; ``"unexpected_parity"``: none found where
            one was predicted; ``"error"``: no verdict possible (missing arrays,
            different shapes, non-finite values on both sides).
        rule: the rule that decided (:data:`RULE_FLOAT64`, :data:`RULE_FLOAT32`,
            :data:`RULE_NONFINITE`, :data:`RULE_STRUCTURE`).
        gap: the rule's relative gap at its decisive step (for the float64 rule the
            greatest gap; for the float32 rule, whose bound varies, the step where
            ``gap / bound`` is greatest), so ``gap > bound`` exactly when the rule
            found a divergence. ``inf`` for a one-sided NaN/Inf.
        bound: the threshold applied at that step.
        floor_a, floor_b: greatest float32 noise floor of each side (float32 rule).
        per_step_gap: ``[steps+1]`` the rule's gap at every step (``nan``/``inf`` where
            values are non-finite, see :func:`relative_gap`).
        per_step_floor: ``[steps+1]`` ``max(floor_A, floor_B)`` (float32 rule) or ``None``.
        per_step_bound: ``[steps+1]`` the bound at every step, or ``None`` (float64: constant).
        step: the step at which ``gap`` and ``bound`` are read (for non-finite values:
            the first step with a NaN/Inf), or ``None``.
        key: the array holding ``gap`` at that step, e.g. ``"param/1.kernel"``, or ``None``.
        first_step: for a divergence, the first step over the bound (where to start
            looking; the mismatch message in ``detail`` is for this step), else ``None``.
            When both channels break, the one that breaks first decides ``key``, ``step``,
            ``gap`` and ``bound`` (at one step the loss comes first: it is computed before
            that step's update), so ``key == "loss"`` says the loss curve broke first.
        per_step_loss_gap, per_step_loss_bound: ``[steps]`` the loss channel's gap and
            bound at every step (row ``r`` is step ``r + 1``), or ``None`` where the loss
            was not judged (a bound of ``inf`` at a step: that step's loss was not judged).
        unjudged: what this verdict did not judge (a channel, some steps, a stage), one
            line each; printed with every status, parity included.
        detail: a line with the figures; for a divergence, followed by the comparator's
            mismatch message at the first failing step.
        known_differences: documented differences the caller attached; they explain,
            they never change the status.
        float64_runs: where the rule judged the pair beside its float64 runs (the bfloat16
            rule holds a mixed pair against each side's float64 run), the float64 rule on those
            two runs with their logged loss judged (``pair.judge_sides``), else ``None``: what
            ``pair.resolve`` reads to tell whether a difference theory says must show in exact
            arithmetic is absent. Also set on a float32 case's ``inconclusive`` (nothing moved beyond the
            float32 noise) whose float64 runs moved and agree (``rules.vacuity.Vacuity``): what
            ``session.mapping.stand_in_leg`` reads as a stand-in's showing. Held in the process only
            (not in :meth:`to_dict`).
    """

    status: str
    rule: str
    gap: float
    bound: float
    floor_a: float | None
    floor_b: float | None
    per_step_gap: np.ndarray
    per_step_floor: np.ndarray | None
    detail: str
    known_differences: tuple[str, ...] = ()
    per_step_bound: np.ndarray | None = None
    step: int | None = None
    key: str | None = None
    first_step: int | None = None
    per_step_loss_gap: np.ndarray | None = None
    per_step_loss_bound: np.ndarray | None = None
    unjudged: tuple[str, ...] = ()
    float64_runs: Verdict | None = None

    def __repr__(self) -> str:
        """One line a person reads (``Verdict(parity, float64 bound: gap 3.1e-16, bound 1e-10 at step 3,
        param/0.kernel)``), never the per-step arrays: they are attributes."""
        where = "" if self.step is None else f" at step {self.step}" + ("" if self.key is None else f", {self.key}")
        first = "" if self.first_step is None else f"; first over the bound at step {self.first_step}"
        return f"Verdict({self.status}, {self.rule}: gap {self.gap:.3g}, bound {self.bound:.3g}{where}{first})"

    @property
    def diverged(self) -> bool:
        """True when a difference beyond rounding was found (expected or not)."""
        return self.status in ("divergence", "expected_difference")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Verdict:
        """The inverse of :meth:`to_dict` (``"nan"``/``"inf"`` strings back to floats)."""

        def num(x: Any) -> float | None:
            return None if x is None else float(x)

        def arr(x: Any) -> np.ndarray | None:
            return None if x is None else np.asarray([float(v) for v in x], dtype=np.float64)

        return cls(
            status=d["status"], rule=d["rule"], gap=float(d["gap"]), bound=float(d["bound"]),
            floor_a=num(d["floor_a"]), floor_b=num(d["floor_b"]), per_step_gap=arr(d["per_step_gap"]),
            per_step_floor=arr(d["per_step_floor"]), detail=d["detail"],
            known_differences=tuple(d["known_differences"]), per_step_bound=arr(d["per_step_bound"]),
            step=d["step"], key=d["key"], first_step=d["first_step"],
            per_step_loss_gap=arr(d.get("per_step_loss_gap")), per_step_loss_bound=arr(d.get("per_step_loss_bound")),
            unjudged=tuple(d.get("unjudged", ())),
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (``json.dumps(..., allow_nan=False)`` works): non-finite floats as strings."""
        return {
            "status": self.status,
            "rule": self.rule,
            "gap": _json(self.gap),
            "bound": _json(self.bound),
            "floor_a": _json(self.floor_a),
            "floor_b": _json(self.floor_b),
            "per_step_gap": _json(self.per_step_gap),
            "per_step_floor": None if self.per_step_floor is None else _json(self.per_step_floor),
            "per_step_bound": None if self.per_step_bound is None else _json(self.per_step_bound),
            "step": self.step,
            "key": self.key,
            "first_step": self.first_step,
            "per_step_loss_gap": None if self.per_step_loss_gap is None else _json(self.per_step_loss_gap),
            "per_step_loss_bound": None if self.per_step_loss_bound is None else _json(self.per_step_loss_bound),
            "detail": self.detail,
            "known_differences": list(self.known_differences),
            "unjudged": list(self.unjudged),
        }


def _known(known_differences: Iterable[str]) -> tuple[str, ...]:
    if isinstance(known_differences, str):
        return (known_differences,)
    out = tuple(known_differences)
    for name in out:
        if not isinstance(name, str) or not name:
            raise TypeError(f"known_differences must be non-empty strings, got {name!r}")
    return out


def _finish(
    status: str, expect_difference: bool, detail: str, known: tuple[str, ...]
) -> tuple[str, str]:
    if status == "divergence" and expect_difference:
        status = "expected_difference"
        detail = "as predicted, a difference was found. " + detail
    elif status == "parity" and expect_difference:
        status = "unexpected_parity"
        detail = "a difference was predicted but none was found. " + detail
    elif status == "divergence" and known:
        first, _, rest = detail.partition("\n")
        detail = (
            first
            + f" (known differences attached: {'; '.join(known)})"
            + (("\n" + rest) if rest else "")
        )
    return status, detail


def _error(rule: str, detail: str, known: tuple[str, ...]) -> Verdict:
    return Verdict("error", rule, math.nan, math.nan, None, None, np.zeros(0), None, detail, known)


def _finished(v: Verdict, expect_difference: bool, known: tuple[str, ...]) -> Verdict:
    status, detail = _finish(v.status, expect_difference, v.detail, known)
    return replace(v, status=status, detail=detail, known_differences=known)


def _first_line_plus(detail: str, note: str) -> str:
    head, _, rest = detail.partition("\n")
    return head + note + (("\n" + rest) if rest else "")

