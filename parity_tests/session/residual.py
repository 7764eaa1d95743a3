"""One pair resolved against theory, the same way in the free compare and in ``--lockstep`` (each of its steps).

The pair as it ran, its residual with the predicted differences mapped away (a built-in's mapped
runs, a stand-in's shown equivalent first: ``mapping.stand_in_leg``; the programs rerun with
Keras' distribution loss scale exact: ``loss_scale``), and ``pair.resolve`` of the one against
the other. What differs between the two callers is only where their runs live: the free
compare's are whole trajectories by ``keys.RunKey`` (``judge_pair._Judged``), lockstep's are one
step's runs from a shared start (``lockstep._judge_steps``). Each hands its runs over as
:class:`Legs`: a run of the pair is named by a *leg* (any hashable: ``(impl, mapping key)`` there,
``"a"``, ``"sm"``, ... here), and :func:`resolve_pair` asks the legs for verdicts and stages.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from parity_tests.judging.pair import Resolution, resolve
from parity_tests.judging.precision_leak import not_float64
from parity_tests.judging.predicted_scale import (
    SUM_REDUCTION,
    check_scale,
    clip_of,
    predicted_scale,
)
from parity_tests.judging.theory import Prediction
from parity_tests.judging.verdict import Verdict
from parity_tests.protocol.engine import EngineSpec
from parity_tests.session.loss_scale import without_loss_scale
from parity_tests.session.mapping import SideMapping, float64_shown, residual_unjudged, stand_in_leg

__all__ = ["Leg", "Legs", "Resolved", "resolve_pair", "scale_checked"]

Leg = Hashable


class Legs(Protocol):
    """A caller's runs of one pair, as :func:`resolve_pair` reads them."""

    def as_ran(self) -> Verdict:
        """The pair's rule (and every guard of the pair as it ran) on its own runs."""
        ...

    def verdict(self, a: Leg, b: Leg) -> Verdict:
        """The pair's rule (and its guards) on the runs ``a`` (the reference's side) and ``b``."""
        ...

    def stage(self, a: Leg, b: Leg, verdict: Verdict, refine: bool = False) -> str | None:
        """Where the runs ``a`` and ``b`` part (``localise``'s stage of ``verdict``), refined by a capture of the step
        where ``refine`` asks and the recorded channels cannot tell."""
        ...

    def leaky(self, legs: Sequence[Leg]) -> bool:
        """Whether a float64 run of ``legs`` computes its loss in float32 (``judging.precision_leak``)."""
        ...


@dataclass(frozen=True)
class Resolved:
    """What :func:`resolve_pair` found of one pair (or one lockstep step)."""

    as_ran: Verdict  # the pair's rule on its runs as they ran
    resolution: Resolution  # pair.resolve of it against the prediction and the residual
    final: Verdict  # the resolution's verdict, saying where no residual was judged and why
    residual: Verdict | None  # the pair with the predicted differences mapped away, or None
    decided: tuple[Leg, Leg]  # the legs whose verdict is the residual (the pair's own where none)
    not_judged: str | None  # why no residual was judged ("residual not judged: no equivalent run: ...")
    judged: Prediction  # the prediction the runs were held against (without the loss scale where it was mapped)
    staged: tuple[Verdict, Leg, Leg]  # the verdict and legs where the pair's stage is read
    text: str | None  # what was mapped, one line


def resolve_pair(legs: Legs, a: Leg, b: Leg, pred: Prediction, *, impl_is_b: bool = True,
                 mapping: SideMapping | None = None, mapped: Leg | None = None, stand: Leg | None = None,
                 exact_a: Leg | None = None, exact_b: Leg | None = None, exact_text: str | None = None,
                 apart: str | None = None, computes: str | None = None) -> Resolved:
    """The pair ``(a, b)`` judged as it ran and with its predicted differences mapped away, resolved by theory.

    ``mapping``: the side run with the other's semantics (``mapping.choose_mapping``), whose runs are
    ``mapped``; where it stands in for a plugin, ``stand`` is the built-in as the plugin runs, and
    the residual is judged through it only once it is shown to compute what the plugin computes
    (``mapping.stand_in_leg``; ``apart``: what theory expects to differ between them). ``exact_a``,
    ``exact_b``: a side's program rerun with Keras' loss scale exact (``loss_scale.ExactScale``),
    which stands for that side wherever the residual takes part, beside ``mapping`` or alone; where a
    stand-in is no equivalent run the exact reruns are still the programs themselves: at parity
    they are the residual, else the stage where they part is held against the prediction without
    the loss scale. ``computes``: why the side other than ``mapping``'s computes the case as given
    (``mapping.stand_in_leg``'s: the stand-in's leg then decides where it parts before the update). Where no
    residual is judged, ``pair.resolve`` holds the stage where the pair parts
    (``legs.stage``) against theory's; it is asked only then.
    """
    ea, eb = exact_a if exact_a is not None else a, exact_b if exact_b is not None else b
    exact = exact_a is not None or exact_b is not None
    v = legs.as_ran()
    residual: Verdict | None = None
    decided: tuple[Leg, Leg] = (a, b)
    not_judged: str | None = None
    if mapping is None and exact:  # the loss scale alone: the exact rerun(s) against the other side
        residual, decided = legs.verdict(ea, eb), (ea, eb)
    if mapping is not None:
        decided = (ea, mapped) if impl_is_b else (mapped, eb)
        residual = legs.verdict(*decided)
        if mapping.stand_in:
            own = eb if impl_is_b else ea
            plain = legs.verdict(stand, own)
            decides, not_judged = stand_in_leg(plain, lambda: legs.stage(stand, own, plain, True), mapping, apart,
                                               legs.leaky((stand, own)), computes)
            if decides is not None:
                residual, decided = decides, (stand, own)
            elif not_judged is not None:
                residual, decided = None, (a, b)
    text = "; ".join(([mapping.text] if mapping is not None else []) + ([exact_text] if exact_text else [])) or None
    judged, staged = pred, (v, a, b)  # the prediction the stage is held against, and where the stage is read
    if residual is None and not_judged is not None and exact:
        # the stand-in computes another program, but the loss scale is mapped on the programs themselves
        # (session.loss_scale.without_loss_scale): their exact reruns, equivalent to them by construction
        ve = legs.verdict(ea, eb)
        # the loss scale alone explains the pair: a residual judged on equivalent runs; at parity, or (a float32
        # case whose float32 runs move nothing beyond their noise, lr 1e-7) with the float64 runs moving and agreeing
        # (``mapping.float64_shown``: what a float32 case is decided by first; the 10,000-pair hunt's seed 10, pair
        # 671: keras_fit_l2 against ddp_l2, the float64 loss 2^-25 apart by Keras' float32(1/3) and nothing else)
        if ve.status == "parity" or float64_shown(ve):
            residual, decided, not_judged, text = ve, (ea, eb), None, exact_text
        else:
            judged, staged = without_loss_scale(pred), (ve, ea, eb)
    stage = None
    if residual is None and staged[0].status not in ("parity", "inconclusive"):
        stage = legs.stage(staged[1], staged[2], staged[0])
    res = resolve(v, judged, residual=residual, stage=stage, mapping=text)
    return Resolved(v, res, residual_unjudged(res.verdict, not_judged), residual, decided, not_judged, judged,
                    staged, text)


def scale_checked(r: Resolved, spec: Mapping[str, Any], a: EngineSpec, b: EngineSpec,
                  a64: Mapping[str, Any] | None, b64: Mapping[str, Any] | None, *, exact: bool = False,
                  ) -> tuple[Verdict, dict[str, Any] | None]:
    """``r``'s verdict, an ``expected_difference`` with no residual judged held against the constant theory predicts.

    Where theory's expected difference makes the step's combined gradient an exact constant multiple
    of the reference's (``judging.predicted_scale``: the sum reduction's ``1/N``), the two float64
    runs' recorded gradients of the step both start from (the free compare's step 1, each lockstep
    step's one-step runs) are checked for it: a gradient that is not that multiple (another
    constant, or none) is a difference the prediction does not explain, and the pair is a
    divergence with both factors in its line. Not where the loss scale was mapped (``exact``: the
    exact reruns decide) or a float64 run computes its loss in float32. Returns the verdict and what
    the check found (``None`` where it did not apply or the prediction holds).
    """
    final = r.final
    if final.status != "expected_difference" or r.residual is not None or exact:
        return final, None
    scale = predicted_scale(spec, r.judged, a, b)
    if scale is None or any(x is None or not_float64(x) for x in (a64, b64)):
        return final, None
    found = check_scale(a64, b64, scale[0], clip=clip_of(spec))  # a clip after the combine: a ratio between 1/N and 1
    if found is None:
        return final, None
    said = next(d.text for d in r.judged.differences if d.text.startswith(SUM_REDUCTION))
    kept = tuple(u for u in final.unjudged if not u.startswith("whether the predicted difference explains"))
    detail = (f"theory predicted {said} ({scale[1]}), which does not explain the gap: {found['text']}; as it"
              f" ran: {r.as_ran.detail}")
    return dataclasses.replace(final, status="divergence", unjudged=kept, detail=detail), found
