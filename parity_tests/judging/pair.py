"""One pair's verdict with every guard, and what theory's prediction makes of it.

The free comparison (``session.comparison.compare_case``) and lockstep (``session.lockstep``) both judge
a pair through :func:`judge_sides` (a rule, then every guard) and settle theory's prediction
through :func:`resolve`, so neither can pass what the other fails.

:func:`judge_sides` applies, in order:

1. the rule the pair is judged by (``rules``/``perturbation``: float64 bound, float32 noise floor or
   perturbation floor), with no expectation attached;
2. the non-finite guard: a NaN or Inf anywhere (loss and gradients included) is never
   parity: one side is a divergence, both alike is no verdict (``error``);
3. the findings guard: a run that found a divergence within itself (DDP replicas out of
   sync) makes every pair it is in a divergence;
4. the vacuity guard (:func:`vacuity`): a pair in which nothing was really compared is
   ``inconclusive`` (docs/tolerance.md, "The verdict"), never parity.

:func:`resolve` then applies the prediction (``theory.predict``): a divergence is an
``expected_difference`` only where a predicted difference explains the whole gap. Where a
side the tool controls can be mapped onto the other (``theory.mapping_changes``), the pair
is judged again with the difference mapped away (the *residual*): it must be parity. Where
nothing can be mapped, the first stage at which the two runs part must not come before the
earliest stage theory predicts, nor be the logged loss alone (``record``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from parity_tests.judging.bfloat16 import judge_bfloat16
from parity_tests.judging.bounds import SCALE_FLOOR
from parity_tests.judging.compare import compare_trajectories, first_nonfinite
from parity_tests.judging.localise import STAGES, bound_at
from parity_tests.judging.perturbation import judge_perturbation
from parity_tests.judging.rules import judge_float32, judge_float64
from parity_tests.judging.theory import Prediction
from parity_tests.judging.verdict import RULE_NONFINITE, Verdict
from parity_tests.judging.zero_gradient import ZeroGradients
from parity_tests.protocol.rows import iter_rows

__all__ = ["Side", "judge_sides", "vacuity", "resolve", "Resolution", "RULE_REPLICAS", "RULE_VACUOUS",
           "with_findings", "OK_STATUSES"]

RULE_REPLICAS = "replicas in sync"
RULE_VACUOUS = "nothing compared"
#: ``tfpar compare`` exits 0 when every pair has one of these (docs/tolerance.md, "The verdict")
OK_STATUSES = ("parity", "expected_difference")


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


def with_findings(src: Mapping[str, Any], out: dict[str, Any]) -> dict[str, Any]:
    """``out`` carrying ``src``'s ``findings`` (a copy of a trajectory must not drop what the run found)."""
    from parity_tests.protocol.trajectory import Trajectory

    found = list(getattr(src, "findings", ()))
    if not found:
        return out
    t = Trajectory(out)
    t.findings.extend(found)
    return t


def judge_sides(dtype: str, a: Side, b: Side, *, rule: str, known: Iterable[str] = (),
                grads: Iterable[Mapping[str, Any]] = (), perturbation: Mapping[str, Any] | None = None,
                bfloat16: tuple[Any, Any] | None = None, zero: ZeroGradients | None = None) -> Verdict:
    """The verdict on ``b`` against ``a`` by ``rule``, with every guard (module docstring); no expectation.

    Args:
        dtype: the case dtype.
        a, b: the reference's and the judged implementation's runs.
        rule: ``float64`` (float64 cases, and float32 cases whose sides both run float64) or
            ``perturbation`` (a side that runs only float32, and mixed_bfloat16).
        known: documented differences to name in the verdict.
        grads: other runs of the case whose gradients may bound the loss's sensitivity
            (``loss_channel.loss_sensitivity``).
        perturbation: keyword arguments of ``perturbation.judge_perturbation`` (``rule``, ``perturbed``, ``loss``).
        bfloat16: for a mixed_bfloat16 pair whose sides ran float64 and their reruns, the two
            ``judging.bfloat16.Side``: judged by ``judge_bfloat16`` (``perturbation``'s ``loss`` applies).
        zero: the case's parameters whose exact gradient is zero (``zero_gradient.zero_gradients``), judged
            against their rounding drift by the float64 rule.
    """
    known = tuple(known)
    if any(np.size(s.run.get("loss", ())) == 0 for s in (a, b)):
        nan = float("nan")
        return Verdict("inconclusive", RULE_VACUOUS, nan, nan, None, None, np.zeros(0), None,
                       "inconclusive: no steps were run", known)
    if dtype == "float64":
        v = judge_float64(a.f64 if a.f64 is not None else a.run, b.f64 if b.f64 is not None else b.run,
                          known_differences=known, grads=grads, zero=zero)
    elif bfloat16 is not None:
        v = judge_bfloat16(*bfloat16, known_differences=known, loss=(perturbation or {}).get("loss"))
    elif rule == "perturbation":
        v = judge_perturbation(a.run, b.run, a32p=a.perturbed, b32p=b.perturbed, known_differences=known,
                               **(perturbation or {}))
    else:
        v = judge_float32(a.run, b.run, a64=a.f64, b64=b.f64, known_differences=known, grads=grads, zero=zero)
    v = _nonfinite_guard(v, a.run, b.run)
    v = _both_nonfinite(v, a.run, b.run)
    v = _findings_guard(v, a.run, b.run)
    why = vacuity(a.run, b.run, v)
    if why is not None:
        v = dataclasses.replace(v, status="inconclusive", rule=RULE_VACUOUS,
                                detail=f"inconclusive: {why}; {v.detail}")
    return v


def _nonfinite_guard(verdict: Verdict, a: Mapping[str, Any], b: Mapping[str, Any]) -> Verdict:
    """Never let a NaN or Inf anywhere (loss and gradients included) pass as parity.

    The tolerance model judges parameters and the loss; a run whose gradients overflow
    while its parameters are still finite has not trained as intended. One side
    non-finite is a divergence; both, at the same place, is no verdict (``error``).
    """
    if verdict.status not in ("parity", "unexpected_parity"):
        return verdict
    fa, fb = first_nonfinite(a, "A"), first_nonfinite(b, "B")
    if fa is None and fb is None:
        return verdict
    where = compare_trajectories(a, b, rtol=0.0, atol=0.0, equal_nan=True).first_nonfinite or (fa or fb)
    status = "error" if fa and fb else "divergence"
    return dataclasses.replace(verdict, status=status, rule=RULE_NONFINITE,
                               detail=f"{where}; the values before that point: {verdict.detail}")


def _both_nonfinite(verdict: Verdict, a: Mapping[str, Any], b: Mapping[str, Any]) -> Verdict:
    """Both runs non-finite, not alike: no verdict (``error``), not a divergence.

    A rule calls a NaN on one side where the other is still finite a divergence. When the other
    side turns non-finite too, later or elsewhere (Adam with ``epsilon = 0`` divides ``0 / 0``
    wherever a gradient element is exactly zero, and which elements round to exactly zero is
    rounding), the runs have both left the numbers: which one left first is not a verdict on
    the update rule.
    """
    if verdict.rule != RULE_NONFINITE or verdict.status != "divergence":
        return verdict
    fa, fb = first_nonfinite(a, "A"), first_nonfinite(b, "B")
    if fa is None or fb is None:
        return verdict
    return dataclasses.replace(verdict, status="error", detail=f"both runs become non-finite ({fa}; {fb}): no verdict"
                                                              f" on non-finite values; {verdict.detail}")


def _findings_guard(verdict: Verdict, a: Mapping[str, Any], b: Mapping[str, Any]) -> Verdict:
    """A run that found a divergence within itself (DDP replicas out of sync) is never at parity."""
    found = [*getattr(a, "findings", ()), *getattr(b, "findings", ())]
    if not found:
        return verdict
    return dataclasses.replace(verdict, status="divergence", rule=RULE_REPLICAS,
                               detail="; ".join(found) + f"; between the implementations: {verdict.detail}")


def _moved(traj: Mapping[str, Any], bound: float) -> bool:
    """Whether any ``param/*`` or ``state/*`` array leaves its row 0 by more than ``bound`` (relative)."""
    for key in traj:
        if not isinstance(key, str) or not key.startswith(("param/", "state/")):
            continue
        rows = iter_rows(traj[key])
        first = None
        for _, chunk in rows:
            chunk = np.asarray(chunk, np.float64)
            if first is None:
                first = chunk[0]
            scale = max(float(np.max(np.abs(first), initial=0.0)), SCALE_FLOOR)
            with np.errstate(invalid="ignore"):
                if np.nanmax(np.abs(chunk - first), initial=0.0) / scale > bound:
                    return True
    return False


def vacuity(a: Mapping[str, Any], b: Mapping[str, Any], verdict: Verdict) -> str | None:
    """Why nothing was really compared between ``a`` and ``b`` (docs/tolerance.md, "The verdict"), or ``None``.

    In order: no steps; a loss non-finite on both sides from the first step; every recorded
    gradient exactly zero at every step; no parameter or state array moving beyond the
    verdict's bound on either side (a learning rate of 0, or too small to move a float32
    number); a loss exactly constant over two or more steps on both sides (a logged constant,
    or a loss that nothing changes). A divergence found in the logged loss alone is no
    comparison of training either where nothing moves (docs/tolerance.md, "The verdict"): the first four
    apply to it too; a constant loss only to a pair that would otherwise pass.
    """
    nonfinite_error = verdict.status == "error" and verdict.rule == RULE_NONFINITE
    if verdict.status not in ("parity", "unexpected_parity", "divergence") and not nonfinite_error:
        return None
    if verdict.status == "divergence" and verdict.rule in (RULE_NONFINITE, RULE_REPLICAS):
        return None
    la, lb = (np.asarray(t.get("loss", np.zeros(0)), np.float64) for t in (a, b))
    if la.size == 0 or lb.size == 0:
        return "no steps were run"
    if not np.isfinite(la[0]) and not np.isfinite(lb[0]):
        return "the loss is not finite from the first step on both sides"
    if nonfinite_error:
        return None
    grads = [t[k] for t in (a, b) for k in t if isinstance(k, str) and k.startswith("grad/")]
    if grads and all(not np.any(np.asarray(chunk)) for g in grads for _, chunk in iter_rows(g)):
        return "every recorded gradient is exactly zero at every step"
    bound = max(bound_at(verdict, 0), 0.0) if np.isfinite(verdict.bound) else 0.0
    if not _moved(a, bound) and not _moved(b, bound):
        return (f"no parameter moves on either side (every step leaves every parameter within {bound:.2g} of its"
                " initial value, relative): a learning rate of 0, or updates too small for the dtype")
    if verdict.status != "divergence" and la.size >= 2 and np.all(la == la[0]) and np.all(lb == lb[0]):
        return f"the loss is the same number ({la[0]:.6g}) at every step on both sides"
    return None


@dataclass(frozen=True)
class Resolution:
    """What :func:`resolve` made of a pair: the final verdict and what the report says beside it."""

    verdict: Verdict
    residual: Verdict | None = None  #: the pair judged with the predicted differences mapped away
    notes: tuple[str, ...] = ()  #: lines for the report (why a prediction was dropped, ...)
    explained: bool = False  #: a divergence fully explained by theory (the residual is parity)
    #: the residual decided ``verdict``: its figures judge the mapped runs, except under ``unexpected_parity``,
    #: where they are the pair's own as it ran (the residual's are in the detail)
    from_residual: bool = False


def _earliest(pred: Prediction) -> str | None:
    stages = [d.first_visible for d in pred.differences if d.expected]
    return min(stages, key=STAGES.index) if stages else None


def _named(pred: Prediction) -> str:
    return "; ".join(d.text.split(":", 1)[0] for d in pred.differences if d.expected)


def _figures(v: Verdict) -> str:
    if v.status == "parity":
        return f"parity, gap {v.gap:.3g} <= {v.bound:.3g}"
    first = v.detail.splitlines()[0] if v.detail else ""
    return f"{v.status} ({v.rule}), gap {v.gap:.3g} against {v.bound:.3g}: {first}"


def resolve(v: Verdict, pred: Prediction, *, residual: Verdict | None = None, stage: str | None = None,
            mapping: str | None = None) -> Resolution:
    """Apply theory's prediction to the pair's verdict ``v`` (judged with nothing mapped).

    Args:
        v: :func:`judge_sides`'s verdict on the pair as it ran.
        pred: ``theory.predict`` for the pair at the case's values.
        residual: :func:`judge_sides`'s verdict with every expected difference (and every
            known one that has a mapping) mapped away on a side the tool controls, or
            ``None`` where no such side can take them all.
        stage: the first stage where the runs part (``localise``), when ``v`` is not parity.
        mapping: what was mapped, one line (for the detail).
    Returns:
        the final verdict: ``expected_difference`` where the prediction explains the whole gap
        (the residual is parity, or, without a residual, the runs part no earlier than theory
        says); ``divergence`` naming both where it does not; ``unexpected_parity`` where a
        predicted difference that must show did not; ``parity`` where the prediction is below
        the bound at these values.
    """
    known = pred.known + pred.expected
    v = dataclasses.replace(v, known_differences=known)
    if v.status in ("error", "inconclusive"):
        return Resolution(v, residual)
    expected = [d for d in pred.differences if d.expected]
    mapped = f" ({mapping})" if mapping else ""
    # a certain difference shows in the logged loss (or, for the moving statistics, the state): only
    # where the verdict judged the loss is its absence a finding, with or without a mapping
    loss_judged = v.per_step_loss_bound is not None and bool(np.isfinite(v.per_step_loss_bound).any())
    must_show = bool(expected) and all(d.certain and (loss_judged or d.stage == "state") for d in expected)
    if v.status == "parity" and must_show:
        return Resolution(dataclasses.replace(v, status="unexpected_parity", detail=(
            f"a difference was predicted ({_named(pred)}) but none was found. {v.detail}")), residual)
    if residual is not None:
        residual = dataclasses.replace(residual, known_differences=known)
        # nothing left to compare once the difference is mapped away (e.g. a learning rate of 0 where only the
        # logged loss differed): nothing is left unexplained either
        if residual.status in ("parity", "inconclusive"):
            if not expected:  # known differences only: the mapped verdict is the verdict (the unmapped gap beside it)
                return Resolution(residual, residual, explained=v.status != "parity", from_residual=True)
            if v.status == "divergence":
                return Resolution(dataclasses.replace(v, status="expected_difference", detail=(
                    f"as predicted ({_named(pred)}), a difference was found; with it mapped{mapped}: "
                    f"{_figures(residual)}. {v.detail}")), residual, explained=True)
            return Resolution(v, residual, notes=(
                f"predicted ({_named(pred)}) but below the bound at these values: the pair is at parity with and"
                f" without the mapping{mapped}",))
        if v.status == "parity" and expected:
            # the pair's own figures (its gap, bound, rule): the runs that part are the mapped ones (a
            # built-in run with the other convention, or a stand-in), whose gap is in the detail and the
            # residual, never in the pair's gap column
            return Resolution(dataclasses.replace(v, status="unexpected_parity", detail=(
                f"a difference was predicted ({_named(pred)}) but none was found (gap {v.gap:.3g} <= {v.bound:.3g}),"
                f" and with it mapped{mapped} the pair parts: {_figures(residual)}")), residual, from_residual=True)
        why = (f"theory predicted {_named(pred)}" if expected else f"theory names {'; '.join(pred.known)}")
        return Resolution(dataclasses.replace(residual, status="divergence" if residual.status != "error" else "error",
                                              detail=f"{why}, but with it mapped{mapped} the pair still parts: "
                                                     f"{residual.detail}"), residual, from_residual=True)
    if not expected:
        if v.status == "divergence" and pred.known:
            first, _, rest = v.detail.partition("\n")
            v = dataclasses.replace(v, detail=first + f" (known differences attached: {'; '.join(pred.known)})"
                                    + (("\n" + rest) if rest else ""))
        return Resolution(v)
    earliest = _earliest(pred)
    if v.status == "parity":
        return Resolution(v, notes=(
            f"predicted ({_named(pred)}) where the values make it large enough; at these values it stays within the"
            " bound (no side the tool controls could map it to measure it)",))
    # a divergence, nothing mapped: the stage is the only check that it is the predicted one
    unjudged = (*v.unjudged, "whether the predicted difference explains the whole gap (no side the tool controls"
                             " can map it away)")
    if stage == "record" or (stage is not None and earliest is not None and stage in STAGES
                             and STAGES.index(stage) < STAGES.index(earliest)):
        where = ("only the logged loss differs while the computation agrees" if stage == "record"
                 else f"it appeared first at {stage}")
        return Resolution(dataclasses.replace(v, status="divergence", unjudged=unjudged, detail=(
            f"not the predicted difference: theory predicted {_named(pred)} first at {earliest}, but {where}. "
            f"{v.detail}")))
    return Resolution(dataclasses.replace(v, status="expected_difference", unjudged=unjudged, detail=(
        f"as predicted ({_named(pred)}), a difference was found"
        + (f", first at {stage}" if stage else "") + f". {v.detail}")), explained=True)

