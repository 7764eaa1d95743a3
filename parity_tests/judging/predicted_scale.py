"""A predicted difference that is a constant scale, held against the scale the runs show at step 1.

Theory's ``sum reduction`` difference (``theory.predict``): with ``reduction: sum``, ``N``
devices and ``equal`` weighting (or ``by_size`` on even shards), under ``grad_mean`` or
``loss_mean``, the parallel side's combined gradient is ``(1/N) sum_r g_r`` with ``g_r`` the sum
of its shard's per-row gradients, so::

    G_parallel = (1/N) sum_r sum_{i in shard r} grad l_i = G_single / N        (exactly, any shards)

where ``G_single`` is the one-device side's full-batch sum. At step 1 both sides start from the
same parameters, so theory does not only predict *that* the gradients differ: it predicts their
ratio, a constant ``1/N`` (``N`` where the parallel side is the reference). Where no residual
could be judged (``session.mapping.stand_in_leg``: "residual not judged: no equivalent run"),
that is still a check of the prediction, made on what both runs recorded: their step-1 gradients.
A gap the prediction explains has ``G_B = c G_A`` there; one that it does not (a shard's loss
averaged where the case sums it: ``(1/N) sum_r g_r / n_r``, no constant at all on uneven shards,
``1/B`` on even ones) does not, and the predicted difference then hides a bug: a divergence, with
the predicted and the measured factor (``factor.constant_ratio``) in its line.

**A clip after the combine** (``parallel.clip.where: after_combine``, the same clip rule on both
sides) scales each side's combined gradient by a positive factor of its own norm, and the gradient
recorded is the one applied (docs/plugins.md, ``grads=``: the clipped one; every built-in records so).
With ``h(n) = n f(n)`` the norm after the clip (``f(n) = c / max(n, c)``, TensorFlow's rule, or
``min(c / (n + 1e-6), 1)``, torch's) and ``x = ||G_single||`` before it::

    G_parallel = f(x / N) G_single_unclipped / N,    G_single = f(x) G_single_unclipped

so the recorded gradients are still in a constant ratio ``k`` (the same direction), and ``k`` is
bounded: ``h`` is nondecreasing and ``f`` nonincreasing, so ``h(x) / N <= h(x / N) <= h(x)``:
``1/N <= k <= 1`` (the parallel side's over the single side's). Where the single side's recorded
norm is below ``c - 1e-6`` (less its float64 rounding) neither rule clipped it (a clipped norm is
``c`` under TensorFlow's rule, above ``c - 1e-6`` under torch's), nor, with ``x / N < x``, the
parallel side: ``k`` is exactly ``1/N``, the check without a clip; read only where both sides
recorded every parameter's gradient (the norm is the global one). A gradient with another
direction (every rank reading rank 0's rows: the hunt's ``same_shard``, pair 1096 of seed 1) or a
ratio out of these bounds is a difference the prediction does not explain.

Only where the identity above holds exactly: no clip per device, no accumulation, no layer whose output for a row depends on other rows (batch norm) or on
the device layout (dropout), and no other predicted difference that acts at or before the
combined gradient (``Difference.first_visible``: padding rows, local batch statistics, Keras'
distribution loss scale). Read from the float64 runs (a float32-only side, or a float64 run whose
loss is float32, ``precision_leak``, is not checked), so a ``mixed_bfloat16`` pair's bfloat16
differences (``theory.mixed_precision_differences``, Keras' bias gradient summed in bfloat16) do
not act there: they are bfloat16 roundings, and no op of a float64 run rounds to bfloat16.

**Tolerance.** ``factor.RTOL`` (1e-6) of the larger side's greatest gradient element, over all
parameters at once: two float64 evaluations of one gradient agree to about ``B u`` (``u = 1.1e-16``,
``B`` rows summed) times the size of the terms summed; for 1e-6 of the gradient's *largest*
element that needs every element of the whole gradient to cancel its terms by ``1e7 / B``, which
a gradient at random initial parameters does not do (an exact stationary point at step 1 would).
The bugs this finds leave a residual of the gradient's own size (0.6 on the hunt's pair 1109).

Other constant-scale predictions: Keras' distribution loss scale is mapped exactly on the
program itself (``session.loss_scale``), so its residual is judged; the class- and sample-weight
normalisations (Keras divides by the rows, torch by the weights' sum) are a constant per batch on
one device but not over devices, and are not checked here.
"""

from __future__ import annotations

from collections.abc import Mapping
from fractions import Fraction
from typing import Any

import numpy as np

from parity_tests.contract.model import nested_layers
from parity_tests.judging.factor import RTOL, constant_ratio
from parity_tests.judging.localise import STAGES
from parity_tests.judging.theory import Prediction, mixed_precision_differences, uneven_shards
from parity_tests.protocol.engine import EngineSpec

__all__ = ["SUM_REDUCTION", "TORCH_CLIP_EPS", "predicted_scale", "clip_of", "check_scale"]

#: the words that name theory's sum-reduction difference (``theory.predict``)
SUM_REDUCTION = "sum reduction"
#: layers whose output for a row depends on other rows or on the device layout: the identity does not hold
_NOT_PER_ROW = ("batch_norm", "dropout")
#: the words of theory's Keras bias gradient summed in bfloat16 (``theory.bias_add_differences``)
_BF16_BIAS = "bias gradient summed in bfloat16"


def _bfloat16_only(spec: Mapping[str, Any], a: EngineSpec, b: EngineSpec) -> set[str]:
    """Theory's differences of a ``mixed_bfloat16`` pair that are bfloat16 roundings (``mixed_precision_differences``)."""
    if spec["dtype"] != "mixed_bfloat16":
        return set()
    expected, known = mixed_precision_differences(dict(spec), a, b)
    return {*expected, *known}


def predicted_scale(spec: Mapping[str, Any], pred: Prediction, a: EngineSpec, b: EngineSpec) -> tuple[Fraction, str] | None:
    """``(c, why)``: the constant theory predicts for ``B``'s step-1 gradient against ``A``'s (reference first), or ``None``.

    ``c = 1/N`` where ``b`` is the parallel side, ``N`` where ``a`` is; only where the module's
    identity holds exactly and the sum-reduction difference is the pair's only expected
    difference that acts at or before the combined gradient.
    """
    par = spec["parallel"]
    n = int(par["devices"])
    if n < 2 or a.parallel == b.parallel or spec["model"]["reduction"] != "sum":
        return None
    clip = par.get("clip")
    if (clip is not None and clip.get("where") != "after_combine") or int(par.get("accumulate", 1) or 1) > 1:
        return None
    if par.get("combine") not in ("grad_mean", "loss_mean"):
        return None
    if par.get("weighting") not in ("equal", "by_size") or (par["weighting"] == "by_size" and uneven_shards(dict(spec))):
        return None
    if any(layer["type"] in _NOT_PER_ROW for _, layer in nested_layers(spec["model"]["layers"])):
        return None
    sums = [d for d in pred.differences if d.text.startswith(SUM_REDUCTION)]
    if len(sums) != 1 or not sums[0].expected:
        return None
    # with a clip after the combine, nothing else may act on the gradient up to the clip (the two sides' clip rules
    # the same: torch's 1e-6 against TensorFlow's c / max(n, c) is theory's clip-rule difference, at the clip)
    before = STAGES.index("clip" if clip is not None else "combined_grads")
    inert = _bfloat16_only(spec, a, b)
    if any(d is not sums[0] and d.text not in inert and not d.text.startswith(_BF16_BIAS)
           and STAGES.index(d.first_visible) <= before for d in pred.differences):
        return None
    c = Fraction(1, n) if b.parallel else Fraction(n)
    side = b.name if b.parallel else a.name
    clipped = (f", before the clip after the combine (after it: the same direction, {side}'s norm 1/{n} to 1 times"
               " the other's)") if clip is not None else ""
    return c, f"{side}'s combined gradient at step 1 is the full-batch sum / {n}{clipped}"


def clip_of(spec: Mapping[str, Any]) -> float | None:
    """The global-norm threshold of a clip after the combine (:func:`check_scale`'s ``clip``), or ``None``."""
    clip = spec["parallel"].get("clip")
    return float(clip["global_norm"]) if clip is not None and clip.get("where") == "after_combine" else None


#: torch's ``clip_grad_norm_`` adds this to the norm: a norm it clipped is above ``c - TORCH_CLIP_EPS``
TORCH_CLIP_EPS = 1e-6


def _ratio_text(c: Fraction) -> str:
    return str(c.numerator) if c.denominator == 1 else f"{c.numerator}/{c.denominator}"


def check_scale(a64: Mapping[str, Any], b64: Mapping[str, Any], c: Fraction, *, rtol: float = RTOL,
                clip: float | None = None) -> dict[str, Any] | None:
    """Whether ``b64``'s step-1 gradient is ``c`` times ``a64``'s; ``None`` where it is, or where it cannot be read.

    Args:
        a64, b64: the two sides' float64 runs (``grad/* [steps, ...]``; reference first).
        c: the predicted constant (:func:`predicted_scale`).
        clip: the threshold of a clip after the combine (:func:`clip_of`): the ratio is then a constant between
            ``c`` and 1, exactly ``c`` where the single side's norm shows that nothing was clipped (module docstring).
    Returns:
        ``None`` when ``||G_B - c G_A||_inf <= rtol max(||G_B||_inf, |c| ||G_A||_inf)`` over every parameter
        both recorded (the module's tolerance), or when no gradient is recorded on both sides, or one is not
        finite or all zero; else ``{"predicted", "measured" (the constant ratio, or ``None`` where the ratio is
        not one constant), "residual" (relative), "text"}``.
    """
    names = sorted(k for k in a64 if isinstance(k, str) and k.startswith("grad/") and k in b64)
    if not names or any(len(a64[k]) < 1 or len(b64[k]) < 1 for k in names):
        return None
    ga = np.concatenate([np.asarray(a64[k][0], np.float64).ravel() for k in names])
    gb = np.concatenate([np.asarray(b64[k][0], np.float64).ravel() for k in names])
    if ga.shape != gb.shape or not (np.all(np.isfinite(ga)) and np.all(np.isfinite(gb))):
        return None
    if clip is not None and not _unclipped(a64, b64, names, ga, gb, c, clip):
        return _check_clipped(ga, gb, c, rtol)
    scale = max(float(np.abs(gb).max(initial=0.0)), abs(float(c)) * float(np.abs(ga).max(initial=0.0)))
    if scale == 0.0:
        return None
    residual = float(np.abs(gb - float(c) * ga).max()) / scale
    if residual <= rtol:
        return None
    measured = constant_ratio(ga, gb, rtol=rtol)
    said = "x" + (str(c.numerator) if c.denominator == 1 else f"{c.numerator}/{c.denominator}")
    got = (f"{measured:.4g}x (a constant, not {said})" if measured is not None else
           "not a constant multiple of it (the ratio varies across the gradient's elements)")
    return {"predicted": float(c), "predicted_exact": said[1:], "measured": measured, "residual": residual,
            "text": f"predicted {float(c):.4g}x ({said[1:]}) the reference's step-1 gradient, measured {got}:"
                    f" |G_B - c G_A| / |G| = {residual:.3g} > {rtol:g}"}


def _unclipped(a64: Mapping[str, Any], b64: Mapping[str, Any], names: list[str], ga: np.ndarray, gb: np.ndarray,
               c: Fraction, clip: float) -> bool:
    """Whether the single side's recorded step-1 norm shows that the clip acted on neither side (module docstring).

    Its norm is the global one only where both sides recorded every parameter's gradient; below
    ``clip - 1e-6`` (less 1e-12 relative for the float64 norm's rounding) neither rule clipped it.
    """
    params = {k[len("param/"):] for run in (a64, b64) for k in run if isinstance(k, str) and k.startswith("param/")}
    if {k[len("grad/"):] for k in names} != params:
        return False
    single = gb if c > 1 else ga  # c = N: the reference is the parallel side
    return float(np.linalg.norm(single)) < (clip - TORCH_CLIP_EPS) * (1.0 - 1e-12)


def _check_clipped(ga: np.ndarray, gb: np.ndarray, c: Fraction, rtol: float) -> dict[str, Any] | None:
    """A clip after the combine may have acted: ``G_B = k G_A`` with ``k`` between ``c`` and 1 (module docstring)."""
    lo, hi = min(float(c), 1.0), max(float(c), 1.0)
    measured = constant_ratio(ga, gb, rtol=rtol)
    if measured is not None and lo * (1.0 - rtol) <= measured <= hi * (1.0 + rtol):
        return None
    aa = float(ga @ ga)
    k = float(ga @ gb) / aa if aa else 0.0  # the least-squares ratio, for the residual of the direction
    scale = max(float(np.abs(gb).max(initial=0.0)), abs(k) * float(np.abs(ga).max(initial=0.0)))
    if scale == 0.0:
        return None
    residual = float(np.abs(gb - k * ga).max()) / scale
    said = _ratio_text(c)
    got = (f"{measured:.4g}x (a constant outside {_ratio_text(Fraction(lo).limit_denominator(64))} .."
           f" {_ratio_text(Fraction(hi).limit_denominator(64))})" if measured is not None else
           "not a constant multiple of it (another direction: the ratio varies across the gradient's elements)")
    return {"predicted": float(c), "predicted_exact": said, "measured": measured, "residual": residual,
            "text": f"predicted a constant multiple of the reference's step-1 gradient between {float(c):.4g}x ({said},"
                    f" neither side clipped) and 1x (the clip after the combine acting on both), measured {got}:"
                    f" |G_B - k G_A| / |G| = {residual:.3g}" + (f" > {rtol:g}" if measured is None else "")}
