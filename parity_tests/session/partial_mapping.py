"""Part of a prediction mapped on the parallel plugin itself, the rest held to the stage where it must first show.

Where theory expects differences that no one side can take (``mapping.choose_mapping``: one maps
only onto the parallel side, another only onto the other, e.g. "uneven shards with equal
weighting" onto a plugin that splits the batch and Keras' ``CosineDecay`` a step late on a
one-device built-in), no residual is judged, and the pair as it ran is held only to the stage where
the *earliest* predicted difference may show (``pair.resolve``). The uneven-shards weighting shows
in step 1's loss (``theory._EARLIEST``), so a bug that changes step 1's loss hid behind it: the
10,000-pair hunt's ``next_batch`` (every step reads the next step's batch) against ``tf_side.py:add_n``,
``expected_difference`` three times.

The differences of the parallel set-up (:data:`mapping.CASE_MAPPINGS`: the weighting, the clip,
...) map onto the plugin itself, rerun with those values of its case (as ``mapping.on_itself``
does where they are all the pair has), and shown to read them (``mapping.reads_mapping``). The
rerun computes what the plugin computes apart from those differences, so against the other side
only the rest of the prediction remains, and that rest is held to *its* stage: where every
difference left first shows in the ``update`` or after (Keras' late schedule: step 1's loss and
gradients are computed before any rate acts; an optimizer formula), the rerun and the other side
must agree on step 1's loss and gradients, and a run that parts there is a difference the
prediction does not explain, a divergence. A rerun that parts where the rest says, or not at all, leaves the
verdict as it was (``expected_difference``, its residual still not judged). Free compare only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from parity_tests.contract.case import MIXED_BFLOAT16, Case
from parity_tests.judging.localise import STAGES
from parity_tests.judging.pair import resolve
from parity_tests.judging.theory import Prediction, engine, mapping_changes
from parity_tests.judging.verdict import Verdict
from parity_tests.protocol.engine import EngineSpec
from parity_tests.session.declared import declared
from parity_tests.session.mapping import CASE_MAPPINGS, SideMapping

__all__ = ["AFTER_THE_GRADIENT", "Partial", "partial_mapping", "partial_verdict"]

#: the stages a difference left beside the rerun may first show at: after every loss and gradient of step 1 is
#: recorded, so that the rerun and the other side must agree on those exactly, whatever the localiser can resolve
#: inside a step (a hand-written plugin records no per-device values: a clip's difference could be told from a
#: combine's only by them), and before the logged record (``pair.resolve`` calls a gap there a divergence)
AFTER_THE_GRADIENT = ("update", "state")


@dataclass(frozen=True)
class Partial:
    """The differences of the parallel set-up mapped on the plugin itself, and the prediction left (:func:`partial_mapping`)."""

    mapping: SideMapping  # the plugin itself, rerun with the mapped values (``SideMapping.itself``)
    rest: Prediction  # the prediction without the mapped differences: what the rerun and the other side may differ by
    earliest: str  # the earliest stage where the rest may first show (``Difference.first_visible``)


def partial_mapping(case: Case, pred: Prediction, a: EngineSpec | str, b: EngineSpec | str) -> Partial | None:
    """The part of ``pred`` that maps onto the pair ``(a, b)``'s parallel plugin itself, or ``None``.

    Only in a float32 or float64 case (the session asks it only of a pair judged by the float64
    rule, whose stages are exact), where the parallel side is a plugin that can be rerun in float64
    deterministically, some expected difference maps onto it through its case
    (:data:`mapping.CASE_MAPPINGS`) and some does not (where every one does, ``mapping.on_itself``
    judges the whole residual), and every difference left, expected or known, first shows after step 1's gradients
    (:data:`AFTER_THE_GRADIENT`: an optimizer formula, a learning rate): only then does the stage tell
    the rest from a bug whatever the localiser resolves.
    """
    from parity_tests.session.spread import nondeterministic

    a, b = engine(a), engine(b)
    if a.parallel == b.parallel or case.spec["dtype"] == MIXED_BFLOAT16:
        return None  # (mixed: the bfloat16 rule's stage is of roundings no float64 run has; not claimed here)
    side, other = (a, b) if a.parallel else (b, a)
    found = declared(side.name)
    if (found is None or found.kind == "builtin" or not found.rerunnable or "float64" not in found.dtypes
            or nondeterministic(side.name)):
        return None
    spec = dict(case.spec)
    changes: dict[str, Any] = {}
    mapped: list[int] = []
    for d in pred.differences:
        if not d.expected or d.mapping not in CASE_MAPPINGS:
            continue
        c = mapping_changes(d.mapping, spec, side, other)
        if c is None or any(k in changes and changes[k] != v for k, v in c.items()):
            return None
        changes.update(c)
        mapped.append(id(d))
    kept = tuple(d for d in pred.differences if id(d) not in mapped)
    rest = [d for d in kept if d.expected]
    if not changes or not rest:
        return None
    if any(d.first_visible not in AFTER_THE_GRADIENT for d in kept):
        return None
    earliest = min((d.first_visible for d in rest), key=STAGES.index)
    left = dataclasses.replace(pred, differences=kept, expected=tuple(d.text for d in rest))
    return Partial(SideMapping(side.name, other.name, changes, side.name, itself=True), left, earliest)


def partial_verdict(final: Verdict, p: Partial, v: Verdict, stage: str | None) -> tuple[Verdict, str]:
    """``final`` (an ``expected_difference`` with no residual judged) held against the rerun: ``v``, the other side
    against :attr:`Partial.mapping`'s rerun by the pair's rule, and ``stage``, where they part (``localise``).

    Returns the verdict (a divergence where they part before :attr:`Partial.earliest`, or at the logged loss
    alone) and a line for the report.
    """
    rest = "; ".join(t.split(":", 1)[0] for t in p.rest.expected)
    if v.status != "divergence":  # nothing to hold to a stage: the verdict stays the pair's own
        return final, f"with {p.mapping.text}: {v.status} against the other side (the rest of the prediction: {rest})"
    if stage is None:
        return final, f"with {p.mapping.text}: the runs part, at a stage the localiser cannot name"
    res = resolve(v, p.rest, stage=stage)
    if res.verdict.status != "divergence":
        return final, (f"with {p.mapping.text}: the runs part first at {stage}, where the rest of the prediction"
                       f" ({rest}) may show first ({p.earliest})")
    kept = tuple(u for u in final.unjudged if not u.startswith("whether the predicted difference explains"))
    detail = f"with {p.mapping.text} (the differences of its parallel set-up mapped on it): {res.verdict.detail}"
    return (dataclasses.replace(res.verdict, unjudged=kept, detail=detail),
            f"with {p.mapping.text}: the runs part first at {stage}, before the rest of the prediction may show")
