"""The factor: where two runs part by a constant scale, how large it is and what it is made of.

The data-parallel bugs users report most (a loss scaled by ``dp_size`` twice or
not at all, micro-batch gradients summed instead of averaged) change the
*magnitude* of a gradient, an update or a loss by a constant and leave its
direction alone. Under Adam the update barely moves (its step is invariant to a
constant gradient scale up to epsilon), so the logged loss does not show it;
the number that tells the engineer what went wrong is the factor itself, said
in the terms of the set-up: ``0.250x the reference's (1/N, N = 4)``,
``8.00x (N x k: ranks x accumulation steps, N = 4, k = 2)``.

Recognising a constant ratio ``B = c A`` between two arrays (the reference's
``A``, the other side's ``B``), robustly:

* ``c`` is the least-squares ratio ``<A, B> / <A, A>``;
* it counts only when the residual is small: ``||B - c A||_inf <= rtol
  max(||B||_inf, |c| ||A||_inf)``. ``rtol`` defaults to 1e-6: the localisation
  reads the float64 runs wherever the float64 rule decided (two implementations of
  one rule agree to ~1e-15 there, so a scaled bug leaves a residual of that size),
  and a float32 run's own rounding stays below ~1e-6 relative for the few steps
  in which a factor is read (float32's unit roundoff is 6e-8; a handful of
  additions of a dozen terms stays inside 1e-6). A ratio that is not constant
  (a per-micro-batch normaliser with different counts, noise) leaves a residual
  of the arrays' own size, orders of magnitude over it;
* ``c`` is then named as the nearest small rational ``p/q`` (``|p|, q <= 64``)
  when it is within ``rtol`` of it, and that rational in terms of the device
  count ``N`` and the accumulation steps ``k`` where one of ``N``, ``k``,
  ``N k``, their inverses, ``N/k`` or ``k/N`` equals it (all names that match
  are given: at ``N = k = 2`` a factor 2 is ``N`` or ``k``), else as a power of
  two, else as the rational alone.

A factor of 1 is no factor (the arrays agree, or differ in another way).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any

import numpy as np

__all__ = ["RTOL", "MAX_TERM", "constant_ratio", "small_rational", "name_in_setup", "describe", "common_factor",
           "per_device", "factor_of_arrays", "attach"]

#: residual allowed around a constant ratio, relative (see the module docstring for why 1e-6)
RTOL = 1e-6
#: the largest numerator and denominator of a "small" rational
MAX_TERM = 64


def constant_ratio(a: Any, b: Any, *, rtol: float = RTOL) -> float | None:
    """``c`` when ``b = c a`` elementwise up to ``rtol``, else ``None``.

    Args:
        a: the reference's array (any shape); b: the other side's, the same shape.
        rtol: the residual allowed, relative to the larger of ``||b||_inf`` and ``|c| ||a||_inf``.
    Returns:
        the least-squares ratio ``<a, b> / <a, a>``, or ``None`` when the shapes differ, ``a`` is all
        zero, a value is non-finite, or the residual ``||b - c a||_inf`` is over the allowance.
    """
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    if a.shape != b.shape or a.size == 0 or not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
        return None
    aa = float(a @ a)
    if aa == 0.0:
        return None
    c = float(a @ b) / aa
    scale = max(float(np.abs(b).max()), abs(c) * float(np.abs(a).max()))
    if scale == 0.0:
        return None
    return c if float(np.abs(b - c * a).max()) <= rtol * scale else None


def small_rational(c: float, *, rtol: float = RTOL, max_term: int = MAX_TERM) -> Fraction | None:
    """The rational ``p/q`` with ``|p|, q <= max_term`` nearest ``c``, when within ``rtol`` of it (relative)."""
    if not np.isfinite(c) or c == 0.0:
        return None
    f = Fraction(c).limit_denominator(max_term)
    if abs(f.numerator) > max_term or f == 0:
        return None
    return f if abs(float(f) - c) <= rtol * abs(c) else None


def _power_of_two(f: Fraction) -> str | None:
    for m in range(1, 13):
        if f == 2 ** m:
            return f"2^{m}"
        if f == Fraction(1, 2 ** m):
            return f"2^-{m}"
    return None


def name_in_setup(f: Fraction, n: int, k: int = 1, b: int | None = None) -> list[str]:
    """Every name of ``f`` in terms of ``N`` (devices) and ``k`` (accumulation steps), most specific first, or
    where none fits, in terms of ``B`` (the global batch's rows: a loss summed where a mean was due).

    A name counts only when its parameter is above 1 (``k`` is no name when there is no accumulation).
    """
    rows = [("B", Fraction(b), True), ("1/B", Fraction(1, b), True)] if b and b > 1 else []
    if b and b > 1 and n > 1 and b % n == 0:
        rows += [("B/N", Fraction(b, n), True), ("N/B", Fraction(n, b), True)]
    names: list[tuple[str, Fraction, bool]] = [
        ("N x k", Fraction(n * k), n > 1 and k > 1), ("1/(N x k)", Fraction(1, n * k), n > 1 and k > 1),
        ("N", Fraction(n), n > 1), ("1/N", Fraction(1, n), n > 1),
        ("k", Fraction(k), k > 1), ("1/k", Fraction(1, k), k > 1),
        ("N/k", Fraction(n, k), n > 1 and k > 1 and n != k), ("k/N", Fraction(k, n), n > 1 and k > 1 and n != k),
    ]
    found = [name for name, value, ok in names if ok and value == f]
    # the batch names only where N and k do not explain it (at B = 16, N = 4, B/N is N: say N)
    return found or [name for name, value, ok in rows if ok and value == f]


_WORDS = {"B": "the global batch's rows", "1/B": "1 / the global batch's rows", "B/N": "rows per device",
          "N/B": "1 / rows per device", "N x k": "ranks x accumulation steps", "1/(N x k)": "1 / (ranks x accumulation steps)",
          "N": "ranks", "1/N": "1 / ranks", "k": "accumulation steps", "1/k": "1 / accumulation steps",
          "N/k": "ranks / accumulation steps", "k/N": "accumulation steps / ranks"}


def describe(c: float, n: int, k: int = 1, *, rtol: float = RTOL, scalar: bool = False,
             b: int | None = None) -> dict[str, Any] | None:
    """The factor ``c`` as report.json carries it, or ``None`` for a factor of 1 (within ``rtol``).

    ``scalar``: ``c`` is the ratio of two single numbers (a loss), which is always "constant": it is then
    named only where it is one of the set-up's ratios (``1/N``, ``N x k``, ...), never as a bare ``p/q``
    (two losses in the ratio 11/12 by chance say nothing).

    Returns:
        ``{"value": c, "exact": "1/4" or None, "as": "1/N" or None, "n": N, "k": k, "text": "0.250x the
        reference's (1/N: 1 / ranks, N = 4)"}``; ``as`` joins every matching name with `` or ``.
    """
    if abs(c - 1.0) <= rtol:
        return None
    f = small_rational(c, rtol=rtol)
    names = name_in_setup(f, n, k, b) if f is not None else []
    if scalar and not names:
        f = None
    exact = None if f is None else (str(f.numerator) if f.denominator == 1 else f"{f.numerator}/{f.denominator}")
    setup = f"N = {n}" + (f", k = {k}" if k > 1 else "") + (f", B = {b}" if any("B" in x for x in names) else "")
    if names:
        why = " or ".join(f"{x}: {_WORDS[x]}" for x in names) + f", {setup}"
    elif f is not None:
        why = _power_of_two(f) or exact
        why = f"{why}, not a ratio of the set-up's N or k ({setup})"
    elif scalar:
        why = f"not a ratio of the set-up's N or k, {setup}"
    else:
        why = "not a small rational"
    return {"value": c, "exact": exact, "as": " or ".join(names) or None, "n": n, "k": k,
            "text": f"{c:#.3g}x the reference's ({why})"}


def common_factor(a: Mapping[str, Any], b: Mapping[str, Any], *, rtol: float = RTOL) -> tuple[float | None, dict]:
    """One factor over several named arrays (the parameters of a gradient or an update), and each one's.

    Returns:
        ``(c, per_name)``: ``c`` when every name both sides hold has the same constant ratio (within
        ``rtol``, relative to ``c``) and else ``None``; ``per_name`` ``{name: ratio or None}``.
        Names where both arrays are all zero carry no ratio and do not break a common one.
    """
    per: dict[str, float | None] = {}
    for name in sorted(set(a) & set(b)):
        x, y = np.asarray(a[name], np.float64), np.asarray(b[name], np.float64)
        if not np.any(x) and not np.any(y):
            continue
        per[name] = constant_ratio(x, y, rtol=rtol)
    values = list(per.values())
    if not values or any(v is None for v in values):
        return None, per
    c = float(np.mean(values))
    return (c if all(abs(v - c) <= rtol * max(abs(c), 1e-300) for v in values) else None), per


def per_device(a: Sequence[Any], b: Sequence[Any], *, rtol: float = RTOL) -> list[float | None]:
    """The constant ratio of each device's array (``a[r]``, ``b[r]``), ``None`` where it is not one."""
    return [constant_ratio(x, y, rtol=rtol) for x, y in zip(a, b, strict=True)]


def factor_of_arrays(a: Mapping[str, Any], b: Mapping[str, Any], what: str, n: int, k: int = 1, *,
                     rtol: float = RTOL, rows: int | None = None) -> dict[str, Any] | None:
    """The localisation's ``factor`` for ``what`` (e.g. ``"combined gradients"``) between named arrays.

    Returns:
        ``None`` when there is no constant scale (or it is 1); else :func:`describe`'s dict with
        ``"of": what`` and, where the parameters differ by different constants, ``"per_name"``.
        ``text`` reads ``"combined gradients 0.250x the reference's (1/N: 1 / ranks, N = 4)"``.
    """
    c, per = common_factor(a, b, rtol=rtol)
    scalar = sum(int(np.size(a[p])) for p in per) <= 1
    if c is not None:
        d = describe(c, n, k, rtol=rtol, scalar=scalar, b=rows)
        if d is None or (scalar and d["as"] is None):  # one number against one: only a ratio of the set-up says more
            return None
        return {**d, "of": what, "text": f"{what} {d['text']}"}
    if per and all(v is not None for v in per.values()):  # a constant per parameter, not one overall
        named = {p: describe(v, n, k, rtol=rtol, scalar=int(np.size(a[p])) <= 1, b=rows) for p, v in per.items()}
        text = "; ".join(f"{p} {d['text']}" if d else f"{p} 1x" for p, d in named.items())
        return {"value": None, "exact": None, "as": None, "n": n, "k": k, "of": what,
                "per_name": {p: (d["value"] if d else 1.0) for p, d in named.items()},
                "text": f"{what} scaled per parameter: {text}"}
    return None


def _device_text(ratios: list[float | None], n: int, k: int, rtol: float, scalar: bool, b: int | None) -> str:
    parts = []
    for r, c in enumerate(ratios):
        if c is None:
            parts.append(f"device {r} not by a constant")
        else:
            d = describe(c, n, k, rtol=rtol, scalar=scalar, b=b)
            parts.append(f"device {r} " + ("1x (agrees)" if d is None else d["text"].replace(" the reference's", "")))
    return ", ".join(parts)


def _devices(a: Mapping[str, Any], b: Mapping[str, Any], prefix: str, what: str, n: int, k: int,
             rtol: float, batch: int | None) -> dict[str, Any] | None:
    """Per-device arrays ``device/<prefix>...`` (``[N, ...]`` each): one factor, or which devices and by how much."""
    names = sorted(key for key in a if key.startswith(f"device/{prefix}") and key in b)
    if not names:
        return None
    rows = [(np.asarray(a[key]), np.asarray(b[key])) for key in names]
    if any(x.shape != y.shape or x.ndim == 0 for x, y in rows):
        return None
    overall = factor_of_arrays({key: x for key, (x, _) in zip(names, rows, strict=True)},
                               {key: y for key, (_, y) in zip(names, rows, strict=True)}, what, n, k, rtol=rtol,
                               rows=batch)
    if overall is not None and overall["value"] is not None:
        return overall
    ratios: list[float | None] = []
    for r in range(len(rows[0][0])):
        c, _ = common_factor({key: x[r] for key, (x, _) in zip(names, rows, strict=True)},
                             {key: y[r] for key, (_, y) in zip(names, rows, strict=True)}, rtol=rtol)
        ratios.append(c)
    if all(c is None for c in ratios):
        return None
    return {"value": None, "exact": None, "as": None, "n": n, "k": k, "of": what,
            "per_device": ratios, "text": f"{what} by device: {_device_text(ratios, n, k, rtol, rows[0][0][0].size * len(rows) <= 1, batch)}"}


def attach(where: Mapping[str, Any], a: Mapping[str, Any], b: Mapping[str, Any], spec: Mapping[str, Any] | None,
           captured: tuple[Mapping[str, Any], Mapping[str, Any]] | None = None, *,
           rtol: float = RTOL) -> dict[str, Any]:
    """``where`` (a localisation) with ``"factor"`` added, and its text appended to the explanation, when the
    two sides differ at the first bad stage by a constant scale (overall, per parameter or per device).

    Args:
        where: the localisation (``first_bad_step``, ``stage``, ...), unchanged when no factor is found.
        a, b: the judged trajectories (reference first): ``loss [steps]``, ``param/* [steps+1, ...]``,
            ``grad/* [steps, ...]``.
        spec: the case (``parallel.devices`` is N, ``parallel.accumulate`` k).
        captured: the two sides' capture runs of that step (``device/loss [N]``, ``device/grad/* [N, ...]``,
            ``device/combined/*``), when the stage chain ran.
    Reads, by stage: ``loss`` the per-device losses (else the logged loss), ``device_grads`` the per-device
    gradients, ``combined_grads`` and ``clip`` the gradient applied (or the captured combined one),
    ``update`` the parameter change of the step, ``record`` the logged loss.
    """
    step, stage = where.get("first_bad_step"), where.get("stage")
    if not step or stage is None or spec is None or where.get("ranks") is not None:
        # DDP replicas out of sync (localise's ``ranks``): the trajectory is rank 0's alone, so a ratio of it to the
        # reference would be claimed for ranks that applied another gradient; the ranks' norms say which and how much
        return dict(where)
    par = spec.get("parallel", {})
    n, k = int(par.get("devices", 1)), int(par.get("accumulate", 1) or 1)
    batch = (spec.get("data") or {}).get("global_batch")
    row = step - 1
    found: dict[str, Any] | None = None
    ca, cb = captured if captured is not None else ({}, {})
    if stage == "device_grads":
        found = _devices(ca, cb, "grad/", "per-device gradients", n, k, rtol, batch)
    elif stage == "loss":
        found = _devices(ca, cb, "loss", "per-device losses", n, k, rtol, batch) if ca and cb else None
        if found is None and "loss" in a and "loss" in b and row < min(len(a["loss"]), len(b["loss"])):
            found = factor_of_arrays({"loss": a["loss"][row]}, {"loss": b["loss"][row]}, "logged losses", n, k, rtol=rtol, rows=batch)
    elif stage == "record" and "loss" in a and "loss" in b and row < min(len(a["loss"]), len(b["loss"])):
        found = factor_of_arrays({"loss": a["loss"][row]}, {"loss": b["loss"][row]}, "logged losses", n, k, rtol=rtol, rows=batch)
    elif stage in ("combined_grads", "clip"):
        grads = sorted(key for key in a if key.startswith("grad/") and key in b)
        if grads and all(row < min(len(a[g]), len(b[g])) for g in grads):
            found = factor_of_arrays({g[5:]: a[g][row] for g in grads}, {g[5:]: b[g][row] for g in grads},
                                     "combined gradients" if stage == "combined_grads" else "gradients applied",
                                     n, k, rtol=rtol, rows=batch)
        elif ca and cb:
            found = _devices(ca, cb, "combined/", "combined gradients", n, k, rtol, batch)
    elif stage == "update":
        params = sorted(key for key in a if key.startswith("param/") and key in b)
        if params and all(step < min(len(a[p]), len(b[p])) for p in params):
            da = {p[6:]: np.asarray(a[p][step], np.float64) - np.asarray(a[p][row], np.float64) for p in params}
            db = {p[6:]: np.asarray(b[p][step], np.float64) - np.asarray(b[p][row], np.float64) for p in params}
            found = factor_of_arrays(da, db, "updates", n, k, rtol=rtol, rows=batch)
    if found is None:
        return dict(where)
    return {**where, "factor": found, "explanation": f"{where.get('explanation', '')}; {found['text']}"}
