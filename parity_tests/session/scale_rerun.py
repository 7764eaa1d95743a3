"""A predicted sum reduction held against its exact ratio on the parallel plugin itself, rerun where that ratio is exact.

Theory's ``sum reduction`` (``theory.predict``) makes the parallel side's step-1 combined gradient
exactly ``1/N`` times the one-device side's full-batch sum where the devices are weighted
``equal`` (any shards) and nothing acts on the gradient before it is combined
(``judging.predicted_scale``): ``residual.scale_checked`` checks that on the runs as they ran.
On the case values where it is *not* exact, nothing was checked, and where the plugin's stand-in
is no equivalent run ("residual not judged: no equivalent run") a bug of the plugin hid behind
the prediction (the 10,000-pair hunt of 2026-11-29: ``unshared_towers``, ``missing_activation``,
``unscoped_loss_collection``, ``same_shard``, all ``expected_difference``):

* ``weighting: by_size`` on uneven shards: the parallel side combines ``sum_r (n_r / B) g_r``, with
  ``g_r`` shard ``r``'s sum, against the single side's ``sum_r g_r``: no constant multiple of it;
* a clip per device (theory's "clipping before vs after averaging"): each ``g_r`` scaled by a
  factor of its own norm before the combine.

Both are values of the plugin's case (``parallel.weighting``, ``parallel.clip.where``) that every
plugin honours, ``equal`` and ``after_combine`` included (docs/plugins.md, ``run.spec``). So the parallel
plugin is rerun in float64 on the case with ``parallel.weighting: equal`` (where it was ``by_size``
on uneven shards) and each other difference theory maps onto the parallel set-up
(``mapping.CASE_MAPPINGS``: the clip after the combine) mapped, and, where it is shown to read
those values (``mapping.reads_mapping``: every changed field among what its rerun read by name,
``protocol.case_read``; else its rerun parts from its run), its step-1 gradient is held against
the one-device side's by ``predicted_scale.check_scale``, exactly as on a case drawn so. For
correct code::

    G_rerun = (1/N) sum_r g_r = G_single / N      (exactly, any shards; with a clip after the combine
                                                    a multiple between 1/N and 1 of it, same direction)

A plugin whose step 1 is not that (a tower that reads another's rows, forgets an activation, adds
other towers' losses) computes a difference the prediction does not explain: a divergence, with
the rerun and both factors in its line. A rerun that holds the ratio leaves the verdict as it was
(``expected_difference``, its residual still not judged on the case as given: the check is of the
prediction, on the rerun). Not where the parallel side is a built-in (its mapped run is the
residual), cannot be rerun, runs no float64, is nondeterministic, or either float64 run computes
its loss in float32 (``precision_leak``). The free compare only: ``--lockstep`` reruns no plugin so.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from parity_tests.contract.case import Case
from parity_tests.judging.predicted_scale import (
    SUM_REDUCTION,
    check_scale,
    clip_of,
    predicted_scale,
)
from parity_tests.judging.theory import Prediction, engine, mapping_changes, uneven_shards
from parity_tests.judging.verdict import Verdict
from parity_tests.protocol.engine import EngineSpec
from parity_tests.session.declared import declared
from parity_tests.session.mapping import CASE_MAPPINGS, SideMapping

__all__ = ["RatioRerun", "ratio_rerun", "ratio_verdict"]


@dataclass(frozen=True)
class RatioRerun:
    """The parallel plugin's rerun under which theory's sum reduction is an exact ratio (:func:`ratio_rerun`)."""

    mapping: SideMapping  # the plugin itself, run with ``mapping.changes`` (``SideMapping.itself``)
    scale: tuple[Fraction, str]  # ``predicted_scale`` on the rerun's case: the constant and why
    clip: float | None  # the threshold of a clip after the combine on the rerun's case (``check_scale``'s ``clip``)
    reference_is_parallel: bool  # the pair's reference is the plugin rerun (``check_scale``'s ``b64`` is then the other)


def ratio_rerun(case: Case, pred: Prediction, a: EngineSpec | str, b: EngineSpec | str) -> RatioRerun | None:
    """The rerun of the pair ``(a, b)``'s parallel plugin that makes theory's sum reduction an exact ratio, or ``None``.

    Only where the sum reduction is expected, its ratio is not exact on the case as given
    (``predicted_scale`` is ``None`` there), the parallel side is a plugin that can be rerun in
    float64 deterministically, and on the case with ``weighting: equal`` (for ``by_size`` on uneven
    shards) and every other difference of the parallel set-up mapped (``mapping.CASE_MAPPINGS``)
    the ratio is exact (``predicted_scale`` of the rerun's case and the prediction without the
    mapped differences).
    """
    from parity_tests.session.spread import nondeterministic

    spec = case.spec
    a, b = engine(a), engine(b)
    if a.parallel == b.parallel or predicted_scale(spec, pred, a, b) is not None:
        return None
    sums = [d for d in pred.differences if d.expected and d.text.startswith(SUM_REDUCTION)]
    if len(sums) != 1:
        return None
    side, other = (a, b) if a.parallel else (b, a)
    found = declared(side.name)
    if (found is None or found.kind == "builtin" or not found.rerunnable or "float64" not in found.dtypes
            or nondeterministic(side.name)):
        return None
    changes: dict[str, Any] = {}
    if spec["parallel"].get("weighting") == "by_size" and uneven_shards(dict(spec)):
        changes["parallel.weighting"] = "equal"  # 1/N of the devices' sums: the full-batch sum / N, any shards
    mapped: list[int] = []
    for d in pred.differences:
        if d is sums[0] or d.mapping not in CASE_MAPPINGS:
            continue  # (one that acts before the combine and cannot be mapped: predicted_scale says no below)
        c = mapping_changes(d.mapping, dict(spec), side, other)
        if c is None or any(k in changes and changes[k] != v for k, v in c.items()):
            return None
        changes.update(c)
        mapped.append(id(d))
    if not changes:
        return None
    rerun = case.replace(**changes).spec
    kept = tuple(d for d in pred.differences if id(d) not in mapped)
    pred2 = dataclasses.replace(pred, differences=kept, expected=tuple(d.text for d in kept if d.expected),
                                known=tuple(d.text for d in kept if not d.expected))
    scale = predicted_scale(rerun, pred2, a, b)
    if scale is None:
        return None
    m = SideMapping(side.name, other.name, changes, side.name, itself=True)
    return RatioRerun(m, scale, clip_of(rerun), side.name == a.name)


def ratio_verdict(final: Verdict, as_ran: Verdict, said: str, rr: RatioRerun, other64: Mapping[str, Any],
                  rerun64: Mapping[str, Any]) -> tuple[Verdict, dict[str, Any] | None, str]:
    """``final`` (an ``expected_difference`` with no residual judged) held against the ratio on the rerun.

    Returns the verdict (a divergence where the rerun's step-1 gradient is not the predicted
    multiple of the other side's), what ``check_scale`` found (``None`` where the ratio holds or
    could not be read) and a line for the report.
    """
    a64, b64 = (rerun64, other64) if rr.reference_is_parallel else (other64, rerun64)
    found = check_scale(a64, b64, rr.scale[0], clip=rr.clip)
    if found is None:
        return final, None, (f"the predicted ratio checked on {rr.mapping.text} (where it is exact:"
                             f" {rr.scale[1]}): it holds")
    kept = tuple(u for u in final.unjudged if not u.startswith("whether the predicted difference explains"))
    detail = (f"theory predicted {said}, which does not explain the gap: with {rr.mapping.text} (a case under which"
              f" {rr.scale[1]}), {found['text']}; as it ran: {as_ran.detail}")
    found = {**found, "rerun": rr.mapping.text, "text": f"on {rr.mapping.text}: {found['text']}"}
    return (dataclasses.replace(final, status="divergence", unjudged=kept, detail=detail), found,
            f"the predicted ratio checked on {rr.mapping.text}: it fails")
