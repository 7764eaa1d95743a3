"""What a comparison found, as data: one pair's verdict (:class:`PairResult`) and a case's (:class:`CaseResult`).

The report, ``report.json`` and the tests read these; nothing here runs or judges.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from parity_tests.contract.case import Case
from parity_tests.judging.compare import first_nonfinite
from parity_tests.judging.pair import OK_STATUSES
from parity_tests.judging.theory import Prediction
from parity_tests.judging.verdict import Verdict, _json, exit_status
from parity_tests.session.keys import RunKey

__all__ = ['UNSUPPORTED', 'PairResult', 'CaseResult']


UNSUPPORTED = "unsupported"  # the implementation does not implement a field of this case


@dataclass
class PairResult:
    """The verdict on ``impl`` against ``reference``."""

    reference: str
    impl: str
    verdict: Verdict
    prediction: Prediction
    mapping: str | None = None  # what was mapped before judging again, if anything
    unmapped_gap: float | None = None  # the gap with nothing mapped (the pair as it ran)
    #: docs/localisation.md: where the two runs first part (``judging.localise``), for every verdict but parity
    localisation: dict[str, Any] | None = None
    #: the pair judged with the predicted differences mapped away (``pair.resolve``), or ``None``
    residual: Verdict | None = None
    notes: tuple[str, ...] = ()  # what the report says beside the verdict (a prediction dropped, ...)
    #: the runs ``verdict`` judged, ``(name, key suffix)`` per side: ``None`` for the pair as it ran; a
    #: built-in's mapped runs (suffix ``SideMapping.key``) where the verdict is the residual's
    judged: tuple[tuple[str, str], tuple[str, str]] | None = None
    #: why the residual was not judged although a mapping was run (:data:`NOT_EQUIVALENT`), or ``None``
    residual_not_judged: str | None = None

    def __repr__(self) -> str:
        v = self.verdict
        return f"PairResult({self.reference} vs {self.impl}: {v.status}, {v.rule}, gap {v.gap:.3g}, bound {v.bound:.3g})"

    def where(self) -> str:
        """The line that says where the pair parted: ``impl: where: STAGE at step K, layer L (explanation)``,
        or the verdict's first line where there is no localisation (``""`` for parity)."""
        loc = self.localisation or {}
        if loc.get("stage"):
            layer = f", layer {loc['layer']}" if loc.get("layer") else ""
            return f"{self.impl}: where: {loc['stage']} at step {loc['first_bad_step']}{layer} ({loc['explanation']})"
        if self.verdict.status == "parity":
            return ""
        return f"{self.impl}: {self.verdict.detail.splitlines()[0] if self.verdict.detail else self.verdict.status}"

    @property
    def as_expected(self) -> bool:
        """Parity where theory predicts none, a divergence where it predicts one (or not applicable)."""
        return self.verdict.status in OK_STATUSES or self.verdict.status == UNSUPPORTED

    def to_dict(self) -> dict[str, Any]:
        r = self.residual
        return {
            "reference": self.reference,
            "impl": self.impl,
            "status": self.verdict.status,  # docs/tolerance.md, "The verdict"
            "verdict": {**self.verdict.to_dict(),
                        **({"localisation": self.localisation} if self.localisation is not None else {})},
            "expected_differences": list(self.prediction.expected),
            "known_differences": list(self.prediction.known),
            "absent_differences": list(self.prediction.absent),
            "mapping": self.mapping,
            "unmapped_gap": self.unmapped_gap,
            "residual": None if r is None else {"status": r.status, "rule": r.rule, "gap": _json(r.gap),
                                                "bound": _json(r.bound), "first_step": r.first_step, "key": r.key},
            "residual_not_judged": self.residual_not_judged,
            "notes": list(self.notes),
            "as_expected": self.as_expected,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PairResult:
        pred = Prediction(tuple(d["expected_differences"]), tuple(d["known_differences"]),
                          absent=tuple(d.get("absent_differences", ())))
        return cls(d["reference"], d["impl"], Verdict.from_dict(d["verdict"]), pred, d["mapping"], d["unmapped_gap"],
                   d["verdict"].get("localisation"), notes=tuple(d.get("notes", ())),
                   residual_not_judged=d.get("residual_not_judged"))


#: the final line of a summary, by the worst status among the pairs
_HEADLINES = (("error", "ERROR"), ("divergence", "DIVERGENCE"), ("unexpected_parity", "DIVERGENCE (unexpected parity)"),
              ("inconclusive", "INCONCLUSIVE"), ("unsupported", "DIVERGENCE"),
              ("expected_difference", "EXPECTED DIFFERENCE (as theory predicts)"), ("parity", "PARITY"))


@dataclass
class CaseResult:
    """Everything ``tfpar compare`` found for one case."""

    case: Case
    impls: list[str]
    pairs: list[PairResult]
    #: the runs by their keys' text (``keys.RunKey.text``, "impl@variant[mapping]"): what reports, saved files and
    #: tests read
    trajectories: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    seconds: float = 0.0
    #: the same runs by typed key (what the session reads: ``lockstep``); empty for a stored result
    runs: dict[RunKey, dict[str, np.ndarray]] = field(default_factory=dict, repr=False)

    @property
    def parity(self) -> bool:
        """True when every pair is at parity."""
        return all(p.verdict.status == "parity" for p in self.pairs)

    @property
    def ok(self) -> bool:
        """Every pair at parity or an expected difference (``compare``'s exit status 0, docs/tolerance.md, "The verdict")."""
        return all(p.verdict.status in OK_STATUSES for p in self.pairs)

    @property
    def as_expected(self) -> bool:
        return all(p.as_expected for p in self.pairs)

    @property
    def exit_status(self) -> int:
        """``tfpar compare``'s exit status: 0 every pair parity or an expected difference, 1 a divergence or
        an unexpected parity, else 3 a pair inconclusive or an error (``judging.verdict.exit_status``)."""
        return exit_status(p.verdict.status for p in self.pairs)

    def _table(self) -> list[str]:
        """The case's line, then one row per pair: pair, verdict, rule, gap, bound."""
        c = self.case
        head = (f"case {c.name}: {c.spec['dtype']}, {c.devices} device(s), {c.spec['parallel']['combine']}, "
                f"{c.spec['optimizer']['name']} ({c.spec['optimizer']['semantics']}), {c.spec['steps']} steps")
        w = max([30, *(len(f"{p.reference} vs {p.impl}") for p in self.pairs)])  # plugin paths are long
        rows = [head, f"{'pair':<{w}} {'verdict':<20} {'rule':<26} {'gap':>10} {'bound':>10}"]
        for p in self.pairs:
            v = p.verdict
            rows.append(f"{p.reference + ' vs ' + p.impl:<{w}} {v.status:<20} {v.rule:<26} {v.gap:>10.3g} {v.bound:>10.3g}")
        return rows

    def _headline(self) -> str:
        statuses = {p.verdict.status for p in self.pairs}
        verdict = next((text for status, text in _HEADLINES if status in statuses), "PARITY")
        return f"verdict: {verdict} ({self.seconds:.1f} s)"

    def __repr__(self) -> str:
        """The summary's table and verdict line, without the notes (:meth:`summary` has them) or any array."""
        return "\n".join(["CaseResult: " + self._table()[0], *self._table()[1:], self._headline()])

    def summary(self) -> str:
        """A table a person reads in a terminal, then one line per finding."""
        rows = self._table()
        notes = []
        for p in self.pairs:
            v = p.verdict
            if p.localisation and p.localisation.get("stage"):
                notes.append("  " + p.where())
                if p.verdict.status == "divergence" and p.localisation.get("loss_only"):  # judging.loss_only (issue 37)
                    notes.append(f"  {p.impl}: loss alone: {p.localisation['loss_only']['text']}")
            for e in p.prediction.expected:
                notes.append(f"  {p.impl}: expected difference: {e}")
            for k in p.prediction.known:
                notes.append(f"  {p.impl}: known difference: {k}")
            for a in p.prediction.absent:
                notes.append(f"  {p.impl}: not at these values: {a}")
            if p.mapping:
                r = p.residual
                with_it = (f"{p.residual_not_judged}; " if p.residual_not_judged else
                           "" if r is None else f"{r.status}, gap {r.gap:.3g} (bound {r.bound:.3g}); ")
                notes.append(f"  {p.impl}: with it mapped ({p.mapping}): {with_it}gap without the mapping"
                             f" {p.unmapped_gap:.3g}")
            notes.extend(f"  {p.impl}: {n}" for n in p.notes)
            notes.extend(f"  {p.impl}: not judged: {u}" for u in v.unjudged)
            if v.status not in ("parity",):
                notes.extend("  " + line for line in v.detail.splitlines())
        for key, traj in self.trajectories.items():
            bad = first_nonfinite(traj, key)
            if bad:
                notes.append(f"  non-finite: {bad}")
        return "\n".join([*rows, *notes, self._headline()])

    def to_dict(self) -> dict[str, Any]:
        return {
            "case": self.case.spec,
            "impls": self.impls,
            "parity": self.parity,
            "ok": self.ok,
            "as_expected": self.as_expected,
            "seconds": round(self.seconds, 3),
            "pairs": [p.to_dict() for p in self.pairs],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CaseResult:
        """A stored result (no trajectories); the case is rebuilt from its spec."""
        from parity_tests.contract.case import case_from_dict

        return cls(case_from_dict(d["case"]), list(d["impls"]), [PairResult.from_dict(p) for p in d["pairs"]],
                   {}, float(d["seconds"]))

