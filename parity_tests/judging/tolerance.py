"""The noise-aware tolerance model: when is a gap between two trajectories rounding, and when not.

Three rules, all on the per-step normwise relative gap of :func:`parity_tests.judging.compare.relative_gap`,
in two channels: the ``param/*`` and ``state/*`` arrays (the outcome of training) and the
``loss`` (the curve a user publishes; see "What is judged" and "The loss")::

    gap_k(X, Y) = max over arrays p of  ||X_p[k] - Y_p[k]||_inf / d_p[k]
    d_p[k]      = max(||A64_p[k]||_inf, ||B64_p[k]||_inf, SCALE_FLOOR)

where row ``k`` is the value after step ``k`` (row 0: the initial values). Every gap of
one verdict uses the same denominator ``d``, taken from the float64 runs, so gaps add
up exactly as the triangle inequality says.

**Float64 rule** (``"float64 bound"``): divergence when ``gap_k(A64, B64) > FLOAT64_RTOL``
at any step. Two float64 implementations of the same update rule differ only by
rounding, far below the bound; anything above it is a semantic difference.

**Float32 rule** (``"float32 noise floor"``): each side's own float32 rounding error is
measured against its own float64 run, ``floor_X[k] = gap_k(X32, X64)``, and::

    bound[k] = factor * max(floor_A[k], floor_B[k]) + FLOAT32_ABS_FLOOR

Divergence when ``gap_k(A32, B32) > bound[k]`` at any step. In :func:`judge_float32`
the float64 rule is applied to ``(A64, B64)`` first: a semantic difference is
reported by the rule that proves it.

**Perturbation rule** (``"float32 perturbation floor"``, :func:`judge_perturbation`): for
implementations that cannot run float64. Each side is re-run in float32 with the numbers
it stores in float32 (initial weights, inputs, optimizer hyperparameters) moved by one float32
ulp (:func:`perturb_ulp`, :func:`perturb_scalars`) and, for a built-in, the rows of each
device's shard reordered (:func:`shard_permutation`); ``d`` comes from the float32 runs
and ``floor_X[k] = max_{j<=k} gap_j(X32, X32')``, with the same bound as the float32 rule
(the loss's plus the parameters' gap carried into it, as in the float64 rule).

Derivation of ``FLOAT64_RTOL = 1e-10``:
    Each rounding stage of a float64 computation has relative error at most
    ``u = 2**-53 ~ 1.1e-16``. A reduction of ``n`` terms (a matmul, a batch mean, the
    all-reduce) has error ``~ sqrt(n) * u`` for rounding errors of random sign
    (Higham & Mary's probabilistic bound) and ``n * u`` at worst; dependent stages
    add, and the error of each step's update is carried by the parameters into the
    later steps (the training map is close to an isometry for a stable learning
    rate), so errors grow at most linearly with the number of steps. The two sides
    round independently, so their gap is at most twice one side's error::

        gap <= 2 * u * D * sqrt(n) * T
             = 2 * 1.1e-16 * 20 * 100 * 200 ~ 8.9e-11  <  1e-10

    for the envelope of the cases here: up to ``D = 20`` dependent rounding stages
    per step (forward, backward, combine and update of a model of a few layers),
    reductions of up to ``n = 1e4`` terms and ``T = 200`` steps. Observed gaps are about 1e-12
    (DESIGN.md), a hundred times below. The smallest documented semantic effect,
    Keras's float32 hyperparameters, changes every update by up to ``2**-24 ~ 6e-8``
    of its size: above the bound as soon as the accumulated updates exceed about
    0.2% of the parameters' size (DESIGN.md measured about 1e-6 on an Adam step).
    The bound is *not* scaled per case: a case far outside the envelope (thousands
    of steps, reductions of millions of terms) needs a bound derived for it.

Derivation of ``SCALE_FLOOR = 1e-2``:
    A relative gap of an array that is (almost) zero in exact arithmetic, such as a
    zero-initialised bias in its first steps, compares rounding residue with
    nothing. Arrays smaller than ``1e-2`` are measured against ``1e-2``: for them the
    rule is an absolute one, ``||A - B||_inf <= FLOAT64_RTOL * 1e-2 = 1e-12``, which
    equals the relative rule at the smallest scale where that rule governs (updates
    of ``lr * g`` with ``lr >= 1e-3`` and gradients ``g`` of order 10).

Derivation of ``FLOAT32_FACTOR = 2`` and ``FLOAT32_ABS_FLOOR = 4 * 2**-24``:
    With the shared denominator ``d`` the triangle inequality through the float64
    runs is exact, per array and step::

        gap(A32, B32) <= gap(A32, A64) + gap(A64, B64) + gap(B64, B32)
                      <= floor_A + floor_B + gap64 <= 2 * max(floor_A, floor_B) + gap64

    so factor 2 is the tightest factor that can never call rounding a divergence;
    it is reached when the two sides' errors are equal and opposite
    (``tests/test_tolerance.py`` shows a factor below 2 failing there). ``gap64`` is
    at most ``FLOAT64_RTOL`` once the float64 rule has passed, and is absorbed by
    ``FLOAT32_ABS_FLOOR``: four float32 unit roundoffs (``2**-24`` each,
    ``~2.4e-7``), which also keeps the bound above zero where both floors are zero
    (the initial values, identical on both sides) and covers the float64 rounding of
    the gap computation itself. No other margin is added.

Warning:
    The same inequality means that the float32 rule *cannot* find a divergence that
    the float64 rule has not already found, when the float64 runs are the same
    computations as the float32 runs: a difference that only one side's float32 run
    makes (TF32 matmuls, a float16 accumulation, a float32-only code path) raises
    that side's floor and is accepted as that side's rounding. The verdict reports
    both floors so that a lopsided pair (``floor_b`` many times ``floor_a``) is
    visible, and a difference below float32 noise in a case that exists only in
    float32 cannot be told apart from rounding at all (docs/tolerance.md).

The loss (float64 bound ``FLOAT64_RTOL + S[k] * pgap[k-1]``):
    The loss of step ``k`` is computed from the parameters of row ``k - 1``, so between
    two sides::

        L_A - L_B = (evalA - L(theta_A)) - (evalB - L(theta_B)) + (L(theta_A) - L(theta_B))

    *Evaluation.* An mse or cross-entropy loss is a non-negatively weighted mean of
    non-negative terms, so its summation has relative error ``<= sqrt(n) * u`` with no
    cancellation (unlike a gradient). Each term is computed from outputs with absolute
    error ``delta <= u * D * sqrt(n) * F`` (``F`` the outputs' size): for cross-entropy
    ``|dl/dz|_1 = 2 (1 - p_y) <= 2 l`` (as ``1 - p <= -log p``), so a term's relative
    error is ``<= 2 delta``; for mse ``|dL| <= 2 sqrt(L) delta`` (Cauchy-Schwarz), which is
    ``<= 20 delta`` of ``max(L, SCALE_FLOOR)``. Both sides together:
    ``2 * (sqrt(n) u + 20 u D sqrt(n) F) <= 1e-10`` for ``F <= 11`` (mse outputs), and
    ``2 * (sqrt(n) u + 2 u D sqrt(n) Z) <= 1e-10`` for logits ``Z <= 110``, with ``D = 20``,
    ``n = 1e4`` as above: ``FLOAT64_RTOL`` covers it within that envelope.
    *Carried.* ``|L(theta_A) - L(theta_B)| <= sum_p ||g_p||_1 ||dtheta_p||_inf`` to first
    order (the second order is ``~1e-20`` relative, inside ``FLOAT64_RTOL``), with ``g`` the
    recorded combined gradient of that step; :func:`loss_sensitivity` turns it into
    ``S[k] * pgap[k-1]`` with the measured parameter gap. Without a recorded gradient
    (``param_mean``, ``async``) the float64 rule cannot bound this part and leaves the
    loss to the other rules (the detail says so). Under clipping the recorded gradient
    is the clipped one, so ``S`` is a lower estimate there; the carried term matters only
    once the parameter gap nears its own bound.
    The float32 and perturbation rules need no such derivation: their loss floors are
    measured like the parameters' (the triangle inequality for the float32 rule holds
    for the loss with its own shared denominator ``d_L = max(|L_A64|, |L_B64|)``, and
    ``FLOAT32_ABS_FLOOR`` absorbs the float64 loss gap while ``(1 + S) * 1e-10`` stays
    below ``2.4e-7``).

Derivation of the perturbation rule:
    ``X32 = exact + e`` with ``e`` the run's rounding error: the rounding of its inputs
    when they are stored in float32 (weights, inputs, hyperparameters), carried through
    the computation with its condition numbers, plus the rounding of every operation.
    The perturbed run moves each input by one ulp (the size of that storage rounding;
    exact zeros are not rounded and stay), so it sees the inputs' part through the same
    condition numbers, and later roundings fall differently: ``X32' = exact' + e'``.
    (Weights alone are not enough: on the polynomial Adam case a one-ulp move of the
    three weights spreads the run by 1.5e-7 while float32 rounding of ``beta2`` moves
    it by 6e-6, through the bias correction.) Nor is it enough for a *long* reduction:
    one-ulp moves of ``n`` terms move the partial sums by about ``sqrt(n)`` term-ulps, far
    below their own ulp (``n`` term-ulps), so the run and its rerun round them almost alike,
    while another kernel (another order) rounds them differently. A built-in's rerun
    therefore also adds each device's examples in another order (:func:`shard_permutation`:
    the same computation in exact arithmetic, other partial sums) and, where theory says
    the N-device update is the full-batch one, computes that full batch on one device.
    Reordering cannot sample a sum whose terms repeat (the conv bias at every blank window
    in front of batch norm): each addition of the same term to a partial sum in the same
    binade rounds alike, in any order; another length and blocking of the sums does. A
    plugin's rerun keeps its order and its device count: a bug of the code under test that
    depends on a row's device, its place or N must reproduce in its rerun. ``gap(X32, X32')`` is a sample of what
    rounding does to that side, not a bound: there are no float64 runs, so no exact
    triangle inequality. Hence two safeguards, both no looser than what rounding has
    been seen to do: the running maximum over steps (errors are carried forward, see
    the float64 bound, so a spread seen at step ``j`` can occur at any later step) and
    the same factor 2 and absolute floor as the float32 rule. A bug reproduces in the
    buggy side's perturbed rerun, so it does not enter that side's floor. The loss bound
    adds ``S[k] * pgap[k-1]`` (:func:`loss_sensitivity`, the float32 runs' measured parameter
    gap): the sampled loss floors hold each side's own carried spread, not the other side's
    parameters, which the parameter channel accepts as rounding.

Warning:
    Reordering does not re-sample every rounding another kernel leaves: on synchronized
    batch norm part of it is systematic (the same in the run and in every reordered rerun).
    There the rule is stricter than the float32 rule: on the scenario matrix it agrees on
    all 120 dense pairs and all 20 local-batch-norm CNN pairs, and reports 5 of the 16
    synchronized-batch-norm pairs as divergences that the float64 runs prove to be
    rounding (benchmarks/bench_perturbation_floor.py, docs/tolerance.md).
    It cannot prove a difference below the float32 spread (the float64 rule can), nor
    separate a chaotic run's amplified rounding from a difference.

Mixed precision (``"bfloat16 perturbation floor"``, the perturbation rule for dtype ``mixed_bfloat16``):
    A ``mixed_bfloat16`` run keeps float32 master weights (the judged, float32 trajectory)
    but computes its layers in bfloat16, unit roundoff ``u_b = 2**-8`` (8 significant bits),
    2**16 times float32's: its error is dominated by bfloat16 roundings -- of the model input
    and of the weights where the layers cast them, and of every bfloat16 op's result (matmul
    and conv outputs; on the Keras side also bias adds and activations). A mixed pair whose
    sides can run float64 (every built-in that runs ``mixed_bfloat16``) is judged by
    ``judging.bfloat16`` instead (rule ``"bfloat16 against float64"``): each side held against
    its float64 run, within a bound derived from the reruns below and from what this CPU's
    kernels do (``running.kernels``); the figures below are the perturbation floor's, which
    decides only a pair without float64 runs. Its reruns (:func:`perturb_bf16_ulp`,
    ``session.comparison.perturbed_case``) are the ones that rule samples its spread from:

    * the inputs ``x`` moved by one *bfloat16* ulp: ``round_bf16(x)`` (round to nearest
      even, as both frameworks cast) moved to its bfloat16 neighbour, up or down by a
      seeded coin (zeros stay). Both sides round ``x`` to bfloat16 at the first layer; the
      move changes that bfloat16 operand by the size of one bfloat16 rounding, and every
      later bfloat16 rounding (layer outputs, the backward pass) falls afresh. A float32
      ulp would not do this: it changes an element's bfloat16 value only when the element
      lies within a float32 ulp of a bfloat16 rounding boundary (about 2**-16 of them),
      so the re-run repeats the run almost bit for bit (measured at 2 devices, greatest
      parameter spread over the run: seed MLP 1.2e-7 with a float32 move of ``x`` against
      5.8e-4 to 6.2e-4 with the bfloat16 move, CNN 1.4e-7 to 2.5e-7 against 1.8e-2 to
      3.6e-2, while tf.towers and torch.ddp part by 1.1e-3 and 5.7e-3: docs/mixed-precision.md).
    * the initial weights and the optimizer's hyperparameters moved by one *float32* ulp,
      their storage type, as in the float32 rule (the master weights and the update are
      float32). Not a bfloat16 ulp: the weights are the judged arrays, and a
      bfloat16-ulp move of them (``2**-8`` relative) would be a floor, from row 0 on,
      far above everything a few steps of training add, hiding every difference.

    The bound is the perturbation rule's, ``2 * max(floor_A, floor_B) + FLOAT32_ABS_FLOOR``
    with the running maximum. A systematic difference between the two sides' bfloat16
    arithmetic (which values each framework rounds to bfloat16: ``theory.py``,
    "mixed precision") repeats at every step and accumulates linearly, while the sampled
    rounding spread adds up like a random walk, so such a difference can outgrow the
    bound: theory names those (``theory.mixed_precision_differences``), and the verdict
    of a pair where one shows names them.

    The *loss* of a Keras side and a torch side is not the same quantity when the last
    layer is a dense layer with a bias: Keras computes it from bfloat16 logits, torch
    from float32 ones (``theory.reported_loss_differs``). For such pairs the loss channel
    is reported beside the verdict, not judged; the parameters decide.

    **The bfloat16 signature** (:func:`bfloat16_signature`; the bound is ``judging.bfloat16.signature_bound``,
    16 times the float32 run's own step-1 gap to float64, and ``BF16_SIGNATURE = 2**-12`` below only
    where no float64 run was made: the fixed one fired on correct small models): a
    side that ignores the policy and computes in float32 is, by the triangle inequality,
    within the bfloat16 noise of a correct side, so no bound that accepts bfloat16
    rounding can call it a divergence. It is caught directly: each side is also run for
    one step in float32, and its mixed run must differ from that run at step 1 (the loss,
    or a combined gradient) by more than ``2**-12`` relative. Derivation: two float32
    computations of one step differ by at most ``2 u D sqrt(n)`` (the float64 bound's
    envelope, ``D = 20`` stages, ``n = 1e4`` terms, ``T = 1``) with ``u = 2**-24``:
    ``2.4e-4 ~ 2**-12``; a bfloat16 computation rounds every matmul operand by up to
    ``2**-9`` relative, which moves the largest gradient entries by that order: measured
    3.5e-3 to 8.9e-3 (largest over the loss and the gradients) on the seed MLP and the
    CNN at 1, 2, 4 devices, against 1.1e-7 to 8.3e-7 between two float32 frameworks.

What is judged:
    ``param/*`` and ``state/*`` arrays by default (``keys=`` to change), and the ``loss``
    channel (``loss=`` to change; by default when ``keys`` is not given). Gradients are
    compared by :mod:`parity_tests.judging.compare` but do not decide: near a minimum they
    are sums of terms that cancel, and their relative rounding error is unbounded, while
    parameters (the accumulated updates) and the loss (a mean of non-negative terms) keep
    a bounded one. A semantic difference in a gradient shows in the parameters one step
    later. When both channels break, the first to break names the verdict's ``key``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from parity_tests.judging.compare import (
    compare_arrays,
    compare_trajectories,
    describe_key,
    describe_step,
    is_real,
    key_order,
    relative_gap,
    step_of_row,
)
from parity_tests.protocol.rows import array_dtype, iter_pairs, iter_rows, nonfinite_rows, row_norms

__all__ = [
    "FLOAT64_RTOL",
    "SCALE_FLOOR",
    "FLOAT32_FACTOR",
    "FLOAT32_ABS_FLOOR",
    "STATUSES",
    "RULE_FLOAT64",
    "RULE_FLOAT32",
    "RULE_PERTURBATION",
    "RULE_BF16_PERTURBATION",
    "RULE_BF16_SIGNATURE",
    "BF16_SIGNATURE",
    "bfloat16_signature",
    "round_bfloat16",
    "perturb_bf16_ulp",
    "LOSS_KEY",
    "PERTURB_STREAM",
    "RULE_NONFINITE",
    "RULE_STRUCTURE",
    "RULE_CONDITIONING",
    "Verdict",
    "judge_float64",
    "judge_float32",
    "judge_perturbation",
    "perturb_ulp",
    "perturb_scalars",
    "shard_permutation",
    "loss_sensitivity",
]

#: Float64 semantic bound on the per-step relative gap (derivation in the module docstring).
FLOAT64_RTOL: float = 1e-10
#: Denominator floor of every relative gap: arrays below it are judged absolutely.
SCALE_FLOOR: float = 1e-2
#: Float32 bound factor on the larger noise floor: the triangle inequality's 2.
FLOAT32_FACTOR: float = 2.0
#: Float32 absolute floor of the bound: four float32 unit roundoffs, relative.
FLOAT32_ABS_FLOOR: float = 4 * 2.0**-24

#: CONTRACT section 8. ``inconclusive``: nothing was really compared (``judging.pair.vacuity``)
STATUSES = ("parity", "divergence", "expected_difference", "unexpected_parity", "inconclusive", "error")
RULE_FLOAT64 = "float64 bound"
RULE_FLOAT32 = "float32 noise floor"
RULE_PERTURBATION = "float32 perturbation floor"
#: the perturbation rule for dtype mixed_bfloat16: inputs moved by one bfloat16 ulp (module docstring)
RULE_BF16_PERTURBATION = "bfloat16 perturbation floor"
#: a mixed_bfloat16 run that does not compute in bfloat16 (module docstring, "The bfloat16 signature")
RULE_BF16_SIGNATURE = "bfloat16 computation"
#: the least step-1 relative gap between a mixed_bfloat16 run and its float32 run (derived in the module docstring)
BF16_SIGNATURE: float = 2.0**-12
#: The judged loss channel's key (one value per step, row ``r`` is step ``r + 1``).
LOSS_KEY = "loss"
#: Second seed word of :func:`perturb_ulp`'s generator, so its coins share no stream with the case's own draws.
PERTURB_STREAM = 0x5E7B
RULE_NONFINITE = "non-finite values"
RULE_STRUCTURE = "structure"
#: a float64 divergence that a one-ulp move of the inputs reproduces: an ill-conditioned run (``judge``)
RULE_CONDITIONING = "float64 conditioning floor"


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


def _judged_keys(trajs: Iterable[Mapping[str, Any]], keys: Iterable[str] | None) -> list[str]:
    if keys is not None:
        return sorted({keys} if isinstance(keys, str) else set(keys), key=key_order)
    found: set[str] = set()
    for t in trajs:
        found |= {k for k in t if isinstance(k, str) and k.startswith(("param/", "state/"))}
    return sorted(found, key=key_order)


def _check_dtype(traj: Mapping[str, Any], keys: list[str], dtype: type, side: str) -> None:
    for key in keys:
        got = array_dtype(traj[key])
        if got != dtype:
            raise ValueError(
                f"side {side}, {key}: expected {np.dtype(dtype).name} values, got {got} "
                f"(judge float32 runs with judge_float32, float64 runs with judge_float64)"
            )


def _structure(
    pairs: list[tuple[str, Mapping[str, Any], Mapping[str, Any]]], keys: list[str]
) -> str | None:
    """A message naming the first pair whose keys or shapes disagree (``None`` if all fit)."""
    if all(_fits(x, y, keys) for _, x, y in pairs):
        return None  # the common case, decided from shapes alone (reads no array)
    for name, x, y in pairs:
        cmp = compare_trajectories(x, y, rtol=0.0, atol=0.0, keys=keys, equal_nan=True)
        if cmp.missing_in_a or cmp.missing_in_b or cmp.shape_mismatches or not cmp.compared:
            lines = [
                ln
                for ln in cmp.message().splitlines()
                if not ln.startswith(("step ", "Greatest", "Non-finite"))
            ]
            return f"{name}: " + "; ".join(lines or ["no param/* or state/* arrays to judge"])
        rows = {np.shape(x[k])[0] for k in keys}
        if len(rows) > 1 or len({step_of_row(k, 0) for k in keys}) > 1:
            return (
                f"{name}: the judged arrays do not share one step axis (rows {sorted(rows)}); "
                "judge param/state arrays and loss/grad arrays separately"
            )
    return None


def _fits(x: Mapping[str, Any], y: Mapping[str, Any], keys: list[str]) -> bool:
    """Every key on both sides, real numbers, one shape with a row axis, and one step axis for all."""
    if not keys or any(k not in x or k not in y for k in keys):
        return False
    shapes = [(np.shape(x[k]), np.shape(y[k])) for k in keys]
    if any(a != b or len(a) == 0 for a, b in shapes):
        return False
    if not all(is_real(array_dtype(t[k])) for t in (x, y) for k in keys):
        return False
    return len({a[0] for a, _ in shapes}) == 1 and len({step_of_row(k, 0) for k in keys}) == 1


def _row_norms(traj: Mapping[str, Any], key: str) -> np.ndarray:
    return row_norms(traj[key])


def _scales(
    a64: Mapping[str, Any], b64: Mapping[str, Any], keys: list[str]
) -> dict[str, np.ndarray]:
    """Shared denominators ``d_p[k] = max(||A64_p[k]||, ||B64_p[k]||)`` (floored later)."""
    return {k: np.maximum(_row_norms(a64, k), _row_norms(b64, k)) for k in keys}


def _gaps(
    x: Mapping[str, Any], y: Mapping[str, Any], keys: list[str], scales: dict[str, np.ndarray]
) -> np.ndarray:
    """``[len(keys), rows]`` per-array gaps with the shared denominators."""
    return np.stack(
        [relative_gap(x[k], y[k], scale=scales[k], scale_floor=SCALE_FLOOR) for k in keys]
    )


def _first_nonfinite_row(trajs: Iterable[Mapping[str, Any]], keys: list[str], rows: int) -> int:
    stop = rows
    for t in trajs:
        for k in keys:
            bad = nonfinite_rows(t[k])
            if bad.any():
                stop = min(stop, int(np.argmax(bad)))
    return stop


def _alike_nonfinite(x: Mapping[str, Any], y: Mapping[str, Any], keys: list[str]) -> bool:
    """Both sides non-finite at exactly the same places with the same values."""
    for k in keys:
        for _, xa, ya in iter_pairs(x[k], y[k]):
            a = np.asarray(xa, dtype=np.float64)
            b = np.asarray(ya, dtype=np.float64)
            fa, fb = np.isfinite(a), np.isfinite(b)
            same = ~fa & ~fb & ((np.isnan(a) & np.isnan(b)) | (a == b))
            if not ((fa & fb) | same).all():
                return False
    return True


def _row_max(gaps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-row greatest gap over arrays and the array index that holds it (inf > nan > numbers)."""
    with np.errstate(invalid="ignore"):
        filled = np.where(np.isnan(gaps), -1.0, gaps)
    arg = np.argmax(filled, axis=0)
    best = np.take_along_axis(gaps, arg[None, :], axis=0)[0]
    any_nan = np.isnan(gaps).any(axis=0)
    return np.where(np.isinf(best) | ~any_nan, best, np.nan), arg


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


def _mismatch_text(
    x: Mapping[str, Any], y: Mapping[str, Any], key: str, row: int, allowed: float
) -> str:
    """The comparator's message at one row, with the rule's absolute allowance there."""
    mm = compare_arrays(
        x[key][row],
        y[key][row],
        rtol=0.0,
        atol=allowed,
        key=key,
        step=step_of_row(key, row),
    )
    return "" if mm is None else "\n" + mm.message()


def _nonfinite_verdict(
    x: Mapping[str, Any],
    y: Mapping[str, Any],
    keys: list[str],
    label: str,
    stop: int,
    gap_before: float,
    bound: float,
) -> tuple[str, str, float, str, int]:
    """Status, rule, gap, detail and step once NaN/Inf appear at row ``stop`` (no divergence before)."""
    where = (
        compare_trajectories(x, y, rtol=0.0, atol=0.0, keys=keys, equal_nan=True).first_nonfinite
        or "non-finite values"
    )
    step = step_of_row(keys[0], stop)
    if _alike_nonfinite(x, y, keys):
        before = (
            f"before step {step} the greatest relative gap is {gap_before:.2e}, bound {bound:.2g}"
            if stop
            else "no finite step to judge"
        )
        detail = f"{label}: {where}; no parity verdict on non-finite values ({before})"
        return "error", RULE_NONFINITE, gap_before, detail, step
    return (
        "divergence",
        RULE_NONFINITE,
        math.inf,
        f"{label}: {where}; {_first_unlike(x, y, keys)}",
        step,
    )


def _first_unlike(x: Mapping[str, Any], y: Mapping[str, Any], keys: list[str]) -> str:
    """The first element (step, then key order) where the two sides' NaN/Inf disagree."""
    best: tuple[Any, ...] | None = None
    for k in keys:
        for start, xa, ya in iter_pairs(x[k], y[k]):
            a = np.asarray(xa, dtype=np.float64)
            b = np.asarray(ya, dtype=np.float64)
            fa, fb = np.isfinite(a), np.isfinite(b)
            same = ~fa & ~fb & ((np.isnan(a) & np.isnan(b)) | (a == b))
            unlike = ~((fa & fb) | same)
            if unlike.any():
                pos = tuple(int(i) for i in np.argwhere(unlike)[0])
                place = (step_of_row(k, start + pos[0]), key_order(k))
                if best is None or place < best[0]:
                    best = (place, k, (start + pos[0], *pos[1:]), float(a[pos]), float(b[pos]))
                break  # the first unlike row of this key: later chunks are later steps
    if best is None:
        return "the non-finite values agree"
    (step, _), key, pos, va, vb = best
    index = pos[1:]
    shown = "(" + ", ".join(map(str, index)) + ("," if len(index) == 1 else "") + ")"
    return (
        f"first disagreement at {describe_step(key, step)}, {describe_key(key)}, index {shown}: "
        f"side A {va:.6g}, side B {vb:.6g}"
    )


def _judge64(
    a64: Mapping[str, Any], b64: Mapping[str, Any], keys: list[str], label: str = "float64"
) -> Verdict:
    """The float64 rule (structure already checked), before expectations are applied."""
    scales = _scales(a64, b64, keys)
    per_step, arg = _row_max(_gaps(a64, b64, keys, scales))
    rows = per_step.shape[0]
    stop = _first_nonfinite_row((a64, b64), keys, rows)
    head = per_step[:stop]
    bound = FLOAT64_RTOL
    worst = int(np.argmax(head)) if stop else 0
    gap = float(head[worst]) if stop else 0.0
    common: dict[str, Any] = {
        "floor_a": None,
        "floor_b": None,
        "per_step_gap": per_step,
        "per_step_floor": None,
    }
    over = np.flatnonzero(head > bound)
    if over.size:
        first = int(over[0])
        first_key, worst_key = keys[int(arg[first])], keys[int(arg[worst])]
        allowed = bound * max(float(scales[first_key][first]), SCALE_FLOOR)
        first_step, worst_step = step_of_row(first_key, first), step_of_row(worst_key, worst)
        detail = (
            f"{label}: relative gap {per_step[first]:.2e} > bound {bound:.2g} first at "
            f"{describe_step(first_key, first_step)} ({describe_key(first_key)}); greatest "
            f"{gap:.2e} at step {worst_step} ({describe_key(worst_key)})"
            + _mismatch_text(a64, b64, first_key, first, allowed)
        )
        return Verdict(
            "divergence",
            RULE_FLOAT64,
            gap,
            bound,
            detail=detail,
            step=worst_step,
            key=worst_key,
            first_step=first_step,
            **common,
        )
    if stop < rows:
        status, rule, g, detail, step = _nonfinite_verdict(a64, b64, keys, label, stop, gap, bound)
        first_step = step if status == "divergence" else None
        return Verdict(
            status, rule, g, bound, detail=detail, step=step, first_step=first_step, **common
        )
    key = keys[int(arg[worst])]
    step = step_of_row(key, worst)
    detail = (
        f"{label}: greatest relative gap {gap:.2e} <= bound {bound:.2g} "
        f"(at {describe_step(key, step)}, {describe_key(key)})"
    )
    return Verdict("parity", RULE_FLOAT64, gap, bound, detail=detail, step=step, key=key, **common)


def _error(rule: str, detail: str, known: tuple[str, ...]) -> Verdict:
    return Verdict("error", rule, math.nan, math.nan, None, None, np.zeros(0), None, detail, known)


# ---------------------------------------------------------------- the loss channel


@dataclass(frozen=True)
class _Channel:
    """The loss channel of one rule: per-step gap and bound (row ``r`` is step ``r + 1``)."""

    gap: np.ndarray
    bound: np.ndarray
    rule: str
    label: str
    how: str  # how the bound was formed, for the detail
    mismatch: tuple[Mapping[str, Any], Mapping[str, Any], np.ndarray]  # (x, y, scale) for the message
    #: why a step whose bound is ``inf`` was not judged (the verdict's ``unjudged`` line)
    why: str = "no recorded gradient bounds its sensitivity to the parameters' rounding"


def _judges_loss(trajs: Iterable[Mapping[str, Any]], keys: Iterable[str] | None, loss: bool | None) -> bool:
    """Judge the loss channel: by default whenever no ``keys=`` were given and every run holds a loss."""
    wanted = keys is None if loss is None else bool(loss)
    return wanted and all(LOSS_KEY in t for t in trajs)


def _loss_scale(*trajs: Mapping[str, Any]) -> np.ndarray:
    """``d_L[r] = max_X |L_X[r]|`` over the runs that set the scale (floored in :func:`relative_gap`)."""
    return np.max([np.abs(np.asarray(t[LOSS_KEY], dtype=np.float64)) for t in trajs], axis=0)


def _loss_gap(x: Mapping[str, Any], y: Mapping[str, Any], scale: np.ndarray) -> np.ndarray:
    """``|L_X[r] - L_Y[r]| / max(d_L[r], SCALE_FLOOR)`` (``inf``/``nan`` where non-finite)."""
    return relative_gap(x[LOSS_KEY], y[LOSS_KEY], scale=scale, scale_floor=SCALE_FLOOR)


def _loss_structure(trajs: Iterable[Mapping[str, Any]]) -> str | None:
    shapes = {np.asarray(t[LOSS_KEY]).shape for t in trajs}
    if len(shapes) > 1 or any(len(s) != 1 for s in shapes):
        return f"loss: one value per step on every run expected, got shapes {sorted(shapes)}"
    return None


def loss_sensitivity(
    a: Mapping[str, Any], b: Mapping[str, Any], param_keys: list[str], scales: Mapping[str, np.ndarray],
    *, grads: Iterable[Mapping[str, Any]] = (),
) -> np.ndarray | None:
    """The loss's normwise relative condition number with respect to the parameters, per step.

    ``S[r] = sum_p ||g_p[r]||_1 * max(d_p[r], SCALE_FLOOR) / max(d_L[r], SCALE_FLOOR)``

    with ``g_p[r]`` a combined gradient of step ``r + 1`` (elementwise the largest of those
    recorded), taken at the parameters of row ``r`` from which that step's loss is computed.
    To first order ``|L(theta_A) - L(theta_B)| <= sum_p ||g_p||_1 ||dtheta_p||_inf`` and
    ``||dtheta_p[r]||_inf = gap_p[r] * max(d_p[r], SCALE_FLOOR)``, so a parameter gap ``pgap[r]``
    moves the loss's relative gap by at most ``S[r] * pgap[r]``.

    The gradient comes from whichever of ``a``, ``b`` and ``grads`` recorded it: one side's
    gradient is enough (to first order the two sides' gradients agree where their parameters
    do, and where they do not the parameter channel has already found it), and ``grads`` holds
    a built-in's run of the same case for pairs in which neither side records one (the judge's
    choice: ``judging.pair``). ``None`` when no run holds every gradient (``param_mean``,
    ``async``: no single gradient applies).
    """
    if not param_keys:
        return None
    names = [f"grad/{k.partition('/')[2]}" for k in param_keys]
    steps = np.asarray(a[LOSS_KEY]).shape[0]
    sources = [t for t in (a, b, *grads)
               if all(n in t and np.shape(t[n])[:1] == (steps,) for n in names)]
    if not sources:
        return None
    total = np.zeros(steps)
    for key, name in zip(param_keys, names, strict=True):
        if len({np.shape(t[name]) for t in sources}) > 1:
            return None
        g1 = np.zeros(steps)
        for t in sources:
            for start, xa in iter_rows(t[name]):  # row by row: a large model's gradients stay on disk
                ga = np.abs(np.asarray(xa, dtype=np.float64)).reshape(len(xa), -1).sum(axis=1)
                g1[start:start + len(xa)] = np.maximum(g1[start:start + len(xa)], ga)
        total += g1 * np.maximum(scales[key][:steps], SCALE_FLOOR)
    return total / np.maximum(_loss_scale(a, b), SCALE_FLOOR)


def _steps_text(steps: Iterable[int]) -> str:
    """``[3, 4, 5, 7]`` -> ``"3-5, 7"``."""
    runs: list[list[int]] = []
    for k in sorted(steps):
        if runs and k == runs[-1][-1] + 1:
            runs[-1].append(k)
        else:
            runs.append([k])
    return ", ".join(f"{r[0]}" if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def _loss_channel64(
    a64: Mapping[str, Any], b64: Mapping[str, Any], judged: list[str], label: str,
    grads: Iterable[Mapping[str, Any]] = (),
) -> _Channel:
    """The float64 loss bound, ``bound_L[r] = FLOAT64_RTOL + S[r] * pgap[r]``.

    ``pgap[r]`` is the measured float64 gap of the ``param/*`` arrays at row ``r`` (the
    parameters the loss of step ``r + 1`` is computed from) and ``S`` is
    :func:`loss_sensitivity`; ``FLOAT64_RTOL`` bounds the two sides' own evaluation of
    the loss (module docstring, "The loss"). Where ``pgap[r]`` is exactly 0 (both sides
    hold the same numbers: always before step 1, when they start from the same weights)
    the carried term is exactly 0 and no gradient is needed: the bound is ``FLOAT64_RTOL``.
    At other steps without any recorded gradient the bound is ``inf`` (that step's loss is
    not judged by this rule) and the verdict's ``unjudged`` says which steps.
    """
    scale = _loss_scale(a64, b64)
    gap = _loss_gap(a64, b64, scale)
    steps = gap.shape[0]
    pkeys = [k for k in judged if k.startswith("param/")]
    scales = _scales(a64, b64, pkeys)
    sens = loss_sensitivity(a64, b64, pkeys, scales, grads=grads)
    pgap = _row_max(_gaps(a64, b64, pkeys, scales))[0][:steps] if pkeys else np.zeros(steps)
    same = pgap == 0.0
    with np.errstate(invalid="ignore"):
        if sens is None:
            bound = np.where(same, FLOAT64_RTOL, math.inf)
            unjudged = [r + 1 for r in range(steps) if not same[r]]
            how = (f"bound {FLOAT64_RTOL:.2g} where both sides start the step from the same parameters"
                   + (f"; not judged at step(s) {_steps_text(unjudged)}: the parameters the loss is computed from"
                      " differ by rounding there, and no recorded gradient bounds its sensitivity to them"
                      if unjudged else ""))
        else:
            bound = FLOAT64_RTOL + sens * np.fmax(pgap, 0.0)
            how = f"bound {FLOAT64_RTOL:.2g} + S x (parameter gap of the step before), S up to {np.nanmax(sens):.2g}"
    return _Channel(gap, bound, RULE_FLOAT64, label, how, (a64, b64, scale))


def _loss_channel_floor(
    x: Mapping[str, Any], y: Mapping[str, Any], floor_x: np.ndarray, floor_y: np.ndarray,
    scale: np.ndarray, factor: float, rule: str, label: str, abs_floor: float = FLOAT32_ABS_FLOOR,
) -> _Channel:
    """A floor rule's loss bound: ``factor * max(floor_A[r], floor_B[r]) + abs_floor``."""
    with np.errstate(invalid="ignore"):
        bound = factor * np.fmax(floor_x, floor_y) + abs_floor
    how = (f"loss floors A up to {np.nanmax(floor_x, initial=0.0):.2e}, "
           f"B up to {np.nanmax(floor_y, initial=0.0):.2e}")
    return _Channel(_loss_gap(x, y, scale), bound, rule, label, how, (x, y, scale))


def _first_line_plus(detail: str, note: str) -> str:
    head, _, rest = detail.partition("\n")
    return head + note + (("\n" + rest) if rest else "")


def _earliest_other(v: Verdict) -> int | None:
    """The step at which the parameter channel stopped being at parity (``None``: it never did)."""
    if v.status == "divergence":
        return v.first_step
    if v.status == "error" and v.rule == RULE_NONFINITE:
        return v.step
    return None


def _with_loss(v: Verdict, ch: _Channel | None) -> Verdict:
    """Merge the loss channel into the parameter channel's verdict ``v`` (before expectations).

    The verdict is a divergence when either channel breaks; the channel that breaks first
    names ``key``, ``step``, ``gap`` and ``bound``. At one step the loss comes first: the
    loss of step ``k`` is computed from the parameters of step ``k - 1``, before the update
    that produces the parameters of step ``k``.
    """
    if ch is None or (v.status == "error" and v.rule == RULE_STRUCTURE):
        return v
    figures: dict[str, Any] = {"per_step_loss_gap": ch.gap, "per_step_loss_bound": ch.bound}
    skipped = [r + 1 for r in np.flatnonzero(~np.isfinite(ch.bound))]
    if skipped:
        figures["unjudged"] = (*v.unjudged, f"the loss at step(s) {_steps_text(skipped)} ({ch.why})")
    with np.errstate(invalid="ignore", divide="ignore"):
        over = np.flatnonzero(ch.gap > ch.bound)
        ratio = np.where(np.isnan(ch.gap), -1.0, ch.gap / ch.bound)
    if not over.size:
        judged = np.isfinite(ch.bound)
        if not judged.any():
            return replace(v, detail=_first_line_plus(v.detail, f"; loss {ch.how}"), **figures)
        r = int(np.nanargmax(np.where(judged, ratio, -1.0)))
        note = f"; loss within its bound (tightest at step {r + 1}: {ch.gap[r]:.2e} <= {ch.bound[r]:.2e}; {ch.how})"
        return replace(v, detail=_first_line_plus(v.detail, note), **figures)
    first = int(over[0])
    other = _earliest_other(v)
    if other is not None and other < first + 1:
        note = f"; the loss is also over its bound from step {first + 1}"
        return replace(v, detail=_first_line_plus(v.detail, note), **figures)
    worst = int(np.argmax(ratio))
    x, y, scale = ch.mismatch
    allowed = float(ch.bound[first]) * max(float(scale[first]), SCALE_FLOOR)
    before = v.detail.splitlines()[0] if v.detail else ""
    detail = (
        f"{ch.label}: loss relative gap {ch.gap[first]:.2e} > bound {ch.bound[first]:.2e} first at "
        f"step {first + 1} (loss); greatest gap/bound {ch.gap[worst]:.2e} / {ch.bound[worst]:.2e} at step "
        f"{worst + 1}; {ch.how}; parameters: {before}"
        + _mismatch_text(x, y, LOSS_KEY, first, allowed)
    )
    return replace(v, status="divergence", rule=ch.rule, gap=float(ch.gap[worst]), bound=float(ch.bound[worst]),
                   step=worst + 1, key=LOSS_KEY, first_step=first + 1, detail=detail, **figures)


# ---------------------------------------------------------------- the rules


def _error(rule: str, detail: str, known: tuple[str, ...]) -> Verdict:
    return Verdict("error", rule, math.nan, math.nan, None, None, np.zeros(0), None, detail, known)


def _finished(v: Verdict, expect_difference: bool, known: tuple[str, ...]) -> Verdict:
    status, detail = _finish(v.status, expect_difference, v.detail, known)
    return replace(v, status=status, detail=detail, known_differences=known)


def _check_factor(factor: Any) -> float:
    if isinstance(factor, bool) or not isinstance(factor, (int, float, np.integer, np.floating)):
        raise TypeError(f"factor must be a real number, got {factor!r}")
    if not (math.isfinite(float(factor)) and factor > 0):
        raise ValueError(f"factor must be finite and > 0, got {factor!r}")
    return float(factor)


def judge_float64(
    a64: Mapping[str, Any],
    b64: Mapping[str, Any],
    *,
    expect_difference: bool = False,
    known_differences: Iterable[str] = (),
    keys: Iterable[str] | None = None,
    loss: bool | None = None,
    grads: Iterable[Mapping[str, Any]] = (),
) -> Verdict:
    """Judge two float64 trajectories of one case by the float64 rule.

    ``gap_k = max_p ||A_p[k] - B_p[k]||_inf / max(||A_p[k]||_inf, ||B_p[k]||_inf, SCALE_FLOOR)``;
    divergence when ``gap_k > FLOAT64_RTOL`` at any step ``k``, or when the loss of a step
    ``k`` breaks its bound ``FLOAT64_RTOL + S[k] * pgap[k-1]`` (:func:`loss_sensitivity`).

    Args:
        a64, b64: float64 trajectories (the judged arrays must be float64).
        expect_difference: theory predicts a difference: a divergence becomes
            ``"expected_difference"``, parity ``"unexpected_parity"``.
        known_differences: names of documented differences, carried into the verdict.
        keys: arrays to judge; by default every ``param/*`` and ``state/*`` key.
        loss: judge the ``loss`` channel too; by default when ``keys`` is not given
            and both runs hold a loss.
        grads: other runs of the same case whose recorded ``grad/*`` may bound the loss's
            sensitivity where neither side records one (:func:`loss_sensitivity`).

    Returns:
        A :class:`Verdict`. Missing arrays or different shapes give status ``"error"``
        (rule ``"structure"``); NaN/Inf on one side only is a divergence, on both
        sides alike an error (rule ``"non-finite values"``), unless the gap already
        exceeded the bound at an earlier step.

    Raises:
        ValueError: a judged array is not float64.
    """
    known = _known(known_differences)
    judged = _judged_keys((a64, b64), keys)
    with_loss = _judges_loss((a64, b64), keys, loss)
    problem = _structure([("float64 runs A64 vs B64", a64, b64)], judged)
    problem = problem or (_loss_structure((a64, b64)) if with_loss else None)
    if problem:
        return _error(RULE_STRUCTURE, problem, known)
    _check_dtype(a64, judged, np.float64, "A")
    _check_dtype(b64, judged, np.float64, "B")
    v = _judge64(a64, b64, judged)
    if with_loss:
        v = _with_loss(v, _loss_channel64(a64, b64, judged, "float64", tuple(grads)))
    return _finished(v, expect_difference, known)


def _judge_floor(
    a32: Mapping[str, Any],
    b32: Mapping[str, Any],
    judged: list[str],
    scales: dict[str, np.ndarray],
    fa_rows: np.ndarray,
    fb_rows: np.ndarray,
    factor: float,
    rule: str,
    context: str,
    abs_floor: float = FLOAT32_ABS_FLOOR,
    label: str = "float32",
) -> Verdict:
    """A floor rule on the parameter channel: divergence when ``gap_k(A32, B32) > bound[k]``,

    ``bound[k] = factor * max(floor_A[k], floor_B[k]) + abs_floor``; ``context``
    is appended to the detail (what was established before, e.g. the float64 runs agree).
    """
    per_step, arg = _row_max(_gaps(a32, b32, judged, scales))
    rows = per_step.shape[0]
    with np.errstate(invalid="ignore"):
        floor_rows = np.fmax(fa_rows, fb_rows)
        bound_rows = factor * floor_rows + abs_floor

    def figures(row: int) -> str:
        return (
            f"{factor:g} x max(floor A {fa_rows[row]:.2e}, floor B {fb_rows[row]:.2e}) "
            f"+ {abs_floor:.2e}"
        )

    def step_at(row: int) -> int:
        return step_of_row(judged[0], row)

    stop = _first_nonfinite_row((a32, b32), judged, rows)
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = per_step[:stop] / bound_rows[:stop]
    worst = int(np.argmax(ratio)) if stop else 0
    floor_a = float(np.max(fa_rows[:stop])) if stop else 0.0
    floor_b = float(np.max(fb_rows[:stop])) if stop else 0.0
    gap, bound = (
        (float(per_step[worst]), float(bound_rows[worst])) if stop else (0.0, abs_floor)
    )
    worst_key = judged[int(arg[worst])]
    common: dict[str, Any] = {
        "floor_a": floor_a,
        "floor_b": floor_b,
        "per_step_gap": per_step,
        "per_step_floor": floor_rows,
        "per_step_bound": bound_rows,
    }
    over = np.flatnonzero(ratio > 1.0)
    if over.size:
        first = int(over[0])
        first_key = judged[int(arg[first])]
        allowed = float(bound_rows[first]) * max(float(scales[first_key][first]), SCALE_FLOOR)
        detail = (
            f"{label}: relative gap {per_step[first]:.2e} > noise bound {bound_rows[first]:.2e} = "
            f"{figures(first)} first at {describe_step(first_key, step_at(first))} "
            f"({describe_key(first_key)}); greatest gap/bound {gap:.2e} / {bound:.2e} at step "
            f"{step_at(worst)}; {context}" + _mismatch_text(a32, b32, first_key, first, allowed)
        )
        return Verdict("divergence", rule, gap, bound, detail=detail, step=step_at(worst), key=worst_key,
                       first_step=step_at(first), **common)
    if stop < rows:
        status, nrule, g, detail, step = _nonfinite_verdict(a32, b32, judged, label, stop, gap, bound)
        detail = _first_line_plus(detail, f"; {context}")
        first_step = step if g == math.inf else None
        return Verdict(status, nrule, g, bound, detail=detail, step=step, first_step=first_step, **common)
    detail = (
        f"{label}: relative gap {gap:.2e} <= noise bound {bound:.2e} = {figures(worst)} "
        f"(tightest at {describe_step(worst_key, step_at(worst))}, {describe_key(worst_key)}); "
        f"{context}; greatest floors A {floor_a:.2e}, B {floor_b:.2e}"
    )
    return Verdict("parity", rule, gap, bound, detail=detail, step=step_at(worst), key=worst_key, **common)


def judge_float32(
    a32: Mapping[str, Any],
    b32: Mapping[str, Any],
    *,
    a64: Mapping[str, Any],
    b64: Mapping[str, Any],
    factor: float = FLOAT32_FACTOR,
    expect_difference: bool = False,
    known_differences: Iterable[str] = (),
    keys: Iterable[str] | None = None,
    loss: bool | None = None,
    grads: Iterable[Mapping[str, Any]] = (),
) -> Verdict:
    """Judge two float32 trajectories against each side's own float32 noise floor.

    First the float64 rule on ``(a64, b64)`` (loss channel included): a semantic
    difference is a divergence by that rule, and the detail says whether it is also
    visible above the float32 noise. Otherwise, per step ``k`` and per channel::

        floor_X[k] = gap_k(X32, X64)
        bound[k]   = factor * max(floor_A[k], floor_B[k]) + FLOAT32_ABS_FLOOR

    and divergence when ``gap_k(A32, B32) > bound[k]`` at any step, for the
    parameters (``param/*``, ``state/*``) or for the loss.

    Args:
        a32, b32: the float32 trajectories of the two implementations.
        a64, b64: the same case run in float64 by the same implementations.
        factor: multiple of the larger floor; ``FLOAT32_FACTOR`` (2) is the smallest
            value for which rounding can never be reported as a divergence.
        expect_difference, known_differences, keys, loss, grads: as in :func:`judge_float64`.

    Returns:
        A :class:`Verdict`; for the float32 rule ``floor_a``/``floor_b`` are each
        side's greatest floor and ``per_step_floor``/``per_step_bound`` the curves.

    Raises:
        ValueError: ``factor`` is not finite and ``> 0``, or a judged array has the
        wrong dtype (float32 for ``a32``/``b32``, float64 for ``a64``/``b64``).
    """
    factor = _check_factor(factor)
    known = _known(known_differences)
    runs = (a32, b32, a64, b64)
    judged = _judged_keys(runs, keys)
    with_loss = _judges_loss(runs, keys, loss)
    problem = _structure(
        [
            ("float64 runs A64 vs B64", a64, b64),
            ("float32 runs A32 vs B32", a32, b32),
            ("side A float32 vs float64", a32, a64),
            ("side B float32 vs float64", b32, b64),
        ],
        judged,
    )
    problem = problem or (_loss_structure(runs) if with_loss else None)
    if problem:
        return _error(RULE_STRUCTURE, problem, known)
    for side, traj, dtype in (
        ("A32", a32, np.float32),
        ("B32", b32, np.float32),
        ("A64", a64, np.float64),
        ("B64", b64, np.float64),
    ):
        _check_dtype(traj, judged, dtype, side)

    scales = _scales(a64, b64, judged)
    fa_rows, _ = _row_max(_gaps(a32, a64, judged, scales))
    fb_rows, _ = _row_max(_gaps(b32, b64, judged, scales))
    v64 = _judge64(a64, b64, judged, label="float64 runs")
    if with_loss:
        v64 = _with_loss(v64, _loss_channel64(a64, b64, judged, "float64 runs", tuple(grads)))
    if v64.status != "parity":
        if v64.status == "divergence" and v64.rule == RULE_FLOAT64:
            v64 = replace(v64, detail=_visibility_note(v64, a32, b32, judged, scales, fa_rows, fb_rows, factor))
        return _finished(v64, expect_difference, known)

    agree64 = f"float64 runs agree (gap {v64.gap:.2e} <= {FLOAT64_RTOL:.2g})"
    v = _judge_floor(a32, b32, judged, scales, fa_rows, fb_rows, factor, RULE_FLOAT32, agree64)
    if with_loss:
        scale = _loss_scale(a64, b64)
        ch = _loss_channel_floor(a32, b32, _loss_gap(a32, a64, scale), _loss_gap(b32, b64, scale), scale,
                                 factor, RULE_FLOAT32, "float32")
        v = _with_loss(v, ch)
    return _finished(v, expect_difference, known)


def _visibility_note(
    v64: Verdict, a32: Mapping[str, Any], b32: Mapping[str, Any], judged: list[str],
    scales: dict[str, np.ndarray], fa_rows: np.ndarray, fb_rows: np.ndarray, factor: float,
) -> str:
    """``v64``'s detail, saying whether its parameter difference is also visible above the float32 noise.

    (A divergence that the loss decided keeps its detail: it names the loss's own figures.)
    """
    if v64.key == LOSS_KEY:
        return v64.detail
    per_step, _ = _row_max(_gaps(a32, b32, judged, scales))
    with np.errstate(invalid="ignore"):
        bound_rows = factor * np.fmax(fa_rows, fb_rows) + FLOAT32_ABS_FLOOR
        visible = np.flatnonzero(per_step > bound_rows)
    note = (
        f"; visible in float32 from step {step_of_row(judged[0], int(visible[0]))} "
        f"(gap {per_step[visible[0]]:.2e} > noise bound {bound_rows[visible[0]]:.2e})"
        if visible.size
        else "; below the float32 noise at every step (gap <= noise bound)"
    )
    return _first_line_plus(v64.detail, note)


# ---------------------------------------------------------------- the perturbation floor


def perturb_ulp(arrays: Mapping[str, Any], seed: int, dtype: type = np.float32) -> dict[str, np.ndarray]:
    """Every non-zero element moved by one float32 ulp, up or down by a seeded coin per element.

    ``x' = nextafter(float32(x), +inf)`` or ``nextafter(float32(x), -inf)``; an exact zero
    stays zero (storing it rounds nothing, and a subnormal in its place breaks the ties
    zeros make: on the CNN a one-ulp-of-zero bias moves torch's loss by 8%). Stored in
    the arrays' own dtype (a float32 number is exact in float64), so that a float32 run
    starts exactly one ulp away from the unperturbed float32 run. The coins come from
    ``numpy.random.default_rng([seed, PERTURB_STREAM])``, one stream per name in sorted
    order: the same case gives the same perturbation on every implementation and run.
    """
    out: dict[str, np.ndarray] = {}
    for name in sorted(arrays):
        a = np.asarray(arrays[name])
        rng = np.random.default_rng([int(seed), PERTURB_STREAM, *name.encode()])
        up = rng.random(a.shape) < 0.5
        a32 = a.astype(dtype)  # (``dtype`` float64: one float64 ulp, for RULE_CONDITIONING)
        moved = np.where(up, np.nextafter(a32, dtype(np.inf)), np.nextafter(a32, dtype(-np.inf)))
        # an exact zero is stored without rounding; moving it to a subnormal would instead break the
        # ties it makes (ReLU outputs, max-pool windows, padding), which is no rounding at all
        moved = np.where(a32 == 0, a32, moved)
        out[name] = moved.astype(a.dtype if a.dtype.kind == "f" else np.float64)
    return out


def round_bfloat16(a: Any) -> np.ndarray:
    """``a`` rounded to bfloat16 (round to nearest, ties to even: what ``tf.cast`` and
    ``Tensor.bfloat16()`` do, both measured), returned as float32 (exact).

    bfloat16 is float32's upper 16 bits: add half of the dropped 16 bits' range
    (``0x7FFF``, plus 1 when the kept last bit is odd, for ties to even) and clear them.
    NaN and infinities are returned unchanged.
    """
    a32 = np.asarray(a, dtype=np.float32)
    bits = a32.view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).astype(np.uint32).view(np.float32)
    return np.where(np.isfinite(a32), rounded, a32)


def perturb_bf16_ulp(arrays: Mapping[str, Any], seed: int) -> dict[str, np.ndarray]:
    """Every non-zero element rounded to bfloat16 and moved to a bfloat16 neighbour, up or down by a seeded coin.

    ``x' = round_bf16(x) +- ulp_bf16``, exact in float32 (and in the arrays' float dtype), so
    that a mixed-precision run casts ``x'`` to bfloat16 without rounding: its first bfloat16
    operand is exactly one bfloat16 ulp from the unperturbed run's ``round_bf16(x)``. The
    neighbour is the next bfloat16 number away from or toward zero (the bit pattern's upper
    16 bits plus or minus one), so crossing a power of two is handled. Zeros stay zero (as in
    :func:`perturb_ulp`); the coins are :func:`perturb_ulp`'s streams, so the same case gives
    the same perturbation everywhere.
    """
    out: dict[str, np.ndarray] = {}
    for name in sorted(arrays):
        a = np.asarray(arrays[name])
        rng = np.random.default_rng([int(seed), PERTURB_STREAM, *name.encode()])
        up = rng.random(a.shape) < 0.5
        b = round_bfloat16(a)
        bits = b.view(np.uint32).astype(np.int64)
        away = np.where(up == (b > 0), 1, -1) << 16  # toward +inf is away from zero for positives
        moved = (bits + away).astype(np.uint32).view(np.float32)
        moved = np.where((b == 0) | ~np.isfinite(b), b, moved)
        out[name] = moved.astype(a.dtype if a.dtype.kind == "f" else np.float64)
    return out


def bfloat16_signature(mixed: Mapping[str, Any], f32: Mapping[str, Any]) -> tuple[float, str]:
    """How far a ``mixed_bfloat16`` run is from the same implementation's float32 run at step 1, and where.

    The largest relative gap over the step-1 loss and every step-1 combined gradient
    (``grad/*`` row 0), each measured against ``max(|mixed|, |f32|, SCALE_FLOOR)``;
    returns ``(gap, key)``. At least :data:`BF16_SIGNATURE` when the run computes in
    bfloat16 (module docstring); gradients that are not recorded are skipped.
    """
    best, where = 0.0, LOSS_KEY
    keys = [LOSS_KEY] + sorted(k for k in mixed if isinstance(k, str) and k.startswith("grad/") and k in f32)
    for key in keys:
        a = np.asarray(mixed[key][:1], dtype=np.float64)  # row 0: step 1 (loss [steps], grad/* [steps, ...])
        b = np.asarray(f32[key][:1], dtype=np.float64)
        if a.size == 0 or b.shape != a.shape:
            continue
        scale = max(float(np.abs(a).max()), float(np.abs(b).max()), SCALE_FLOOR)
        gap = float(np.abs(a - b).max()) / scale
        if not np.isfinite(gap):  # a non-finite first step is not a float32 computation either
            return math.inf, key
        if gap > best:
            best, where = gap, key
    return best, where


def _spread(rows: np.ndarray) -> np.ndarray:
    """``floor[k] = max_{j <= k} gap_j(X, X')``: the largest spread rounding has shown up to step ``k``.

    One perturbed run is a *sample* of what rounding does, not a bound on it: at a
    single step its gap can happen to be small while the other side's rounding is
    large. Rounding errors of a training run are carried forward by the parameters
    (the premise of the float64 bound), so a spread seen at step ``j`` is one that
    rounding can produce at every later step; the running maximum keeps it.
    (NaN rows are skipped; they are judged as non-finite values.)
    """
    return np.fmax.accumulate(np.asarray(rows, dtype=np.float64)) if rows.size else rows


def perturb_scalars(values: Mapping[str, Any], seed: int) -> dict[str, float]:
    """Every non-zero real number moved by one float32 ulp, up or down by a seeded coin (zeros stay zero).

    For the hyperparameters a float32 run stores in float32 (``lr``, ``beta2``, ...): their
    rounding is part of that run's error, and an ill-conditioned use of one (Adam's bias
    correction ``1 - beta2**t`` cancels ``log10(1 / (1 - beta2))`` digits) is only explored
    by moving it. A zero (``weight_decay: 0``) is a switch, not a rounded number.
    """
    rng = np.random.default_rng([int(seed), PERTURB_STREAM, 1])
    out: dict[str, float] = {}
    for name in sorted(values):
        v = values[name]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v == 0:
            continue
        toward = np.float32(np.inf) if rng.random() < 0.5 else np.float32(-np.inf)
        out[name] = float(np.nextafter(np.float32(v), toward))
    return out


def shard_permutation(steps: int, batch: int, devices: int, shard: str, seed: int, *,
                      across: bool = False) -> np.ndarray:
    """Row order of a run whose every device shard holds the same rows in a seeded other order.

    Returns int64 ``idx`` ``[steps * batch]``: the perturbed run reads data row ``idx[j]`` where
    the run reads row ``j``. Within step ``k`` (rows ``[k B, (k + 1) B)``) the rows of each
    device's shard (``shard``: ``contiguous``, ``np.array_split`` order; ``strided``, rows
    ``r, r + N, ...``) are permuted among themselves, so every device computes on the same
    examples, only in another order: in exact arithmetic every sum over examples (the loss
    mean, the gradients' sums, batch-norm statistics) is unchanged, in float32 each is
    accumulated in another order. That is the rounding another implementation's kernel
    leaves and a one-ulp move of the inputs cannot sample (module docstring, "Derivation of
    the perturbation rule"). ``across=True`` permutes each step's whole global batch instead,
    so that each device (each block of the cross-device sum) also adds up other examples:
    the same computation only where the N-device update equals the full-batch one, and only
    for code that is known to compute it (``session.comparison.perturbed_case`` decides: a bug that depends
    on which rows a device holds must reproduce in the buggy side's rerun, or it raises that
    side's floor instead of showing). The permutations come from
    ``default_rng([seed, PERTURB_STREAM, 2])``.
    """
    rng = np.random.default_rng([int(seed), PERTURB_STREAM, 2])
    base = np.arange(batch)
    parts = np.array_split(base, devices) if shard == "contiguous" else [base[r::devices] for r in range(devices)]
    parts = [base] if across else parts
    idx = np.arange(steps * batch, dtype=np.int64)
    for k in range(steps):
        for rows in parts:
            idx[k * batch + rows] = k * batch + rng.permutation(rows)
    return idx


def judge_perturbation(
    a32: Mapping[str, Any],
    b32: Mapping[str, Any],
    *,
    a32p: Mapping[str, Any] | None,
    b32p: Mapping[str, Any] | None,
    factor: float = FLOAT32_FACTOR,
    expect_difference: bool = False,
    known_differences: Iterable[str] = (),
    keys: Iterable[str] | None = None,
    loss: bool | None = None,
    rule: str = RULE_PERTURBATION,
    perturbed: str = "a one-ulp perturbation of the initial weights",
    dtype: type = np.float32,
    abs_floor: float = FLOAT32_ABS_FLOOR,
) -> Verdict:
    """Judge two float32 trajectories without float64 runs: the perturbation floor.

    Each side is re-run in float32 from its initial weights (and inputs and hyperparameters)
    moved by one float32 ulp (:func:`perturb_ulp`; ``session.comparison.perturbed_case`` also reorders a
    built-in's shards); the spread is what rounding alone does to that side::

        d_p[k]     = max(||A32_p[k]||_inf, ||B32_p[k]||_inf, SCALE_FLOOR)
        floor_X[k] = max over j <= k of gap_j(X32, X32')  (X32': the perturbed run)
        bound[k]   = factor * max(floor_A[k], floor_B[k]) + FLOAT32_ABS_FLOOR

    divergence when ``gap_k(A32, B32) > bound[k]`` at any step, for the parameters
    or for the loss (whose bound adds ``S[k] * pgap[k-1]``, :func:`_carried`). A side without a perturbed run (a recorded run cannot be run
    again) takes the other side's floor.

    Args:
        a32, b32: the float32 trajectories of the two implementations.
        a32p, b32p: each side's run from the perturbed weights, or ``None``.
        factor, expect_difference, known_differences, keys, loss: as in :func:`judge_float32`.
        rule: the rule's name in the verdict (:data:`RULE_BF16_PERTURBATION` for ``mixed_bfloat16``
            cases, whose inputs are moved by a bfloat16 ulp: module docstring).
        perturbed: what the re-runs moved, for the detail ("floors measured by ...").
        dtype, abs_floor: the runs' dtype and the bound's absolute floor; ``numpy.float64`` and
            ``FLOAT64_RTOL`` sample an ill-conditioned float64 run's own spread
            (:data:`RULE_CONDITIONING`).

    Raises:
        ValueError: both perturbed runs are missing, ``factor`` is not finite and ``> 0``,
        or a judged array is not float32.
    """
    factor = _check_factor(factor)
    if a32p is None and b32p is None:
        raise ValueError("judge_perturbation needs a perturbed run of at least one side (a32p or b32p)")
    known = _known(known_differences)
    pa, pb = (a32p if a32p is not None else b32p), (b32p if b32p is not None else a32p)
    own = {"A": a32p is not None, "B": b32p is not None}
    runs = (a32, b32, pa, pb)
    judged = _judged_keys(runs, keys)
    with_loss = _judges_loss(runs, keys, loss)
    problem = _structure(
        [
            ("float32 runs A32 vs B32", a32, b32),
            ("side A run vs perturbed run", a32, pa if own["A"] else pb),
            ("side B run vs perturbed run", b32, pb if own["B"] else pa),
        ],
        judged,
    )
    problem = problem or (_loss_structure(runs) if with_loss else None)
    if problem:
        return _error(RULE_STRUCTURE, problem, known)
    for side, traj in (("A32", a32), ("B32", b32), ("A32 perturbed", pa), ("B32 perturbed", pb)):
        _check_dtype(traj, judged, dtype, side)

    scales = _scales(a32, b32, judged)
    fa_rows = _spread(_row_max(_gaps(a32, pa, judged, scales))[0]) if own["A"] else None
    fb_rows = _spread(_row_max(_gaps(b32, pb, judged, scales))[0]) if own["B"] else None
    fa_rows = fb_rows if fa_rows is None else fa_rows
    fb_rows = fa_rows if fb_rows is None else fb_rows
    borrowed = [s for s, o in own.items() if not o]
    context = f"floors measured by {perturbed}" + (
        f" (side {borrowed[0]} cannot be re-run: it takes the other side's floor)" if borrowed else ""
    )
    label = np.dtype(dtype).name
    v = _judge_floor(a32, b32, judged, scales, fa_rows, fb_rows, factor, rule, context, abs_floor, label)
    if with_loss:
        scale = _loss_scale(a32, b32)
        la = _spread(_loss_gap(a32, pa, scale) if own["A"] else _loss_gap(b32, pb, scale))
        lb = _spread(_loss_gap(b32, pb, scale)) if own["B"] else la
        ch = _carried(_loss_channel_floor(a32, b32, la, lb, scale, factor, rule, label, abs_floor),
                      a32, b32, judged, scales)
        v = _with_loss(v, ch)
    return _finished(v, expect_difference, known)


def _carried(ch: _Channel, a32: Mapping[str, Any], b32: Mapping[str, Any], judged: list[str],
             scales: dict[str, np.ndarray]) -> _Channel:
    """The perturbation rule's loss bound plus the parameters' gap carried into the loss: ``+ S[r] * pgap[r]``.

    The loss of step ``r + 1`` is computed from the parameters of row ``r``; the two sides'
    parameters there differ by ``pgap[r]`` (measured between ``A32`` and ``B32``, and judged
    by the parameter channel), which moves the loss's relative gap by at most ``S[r] * pgap[r]``
    to first order (:func:`loss_sensitivity`; the float64 rule's "carried" term, module
    docstring "The loss"). The sampled loss floors hold each side's own evaluation and its
    own carried spread, not the *other* side's parameters: without this term the loss channel
    would call a divergence what the parameter channel accepts as rounding. Unchanged when a
    side recorded no gradient.
    """
    pkeys = [k for k in judged if k.startswith("param/")]
    sens = loss_sensitivity(a32, b32, pkeys, scales)
    if sens is None:
        return ch
    pgap, _ = _row_max(_gaps(a32, b32, pkeys, scales))
    with np.errstate(invalid="ignore"):
        bound = ch.bound + sens * np.fmax(pgap[: ch.bound.shape[0]], 0.0)
    return replace(ch, bound=bound, how=ch.how + f", + S x (parameter gap of the step before), S up to "
                                                 f"{np.nanmax(sens, initial=0.0):.2g}")
