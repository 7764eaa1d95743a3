"""The tolerance model's constants, each derived: when a gap between two trajectories is rounding.

The rules (:mod:`parity_tests.judging.rules`, :mod:`parity_tests.judging.perturbation`) measure the
per-step normwise relative gap of :mod:`parity_tests.judging.gaps` and hold it to the bounds below.
The same derivations, with the measurements behind them, are in docs/tolerance.md ("Rule 1: the
float64 bound", "Rule 2: the float32 noise floor", "What the judge cannot tell apart").

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
    (docs/tolerance.md, "Measured on the scenario matrix": at most 7.6e-14), a hundred times below.
    The smallest documented semantic effect,
    Keras's float32 hyperparameters, changes every update by up to ``2**-24 ~ 6e-8``
    of its size: above the bound as soon as the accumulated updates exceed about
    0.2% of the parameters' size (docs/tolerance.md, "Keras' float32 hyperparameters": about 1e-6 on an Adam step).
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
    (``tests/test_bounds.py`` shows a factor below 2 failing there). ``gap64`` is
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
"""

from __future__ import annotations

__all__ = ["FLOAT64_RTOL", "SCALE_FLOOR", "FLOAT32_FACTOR", "FLOAT32_ABS_FLOOR"]

#: Float64 semantic bound on the per-step relative gap (derivation in the module docstring).
FLOAT64_RTOL: float = 1e-10
#: Denominator floor of every relative gap: arrays below it are judged absolutely.
SCALE_FLOOR: float = 1e-2
#: Float32 bound factor on the larger noise floor: the triangle inequality's 2.
FLOAT32_FACTOR: float = 2.0
#: Float32 absolute floor of the bound: four float32 unit roundoffs, relative.
FLOAT32_ABS_FLOOR: float = 4 * 2.0**-24
