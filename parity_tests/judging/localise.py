"""Where two runs first part: the ``localisation`` of a verdict (docs/localisation.md), from what both recorded.

A step runs ``inputs -> forward -> loss -> device_grads -> combined_grads ->
clip -> update -> state``, and an implementation reports some of it: the
parameters before step 1 (row 0) and after each step, the step's combined
loss (computed before the update), optionally the combined gradient it
applied, and its non-trainable state. Reading those channels step by step
against the verdict's own bounds gives the first bad step and the earliest
stage that explains it:

==================  ==========================================================
stage               when (at the first step k where any channel breaks)
==================  ==========================================================
``inputs``          the parameters differ before step 1: the runs did not start
                    from the same weights (loading, layouts)
``loss``            the loss of step k differs and so does what follows from it
                    (the gradient, or the parameters when no gradient was recorded)
``combined_grads``  the parameters agree before step k, the loss agrees, the
                    gradient applied at step k differs; also DDP ranks that
                    applied different gradients at step k (``device``: the rank)
``update``          the gradient applied agrees (or was not recorded and the loss
                    agrees), the parameters after step k differ: the optimizer's
                    step; also DDP replicas that stopped being identical while
                    every rank applied a gradient of the same norm
``state``           only the non-trainable state differs (moving statistics)
``record``          only the reported loss differs, while the gradients and the
                    parameters agree at every step: what was logged, not what
                    was computed
==================  ==========================================================

The per-device stages (``forward``, ``device_grads``, ``clip``) need values the
implementations do not report today; until they do, ``device`` is set only for
a replica finding (the rank; ``ranks``: each rank's applied gradient norm) and
the explanation says which channels were compared.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from parity_tests.contract.paths import describe, execution_key
from parity_tests.judging.bounds import SCALE_FLOOR
from parity_tests.judging.compare import relative_gap
from parity_tests.protocol.rows import RowArray, row_norms
from parity_tests.protocol.trajectory import finding_data

__all__ = ["STAGES", "localise", "row_gaps", "REFINABLE", "refinable", "stage_chain", "bound_at", "with_layer",
           "float32_sized", "FLOAT32_U"]

STAGES = ("inputs", "forward", "loss", "device_grads", "combined_grads", "clip", "update", "state", "record")


def row_gaps(a: Any, b: Any) -> np.ndarray:
    """``[rows]``: ``||A_k - B_k||_inf / max(||A_k||_inf, ||B_k||_inf, SCALE_FLOOR)``, the tolerance model's gap.

    :func:`~parity_tests.judging.compare.relative_gap` with the judge's shared denominator,
    so a row is over its bound here exactly when the verdict counts it over. ``inf`` for
    arrays of different shapes; ``nan`` where both sides are non-finite alike.
    """
    if not isinstance(a, RowArray):  # a file-backed array is read row by row (parity_tests.protocol.rows)
        a = np.asarray(a, np.float64)
    if not isinstance(b, RowArray):
        b = np.asarray(b, np.float64)
    if np.shape(a) != np.shape(b):
        return np.full(min(len(a), len(b)), np.inf)
    return relative_gap(a, b, scale=np.maximum(row_norms(a), row_norms(b)), scale_floor=SCALE_FLOOR)


def _channel(a: Mapping[str, Any], b: Mapping[str, Any], prefix: str) -> dict[str, np.ndarray]:
    """The row gaps of every ``prefix`` array both sides recorded (computed once per array)."""
    return {key[len(prefix):]: row_gaps(a[key], b[key]) for key in sorted(set(a) & set(b)) if key.startswith(prefix)}


def _worst(gaps: Mapping[str, np.ndarray], row: int) -> tuple[float, str | None]:
    """The greatest gap among ``gaps`` at ``row``, and its name (NaN rows: alike non-finite, never the worst)."""
    best, name = 0.0, None
    for key, g in gaps.items():
        if row < len(g) and not np.isnan(g[row]) and (name is None or g[row] > best):
            best, name = float(g[row]), key
    return best, name


def _not_finite_from(gaps: Mapping[str, np.ndarray], row: int) -> bool:
    """Whether some array's gap is NaN (non-finite on a side: ``row_gaps``) at trajectory row ``row`` or later."""
    return any(np.isnan(np.asarray(g[row:], np.float64)).any() for g in gaps.values())


def bound_at(verdict: Any, row: int) -> float:
    """The verdict's bound at trajectory row ``row`` (its per-step bound where it has one, else its bound)."""
    per = getattr(verdict, "per_step_bound", None)
    if per is not None and row < len(per) and np.isfinite(per[row]):
        return float(per[row])
    return float(verdict.bound)


def _loss_at(verdict: Any, a: Mapping[str, Any], b: Mapping[str, Any], step: int) -> tuple[float, float] | None:
    """(gap, bound) of the loss at ``step`` (1-based), when the verdict judged the loss channel."""
    gaps, bounds = getattr(verdict, "per_step_loss_gap", None), getattr(verdict, "per_step_loss_bound", None)
    if gaps is None or bounds is None or step - 1 >= len(gaps):
        return None
    return float(gaps[step - 1]), float(bounds[step - 1])


#: float32's unit roundoff, 2^-24: the relative size of one float32 rounding
FLOAT32_U = 2.0 ** -24


def float32_sized(gap: float | None, dtype: Any) -> str:
    """A note for a gap of float32 rounding size in a float64 run, else ``""``.

    A float64 run rounds by ``2^-53`` relative; its bound allows the accumulation of that over the run
    (far below 1e-9: docs/tolerance.md). A gap between ``2^-30`` and ``2^-20`` (1/64 to 16 float32
    roundings, 9.3e-10 to 9.5e-7) at the first stage that breaks is what one value computed in float32
    in the middle of a float64 computation gives (``1 / num_tokens`` of a float32 count, a float32
    constant, a framework op that casts): said so, with the gap in units of ``2^-24``, because no
    float64 arithmetic makes it. A real bug that happens to move a value by that much is rare; the
    note says what the size is, the stage and name say where.
    """
    if gap is None or not np.isfinite(gap) or np.dtype(dtype) != np.float64:
        return ""
    if not 2.0 ** -30 <= gap <= 2.0 ** -20:
        return ""
    return (f"; a gap of float32 rounding size ({gap / FLOAT32_U:.2g} x 2^-24 relative) in a float64 run:"
            " something computes in float32 (a float32 constant or count, a cast, a framework op in float32)")


def _run_dtype(traj: Mapping[str, Any], prefixes: tuple[str, ...] = ("param/", "grad/")) -> Any:
    """The floating dtype a run computed in, read from its first parameter (or gradient) array."""
    for key in traj:
        if isinstance(key, str) and key.startswith(prefixes):
            dt = getattr(traj[key], "dtype", None)
            if dt is not None and np.dtype(dt).kind == "f":
                return np.dtype(dt)
    return np.dtype(np.float32)


def _with_size_note(where: dict[str, Any], *trajs: Mapping[str, Any], prefixes: tuple[str, ...] = ("param/", "grad/")
                    ) -> dict[str, Any]:
    """``where`` with :func:`float32_sized`'s note when both runs are float64 (the widest of the two decides)."""
    if where.get("stage") is None:
        return where
    dtypes = [_run_dtype(t, prefixes) for t in trajs]
    note = float32_sized(where.get("gap"), np.float64 if all(d == np.float64 for d in dtypes) else np.float32)
    return {**where, "explanation": where["explanation"] + note} if note else where


def _result(step: int | None, stage: str | None, device: int | None, name: str | None, gap: float, bound: float,
            explanation: str) -> dict[str, Any]:
    finite = lambda v: float(v) if np.isfinite(v) else None  # noqa: E731  (JSON has no inf)
    return {"first_bad_step": step, "stage": stage, "device": device, "name": name,
            "gap": finite(gap), "bound": finite(bound), "explanation": explanation}


def _replicas(finding: str, found: Mapping[str, Any], a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    """The localisation of DDP replicas out of sync (``finding``: the replica check's line; ``found``: its data).

    ``found`` (``running.plugins.replica_divergence``): ``step`` (first row apart, 0 = ``run.begin()``),
    ``rank``, ``name``, ``norms`` (``[[rank, |g|], ...]`` or ``None``): read as data, never from the line.

    Only rank 0's trajectory comes back from a DDP plugin; the other ranks send digests of their
    parameters and the norm of each gradient they applied. Where those norms differ between the ranks,
    the ranks applied different gradients: what should be one combined gradient on every rank (DDP's
    all-reduce) is not, so the stage is ``combined_grads`` at that step, ``device`` the first rank apart,
    and ``ranks`` says which ranks applied what (``{"name", "norms": [[rank, |g|], ...]}``: rank 0 and every
    rank whose norm differs from rank 0's; ``gap`` the greatest relative difference of a rank's norm to rank
    0's, against the bitwise rule's bound 0). Rank 0's gradient is also held against the reference's. Where
    every rank applied the same norm (one rank skipped or doubled its optimizer step), or no gradient was
    recorded, the stage is ``update`` (``ranks`` without norms). The stage chain never refines this
    (:func:`refinable`): it compares one side's devices with the other's, not one rank's applied gradient
    with another's, and a DDP communication hook captures a rank's gradients only on a synchronising backward.
    """
    step, rank, name = int(found["step"]), int(found["rank"]), str(found["name"])
    norms = [(int(r), float(g)) for r, g in found.get("norms") or ()]
    g0 = norms[0][1] if norms else 0.0
    if step < 1 or len(norms) < 2 or all(g == g0 for _, g in norms[1:]):  # no gradient, or every rank the same
        out = _result(step, "update", rank, name, float("nan"), 0.0, f"step {step}: {finding}")
        out["ranks"] = {"name": name, "norms": None}
        return out
    gap = max(abs(g - g0) / max(abs(g), abs(g0)) for _, g in norms[1:])
    apart = ", ".join(f"rank {r} {g:.4g} ({g / g0:.3g}x rank 0's)" for r, g in norms[1:])
    key = f"grad/{name}"
    against = ""
    if key in a and key in b and min(len(a[key]), len(b[key])) >= step:
        ref = _gap(np.asarray(a[key][step - 1]), np.asarray(b[key][step - 1]))
        against = f"; rank 0's gradient against the reference's: gap {ref:.3g} in {name}"
    out = _result(step, "combined_grads", rank, name, gap, 0.0,
                  f"step {step}: the ranks applied different gradients where DDP's all-reduce gives every rank the"
                  f" same one (an all-reduce skipped, or made on another micro-batch than the last): |g| of {name}"
                  f" rank 0 {g0:.4g}, {apart}{against}; {finding.split('; the gradient applied')[0]}")
    out["ranks"] = {"name": name, "norms": [[r, g] for r, g in norms]}
    return out


def localise(a: Mapping[str, Any], b: Mapping[str, Any], verdict: Any) -> dict[str, Any]:
    """The ``localisation`` (docs/localisation.md) of ``verdict`` between trajectories ``a`` (reference) and ``b``.

    Args:
        a, b: the judged trajectories (the case dtype); ``findings`` on either are read too.
        verdict: the pair's :class:`~parity_tests.judging.verdict.Verdict` (its bounds are used).
    Returns:
        ``{"first_bad_step", "stage", "device", "name", "gap", "bound", "explanation"}``;
        ``first_bad_step`` and ``stage`` are ``None`` when no channel is over its bound. A gap of
        float32 rounding size in float64 runs is named (:func:`float32_sized`).
    """
    return _with_size_note(_localise(a, b, verdict), a, b)


def _localise(a: Mapping[str, Any], b: Mapping[str, Any], verdict: Any) -> dict[str, Any]:
    """:func:`localise` before the note on gaps of float32 size."""
    for finding in [*getattr(a, "findings", ()), *getattr(b, "findings", ())]:
        found = finding_data(finding)
        if found.get("kind") == "replicas":
            return _replicas(finding, found, a, b)
    steps = len(a.get("loss", ())) if "loss" in a else 0
    params, grads, states = (_channel(a, b, prefix) for prefix in ("param/", "grad/", "state/"))
    has_grads = bool(grads)
    g0, n0 = _worst(params, 0)
    if g0 > bound_at(verdict, 0):
        return _result(0, "inputs", None, n0, g0, bound_at(verdict, 0),
                       f"before step 1: the initial parameters differ ({n0}, gap {g0:.3g}): the runs did not start from"
                       " the same weights (a loading mistake, or a torch layout recorded without run.to_tf)")
    later_bad = later_params = False
    also: tuple[str | None, float, float] | None = None
    first: dict[str, Any] | None = None
    for k in range(1, steps + 1):
        bound = bound_at(verdict, k)
        loss = _loss_at(verdict, a, b, k)
        loss_bad = loss is not None and loss[0] > loss[1]
        gg, gn = _worst(grads, k - 1)
        grads_bad = has_grads and gg > bound
        pg, pn = _worst(params, k)
        params_bad = pg > bound
        sg, sn = _worst(states, k)
        state_bad = sg > bound
        if first is not None:
            later_bad = later_bad or grads_bad or params_bad or state_bad
            later_params = later_params or grads_bad or params_bad
            continue
        if not (loss_bad or grads_bad or params_bad or state_bad):
            continue
        agree = f"step {k}: the parameters agree before it"
        if loss_bad and (grads_bad or (params_bad and not has_grads)):
            first = _result(k, "loss", None, None, loss[0], loss[1],
                            f"{agree}; the loss differs (gap {loss[0]:.3g} > {loss[1]:.3g}) and so does "
                            + (f"the combined gradient ({gn})" if grads_bad else f"the update ({pn}; no gradient recorded)")
                            + ": the per-device losses or the way they are combined")
        elif grads_bad:
            first = _result(k, "combined_grads", None, gn, gg, bound,
                            f"{agree} and so does the loss; the combined gradient applied differs ({gn}, gap {gg:.3g})"
                            ": the per-device gradients or their combination (weighting, sum vs mean, clipping)")
        elif params_bad:
            how = "the gradient applied agrees" if has_grads else "the loss agrees (no gradient recorded)"
            first = _result(k, "update", None, pn, pg, bound,
                            f"{agree}; {how}; the parameters after it differ ({pn}, gap {pg:.3g}): the optimizer's"
                            " step (its rule, hyperparameters, slots or learning-rate schedule)")
        elif state_bad and not loss_bad:
            first = _result(k, "state", None, sn, sg, bound,
                            f"{agree}; only the non-trainable state differs ({sn}, gap {sg:.3g}): moving statistics")
        else:
            first = _result(k, "loss", None, None, loss[0], loss[1], "")  # loss first: decided after the loop
            if state_bad:  # two differences at one step: which comes first depends on what the loss is
                also = (sn, sg, bound)
    if first is None:
        return _result(None, None, None, None, float(verdict.gap), float(verdict.bound),
                       "no recorded channel exceeds its bound" + (" (theory predicted a difference that did not appear)"
                                                                   if verdict.status == "unexpected_parity" else ""))
    if first["explanation"] == "":
        k = first["first_bad_step"]
        if also and not later_params:  # the loss is only what was logged (record), the state a computation before it
            sn, sg, bound = also
            return _result(k, "state", None, sn, sg, bound,
                           f"step {k}: the parameters agree before and after it; the non-trainable state differs ({sn},"
                           f" gap {sg:.3g}): moving statistics; the reported loss differs too (gap {first['gap']:.3g})"
                           " while the gradients and parameters agree at every step: what was logged")
        if later_bad:
            first["explanation"] = (f"step {k}: only the loss differs at first (gap {first['gap']:.3g}), the"
                                    " parameters later: the per-device losses or their combination")
        elif _not_finite_from(params, k):
            # NaN on both sides is never "agree": the loss is all that was compared from here on
            first["explanation"] = (f"step {k}: the loss differs (gap {first['gap']:.3g}); the parameters after it are"
                                    " not finite on both sides, so whether the computation differs cannot be told:"
                                    " the per-device losses or their combination, or only what was logged")
        else:
            first["stage"] = "record"
            first["explanation"] = (f"step {k}: the reported loss differs (gap {first['gap']:.3g}) while the gradients"
                                    " and parameters agree at every step: what was logged, not what was computed"
                                    " (e.g. one tower's loss, or a loss not averaged over ranks)")
        if also:
            first["explanation"] += f"; the non-trainable state differs at that step too ({also[0]}, gap {also[1]:.3g})"
    return first


#: the stages a captured step can refine: what happens inside a step before its update
REFINABLE = ("loss", "combined_grads")


def refinable(where: Mapping[str, Any], a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether the stage chain of ``where``'s first bad step can say more than the recorded channels.

    Stages inside the step (:data:`REFINABLE`), and ``update`` when a side recorded no gradient:
    then "the loss agrees, the parameters after the step differ" cannot tell the gradient from
    the optimizer's step, and per-device gradients can. Never DDP replicas out of sync (``ranks``,
    :func:`_replicas`): the chain compares the reference's devices with the other side's, not one rank's
    applied gradient with another's, and would replace the rank that parted with what it sees: a DDP
    communication hook captures a rank's gradients only on a synchronising backward (FunASR #3472's
    loop synchronises its first micro-batch, so the hook sees that one only, on every rank).
    """
    if not where.get("first_bad_step") or where.get("ranks") is not None:  # replicas: :func:`_replicas`
        return False
    grads = all(any(k.startswith("grad/") for k in t) for t in (a, b))
    return where.get("stage") in REFINABLE or (where.get("stage") == "update" and not grads)


def _gap(a: Any, b: Any) -> float:
    """The gap of two whole arrays as one row of :func:`row_gaps` (inf for different shapes or one side
    non-finite; 0 where both are non-finite alike, which the verdict's own rule reports)."""
    g = float(row_gaps(np.asarray(a)[None], np.asarray(b)[None])[0])
    return 0.0 if np.isnan(g) else g


def _ratio(a: np.ndarray, b: np.ndarray, tol: float | None = None) -> float | None:
    """``c`` when ``B = c A`` to ``tol`` (:func:`_tolerance` of the two) relative (a scaling: a weight, a missing or
    extra factor, a clip), else ``None``."""
    tol = _tolerance(a, b) if tol is None else tol
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    aa = float(a @ a)
    if aa == 0.0:
        return None
    c = float(a @ b) / aa
    return c if np.abs(b - c * a).max() <= tol * max(np.abs(b).max(), 1e-300) else None


def _split(rows: np.ndarray, sizes: np.ndarray) -> list[np.ndarray]:
    return np.split(np.asarray(rows), np.cumsum(sizes)[:-1])


def _per_device(a: np.ndarray, b: np.ndarray, sizes: np.ndarray | None) -> list[float]:
    """Per device gaps of row-concatenated arrays (one gap for the whole when sizes are unknown)."""
    if sizes is None:
        return [_gap(a, b)]
    return [_gap(x, y) for x, y in zip(_split(a, sizes), _split(b, sizes), strict=True)]


def _which(gaps: list[float], bound: float) -> tuple[int | None, list[int]]:
    over = [r for r, g in enumerate(gaps) if g > bound]
    return (over[0] if len(over) == 1 and len(gaps) > 1 else None), over


def _devices_text(over: list[int], n: int, word: str) -> str:
    if len(over) == n:
        return f"every {word}"
    return f"{word} " + ", ".join(map(str, over)) if len(over) > 1 else f"{word} {over[0]}"


#: the combinations of device gradients the chain recognises: name -> weights ``w_r`` from the shard sizes
_RULES = {
    "equal": ("the equal mean (1/N each)", lambda sizes: np.full(len(sizes), 1.0 / len(sizes))),
    "by_size": ("the mean weighted by shard size (n_r/B)", lambda sizes: sizes / sizes.sum()),
    "sum": ("the sum", lambda sizes: np.ones(len(sizes))),
}


def _weighted(d: Mapping[str, np.ndarray], names: list[str], rule: str) -> dict[str, np.ndarray]:
    """``sum_r w_r g_r`` of the device gradients ``d["grad/<p>"]`` with the weights of ``rule`` (a key of ``_RULES``)."""
    w = _RULES[rule][1](np.asarray(d["sizes"], np.float64))
    return {p: np.tensordot(w, np.asarray(d[f"grad/{p}"], np.float64), axes=1) for p in names}


def _rule_of(d: Mapping[str, np.ndarray], combined: Mapping[str, np.ndarray], names: list[str], *,
             scaled: bool = False) -> str | None:
    """Which combination (equal mean, by-size mean, sum) of the device gradients ``d["grad/<p>"]`` ``combined`` is.

    With ``scaled``, up to one common factor (a global-norm clip after the combination).
    """
    got = np.concatenate([np.asarray(combined[p], np.float64).ravel() for p in names])
    tol = _tolerance(*(combined[p] for p in names))
    for rule, (text, _) in _RULES.items():
        mixed = np.concatenate([g.ravel() for g in _weighted(d, names, rule).values()])
        c = _ratio(mixed, got, tol) if scaled else 1.0
        if c is not None and _gap(c * mixed, got) < tol:
            return text + (f" times {c:.3g}" if scaled and abs(c - 1.0) > 1e-9 else "")
    return None


def _combination(da: Mapping[str, np.ndarray], db: Mapping[str, np.ndarray], ca: Mapping[str, np.ndarray],
                 cb: Mapping[str, np.ndarray], names: list[str]) -> str:
    """``: the reference combines by X, the other by Y`` when the two combinations differ, else ``""``."""
    ra, rb = _rule_of(da, ca, names), _rule_of(db, cb, names)
    if ra and rb and ra != rb:
        sizes = da["sizes"]
        uneven = " (the shards are uneven: " + "/".join(str(int(s)) for s in sizes) + " rows)" if len(set(sizes.tolist())) > 1 else ""
        return f": the reference combines by {ra}, the other by {rb}{uneven}"
    return ""


def _tolerance(*arrays: Any) -> float:
    """The relative gap under which two computations of one combination or clip count as the same.

    float64: 1e-6, far above rounding and far below any real difference of weights or thresholds.
    float32 (or narrower) values: 1e-4: a global norm sums n squares, each rounding by ``u = 6e-8``
    relative, so it is off by up to ``sqrt(n) u`` in a typical run (6e-5 at a million elements), and
    the factor ``c / norm`` with it; a wrong weighting or threshold moves the result by far more.
    """
    narrow = any(np.dtype(getattr(a, "dtype", np.float64)).itemsize < 8 for a in arrays)
    return 1e-4 if narrow else 1e-6


def _norm(g: Mapping[str, Any], names: Iterable[str]) -> float:
    """The global L2 norm ``sqrt(sum_p ||g_p||^2)`` of the gradients ``g`` (a clip's norm)."""
    return float(np.sqrt(sum(float(np.sum(np.square(np.asarray(g[p], np.float64)))) for p in names)))


def _clip_acted(d: Mapping[str, Any], applied: Mapping[str, Any], names: list[str], spec: Mapping[str, Any] | None) -> str:
    """Which clip acted on one side, read from its device gradients ``d["grad/<p>"]`` and its applied gradient.

    ``applied = c * G`` with ``G = sum_r w_r g_r`` (the case's weighting, or another of :data:`_RULES`): one
    global-norm clip after the combination with norm ``||G||`` and factor ``c``; when ``c ||G||`` is not the
    case's threshold, the threshold it acted at (and how far from the case's: a clip of a loss-scaled
    gradient acts at ``threshold / S``). ``applied = sum_r w_r f_r g_r`` with factors ``f_r`` fitted per
    device: a clip of each device's gradient, with each device's norm and factor. Else says so.
    """
    names = [p for p in names if p in applied]
    if not names:
        return "nothing applied to compare"
    threshold = ((spec or {}).get("parallel", {}).get("clip") or {}).get("global_norm")
    got = np.concatenate([np.asarray(applied[p], np.float64).ravel() for p in names])
    tol = _tolerance(*(applied[p] for p in names))
    rules = list(_RULES)
    own = (spec or {}).get("parallel", {}).get("weighting")
    if own in rules:  # the case's weighting first: with even shards equal and by-size weights are the same
        rules.remove(own)
        rules.insert(0, own)
    sizes = np.asarray(d["sizes"], np.float64)
    for rule in rules:
        combined = _weighted(d, names, rule)
        mixed = np.concatenate([combined[p].ravel() for p in names])
        c = _ratio(mixed, got, tol)
        if c is None or _gap(c * mixed, got) > tol:
            continue
        norm = _norm(combined, names)
        head = f"{_RULES[rule][0]} of the device gradients"
        if abs(c - 1.0) <= tol:
            over = f", over the case's {threshold:.3g}: no clip acted where one should" if threshold and norm > threshold * (1 + tol) else ""
            return f"{head}, unscaled (global norm {norm:.3g}{over})"
        acted = c * norm  # the threshold a global-norm clip with this factor acted at
        text = f"{head} clipped once after the combination (global norm {norm:.3g}, factor {c:.3g}"
        if threshold and abs(acted - threshold) <= 1e-4 * threshold + 2e-6:  # torch divides by norm + 1e-6
            return text + f" = {threshold:.3g} / {norm:.3g})"
        away = f", {threshold / acted:.3g}x below the case's {threshold:.3g}: the norm of a gradient scaled by that" \
               " (a loss scale?)" if threshold and acted < threshold else (f", not the case's {threshold:.3g}" if threshold else "")
        return text + f": a global-norm clip at {acted:.3g}{away})"
    # one factor per device: least squares for f in applied = sum_r w_r f_r g_r, for each weighting
    for rule in rules:
        w = _RULES[rule][1](sizes)
        cols = np.stack([np.concatenate([w[r] * np.asarray(d[f"grad/{p}"][r], np.float64).ravel() for p in names])
                         for r in range(len(sizes))], axis=1)
        f, *_ = np.linalg.lstsq(cols, got, rcond=None)
        if _gap(cols @ f, got) > tol:
            continue
        norms = [_norm({p: d[f"grad/{p}"][r] for p in names}, names) for r in range(len(sizes))]
        fac = "/".join(f"{x:.3g}" for x in f)
        at = (f" = min(1, {threshold:.3g} / norm)" if threshold and all(
            abs(x - min(1.0, threshold / n)) <= 1e-4 * x + 2e-6 for x, n in zip(f, norms, strict=True)) else "")
        return (f"each device's gradient clipped before {_RULES[rule][0]} (device norms "
                + "/".join(f"{x:.3g}" for x in norms) + f", factors {fac}{at})")
    return "not one factor on a combination of the device gradients, nor one factor per device: no clip the chain recognises"


def _factor(combined: Mapping[str, Any], applied: Mapping[str, Any], names: list[str],
            spec: Mapping[str, Any] | None) -> str:
    """What was applied of the combined gradient: one factor (a global-norm clip: its norm, factor and threshold)."""
    names = [p for p in names if p in combined]
    mixed = np.concatenate([np.asarray(combined[p], np.float64).ravel() for p in names])
    got = np.concatenate([np.asarray(applied[p], np.float64).ravel() for p in names])
    tol = _tolerance(*(applied[p] for p in names))
    c = _ratio(mixed, got, tol)
    if c is None or _gap(c * mixed, got) > tol:
        return "not one factor times the combined gradient"
    norm = _norm(combined, names)
    threshold = ((spec or {}).get("parallel", {}).get("clip") or {}).get("global_norm")
    if abs(c - 1.0) <= tol:
        return f"the combined gradient unscaled (global norm {norm:.3g})"
    said = f" (the case's {threshold:.3g})" if threshold else ""
    return f"the combined gradient times {c:.3g} (global norm {norm:.3g}: a clip at {c * norm:.3g}{said})"


def _row_key(d: Mapping[str, Any]) -> np.ndarray | None:
    """The rows a side's devices received, concatenated in device order: ``x`` (built-ins, ``device_inputs=``), or
    the rows its model's first layer received (``rows``, the layer hooks'), one row per example, flattened."""
    for key in ("x", "rows"):
        if key in d:
            rows = np.asarray(d[key])
            return rows.reshape(len(rows), -1) if rows.ndim else None
    return None


def _row_match(a: np.ndarray | None, b: np.ndarray | None) -> np.ndarray | None:
    """``perm`` with ``b[perm[i]]`` the same example as ``a[i]``, matched by content, or ``None``.

    A row's values sorted are its signature, so a row flattened in another order (torch's NCHW
    ``x.flatten(1)`` against Keras' NHWC ``Flatten``) is still the same row; the two sides read
    the same data in the same dtype, so the values are equal, not close. ``None`` where the two
    sets of rows differ (other rows in all: the global batch is not the same set).
    """
    if a is None or b is None or a.shape != b.shape:
        return None
    sa, sb = np.sort(a.astype(np.float64), axis=1), np.sort(b.astype(np.float64), axis=1)
    ia, ib = np.lexsort(sa.T[::-1]), np.lexsort(sb.T[::-1])
    if not np.array_equal(sa[ia], sb[ib]):
        return None
    perm = np.empty(len(a), np.int64)
    perm[ia] = ib
    return perm


def _dealt(devices_a: np.ndarray, devices_b: np.ndarray, sizes: np.ndarray) -> str:
    """How the two sides dealt the global batch's rows, from each row's device on each side (in the reference's
    row order, which is its devices' rows concatenated): contiguous against strided, either way, or another way."""
    n, rows = len(sizes), len(devices_a)
    g = np.arange(rows)
    if np.array_equal(devices_b, g % n):
        return "contiguous slices (the reference) vs rows r, r+N, ... (the other, as DistributedSampler deals them)"
    if len(set(sizes.tolist())) == 1:  # the reference strided: global row g is its device g % N's row g // N
        per = rows // n
        order = (g % n) * per + g // n
        if np.array_equal(devices_b[order], g // per):
            return "rows r, r+N, ... (the reference, as DistributedSampler deals them) vs contiguous slices (the other)"
    return "another split of the same rows"


def _own_names(key: str, sides: tuple[Mapping[str, Any], ...]) -> str:
    """`` (blocks.2.body.1 LayerNorm / model/block_2/layer_normalization LayerNormalization)``: what the
    plugins' layer hooks call layer ``key`` (``device/name/<key>``), reference first; empty if none does."""
    own = dict.fromkeys(str(d[f"name/{key}"]) for d in sides if f"name/{key}" in d)
    return f" ({' / '.join(own)})" if own else ""


def _layer_name(key: str, spec: Mapping[str, Any] | None, *sides: Mapping[str, Any]) -> str:
    """A forward-stage layer as localisation names it: ``layer 5.2.0.body.1 layer_norm`` (path and type), or
    ``layer hooks.6`` where the case does not say (a plugin's hook layers), with the plugins' own names."""
    return f"layer {describe(key, spec) or key}{_own_names(key, sides)}"


def _layer_text(key: str, spec: Mapping[str, Any] | None, word: str = "layer ", *sides: Mapping[str, Any]) -> str:
    """``layer 5.2.0.body.1 (layer_norm)`` for an explanation."""
    said = describe(key, spec)
    return f"{word}{key}" + (f" ({said.split(' ', 1)[1]})" if said else "") + _own_names(key, sides)


def with_layer(where: Mapping[str, Any] | None, spec: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """``where`` with ``"layer"``: the path and type of the layer its ``name`` belongs to
    (``"5.2.0.body.1 layer_norm"`` for ``5.2.0.body.1.gamma`` or for that layer's output), when it names one."""
    if not where or not where.get("name"):
        return where
    name = str(where["name"])
    said = describe((name[len("layer "):] if name.startswith("layer ") else name).split(" ", 1)[0], spec)
    return {**where, "layer": said} if said else where


class _Lazy(Mapping):
    """Arrays by name, each read when asked for (``read(name)``), none kept.

    A large model's captured step is N + 2 copies of it, spilled to files
    (``protocol.rows.spill_arrays``), and its applied gradients are rows of spilled
    trajectories: the chain reads one or two arrays at a time instead of holding both sides'
    whole gradients (a float64 GPT-2 small: 1 GB each, four of them).
    """

    def __init__(self, keys: Iterable[str], read: Callable[[str], np.ndarray]) -> None:
        self._keys = list(keys)
        self._known = set(self._keys)
        self._read = read

    def __getitem__(self, key: str) -> np.ndarray:
        if key not in self._known:
            raise KeyError(key)
        return self._read(key)

    def __contains__(self, key: object) -> bool:
        return key in self._known

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def _captured(traj: Mapping[str, Any]) -> _Lazy:
    """A trajectory's ``device/...`` arrays by their name without the prefix."""
    return _Lazy([k[len("device/"):] for k in traj if k.startswith("device/")],
                 lambda key: np.asarray(traj[f"device/{key}"]))


def _later_micro_batch(a: Any, b: Any, sizes: np.ndarray | None, spec: Mapping[str, Any] | None,
                       bound: float) -> tuple[int, int, float, float | None] | None:
    """``(j, k, gap, c)`` where a layer's outputs (``[B, ...]``, devices' rows concatenated) agree on every device's
    first micro-batch and differ first on micro-batch ``j`` (1-based) of ``k``; else ``None``.

    With ``parallel.accumulate = k`` a device cuts its rows into k equal contiguous micro-batches and runs them
    in order (``tfpar.towers``; the captured rows are each device's, micro-batches in call order), each forward
    pass reading the parameters as they are then. The same rows through the same layers agree on micro-batch 1
    and not on a later one only when what that later pass read changed between them: the parameters moved
    inside the step (keras #19990: weight decay applied at every micro-step). ``None`` without accumulation,
    with unknown or uneven device sizes, or where the first micro-batch differs too. ``c``: micro-batch ``j``'s
    outputs as a constant times the reference's, where they are one (:func:`_ratio`), else ``None``.
    """
    k = int(((spec or {}).get("parallel") or {}).get("accumulate", 1) or 1)
    if k < 2 or sizes is None or any(int(n) % k for n in sizes):
        return None
    a, b = np.asarray(a), np.asarray(b)
    blocks: list[list[float]] = [[] for _ in range(k)]
    rows: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(k)]
    for xa, xb in zip(_split(a, sizes), _split(b, sizes), strict=True):
        for j, (ma, mb) in enumerate(zip(np.split(xa, k), np.split(xb, k), strict=True)):
            blocks[j].append(_gap(ma, mb))
            rows[j].append((ma, mb))
    worst = [max(g) for g in blocks]
    if worst[0] > bound:
        return None
    j = next((j for j in range(1, k) if worst[j] > bound), None)
    if j is None:
        return None
    c = _ratio(np.concatenate([x for x, _ in rows[j]]), np.concatenate([y for _, y in rows[j]]))
    return j + 1, k, worst[j], c


def _decayed(c: float | None, spec: Mapping[str, Any] | None) -> str:
    """``; 0.9999x the reference's: 1 - lr x weight_decay, the weights decayed once ...`` where a later micro-batch's
    layer output is a constant ``c`` times the reference's (a ReLU network's output scales with its weights), else
    the ratio alone or ``""``. Said as a decay where ``1 - c`` is ``lr x weight_decay`` to 1e-3 relative (float32
    runs give ``c`` to ~1e-7, so ``1 - c = 1e-4`` to ~1e-3; float64 runs far closer)."""
    if c is None or abs(c - 1.0) <= 1e-12:
        return ""
    opt = (spec or {}).get("optimizer") or {}
    lr, wd = opt.get("lr"), opt.get("weight_decay")
    if isinstance(lr, (int, float)) and isinstance(wd, (int, float)) and wd > 0:
        for m in (1, 2, 3):
            want = 1.0 - (1.0 - lr * wd) ** m
            if abs((1.0 - c) - want) <= 1e-3 * want:
                return (f"; {c:.6g}x the reference's: (1 - lr x weight_decay)^{m}, the weights decayed {m} times"
                        " more than the reference's") if m > 1 else \
                    f"; {c:.6g}x the reference's: 1 - lr x weight_decay, the weights decayed once more than the reference's"
    return f"; {c:.6g}x the reference's"


def _rows_as(b: Any, perm: np.ndarray | None) -> Any:
    """``b``'s rows in the reference's row order (``perm``: :func:`_row_match`), or ``b`` as it is."""
    return b if perm is None else np.asarray(b)[perm]


def _dealt_otherwise(da: Mapping[str, Any], db: Mapping[str, Any], perm: np.ndarray, devices: np.ndarray,
                     sizes: np.ndarray, step: int, bound: float, spec: Mapping[str, Any] | None,
                     chain: list[dict[str, Any]], runs: tuple[Mapping[str, Any], Mapping[str, Any]]) -> dict[str, Any]:
    """The localisation where both sides' devices received the same rows in all but not the same rows each.

    The stage is ``inputs``: that is the first thing that differs. Per-device losses and gradients are
    of other rows on each side and are not compared; the forward pass is, on matching rows (each
    layer's output of a row against the same row's on the other side): agreeing, the layers compute
    alike and only the dealing differs; differing, a layer computes from a device's rows together
    (batch-norm statistics) or computes otherwise, and the explanation names it. The gradient
    applied (``runs``: both trajectories) is compared too: equal shards combined by a mean do
    not depend on which device holds a row, so a gradient that differs while the forward pass
    agrees is said to be more than the dealing.
    """
    how = _dealt(devices, devices[perm], sizes)
    moved = int(np.sum(devices != devices[perm]))
    text = (f"step {step}: the devices received different rows: the same {len(perm)} rows in all, dealt {how}"
            f" ({moved} of {len(perm)} rows on another device); per-device losses and gradients are of other rows"
            " and are not compared")
    chain.append({"stage": "inputs", "device": None, "name": None, "gap": float("inf"), "bound": bound})
    layers = sorted((k[len("act/"):] for k in da if k.startswith("act/") and k in db), key=execution_key)
    worst, last = 0.0, None
    for layer in layers:
        a, b = da[f"act/{layer}"], db[f"act/{layer}"]
        if a.shape != b.shape:
            break
        g = _gap(a, _rows_as(b, perm))
        if g > bound:
            name = _layer_name(layer, spec, da, db)
            chain.append({"stage": "forward", "device": None, "name": name, "gap": g, "bound": bound})
            text += (f"; on matching rows the output of {_layer_text(layer, spec, 'layer ', da, db)} differs (gap"
                     f" {g:.3g}): it computes from a device's rows together (batch-norm statistics) or otherwise")
            break
        worst, last = max(worst, g), layer
    else:
        if last is not None:
            chain.append({"stage": "forward", "device": None, "name": _layer_name(last, spec, da, db), "gap": worst,
                          "bound": bound})
            text += (f"; on matching rows the forward pass agrees to {worst:.1g} through {_layer_text(last, spec)}:"
                     " the layers compute alike, only the dealing of the rows differs")
    a, b = runs
    applied = [q[len("grad/"):] for q in a if isinstance(q, str) and q.startswith("grad/") and q in b
               and len(a[q]) >= step and len(b[q]) >= step]
    if applied:
        worst_a, pa = max((_gap(np.asarray(a[f"grad/{p}"][step - 1]), np.asarray(b[f"grad/{p}"][step - 1])), p)
                          for p in applied)
        chain.append({"stage": "combined_grads", "device": None, "name": pa, "gap": worst_a, "bound": bound})
        text += (f"; the gradient applied agrees (gap {worst_a:.1g})" if worst_a <= bound else
                 f"; the gradient applied differs in {pa} (gap {worst_a:.3g})"
                 + (": more than the dealing, where the forward pass agrees on matching rows" if last is not None
                    and not any(c["stage"] == "forward" and c["gap"] > bound for c in chain) else ""))
    out = _with_size_note(_result(step, "inputs", None, None, float("inf"), bound, text), da, db,
                          prefixes=("grad/", "act/", "x"))
    out["chain"] = chain
    return out


def stage_chain(a: Mapping[str, Any], b: Mapping[str, Any], step: int, bound: float,
                spec: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
    """The stages of one captured step, each judged against ``bound``, and the first one that breaks.

    Args:
        a, b: trajectories of the reference and the other implementation run with
            ``case.capture = step`` (their ``device/...`` arrays: see ``TowerTrainer.step``).
        step: the step both captured; bound: the relative gap allowed at that step (the
            verdict's own bound there).
        spec: the case (per-device gradients are not compared under synchronized batch norm,
            where a tower's gradient of its own loss and a DDP rank's share differ by design).
    Returns:
        ``None`` when either side captured nothing; else a localisation (docs/localisation.md): ``stage``,
        ``device``, ``name``, ``gap``, ``bound``, ``explanation``; ``stage`` ``None`` when every
        captured stage agrees, plus ``"chain"``: ``[{"stage", "device", "name", "gap", "bound"}]``,
        the greatest gap of every stage compared, in step order.
    """
    da, db = _captured(a), _captured(b)
    if not da or not db:
        return None
    chain: list[dict[str, Any]] = []
    agreed: list[str] = []
    same_n = "sizes" in da and "sizes" in db and len(da["sizes"]) == len(db["sizes"])
    sizes = da["sizes"] if same_n and np.array_equal(da["sizes"], db["sizes"]) else None
    n = len(sizes) if sizes is not None else 1
    # rows concatenated in device order line up across device counts only for contiguous shards of split data
    rows_line_up = same_n or spec is None or (spec["parallel"].get("shard") == "contiguous"
                                              and spec["data"].get("order", "split") == "split")

    def broke(stage: str, device: int | None, name: str | None, gap: float, text: str) -> dict[str, Any]:
        prefix = f"step {step}: " + ("; ".join(agreed) + "; " if agreed else "")
        out = _with_size_note(_result(step, stage, device, name, gap, bound, prefix + text), da, db,
                              prefixes=("grad/", "act/", "x"))
        out["chain"] = chain
        return out

    # inputs: the rows each device received; first, how many in all (a sampler's padding adds rows)
    if "sizes" in da and "sizes" in db and int(np.sum(da["sizes"])) != int(np.sum(db["sizes"])):
        ta, tb = int(np.sum(da["sizes"])), int(np.sum(db["sizes"]))
        chain.append({"stage": "inputs", "device": None, "name": None, "gap": float("inf"), "bound": bound})
        return broke("inputs", None, None, float("inf"),
                     f"the devices received {tb} rows in all, the reference's {ta}"
                     " (padding to equal shards, as DistributedSampler does, or rows dropped)")
    if same_n and sizes is None:
        r = int(np.flatnonzero(da["sizes"] != db["sizes"])[0])
        chain.append({"stage": "inputs", "device": r, "name": None, "gap": float("inf"), "bound": bound})
        return broke("inputs", r, None, float("inf"),
                     f"device {r} received {int(db['sizes'][r])} rows, the reference's {int(da['sizes'][r])}"
                     " (sharding: contiguous vs strided, uneven split, or a sampler's padding)")
    # the same rows in all, dealt otherwise: matched by content, the forward pass compared on matching rows
    total = int(np.sum(da["sizes"])) if "sizes" in da else None
    perm = _row_match(_row_key(da), _row_key(db))
    if perm is not None and total is not None and len(perm) != total:
        perm = None
    moved = perm is not None and not np.array_equal(perm, np.arange(len(perm)))
    if moved and sizes is not None:
        devices = np.repeat(np.arange(n), sizes)
        if not np.array_equal(devices, devices[perm]):
            return _dealt_otherwise(da, db, perm, devices, sizes, step, bound, spec, chain, (a, b))
    if moved:
        agreed.append("inputs: the same rows, in another order (matched by content)")
        rows_line_up = True
    elif "x" in da and "x" in db and rows_line_up:
        gaps = _per_device(da["x"], db["x"], sizes)
        dev, over = _which(gaps, bound)
        chain.append({"stage": "inputs", "device": dev, "name": None, "gap": max(gaps), "bound": bound})
        if over:
            return broke("inputs", dev, None, max(gaps),
                         f"{_devices_text(over, n, 'device')} received other rows than the reference's"
                         " (a sharding or sampler mismatch)")
        agreed.append("inputs agree")
    # forward: every layer's output, in layer order
    # (nested layers by path, in the order the forward pass finishes them: parity_tests.contract.paths)
    layers = [k[len("act/"):] for k in da if k.startswith("act/") and k in db] if rows_line_up else []
    layers.sort(key=execution_key)
    worst, last = 0.0, None
    for layer in layers:
        if da[f"act/{layer}"].shape != db[f"act/{layer}"].shape:
            break
        gaps = _per_device(da[f"act/{layer}"], _rows_as(db[f"act/{layer}"], perm if moved else None), sizes)
        dev, over = _which(gaps, bound)
        if over:
            name = _layer_name(layer, spec, da, db)
            chain.append({"stage": "forward", "device": dev, "name": name, "gap": max(gaps), "bound": bound})
            later = None if moved else _later_micro_batch(da[f"act/{layer}"], db[f"act/{layer}"], sizes, spec, bound)
            if later is not None:  # micro-batch 1 agrees, a later one not: the parameters moved inside the step
                j, k_micro, g, c = later
                chain.append({"stage": "update", "device": None, "name": name, "gap": g, "bound": bound})
                return broke("update", None, name, g,
                             f"the first of {k_micro} micro-batches agrees through the forward pass on every device;"
                             f" micro-batch {j}'s output of {_layer_text(layer, spec, 'layer ', da, db)}, from the same"
                             f" rows, differs (gap {g:.3g}{_decayed(c, spec)}): the parameters it read had changed inside the step, before"
                             " the step's update: an optimizer acting at every micro-step (weight decay or clipping"
                             " applied per micro-batch, a step counter advanced per micro-batch), or a weight written"
                             " during the accumulation")
            out = broke("forward", dev, name, max(gaps),
                        f"the output of {_layer_text(layer, spec, 'layer ', da, db)} differs on"
                        f" {_devices_text(over, n, 'device')}"
                        f" (gap {max(gaps):.3g})"
                        + (f" while layers up to {_layer_text(last, spec, '')} agree" if last is not None
                           else " (the first layer" + ("" if layer == min((k[len("act/"):] for k in da if k.startswith(
                               "act/")), key=execution_key) else " both sides recorded") + ")"))
            return out
        worst, last = max(worst, max(gaps)), layer
    if last is not None:
        chain.append({"stage": "forward", "device": None, "name": _layer_name(last, spec, da, db), "gap": worst,
                      "bound": bound})
        agreed.append(f"forward agrees to {worst:.1g} through {_layer_text(last, spec)}" + (" (all devices)" if n > 1 else ""))
    # loss: each device's own loss
    if same_n and "loss" in da and "loss" in db:
        gaps = [_gap(x, y) for x, y in zip(da["loss"], db["loss"], strict=True)]
        dev, over = _which(gaps, bound)
        chain.append({"stage": "loss", "device": dev, "name": None, "gap": max(gaps), "bound": bound})
        if over:
            r = over[0]
            c = _ratio(da["loss"][r], db["loss"][r])
            how = f" ({c:.3g}x the reference's)" if c is not None and abs(c - 1) > 1e-6 else ""
            return broke("loss", dev, None, max(gaps),
                         f"the loss of {_devices_text(over, n, 'device')} differs{how} (gap {max(gaps):.3g}): the"
                         " per-device loss (its formula, reduction or scaling)")
        agreed.append("per-device losses agree")
    names = sorted(k[len("grad/"):] for k in da if k.startswith("grad/") and k in db)
    sync_bn = spec is not None and spec["parallel"].get("batch_norm", "local") == "sync" and any(
        layer.get("type") == "batch_norm" for layer in spec["model"].get("layers", ()))
    # device_grads: each device's gradient of its own loss, before clipping and combining
    if same_n and names and not sync_bn:
        worst_g, at = 0.0, (None, None, [])
        for p in names:
            gaps = [_gap(x, y) for x, y in zip(da[f"grad/{p}"], db[f"grad/{p}"], strict=True)]
            if max(gaps) > worst_g:
                worst_g, at = max(gaps), (p, *_which(gaps, bound))
        p, dev, over = at
        chain.append({"stage": "device_grads", "device": dev, "name": p, "gap": worst_g, "bound": bound})
        if over:
            r = over[0]
            c = _ratio(da[f"grad/{p}"][r], db[f"grad/{p}"][r])
            how = f" by {c:.3g}x" if c is not None else ""
            note = ""
            if sizes is not None and len(set(sizes.tolist())) > 1 and dev is not None and list(sizes).count(sizes[dev]) == 1:
                note = f"; it is the only shard of {int(sizes[dev])} rows"
            return broke("device_grads", dev, p, worst_g,
                         f"the gradient of {_devices_text(over, n, 'device')} differs in {p}{how} (gap {worst_g:.3g})"
                         f"{note}: that device's backward pass, or the loss it differentiates")
        agreed.append("per-device gradients agree")
    # clip per device (built-ins record each device's clipped gradient): before the combination
    clipped = [p for p in names if f"clipped/{p}" in da and f"clipped/{p}" in db] if same_n else []
    if clipped:
        worst_k, pk = max((_gap(da[f"clipped/{p}"], db[f"clipped/{p}"]), p) for p in clipped)
        gaps = [_gap(x, y) for x, y in zip(da[f"clipped/{pk}"], db[f"clipped/{pk}"], strict=True)]
        dev, over = _which(gaps, bound)
        chain.append({"stage": "clip", "device": dev, "name": pk, "gap": worst_k, "bound": bound})
        if over:
            return broke("clip", dev, pk, worst_k,
                         f"the clipped gradient of {_devices_text(over, n, 'device')} differs in {pk} (gap"
                         f" {worst_k:.3g}): per-device clipping (its threshold, norm or formula)")
    # combined_grads: recorded before any clipping after it, or (no clipping in the case) the one applied
    k = step - 1
    has_clip = spec is not None and spec["parallel"].get("clip") is not None
    applied = [p for p in sorted({q[len("grad/"):] for q in a if q.startswith("grad/")} & {q[len("grad/"):] for q in b if q.startswith("grad/")})
               if len(a[f"grad/{p}"]) > k and len(b[f"grad/{p}"]) > k]
    ga = _Lazy(applied, lambda p: np.asarray(a[f"grad/{p}"][k]))
    gb = _Lazy(applied, lambda p: np.asarray(b[f"grad/{p}"][k]))

    def combined(d: Mapping[str, np.ndarray], g: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray] | None:
        rec = _Lazy([q[len("combined/"):] for q in d if q.startswith("combined/")], lambda p: d[f"combined/{p}"])
        return rec or (g if g and (spec is not None and not has_clip) else None)

    ca, cb = combined(da, ga), combined(db, gb)
    by_rule = same_n and sizes is not None and bool(names)
    if ca and cb:
        common = sorted(set(ca) & set(cb))
        worst_c, pc = max((_gap(ca[p], cb[p]), p) for p in common)
        chain.append({"stage": "combined_grads", "device": None, "name": pc, "gap": worst_c, "bound": bound})
        if worst_c > bound and spec is not None and (spec["parallel"].get("clip") or {}).get("where") == "per_device" \
                and names and "sizes" in da and "sizes" in db:
            # different device counts: clipping each device's gradient is what differs when the unclipped
            # device gradients, combined by the case's weighting, agree
            unclipped = [_weighted(d, names, spec["parallel"]["weighting"]) for d in (da, db)]
            worst_u = max(_gap(unclipped[0][p], unclipped[1][p]) for p in names)
            if worst_u <= bound:
                chain.append({"stage": "clip", "device": None, "name": pc, "gap": worst_c, "bound": bound})
                return broke("clip", None, pc, worst_c,
                             f"the unclipped per-device gradients combine to the same gradient (gap {worst_u:.1g}), the"
                             f" combined gradient after clipping each device's differs in {pc} (gap {worst_c:.3g}):"
                             " per-device clipping")
        if worst_c > bound:
            why = _combination(da, db, ca, cb, names) if by_rule and set(names) <= set(common) else ""
            return broke("combined_grads", None, pc, worst_c,
                         f"the combined gradient differs in {pc} (gap {worst_c:.3g})"
                         + (why or ": the combination of the per-device gradients (weighting, sum vs mean)"))
        agreed.append("the combined gradient agrees")
    if applied and (not (ca and cb) or has_clip):
        worst_a, pa = max((_gap(ga[p], gb[p]), p) for p in applied)
        if worst_a > bound:
            if ca and cb:  # the combination agrees: what is applied after it is the clip
                chain.append({"stage": "clip", "device": None, "name": pa, "gap": worst_a, "bound": bound})
                acted = [_factor(c, g, applied, spec) for c, g in ((ca, ga), (cb, gb))]
                return broke("clip", None, pa, worst_a, f"the gradient applied differs in {pa} (gap {worst_a:.3g}):"
                                                        " clipping after the combination (its threshold, norm or formula)"
                                                        f"; the reference applied {acted[0]}; the other applied {acted[1]}")
            ra = _rule_of(da, ga, names, scaled=True) if by_rule and set(names) <= set(applied) else None
            rb = _rule_of(db, gb, names, scaled=True) if by_rule and set(names) <= set(applied) else None
            if (ra and rb and ra.split(" times ")[0] != rb.split(" times ")[0]) or not has_clip:
                chain.append({"stage": "combined_grads", "device": None, "name": pa, "gap": worst_a, "bound": bound})
                why = f": the reference's is {ra}, the other's {rb}" if ra and rb else \
                    ": the combination of the per-device gradients (weighting, sum vs mean)"
                return broke("combined_grads", None, pa, worst_a,
                             f"the gradient applied differs in {pa} (gap {worst_a:.3g}){why} of the device gradients")
            chain.append({"stage": "clip", "device": None, "name": pa, "gap": worst_a, "bound": bound})
            what = (f"; the reference applied {_clip_acted(da, ga, names, spec)}; the other applied"
                    f" {_clip_acted(db, gb, names, spec)}") if by_rule and set(names) <= set(applied) else ""
            return broke("clip", None, pa, worst_a, f"the gradient applied differs in {pa} (gap {worst_a:.3g}) while"
                                                    f" the per-device gradients agree: the clipping{what}")
        chain.append({"stage": "clip" if has_clip else "combined_grads", "device": None, "name": pa, "gap": worst_a,
                      "bound": bound})
        agreed.append("the gradient applied agrees")
    out = _result(step, None, None, None, 0.0, bound, f"step {step}: " + "; ".join(agreed))
    out["chain"] = chain
    return out
