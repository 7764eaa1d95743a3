"""The float64 and float32 rules: when is a gap between two trajectories rounding, and when not.

Two rules on the per-step gap of :mod:`parity_tests.judging.gaps`, in two channels: the
``param/*`` and ``state/*`` arrays (the outcome of training) and the ``loss``
(:mod:`parity_tests.judging.loss_channel`). A third, for code that cannot run float64, is
:mod:`parity_tests.judging.perturbation`; the bounds are derived in
:mod:`parity_tests.judging.bounds`, and all of it is explained in docs/tolerance.md.

**Float64 rule** (``"float64 bound"``): divergence when ``gap_k(A64, B64) > FLOAT64_RTOL``
at any step. Two float64 implementations of the same update rule differ only by
rounding, far below the bound; anything above it is a semantic difference.

**Float32 rule** (``"float32 noise floor"``): each side's own float32 rounding error is
measured against its own float64 run, ``floor_X[k] = gap_k(X32, X64)``, and::

    bound[k] = factor * max(floor_A[k], floor_B[k]) + FLOAT32_ABS_FLOOR

Divergence when ``gap_k(A32, B32) > bound[k]`` at any step. In :func:`judge_float32`
the float64 rule is applied to ``(A64, B64)`` first: a semantic difference is
reported by the rule that proves it.

What is judged:
    ``param/*`` and ``state/*`` arrays by default (``keys=`` to change), and the ``loss``
    channel (``loss=`` to change; by default when ``keys`` is not given). Gradients are
    compared by :mod:`parity_tests.judging.compare` but do not decide: near a minimum they
    are sums of terms that cancel, and their relative rounding error is unbounded, while
    parameters (the accumulated updates) and the loss (a mean of non-negative terms) keep
    a bounded one. A semantic difference in a gradient shows in the parameters one step
    later. When both channels break, the first to break names the verdict's ``key``.

**One list.** Before any run, each rule says which runs of each side it judges from
(``needs(planned)``, typed by ``judging.run_kinds.Variant``; ``None`` where it does not apply), and the
session makes the union of the first declaring rule's needs over every pair (:func:`needs`,
``session.plan``). ``pair.judge_sides`` then tries :data:`RULES` in order, as ``torch.testing``'s comparison
pairs are tried: the first whose ``applies(pair)`` holds judges the pair (``judge(pair) -> Verdict``),
and then every check of :data:`CHECKS`, in order, may change that verdict (``judge(pair, verdict)``).
Each rule and check is one module of this package: ``float64_bound``, ``bfloat16``, ``perturbation``,
``float32_floor`` (the last always applies); ``nonfinite``, ``replicas_in_sync``, ``vacuity``. The
checks that need runs of their own are modules here too, each declaring its runs (``needs``) and
judging them, while the session makes the runs (:data:`SESSION_CHECKS`): ``conditioning`` (a float64
divergence against each side's one-ulp rerun, asked for after it), ``spread`` (a nondeterministic
plugin's repeats, after a divergence) and ``bfloat16_signature`` (each mixed side's one-step float32
run, planned with the rules' runs). The zero-gradient and loss-channel checks run inside the float
rules (``judging.zero_gradient``, ``judging.loss_channel``): they change the bound, not the verdict after it.
"""

from __future__ import annotations

from parity_tests.judging.rules.bfloat16 import BFloat16
from parity_tests.judging.rules.bfloat16_signature import BFloat16Signature
from parity_tests.judging.rules.conditioning import Conditioning
from parity_tests.judging.rules.context import Can, PairRuns, Planned, Side
from parity_tests.judging.rules.float32_floor import Float32Floor, _judge_floor, judge_float32
from parity_tests.judging.rules.float64_bound import Float64Bound, _check_factor, judge_float64
from parity_tests.judging.rules.nonfinite import BothNonFinite, NonFinite
from parity_tests.judging.rules.perturbation import Perturbation
from parity_tests.judging.rules.replicas_in_sync import RULE_REPLICAS, ReplicasInSync
from parity_tests.judging.rules.spread import Spread
from parity_tests.judging.rules.vacuity import RULE_VACUOUS, Vacuity, vacuity
from parity_tests.judging.run_kinds import Variant

__all__ = ["judge_float64", "judge_float32", "RULES", "CHECKS", "needs", "Planned", "Can", "PairRuns", "Side", "RULE_REPLICAS", "RULE_VACUOUS",
           "vacuity", "Float64Bound", "BFloat16", "Perturbation", "Float32Floor", "NonFinite", "BothNonFinite",
           "ReplicasInSync", "Vacuity", "Conditioning", "Spread", "BFloat16Signature", "SESSION_CHECKS", "_check_factor",
           "_judge_floor"]

#: the rules, tried in order: the first that applies judges the pair (the float32 floor always applies)
RULES = (Float64Bound(), BFloat16(), Perturbation(), Float32Floor())
#: the checks every verdict then goes through, in order (each may change it)
CHECKS = (NonFinite(), BothNonFinite(), ReplicasInSync(), Vacuity())
#: the checks whose runs the session makes (each declares them: ``needs``) and then hands them to the check
SESSION_CHECKS = (Conditioning(), Spread(), BFloat16Signature())


def needs(p: Planned) -> tuple[tuple[Variant, ...], tuple[Variant, ...]]:
    """The runs of each side (reference, judged) the pair's rule judges from: the first rule of :data:`RULES` that
    declares needs for ``p`` (``needs(p)`` not ``None``: decided from the sides' declarations alone, before any run
    is made). The session makes their union over every pair, each run once (``session.plan``)."""
    return next(n for r in RULES if (n := r.needs(p)) is not None)
