"""The one comparator: two trajectories, element by element, with messages a person can act on.

A trajectory is a ``dict[str, np.ndarray]`` (docs/case-format.md, "Trajectories"):

* ``loss`` ``[steps]`` and ``grad/<name>`` ``[steps, *shape]``: row ``k`` belongs to
  step ``k + 1`` (the loss and gradient of that step, before its update);
* ``param/<name>`` and ``state/<name>`` ``[steps+1, *shape]``: row ``k`` holds the
  values *after* step ``k``; row 0 is the initial values ("step 0").

Every place is therefore named the way a person reads it: ``step 3, param 1.kernel``
is the kernel after the third update, ``step 3, grad 1.kernel`` the gradient that
produced it. The first failing place is the earliest step, and within a step the
order ``loss``, ``grad/*``, ``param/*``, ``state/*`` (the order in which a step
computes them), then the parameter name with layer indices compared as numbers.

The elementwise rule is :func:`torch.testing.assert_close`'s::

    |a - b| <= atol + rtol * |b|        (b is side B, the reference)

with both ``rtol`` and ``atol`` required (keyword-only): a tolerance is a decision
the caller states, never a default.

Warning:
    Non-finite values are stricter than in ``torch.testing``. A NaN or an Inf at the
    same place on both sides is *not* a match unless ``equal_nan=True`` (torch
    accepts equal infinities always): a training run that overflowed on both sides is
    no evidence that the two sides agree. A NaN against an Inf, ``+Inf`` against
    ``-Inf``, or a non-finite value against a finite one is always a mismatch. The
    comparison also describes where non-finite values first appear
    (:attr:`Comparison.first_nonfinite`), whether or not they are accepted.

:func:`relative_gap` is the normwise per-row metric that the tolerance model
(:mod:`parity_tests.judging.gaps`, :mod:`parity_tests.judging.rules`) judges with; :func:`compare_arrays` is the
elementwise check of one step's array that both this module and the tolerance
model use to produce the mismatch message.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from parity_tests.protocol.rows import RowArray, iter_pairs, nonfinite_rows
from parity_tests.protocol.trajectory import _group, key_order, step_of_row

__all__ = [
    "TINY",
    "Mismatch",
    "Comparison",
    "compare_trajectories",
    "assert_trajectories_close",
    "compare_arrays",
    "relative_gap",
    "is_real",
    "step_of_row",
    "describe_key",
    "describe_step",
    "key_order",
    "first_nonfinite",
]

#: Smallest normal float64: the floor of every denominator, so ``0 / 0`` is ``0`` and
#: a difference against an exact zero is reported as huge rather than as ``inf``/``nan``.
TINY: float = float(np.finfo(np.float64).tiny)


def describe_key(key: str) -> str:
    """``"param/1.kernel"`` -> ``"param 1.kernel"``; ``"loss"`` -> ``"loss"``."""
    group = _group(key)
    if group is None or group == "loss":
        return key
    return f"{group} {key.partition('/')[2]}"


def describe_step(key: str, step: int) -> str:
    """``"step 3"``, or ``"step 0 (initial values)"`` for row 0 of a param/state array."""
    if step == 0 and _group(key) not in ("loss", "grad"):
        return "step 0 (initial values)"
    return f"step {step}"


def _fmt_index(index: tuple[int, ...]) -> str:
    return "(" + ", ".join(str(i) for i in index) + ("," if len(index) == 1 else "") + ")"


@dataclass(frozen=True)
class Mismatch:
    """The first failing place: one key at one step.

    Attributes:
        key: trajectory key, e.g. ``"param/1.kernel"``.
        step: the step as a person reads it (see :func:`step_of_row`).
        index: index, within that step's array, of the greatest absolute difference
            (``()`` for the scalar ``loss``).
        max_abs: greatest ``|a - b|`` within that step (``inf`` where a non-finite
            value does not match).
        max_rel: greatest ``|a - b| / max(|b|, TINY)`` within that step.
        mismatched: elements of that step over tolerance.
        total: elements in that step's array.
        rtol, atol: the tolerance applied.
        rel_index: index of the greatest relative difference.
        nonfinite: how many of the ``mismatched`` elements are NaN/Inf on a side.
        nonfinite_note: what those non-finite elements are, for the message.
    """

    key: str
    step: int
    index: tuple[int, ...]
    max_abs: float
    max_rel: float
    mismatched: int
    total: int
    rtol: float
    atol: float
    rel_index: tuple[int, ...] = ()
    nonfinite: int = 0
    nonfinite_note: str = ""

    def message(self) -> str:
        """``step 3, param 1.kernel: Mismatched elements: 2 / 50 (4.0%)`` and the greatest differences."""
        pct = self.mismatched / self.total if self.total else 0.0
        rel_allowed = (
            f"(up to {self.rtol:.3g} allowed)"
            if self.rtol > 0
            else "(no relative tolerance: the bound is absolute)"
        )
        lines = [
            f"{describe_step(self.key, self.step)}, {describe_key(self.key)}: "
            f"Mismatched elements: {self.mismatched} / {self.total} ({pct:.1%})",
            f"Greatest absolute difference: {self.max_abs:.2e} at index {_fmt_index(self.index)} "
            f"(up to {self.atol:.3g} allowed)",
            f"Greatest relative difference: {self.max_rel:.2e} at index {_fmt_index(self.rel_index)} "
            f"{rel_allowed}",
        ]
        if self.nonfinite_note:
            lines.append(f"Non-finite values: {self.nonfinite_note}")
        return "\n".join(lines)


@dataclass(frozen=True, eq=False)
class Comparison:
    """The result of :func:`compare_trajectories`.

    Attributes:
        ok: every compared element within tolerance and nothing missing or misshapen.
        mismatch: the first failing place (earliest step; then loss, grad, param,
            state), or ``None``.
        max_abs, max_rel: greatest differences over everything compared (``inf`` where
            non-finite values do not match).
        per_step_gap: ``[steps+1]`` greatest :func:`relative_gap` over all ``param/*``
            arrays at each row (for plots; empty without param arrays).
        first_nonfinite: where NaN/Inf first appear, e.g. ``"both trajectories are NaN
            from step 4 (param 0.kernel) on"``; ``None`` when everything is finite.
        missing_in_a, missing_in_b: keys that one side lacks.
        shape_mismatches: one line per key whose shapes differ (not compared).
        compared: the keys compared, in reporting order.
        rtol, atol, equal_nan: the rule applied.
    """

    ok: bool
    mismatch: Mismatch | None
    max_abs: float
    max_rel: float
    per_step_gap: np.ndarray
    first_nonfinite: str | None
    missing_in_a: tuple[str, ...] = ()
    missing_in_b: tuple[str, ...] = ()
    shape_mismatches: tuple[str, ...] = ()
    compared: tuple[str, ...] = ()
    rtol: float = 0.0
    atol: float = 0.0
    equal_nan: bool = False

    def __repr__(self) -> str:
        """One line (``Comparison(ok, 7 arrays, ...)``), never the per-step gaps: :meth:`message` has the details."""
        first = "" if self.mismatch is None else (f"; first mismatch: {describe_step(self.mismatch.key, self.mismatch.step)},"
                                                  f" {describe_key(self.mismatch.key)}")
        missing = len(self.missing_in_a) + len(self.missing_in_b) + len(self.shape_mismatches)
        return (f"Comparison({'ok' if self.ok else 'NOT ok'}, {len(self.compared)} arrays compared,"
                f" greatest absolute difference {self.max_abs:.3g}, relative {self.max_rel:.3g}"
                f" (rtol {self.rtol:g}, atol {self.atol:g}){f'; {missing} arrays missing or misshapen' if missing else ''}"
                f"{first})")

    def message(self) -> str:
        """One line when the trajectories agree; otherwise every problem, the first mismatch last."""
        if self.ok:
            text = (
                f"trajectories agree: {len(self.compared)} arrays compared, greatest absolute "
                f"difference {self.max_abs:.2e}, greatest relative difference {self.max_rel:.2e} "
                f"(rtol {self.rtol:g}, atol {self.atol:g})"
            )
            if self.first_nonfinite:
                text += f"; non-finite values accepted (equal_nan=True): {self.first_nonfinite}"
            return text
        lines: list[str] = []
        if self.missing_in_a:
            lines.append("missing from side A (present in side B): " + ", ".join(self.missing_in_a))
        if self.missing_in_b:
            lines.append("missing from side B (present in side A): " + ", ".join(self.missing_in_b))
        lines.extend(self.shape_mismatches)
        if not self.compared and not lines:
            lines.append(
                "no arrays to compare: neither trajectory has loss, param/*, grad/* or state/* keys"
            )
        if self.first_nonfinite:
            lines.append(f"Non-finite values: {self.first_nonfinite}")
        if self.mismatch is not None:
            lines.append(self.mismatch.message())
        return "\n".join(lines)


def _check_tolerances(rtol: Any, atol: Any) -> tuple[float, float]:
    if rtol is None and atol is None:
        raise ValueError("both rtol and atol are required (keyword-only); got neither")
    if atol is None:
        raise ValueError(f"atol is required when rtol is given (got rtol={rtol!r} and no atol)")
    if rtol is None:
        raise ValueError(f"rtol is required when atol is given (got atol={atol!r} and no rtol)")
    out = []
    for name, value in (("rtol", rtol), ("atol", atol)):
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise TypeError(f"{name} must be a real number, got {value!r}")
        v = float(value)
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"{name} must be finite and >= 0, got {value!r}")
        out.append(v)
    return out[0], out[1]


def is_real(dtype: np.dtype) -> bool:
    """Whether arrays of ``dtype`` are real numbers the comparator judges (floats and integers, not bools)."""
    return dtype != np.bool_ and (np.issubdtype(dtype, np.floating) or np.issubdtype(dtype, np.integer))


def _array(traj: Mapping[str, Any], key: str, side: str) -> np.ndarray:
    arr = traj[key]
    if not isinstance(arr, RowArray):  # a file-backed array stays one: it is read chunk by chunk
        arr = np.asarray(arr)
    if not is_real(arr.dtype):
        raise TypeError(
            f"side {side}, key {key!r}: expected a real numeric array, got dtype {arr.dtype}"
        )
    return arr


def _elementwise(
    a: np.ndarray, b: np.ndarray, rtol: float, atol: float, equal_nan: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(abs_diff, rel_diff, bad, same_nonfinite, other_nonfinite)``, all shaped like ``a``."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    fa, fb = np.isfinite(a), np.isfinite(b)
    both = fa & fb
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.abs(a - b)
    abs_b = np.abs(np.where(fb, b, 0.0))
    same_nonfinite = ~fa & ~fb & ((np.isnan(a) & np.isnan(b)) | (a == b))
    other_nonfinite = ~both & ~same_nonfinite
    accepted_nonfinite = same_nonfinite if equal_nan else np.zeros_like(same_nonfinite)
    with np.errstate(invalid="ignore"):
        within = both & (diff <= atol + rtol * abs_b)
    bad = ~(within | accepted_nonfinite)
    abs_diff = np.where(both, diff, np.where(accepted_nonfinite, 0.0, np.inf))
    with np.errstate(over="ignore"):  # a finite difference over a tiny |b| is an infinite relative one
        rel_diff = np.where(both, diff / np.maximum(abs_b, TINY), abs_diff)
    return abs_diff, rel_diff, bad, same_nonfinite & bad, other_nonfinite


def _nonfinite_note(same: int, other: int) -> str:
    parts = []
    if same:
        parts.append(
            f"{same} element(s) NaN/Inf at the same place on both sides (pass equal_nan=True to accept them)"
        )
    if other:
        parts.append(f"{other} element(s) NaN/Inf on one side only, or NaN against Inf")
    return "; ".join(parts)


def compare_arrays(
    a: Any,
    b: Any,
    *,
    rtol: float | None = None,
    atol: float | None = None,
    key: str = "",
    step: int = 0,
    equal_nan: bool = False,
) -> Mismatch | None:
    """Compare one step's arrays elementwise; the :class:`Mismatch` if any element fails.

    Args:
        a, b: arrays of one shape (any; ``()`` for a scalar loss). ``b`` is the reference.
        rtol, atol: required, finite, ``>= 0``; the rule is ``|a-b| <= atol + rtol*|b|``.
        key, step: the place, as it should appear in the message.
        equal_nan: accept NaN/Inf at the same place on both sides.

    Returns:
        ``None`` when every element is within tolerance, else the :class:`Mismatch`.
    """
    rtol_f, atol_f = _check_tolerances(rtol, atol)
    a_arr, b_arr = np.asarray(a), np.asarray(b)
    if a_arr.shape != b_arr.shape:
        raise ValueError(
            f"{describe_key(key) or 'arrays'}: shapes differ, side A {a_arr.shape}, side B {b_arr.shape}"
        )
    abs_diff, rel_diff, bad, same_nf, other_nf = _elementwise(
        a_arr, b_arr, rtol_f, atol_f, equal_nan
    )
    if not bad.any():
        return None
    shape = abs_diff.shape
    i_abs = (
        tuple(int(i) for i in np.unravel_index(int(np.argmax(abs_diff)), shape)) if shape else ()
    )
    i_rel = (
        tuple(int(i) for i in np.unravel_index(int(np.argmax(rel_diff)), shape)) if shape else ()
    )
    n_same, n_other = int(same_nf.sum()), int((other_nf & bad).sum())
    return Mismatch(
        key=key,
        step=int(step),
        index=i_abs,
        max_abs=float(abs_diff.max()),
        max_rel=float(rel_diff.max()),
        mismatched=int(bad.sum()),
        total=int(bad.size),
        rtol=rtol_f,
        atol=atol_f,
        rel_index=i_rel,
        nonfinite=n_same + n_other,
        nonfinite_note=_nonfinite_note(n_same, n_other),
    )


def relative_gap(a: Any, b: Any, *, scale: Any = None, scale_floor: float = TINY) -> np.ndarray:
    """Per-row normwise relative gap ``||a_k - b_k||_inf / max(s_k, scale_floor)``.

    Args:
        a, b: arrays of one shape ``[rows, *shape]``.
        scale: per-row denominators ``s_k`` (shape ``[rows]`` or a scalar); by default
            ``s_k = ||b_k||_inf``. The tolerance model passes a denominator shared by
            all the gaps it adds up, so that the triangle inequality holds exactly.
        scale_floor: lower limit of the denominator (``> 0``): arrays smaller than
            this are measured against it rather than against their own near-zero size.

    Returns:
        ``[rows]`` float64. A row with a NaN or Inf on either side gives ``nan`` when
        both sides are non-finite at exactly the same places with the same values
        (undefined: both blew up alike), and ``inf`` otherwise (one side blew up).
    """
    if isinstance(a, RowArray) or isinstance(b, RowArray):  # row by row, never the whole array
        if np.shape(a) != np.shape(b):
            raise ValueError(f"relative_gap: shapes differ, side A {np.shape(a)}, side B {np.shape(b)}")
        rows = len(a)
        sc = None if scale is None else np.broadcast_to(np.asarray(scale, dtype=np.float64), (rows,))
        parts = [relative_gap(xa, ya, scale=None if sc is None else sc[start:start + len(xa)], scale_floor=scale_floor)
                 for start, xa, ya in iter_pairs(a, b)]
        return np.concatenate(parts) if parts else np.zeros(0)
    a_arr = np.asarray(a, dtype=np.float64)
    b_arr = np.asarray(b, dtype=np.float64)
    if a_arr.shape != b_arr.shape:
        raise ValueError(f"relative_gap: shapes differ, side A {a_arr.shape}, side B {b_arr.shape}")
    if a_arr.ndim == 0:
        raise ValueError("relative_gap: arrays need a leading row axis, got scalars")
    if not (math.isfinite(scale_floor) and scale_floor > 0):
        raise ValueError(f"scale_floor must be finite and > 0, got {scale_floor!r}")
    rows = a_arr.shape[0]
    a2, b2 = a_arr.reshape(rows, -1), b_arr.reshape(rows, -1)
    if a2.shape[1] == 0:
        return np.zeros(rows)
    # every difference finite means both sides finite everywhere (inf - x and nan - x are not): then
    # max |a - b| and max |b| are each the larger magnitude of a row's max and min, five passes over
    # the rows where the general path below makes a dozen (a large model's rows are 0.3 GB each), the
    # same numbers bit for bit
    with np.errstate(invalid="ignore", over="ignore"):
        d = np.subtract(a2, b2)
        num = np.maximum(np.abs(d.max(axis=1)), np.abs(d.min(axis=1)))
    del d
    if np.isfinite(num).all():
        den = (np.maximum(np.abs(b2.max(axis=1)), np.abs(b2.min(axis=1))) if scale is None
               else np.broadcast_to(np.asarray(scale, dtype=np.float64), (rows,)))
        return num / np.maximum(den, scale_floor)
    fa, fb = np.isfinite(a2), np.isfinite(b2)
    finite_row = (fa & fb).all(axis=1)
    with np.errstate(invalid="ignore", over="ignore"):
        num = np.abs(np.where(fa & fb, a2 - b2, 0.0)).max(axis=1)
    if scale is None:
        den = np.abs(np.where(fb, b2, 0.0)).max(axis=1)
    else:
        den = np.broadcast_to(np.asarray(scale, dtype=np.float64), (rows,))
    gap = num / np.maximum(den, scale_floor)  # a NaN denominator stays NaN: undefined
    if not finite_row.all():
        same = ~fa & ~fb & ((np.isnan(a2) & np.isnan(b2)) | (a2 == b2))
        alike = ((fa & fb) | same).all(axis=1)
        gap = np.where(finite_row, gap, np.where(alike, np.nan, np.inf))
    return gap


def _max_rows(gaps: list[np.ndarray]) -> np.ndarray:
    """Row-wise greatest gap over keys: ``inf`` beats ``nan`` (undefined) beats numbers."""
    if not gaps:
        return np.zeros(0)
    rows = max(len(g) for g in gaps)
    stack = np.full((len(gaps), rows), np.nan)
    for i, g in enumerate(gaps):
        stack[i, : len(g)] = g
    with np.errstate(invalid="ignore"):
        out = np.fmax.reduce(stack, axis=0)
    return np.where(np.isinf(out), out, np.where(np.isnan(stack).any(axis=0), np.nan, out))


def _nonfinite_kind(arr: np.ndarray) -> str:
    has_nan, has_inf = bool(np.isnan(arr).any()), bool(np.isinf(arr).any())
    return "NaN and Inf" if has_nan and has_inf else ("NaN" if has_nan else "Inf")


def _first_nonfinite(
    traj: Mapping[str, Any], keys: Iterable[str], side: str
) -> tuple[tuple[int, tuple[Any, ...]], str, str] | None:
    best = None
    for key in keys:
        arr = _array(traj, key, side)
        bad_rows = nonfinite_rows(arr)
        if bad_rows.any():
            row = int(np.argmax(bad_rows))
            place = (step_of_row(key, row), key_order(key))
            if best is None or place < best[0]:
                best = (place, key, _nonfinite_kind(np.asarray(arr[row] if arr.ndim else arr, dtype=np.float64)))
    return best


def _describe_nonfinite(first_a: Any, first_b: Any) -> str | None:
    if first_a is None and first_b is None:
        return None

    def where(first: Any) -> str:
        (step, _), key, _ = first
        initial = ", initial values" if describe_step(key, step) != f"step {step}" else ""
        return f"step {step} ({describe_key(key)}{initial})"

    if first_b is None:
        return f"side A becomes {first_a[2]} at {where(first_a)} while side B stays finite"
    if first_a is None:
        return f"side B becomes {first_b[2]} at {where(first_b)} while side A stays finite"
    if first_a[0] == first_b[0] and first_a[2] == first_b[2]:
        (step, _), key, kind = first_a
        return f"both trajectories are {kind} from {where(first_a)} on"
    if first_a[0][0] == first_b[0][0]:
        step = first_a[0][0]
        return (
            f"both trajectories become non-finite at step {step}: side A {first_a[2]} "
            f"({describe_key(first_a[1])}), side B {first_b[2]} ({describe_key(first_b[1])})"
        )
    early, late, e_name, l_name = (
        (first_a, first_b, "A", "B") if first_a[0] < first_b[0] else (first_b, first_a, "B", "A")
    )
    return (
        f"side {e_name} becomes {early[2]} at {where(early)}; side {l_name} follows "
        f"({late[2]}) at {where(late)}"
    )


def _trajectory_keys(traj: Mapping[str, Any]) -> set[str]:
    return {k for k in traj if isinstance(k, str) and _group(k) is not None}


def compare_trajectories(
    a: Mapping[str, Any],
    b: Mapping[str, Any],
    *,
    rtol: float | None = None,
    atol: float | None = None,
    keys: Iterable[str] | None = None,
    equal_nan: bool = False,
) -> Comparison:
    """Compare two trajectories elementwise, ``|a - b| <= atol + rtol * |b|``.

    Args:
        a, b: trajectories (``dict[str, np.ndarray]`` or an opened ``.npz``); ``b`` is
            the reference of the relative tolerance.
        rtol, atol: required (keyword-only), finite, ``>= 0``. Giving one without the
            other raises :class:`ValueError` naming the missing one.
        keys: the keys to compare; by default every ``loss``, ``param/*``, ``grad/*``
            and ``state/*`` key of either side (other keys are ignored).
        equal_nan: accept NaN/Inf that sit at the same places, with the same values,
            on both sides (by default they are mismatches).

    Returns:
        A :class:`Comparison`. Keys that one side lacks, or whose shapes differ, make
        ``ok`` false and are named in the message; the remaining keys are compared.
    """
    rtol_f, atol_f = _check_tolerances(rtol, atol)
    for side, traj in (("A", a), ("B", b)):
        if not isinstance(traj, Mapping):
            raise TypeError(
                f"side {side}: expected a trajectory mapping key -> array, got {type(traj).__name__}"
            )
    if keys is None:
        wanted = _trajectory_keys(a) | _trajectory_keys(b)
    else:
        wanted = set()
        for k in keys if not isinstance(keys, str) else [keys]:
            if not isinstance(k, str):
                raise TypeError(f"keys must be strings, got {k!r}")
            wanted.add(k)
    ordered = sorted(wanted, key=key_order)
    missing_in_a = tuple(k for k in ordered if k not in a)
    missing_in_b = tuple(k for k in ordered if k not in b)
    shape_lines: list[str] = []
    compared: list[str] = []
    arrays: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for key in ordered:
        if key not in a or key not in b:
            continue
        x, y = _array(a, key, "A"), _array(b, key, "B")
        if x.shape != y.shape:
            shape_lines.append(f"shape mismatch for {key}: side A {x.shape}, side B {y.shape}")
        elif x.ndim == 0:
            shape_lines.append(f"{key}: expected a leading step axis, got a scalar")
        else:
            compared.append(key)
            arrays[key] = (x, y)

    max_abs = max_rel = 0.0
    first: tuple[tuple[int, tuple[Any, ...]], str, int] | None = None
    param_gaps: list[np.ndarray] = []
    for key in compared:
        x, y = arrays[key]
        parts = []
        for _, xa, ya in iter_pairs(x, y):  # chunks of rows: one chunk for an array that fits
            abs_diff, rel_diff, bad, _, _ = _elementwise(xa, ya, rtol_f, atol_f, equal_nan)
            if abs_diff.size:
                max_abs = max(max_abs, float(abs_diff.max()))
                max_rel = max(max_rel, float(rel_diff.max()))
            parts.append(bad.reshape(bad.shape[0], -1).any(axis=1))
        bad_rows = np.concatenate(parts)
        if bad_rows.any():
            row = int(np.argmax(bad_rows))
            place = (step_of_row(key, row), key_order(key))
            if first is None or place < first[0]:
                first = (place, key, row)
        if _group(key) == "param":
            param_gaps.append(relative_gap(x, y))

    mismatch = None
    if first is not None:
        _, key, row = first
        x, y = arrays[key]
        mismatch = compare_arrays(
            x[row],
            y[row],
            rtol=rtol_f,
            atol=atol_f,
            key=key,
            step=step_of_row(key, row),
            equal_nan=equal_nan,
        )
    nonfinite = _describe_nonfinite(
        _first_nonfinite(a, compared, "A"), _first_nonfinite(b, compared, "B")
    )
    ok = bool(compared) and mismatch is None and not (missing_in_a or missing_in_b or shape_lines)
    return Comparison(
        ok=ok,
        mismatch=mismatch,
        max_abs=max_abs,
        max_rel=max_rel,
        per_step_gap=_max_rows(param_gaps),
        first_nonfinite=nonfinite,
        missing_in_a=missing_in_a,
        missing_in_b=missing_in_b,
        shape_mismatches=tuple(shape_lines),
        compared=tuple(compared),
        rtol=rtol_f,
        atol=atol_f,
        equal_nan=bool(equal_nan),
    )


def assert_trajectories_close(
    a: Mapping[str, Any],
    b: Mapping[str, Any],
    *,
    rtol: float | None = None,
    atol: float | None = None,
    keys: Iterable[str] | None = None,
    equal_nan: bool = False,
) -> None:
    """Raise :class:`AssertionError` with :meth:`Comparison.message` unless the trajectories agree.

    Same arguments as :func:`compare_trajectories`.
    """
    __tracebackhide__ = True  # pytest shows the caller's line, not this one
    result = compare_trajectories(a, b, rtol=rtol, atol=atol, keys=keys, equal_nan=equal_nan)
    if not result.ok:
        raise AssertionError(result.message())


def first_nonfinite(traj: Mapping[str, Any], impl: str = "trajectory") -> str | None:
    """Where a trajectory first holds a NaN or Inf, as a sentence, or ``None`` if it is finite.

    Synchronous training can explode; this names the first step, the
    implementation and the array: ``"torch.ddp becomes NaN at step 3 (grad 0.kernel)"``.
    Loss and gradients of step k are looked at before the parameters after it.
    """
    keys = sorted(_trajectory_keys(traj), key=key_order)
    found = _first_nonfinite(traj, keys, "A")
    if found is None:
        return None
    (step, _), key, kind = found
    return f"{impl} becomes {kind} at step {step} ({describe_key(key)})"
