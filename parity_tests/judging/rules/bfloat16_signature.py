"""The bfloat16 signature check: a side of a mixed_bfloat16 pair whose run matches its float32 run does not compute in bfloat16.

``judging.bfloat16.signature_bound``: such a side is *closer* to float64 than bfloat16 arithmetic, so
the bfloat16 rule cannot find it; this check does. Its mixed run must part from its float32 run at
step 1 by more than ``BF16_SIGNATURE_FACTOR`` times that float32 run's own distance from float64
(``perturbation.BF16_SIGNATURE`` where no float64 run was made). It needs one run of its own per
side, the case's first step in float32 (:meth:`BFloat16Signature.needs`), which the session makes
with the first round, before any verdict.

A gradient array that is exactly zero in the side's float64 run at step 1 is zero in exact arithmetic (a
dead unit's, or the mean of per-device gradients that cancel: two one-row devices whose gradients of opposite
sign are each clipped to 1e-6) and reads no signature: its float32 and bfloat16 values are rounding residue
of 0 (the seed-1 hunt's pair 857: 0 in bfloat16 and float64, -5.7e-14 in float32), measured against nothing but
itself (the gradients' floor is then that residue), so a gap of 1.0 in both the signature and its bound, which
left the loss's bfloat16 rounding (5.7e-5 against a bound of 5.5e-7) unread and called a correct torch.ddp one
that "does not compute in bfloat16". Such arrays are left out of both (:func:`_live`); the loss still reads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from parity_tests.contract.case import MIXED_BFLOAT16
from parity_tests.judging.rules.context import Planned
from parity_tests.judging.run_kinds import STEP1, Variant
from parity_tests.judging.verdict import RULE_BF16_SIGNATURE, Verdict

__all__ = ["BFloat16Signature", "SignatureSide"]


def _live(run: Mapping[str, Any] | None, f64: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """``run`` less the ``grad/*`` arrays whose step-1 row is exactly zero in ``f64`` (module docstring)."""
    if run is None or f64 is None:
        return run
    dead = {k for k in f64 if isinstance(k, str) and k.startswith("grad/")
            and np.asarray(f64[k][:1]).size and not np.any(np.asarray(f64[k][:1]))}
    return {k: v for k, v in run.items() if k not in dead} if dead else run


@dataclasses.dataclass(frozen=True)
class SignatureSide:
    """One side's runs the check reads: its mixed run, its one-step float32 run, its float64 run (each or ``None``)."""

    name: str
    mixed: Mapping[str, Any] | None
    step1: Mapping[str, Any] | None
    f64: Mapping[str, Any] | None


class BFloat16Signature:
    """The check of each side of a mixed pair: does it compute in bfloat16 at all (module docstring)."""

    name = RULE_BF16_SIGNATURE

    def needs(self, p: Planned) -> tuple[tuple[Variant, ...], tuple[Variant, ...]] | None:
        """Each side's one-step float32 run, where the case is mixed_bfloat16 and the side can be run again."""
        if p.dtype != MIXED_BFLOAT16:
            return None
        return tuple((STEP1,) if c.rerunnable else () for c in (p.a, p.b))

    def judge(self, verdict: Verdict, sides: Sequence[SignatureSide]) -> Verdict:
        """``verdict``, or a divergence naming the first side whose mixed run matches its float32 run at step 1."""
        from parity_tests.judging.bfloat16 import (
            signature_bound,  # (imports this package's float64 rule)
        )
        from parity_tests.judging.perturbation import bfloat16_signature

        if verdict.status in ("error", "inconclusive", "unsupported"):  # nothing moved: no signature to read either
            return verdict
        read = []  # (side, gap, key, bound, how) of each side whose runs are there
        for side in sides:
            if side.mixed is None or side.step1 is None:
                continue
            mixed, step1 = _live(side.mixed, side.f64), _live(side.step1, side.f64)
            gap, key = bfloat16_signature(mixed, step1)
            bound, how = signature_bound(step1, side.f64)
            read.append((side, gap, key, bound, how))
        missing = [r for r in read if r[1] <= r[3]]
        if not missing:
            return verdict
        if len(missing) == len(read) == len(sides) > 1:
            # neither side's step 1 shows a bfloat16 rounding: the case itself cannot (a clip of fixed direction
            # turns every gradient into the same numbers whatever the rounding, a loss too flat to round visibly),
            # and two implementations that both skip bfloat16 are not told from a case that hides it; one side
            # that shows it against one that does not is (below). Only a parity needs the signature (it could be
            # two float32 runs agreeing): a pair that parts, or parts as predicted, keeps its verdict
            if verdict.status != "parity":
                return verdict
            lines = "; ".join(f"{s.name} {gap:.2e} at {key} (a bfloat16 computation shows > {bound:.2e})"
                              for s, gap, key, bound, _ in missing)
            return dataclasses.replace(verdict, status="inconclusive", rule=RULE_BF16_SIGNATURE, detail=(
                f"inconclusive: this case shows no bfloat16 rounding at step 1 on either side (mixed_bfloat16 run"
                f" against its float32 run: {lines}), so whether each computes in bfloat16 cannot be read here;"
                f" between the implementations: {verdict.detail}"))
        side, gap, key, bound, how = missing[0]
        detail = (f"{side.name} does not compute in bfloat16: its mixed_bfloat16 run matches its float32 run at"
                  f" step 1 (greatest relative gap {gap:.2e} at {key}, expected > {bound:.2e}: {how}); between"
                  f" the implementations: {verdict.detail}")
        return dataclasses.replace(verdict, status="divergence", rule=RULE_BF16_SIGNATURE, gap=gap,
                                   bound=bound, detail=detail, key=key, step=1, first_step=1)
