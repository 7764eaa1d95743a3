"""The noise-aware tolerance model: when is a gap between two trajectories rounding, and when not.

Two rules, both on the per-step normwise relative gap of :func:`parity_tests.judging.compare.relative_gap`
over the ``param/*`` and ``state/*`` arrays (the outcome of training; see "What is judged")::

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

What is judged:
    ``param/*`` and ``state/*`` arrays by default (``keys=`` to change). Losses and
    gradients are compared by :mod:`parity_tests.judging.compare` but do not decide: near a
    minimum they are sums of terms that cancel, and their relative rounding error is
    unbounded, while parameters (the accumulated updates) keep a bounded one. A
    semantic difference in a gradient shows in the parameters one step later.
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
    key_order,
    relative_gap,
    step_of_row,
)

__all__ = [
    "FLOAT64_RTOL",
    "SCALE_FLOOR",
    "FLOAT32_FACTOR",
    "FLOAT32_ABS_FLOOR",
    "STATUSES",
    "RULE_FLOAT64",
    "RULE_FLOAT32",
    "RULE_NONFINITE",
    "RULE_STRUCTURE",
    "Verdict",
    "judge_float64",
    "judge_float32",
]

#: Float64 semantic bound on the per-step relative gap (derivation in the module docstring).
FLOAT64_RTOL: float = 1e-10
#: Denominator floor of every relative gap: arrays below it are judged absolutely.
SCALE_FLOOR: float = 1e-2
#: Float32 bound factor on the larger noise floor: the triangle inequality's 2.
FLOAT32_FACTOR: float = 2.0
#: Float32 absolute floor of the bound: four float32 unit roundoffs, relative.
FLOAT32_ABS_FLOOR: float = 4 * 2.0**-24

STATUSES = ("parity", "divergence", "expected_difference", "unexpected_parity", "error")
RULE_FLOAT64 = "float64 bound"
RULE_FLOAT32 = "float32 noise floor"
RULE_NONFINITE = "non-finite values"
RULE_STRUCTURE = "structure"


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
            "detail": self.detail,
            "known_differences": list(self.known_differences),
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
        got = np.asarray(traj[key]).dtype
        if got != dtype:
            raise ValueError(
                f"side {side}, {key}: expected {np.dtype(dtype).name} values, got {got} "
                f"(judge float32 runs with judge_float32, float64 runs with judge_float64)"
            )


def _structure(
    pairs: list[tuple[str, Mapping[str, Any], Mapping[str, Any]]], keys: list[str]
) -> str | None:
    """A message naming the first pair whose keys or shapes disagree (``None`` if all fit)."""
    for name, x, y in pairs:
        cmp = compare_trajectories(x, y, rtol=0.0, atol=0.0, keys=keys, equal_nan=True)
        if cmp.missing_in_a or cmp.missing_in_b or cmp.shape_mismatches or not cmp.compared:
            lines = [
                ln
                for ln in cmp.message().splitlines()
                if not ln.startswith(("step ", "Greatest", "Non-finite"))
            ]
            return f"{name}: " + "; ".join(lines or ["no param/* or state/* arrays to judge"])
        rows = {np.asarray(x[k]).shape[0] for k in keys}
        if len(rows) > 1 or len({step_of_row(k, 0) for k in keys}) > 1:
            return (
                f"{name}: the judged arrays do not share one step axis (rows {sorted(rows)}); "
                "judge param/state arrays and loss/grad arrays separately"
            )
    return None


def _row_norms(traj: Mapping[str, Any], key: str) -> np.ndarray:
    arr = np.asarray(traj[key], dtype=np.float64)
    flat = arr.reshape(arr.shape[0], -1)
    if flat.shape[1] == 0:
        return np.zeros(arr.shape[0])
    with np.errstate(invalid="ignore"):
        return np.abs(flat).max(axis=1)


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
            arr = np.asarray(t[k], dtype=np.float64)
            bad = ~np.isfinite(arr.reshape(rows, -1)).all(axis=1)
            if bad.any():
                stop = min(stop, int(np.argmax(bad)))
    return stop


def _alike_nonfinite(x: Mapping[str, Any], y: Mapping[str, Any], keys: list[str]) -> bool:
    """Both sides non-finite at exactly the same places with the same values."""
    for k in keys:
        a = np.asarray(x[k], dtype=np.float64)
        b = np.asarray(y[k], dtype=np.float64)
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
        np.asarray(x[key])[row],
        np.asarray(y[key])[row],
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
        a = np.asarray(x[k], dtype=np.float64)
        b = np.asarray(y[k], dtype=np.float64)
        fa, fb = np.isfinite(a), np.isfinite(b)
        same = ~fa & ~fb & ((np.isnan(a) & np.isnan(b)) | (a == b))
        unlike = ~((fa & fb) | same)
        if unlike.any():
            pos = tuple(int(i) for i in np.argwhere(unlike)[0])
            place = (step_of_row(k, pos[0]), key_order(k))
            if best is None or place < best[0]:
                best = (place, k, pos, float(a[pos]), float(b[pos]))
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


def judge_float64(
    a64: Mapping[str, Any],
    b64: Mapping[str, Any],
    *,
    expect_difference: bool = False,
    known_differences: Iterable[str] = (),
    keys: Iterable[str] | None = None,
) -> Verdict:
    """Judge two float64 trajectories of one case by the float64 rule.

    ``gap_k = max_p ||A_p[k] - B_p[k]||_inf / max(||A_p[k]||_inf, ||B_p[k]||_inf, SCALE_FLOOR)``;
    divergence when ``gap_k > FLOAT64_RTOL`` at any step ``k``.

    Args:
        a64, b64: float64 trajectories (the judged arrays must be float64).
        expect_difference: theory predicts a difference: a divergence becomes
            ``"expected_difference"``, parity ``"unexpected_parity"``.
        known_differences: names of documented differences, carried into the verdict.
        keys: arrays to judge; by default every ``param/*`` and ``state/*`` key.

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
    problem = _structure([("float64 runs A64 vs B64", a64, b64)], judged)
    if problem:
        return _error(RULE_STRUCTURE, problem, known)
    _check_dtype(a64, judged, np.float64, "A")
    _check_dtype(b64, judged, np.float64, "B")
    v = _judge64(a64, b64, judged)
    status, detail = _finish(v.status, expect_difference, v.detail, known)
    return replace(v, status=status, detail=detail, known_differences=known)


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
) -> Verdict:
    """Judge two float32 trajectories against each side's own float32 noise floor.

    First the float64 rule on ``(a64, b64)``: a semantic difference is a divergence
    by that rule, and the detail says whether it is also visible above the float32
    noise. Otherwise, per step ``k``::

        floor_X[k] = gap_k(X32, X64)
        bound[k]   = factor * max(floor_A[k], floor_B[k]) + FLOAT32_ABS_FLOOR

    and divergence when ``gap_k(A32, B32) > bound[k]`` at any step.

    Args:
        a32, b32: the float32 trajectories of the two implementations.
        a64, b64: the same case run in float64 by the same implementations.
        factor: multiple of the larger floor; ``FLOAT32_FACTOR`` (2) is the smallest
            value for which rounding can never be reported as a divergence.
        expect_difference, known_differences, keys: as in :func:`judge_float64`.

    Returns:
        A :class:`Verdict`; for the float32 rule ``floor_a``/``floor_b`` are each
        side's greatest floor and ``per_step_floor``/``per_step_bound`` the curves.

    Raises:
        ValueError: ``factor`` is not finite and ``> 0``, or a judged array has the
        wrong dtype (float32 for ``a32``/``b32``, float64 for ``a64``/``b64``).
    """
    if isinstance(factor, bool) or not isinstance(factor, (int, float, np.integer, np.floating)):
        raise TypeError(f"factor must be a real number, got {factor!r}")
    if not (math.isfinite(float(factor)) and factor > 0):
        raise ValueError(f"factor must be finite and > 0, got {factor!r}")
    factor = float(factor)
    known = _known(known_differences)
    judged = _judged_keys((a32, b32, a64, b64), keys)
    problem = _structure(
        [
            ("float64 runs A64 vs B64", a64, b64),
            ("float32 runs A32 vs B32", a32, b32),
            ("side A float32 vs float64", a32, a64),
            ("side B float32 vs float64", b32, b64),
        ],
        judged,
    )
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
    gaps32 = _gaps(a32, b32, judged, scales)
    per_step, arg = _row_max(gaps32)
    rows = per_step.shape[0]
    with np.errstate(invalid="ignore"):
        floor_rows = np.fmax(fa_rows, fb_rows)
        bound_rows = factor * floor_rows + FLOAT32_ABS_FLOOR

    def figures(row: int) -> str:
        return (
            f"{factor:g} x max(floor A {fa_rows[row]:.2e}, floor B {fb_rows[row]:.2e}) "
            f"+ {FLOAT32_ABS_FLOOR:.2e}"
        )

    def step_at(row: int) -> int:
        return step_of_row(judged[0], row)

    v64 = _judge64(a64, b64, judged, label="float64 runs")
    if v64.status != "parity":
        detail = v64.detail
        if v64.status == "divergence" and v64.rule == RULE_FLOAT64:
            with np.errstate(invalid="ignore"):
                visible = np.flatnonzero(per_step > bound_rows)
            head, _, rest = detail.partition("\n")
            note = (
                f"; visible in float32 from step {step_at(int(visible[0]))} "
                f"(gap {per_step[visible[0]]:.2e} > noise bound {bound_rows[visible[0]]:.2e})"
                if visible.size
                else "; below the float32 noise at every step (gap <= noise bound)"
            )
            detail = head + note + (("\n" + rest) if rest else "")
        status, detail = _finish(v64.status, expect_difference, detail, known)
        return replace(v64, status=status, detail=detail, known_differences=known)
    g64 = v64.gap

    stop = _first_nonfinite_row((a32, b32), judged, rows)
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = per_step[:stop] / bound_rows[:stop]
    worst = int(np.argmax(ratio)) if stop else 0
    floor_a = float(np.max(fa_rows[:stop])) if stop else 0.0
    floor_b = float(np.max(fb_rows[:stop])) if stop else 0.0
    gap, bound = (
        (float(per_step[worst]), float(bound_rows[worst])) if stop else (0.0, FLOAT32_ABS_FLOOR)
    )
    worst_key = judged[int(arg[worst])]
    figures32: dict[str, Any] = {
        "floor_a": floor_a,
        "floor_b": floor_b,
        "per_step_gap": per_step,
        "per_step_floor": floor_rows,
        "per_step_bound": bound_rows,
        "known_differences": known,
    }
    agree64 = f"float64 runs agree (gap {g64:.2e} <= {FLOAT64_RTOL:.2g})"
    over = np.flatnonzero(ratio > 1.0)
    if over.size:
        first = int(over[0])
        first_key = judged[int(arg[first])]
        allowed = float(bound_rows[first]) * max(float(scales[first_key][first]), SCALE_FLOOR)
        detail = (
            f"float32: relative gap {per_step[first]:.2e} > noise bound {bound_rows[first]:.2e} = "
            f"{figures(first)} first at {describe_step(first_key, step_at(first))} "
            f"({describe_key(first_key)}); greatest gap/bound {gap:.2e} / {bound:.2e} at step "
            f"{step_at(worst)}; {agree64}" + _mismatch_text(a32, b32, first_key, first, allowed)
        )
        status, detail = _finish("divergence", expect_difference, detail, known)
        return Verdict(
            status,
            RULE_FLOAT32,
            gap,
            bound,
            detail=detail,
            step=step_at(worst),
            key=worst_key,
            first_step=step_at(first),
            **figures32,
        )
    if stop < rows:
        status, rule, g, detail, step = _nonfinite_verdict(
            a32, b32, judged, "float32", stop, gap, bound
        )
        head, _, rest = detail.partition("\n")
        detail = head + f"; {agree64}" + (("\n" + rest) if rest else "")
        status, detail = _finish(status, expect_difference, detail, known)
        first_step = step if g == math.inf else None
        return Verdict(
            status, rule, g, bound, detail=detail, step=step, first_step=first_step, **figures32
        )
    detail = (
        f"float32: relative gap {gap:.2e} <= noise bound {bound:.2e} = {figures(worst)} "
        f"(tightest at {describe_step(worst_key, step_at(worst))}, {describe_key(worst_key)}); "
        f"{agree64}; greatest floors A {floor_a:.2e}, B {floor_b:.2e}"
    )
    status, detail = _finish("parity", expect_difference, detail, known)
    return Verdict(
        status,
        RULE_FLOAT32,
        gap,
        bound,
        detail=detail,
        step=step_at(worst),
        key=worst_key,
        **figures32,
    )
