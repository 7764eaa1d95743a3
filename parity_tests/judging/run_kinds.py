"""Which computation of a case a run makes (:class:`Variant`), by which the rules declare the runs they need.

The session names every run by ``session.keys.RunKey`` (implementation, variant, mapping); a rule of
``judging.rules`` says, before any run is made, which variants of each side it judges from
(``needs``), so these live with the judge.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["KINDS", "Variant", "as_given", "repeat", "bf16_reruns", "capture", "FLOAT64", "PERTURBED_RUN", "STEP1",
           "ROUNDED64", "GRADS64", "RULE64", "MOVED64", "MOVED64_AGAIN", "AGAIN64"]

#: a variant's kinds: the case in a dtype; a rerun from moved numbers (the ``index``-th, from 0); the float64 run of
#: such a moved case; the float64 run from inputs and weights rounded to bfloat16; the float64 run rounding the
#: gradients to bfloat16 where the mixed recipe does (``protocol.grad_rounding``); a mixed case's one-step float32
#: run; a plugin's float64 run with its class's rule (``mapping.rule_runs``); a repeat of a run (``spread``); the
#: conditioning check's float64 run from inputs moved by one float64 ulp (index 1: its repeat) and its repeat of
#: the judged float64 run (``judge_pair``); a run recording step ``index``'s per-device values (``capture``)
KINDS = ("dtype", "perturbed", "perturbed64", "rounded64", "grads64", "step1", "rule64", "rerun", "moved64", "again64", "capture")


@dataclass(frozen=True)
class Variant:
    """Which computation of the case a run makes (``kind`` of :data:`KINDS`).

    ``dtype``: the dtype of a ``dtype`` or ``rerun`` variant; ``index``: which perturbed rerun
    (0 the first) or which repeat (from 1).
    """

    kind: str
    dtype: str = ""
    index: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"variant kind must be one of {', '.join(KINDS)}, got {self.kind!r}")

    @property
    def text(self) -> str:
        """The legacy text of this variant in a trajectory key (``float32+perturbed-2``, ...)."""
        if self.kind == "dtype":
            return self.dtype
        if self.kind == "perturbed":
            return "float32+perturbed" + (f"-{self.index + 1}" if self.index else "")
        if self.kind == "perturbed64":
            return "float64+" + Variant("perturbed", index=self.index).text
        if self.kind == "rounded64":
            return "float64+bfloat16-rounded"
        if self.kind == "grads64":
            return "float64+bfloat16-grads"
        if self.kind == "step1":
            return "float32-step1"
        if self.kind == "rule64":
            return "float64+rule"
        if self.kind == "moved64":  # (made for a check alone: never a trajectory key)
            return "float64+moved" + (f"-{self.index + 1}" if self.index else "")
        if self.kind == "again64":
            return "float64+again"
        if self.kind == "capture":
            return f"capture{self.index}"
        return f"{self.dtype}+rerun{self.index}"

    @property
    def perturbed(self) -> bool:
        """A rerun from moved numbers in the case dtype (its case is what each implementation reruns: ``_rerun_of``)."""
        return self.kind == "perturbed"

    def __str__(self) -> str:
        return self.text


def as_given(dtype: str) -> Variant:
    """The case run in ``dtype`` (``float32``, ``float64``, ``mixed_bfloat16``)."""
    return Variant("dtype", dtype)


def repeat(dtype: str, i: int) -> Variant:
    """The ``i``-th repeat of the case's ``dtype`` run (a nondeterministic plugin's spread)."""
    return Variant("rerun", dtype, i)


def bf16_reruns(n: int) -> tuple[tuple[Variant, ...], tuple[Variant, ...]]:
    """A mixed case's ``n`` perturbed reruns and the float64 run of each one's moved case."""
    return (tuple(Variant("perturbed", index=r) for r in range(n)),
            tuple(Variant("perturbed64", index=r) for r in range(n)))


FLOAT64 = as_given("float64")
#: a float32 case's (and a mixed case's first) rerun from numbers moved by one ulp
PERTURBED_RUN = Variant("perturbed")
#: a mixed_bfloat16 case's one-step float32 run, against which each side's bfloat16 signature is measured
STEP1 = Variant("step1")
#: the float64 run from the inputs and initial weights rounded to bfloat16 (judging.bfloat16: the storage term)
ROUNDED64 = Variant("rounded64")
#: the float64 run rounding the loss's gradient at the output and each device's gradients to bfloat16, as the mixed
#: recipe does (``protocol.grad_rounding``; judging.bfloat16: the gradient term), where the side can make it
GRADS64 = Variant("grads64")
#: a float64 run with the class's rule (``mapping.rule_runs``), under a key of its own
RULE64 = Variant("rule64")
#: the conditioning check's float64 rerun from inputs moved by one float64 ulp, its repeat, and the judged run's repeat
MOVED64, MOVED64_AGAIN, AGAIN64 = Variant("moved64"), Variant("moved64", index=1), Variant("again64")


def capture(step: int) -> Variant:
    """A run recording step ``step``'s per-device values (``capture.inside_step``)."""
    return Variant("capture", index=step)
