"""The float32 noise floor (``"float32 noise floor"``): each side's own float32 rounding, measured against its float64 run.

``bound[k] = factor * max(floor_A[k], floor_B[k]) + FLOAT32_ABS_FLOOR`` with ``floor_X[k] = gap_k(X32, X64)``;
the float64 rule is applied to ``(A64, B64)`` first: a semantic difference is reported by the rule that
proves it (docs/tolerance.md).
"""


from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

import numpy as np

from parity_tests.judging.bounds import FLOAT32_ABS_FLOOR, FLOAT32_FACTOR, FLOAT64_RTOL, SCALE_FLOOR
from parity_tests.judging.compare import describe_key, describe_step, step_of_row
from parity_tests.judging.gaps import _gaps, _judged_keys, _mismatch_text, _row_max, _scales
from parity_tests.judging.guards import (
    _check_dtype,
    _first_nonfinite_row,
    _nonfinite_verdict,
    _structure,
)
from parity_tests.judging.loss_channel import (
    LOSS_KEY,
    _judges_loss,
    _loss_channel64,
    _loss_channel_floor,
    _loss_gap,
    _loss_scale,
    _loss_structure,
    _with_loss,
)
from parity_tests.judging.precision_leak import float32_constants, not_float64
from parity_tests.judging.rules.context import PairRuns, Planned
from parity_tests.judging.rules.float64_bound import (
    _check_factor,
    _judge64,
    _with_zero,
    _without_zero,
)
from parity_tests.judging.run_kinds import FLOAT64, Variant, as_given
from parity_tests.judging.verdict import (
    RULE_FLOAT32,
    RULE_FLOAT64,
    RULE_STRUCTURE,
    Verdict,
    _error,
    _finished,
    _first_line_plus,
    _known,
)
from parity_tests.judging.zero_gradient import ZeroGradients

__all__ = ["judge_float32", "Float32Floor"]


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
    carried: Mapping[str, np.ndarray] | None = None,
) -> Verdict:
    """A floor rule on the parameter channel: divergence when ``gap_k(A32, B32) > bound[k]``,

    ``bound[k] = factor * max(floor_A[k], floor_B[k]) + abs_floor``; ``context``
    is appended to the detail (what was established before, e.g. the float64 runs agree).
    ``carried``: per key, the part of ``|A32 - B32|`` (elementwise, same shape) that the gradients'
    accepted gap carries (``judging.update_sensitivity``): those keys' gaps are ``(|A - B| - carried)+``.
    """
    gaps = _gaps(a32, b32, judged, scales)
    if carried:
        gaps = _less_carried(gaps, a32, b32, judged, scales, carried)
    per_step, arg = _row_max(gaps)
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


def _less_carried(gaps: np.ndarray, a32: Mapping[str, Any], b32: Mapping[str, Any], judged: list[str],
                  scales: dict[str, np.ndarray], carried: Mapping[str, np.ndarray]) -> np.ndarray:
    """``gaps`` with each carried key's rows replaced by ``max (|A - B| - carried)+ / max(scale, SCALE_FLOOR)``
    (rows whose gap is not finite keep it: the non-finite rule reads them)."""
    out = gaps.copy()
    for i, key in enumerate(judged):
        if key not in carried:
            continue
        a, b = np.asarray(a32[key], dtype=np.float64), np.asarray(b32[key], dtype=np.float64)
        rows = a.shape[0]
        with np.errstate(invalid="ignore"):
            left = np.maximum(np.abs(a - b) - carried[key], 0.0).reshape(rows, -1).max(axis=1, initial=0.0)
        rel = left / np.maximum(scales[key], SCALE_FLOOR)
        out[i] = np.where(np.isfinite(gaps[i]), rel, gaps[i])
    return out


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
    zero: ZeroGradients | None = None,
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
        expect_difference, known_differences, keys, loss, grads, zero: as in :func:`judge_float64` (``zero``
            applies to the float64 runs; each side's float32 floor holds its own drift there).

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
    found, judged64 = _without_zero(zero, a64, b64, judged)
    v64 = _judge64(a64, b64, judged64, label="float64 runs")
    leaky = [side for side, t in (("A", a64), ("B", b64)) if not_float64(t)]
    constants = any(float32_constants(t) for t in (a64, b64))
    held32: Verdict | None = None  # the float64 parameters held to the float32 noise (a leaky loss), at parity there
    if leaky and v64.status == "divergence" and v64.rule == RULE_FLOAT64:
        # the float32 cast inside the loss is differentiated too (a cast's gradient casts back): the leaky side's
        # float64 gradients carry float32 rounding of the loss's backward (tf.compat.v1.losses' float32 1/n), and its
        # parameters with them. The float64 runs cannot resolve the parameters below float32 rounding either, so
        # their gap is held to the float32 rule's parameter bound (the float32 runs' own floors); above it the
        # divergence stands, by the float64 rule (precision_leak, "Bound")
        p32 = _judge_floor(a64, b64, judged64, scales, fa_rows, fb_rows, factor, RULE_FLOAT32,
                           f"float64 runs {_held_to_float32(leaky, constants)}", label="float64 runs")
        if p32.status == "parity":
            v64, held32 = p32, p32
    if with_loss and leaky:
        # a float64 run's loss computed in float32 (precision_leak): the float64 runs cannot resolve that
        # channel below float32 rounding, so their loss gap is held to the float32 rule's loss bound
        scale = _loss_scale(a64, b64)
        ch = _loss_channel_floor(a64, b64, _loss_gap(a32, a64, scale), _loss_gap(b32, b64, scale), scale, factor,
                                 RULE_FLOAT32, f"float64 runs (the float64 run of {' and '.join(leaky)} not float64"
                                                             " throughout)")
        v64 = _with_loss(v64, replace(ch, how=ch.how + f"; {' and '.join(leaky)}'s float64 loss "
                                                       + ("holds a float32 constant" if constants else
                                                          "has float32's precision at every step")
                                                       + ": judged at the float32 noise"))
    elif with_loss:
        v64 = _with_loss(v64, _loss_channel64(a64, b64, judged64, "float64 runs", tuple(grads)))
    v64 = _with_zero(v64, found, "float64 runs")
    if v64.status != "parity":
        if v64.status == "divergence" and v64.rule == RULE_FLOAT64:
            v64 = replace(v64, detail=_visibility_note(v64, a32, b32, judged, scales, fa_rows, fb_rows, factor))
        return _finished(v64, expect_difference, known)

    agree64 = (f"float64 runs agree (gap {v64.gap:.2e} <= {FLOAT64_RTOL:.2g})" if held32 is None else
               f"float64 runs within the float32 noise (gap {held32.gap:.2e} <= {held32.bound:.2e}; {_held_to_float32(leaky, constants)})")
    v = _judge_floor(a32, b32, judged, scales, fa_rows, fb_rows, factor, RULE_FLOAT32, agree64)
    if with_loss:
        scale = _loss_scale(a64, b64)
        ch = _loss_channel_floor(a32, b32, _loss_gap(a32, a64, scale), _loss_gap(b32, b64, scale), scale,
                                 factor, RULE_FLOAT32, "float32")
        v = _with_loss(v, ch)
    return _finished(v, expect_difference, known)


def _held_to_float32(leaky: list[str], constants: bool = False) -> str:
    """Why the float64 parameters of a pair with a leaky side (``leaky``: its sides; ``constants``: a float32
    constant read from a run, else a loss computed in float32) are held to the float32 noise."""
    if constants:
        return (f"held to the float32 noise: {' and '.join(leaky)}'s float64 run holds a float32 constant (a Keras"
                " regularizer's factor), which its loss and every gradient carry")
    return (f"held to the float32 noise: {' and '.join(leaky)}'s float64 loss has float32's precision at every step,"
            " and its gradients flow through that float32 computation")


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



class Float32Floor:
    """The rule of a float32 case whose sides both ran float64: :func:`judge_float32` (tried last: it always applies)."""

    name = "float32 noise floor"

    def needs(self, p: Planned) -> tuple[tuple[Variant, ...], tuple[Variant, ...]] | None:
        """Each side's float32 run and its float64 run (the floor of each side is its float32 run's gap to it)."""
        return ((as_given(p.dtype), FLOAT64),) * 2

    def applies(self, pair: PairRuns) -> bool:
        return True

    def judge(self, pair: PairRuns) -> Verdict:
        a, b = pair.a, pair.b
        return judge_float32(a.run, b.run, a64=a.f64, b64=b.f64, known_differences=pair.known, grads=pair.grads,
                             zero=pair.zero)
