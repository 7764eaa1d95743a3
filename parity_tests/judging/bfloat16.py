"""The bfloat16 rule: a mixed-precision pair is held against its float64 runs (``"bfloat16 against float64"``).

A ``mixed_bfloat16`` run keeps float32 master weights and computes its layers in bfloat16;
the float64 run of the same case (:func:`float64_reference`) is its ground truth. A pair is
at parity when

1. the two float64 runs agree (the float64 rule, :func:`rules.judge_float64`: a
   semantic difference shows there, on any CPU), and
2. each side is as far from its float64 run as its bfloat16 arithmetic explains, beyond the
   error both sides share (``R_X``, "Shared error" below)::

       D_X        = X - X64                      (the run's error; X'_r - X'64_r for rerun r)
       e_X[k]     = max_{j <= k} gap_j(X, X64)   (its distance from float64)
       S[k]       = max_{j <= k} max_{Y in {A, B}, r <= R} gap_j(D_Y, D'_{Y,r})   (the sampled spread)
       T_X[k]     = max_{j <= k} gap_j(X64 - X64[0], X64r - X64r[0])            (the storage term)
       G_X[k]     = max_{j <= k} gap_j(X64 - X64[0], X64g - X64g[0])            (the gradient term)
       E_X[k]     = F * rho_X * S[k] + 2 * T_X[k] + 2 * G_X[k] + FLOAT32_ABS_FLOOR   (what its arithmetic explains)

   with every gap measured against the float64 runs' norms (``gaps._scales``), and
   ``gap_k(R_X, 0) <= E_X[k]`` at every step for the parameters and batch-norm state.

Then, as ``|A - B| <= |D_A - D_B| + |A64 - B64| = R_A + R_B + |A64 - B64|`` elementwise,
``gap(A, B) <= gap(R_A, 0) + gap(R_B, 0) + gap(A64, B64) <= E_A + E_B + gap64``:
the pair's gap is reported against that bound, which it cannot exceed once both sides pass.
A side that fails is named: the verdict says *which* side is farther from float64 than
bfloat16 explains, where (array, step) and by how much. The loss, where it is judged, is
judged for the pair: its gap against ``F * max(rho_A, rho_B) * S_L + S[k] * pgap[k-1]`` with ``S_L`` the loss's
spread (a loss averaged over a large batch keeps the common bfloat16 rounding of the weights, which no
rerun re-samples, and which the same recipe on both sides shares) and the second term the
parameters' gap between the sides carried into the loss (``loss_channel._carried``: the loss of
step ``k`` is computed from the parameters of row ``k - 1``, whose gap ``pgap`` the parameter
channel judged, and ``S`` is the loss's condition number from the recorded gradients; the
sampled spread holds each side's own carried rounding, not the other side's parameters: at
lr 10 the hunt's pair 464 logged step-2 losses 1.2e-3 apart, where the parameters' gap of
3.7e-3 carries up to 1.2e-2). Between a TensorFlow side and a torch side, whose recipes round
different values in the forward pass (theory's ``"mixed precision, ..."`` known differences: a
Keras dense layer with a bias rounds twice, torch's once; :func:`_recipes_differ`), a step at which one side's reruns all log its
mixed loss bit for bit while their float64 losses move is not judged (:func:`_repeated_loss`;
the verdict's ``unjudged`` names it): the move was absorbed by bfloat16 roundings coarser than
it (the hunt's pairs 464 and 465: sigmoid outputs near 0.5, whose bfloat16 step 2^-9 the move's
1e-5 does not cross), so the roundings that part the two sides' losses there were never sampled
and ``S_L`` bounds nothing (step-1 losses 1.4e-5 apart against a spread of 1.5e-7). It is the
reason ``theory.reported_loss_differs`` reports rather than judges the mixed loss of a pair whose last
dense layer has a bias, at the steps where the runs show it. The parameters, and the loss at
every sampled step, are still judged; a pair of one recipe rounds the same values alike, and
its loss stays judged at every step (a logged-loss bug there is still caught). The float64 runs'
loss is judged in every pair, ``loss=False`` or not (``FLOAT64_RTOL + S x pgap``, docs/tolerance.md): those
runs compute no bfloat16, so neither reason above is theirs, and a bug in the logged loss alone (a tower's
loss logged for the towers' mean) parts them at step 1 by its full size (measured on 117 mixed
TensorFlow-vs-torch cases of two hunts, ``benchmarks/bench_mixed_loss64.py``: correct sides at most 3.2e-16
apart at step 1, 1.4e-14 at any step).

**The sampled spread** ``S``. Each side is re-run ``R = BF16_RERUNS = 2`` times with its
inputs ``x`` moved by one bfloat16 ulp and its initial weights and hyperparameters by one
float32 ulp, each rerun with its own seeded coins (``session.variants.perturbed_case``, seeds ``s`` and
``s + 2**32``), and each rerun's moved case is also run in float64. Both sides round ``x``
to bfloat16 at the first layer, so a rerun moves the first bfloat16 operand by one bfloat16
rounding and every later bfloat16 rounding (activations, products, gradients) falls afresh:
``D'`` is another sample of the run's rounding error, and ``gap(D, D')`` is what rounding
alone does, without the move's own effect on the exact trajectory (on the CNN at 2 devices a
rerun parts from its run by 0.26-0.64 while each run is 0.04-0.08 from its float64 run: most
of a rerun's gap is the move's own effect on the exact trajectory). The spread
is the largest of the pair's ``2 R`` samples, with the running maximum over steps (rounding
errors are carried forward by the parameters). A bug that reproduces in its side's reruns
leaves ``D ~ D'``, so it does not enter the spread but does enter ``e``.

**The storage term** ``T``: the layers read the inputs and the float32 weights rounded to
bfloat16, and a rerun that moves the weights by a float32 ulp rounds them the same way, so
the spread cannot sample that rounding (moving them by a bfloat16 fraction would, but would
also re-randomise a seeded bug's error and hide it in its own side's spread). It is measured
instead, without a single bfloat16 op: ``X64r`` is the float64 run from the inputs and initial
weights rounded to bfloat16 (:func:`rounded_reference`), and ``T`` is how far that moves the
*updates* (each array less its initial value: the mixed run keeps its float32 masters, only
what the layers read is rounded). A bug cannot raise it (no bfloat16 op runs), and both sides
of a pair round the same values the same way. It counts twice (``BF16_STORAGE_FACTOR = 2``):
as training moves the weights, what the layers read is rounded afresh, another sample of a
rounding of the same size that no rerun re-samples, and two such samples can add (the
triangle inequality's 2, as for ``F``). Without ``T`` a 3-layer sigmoid/tanh MLP on binary
inputs was 6.5 times its spread from float64 on correct runs of both frameworks.

**The gradient term** ``G``: the backward of a mixed recipe rounds two values that no rerun re-samples
either (docs/error-rates.md, "the bfloat16 rule's pairs 432 and 896"): the loss's gradient at the bfloat16
output, ``s_r dl_r/dout`` at the scale ``s_r`` the device differentiates its loss (the float32 loss's cast back to
bfloat16), and each device's gradient of every parameter (a bfloat16 result, cast to float32 before the float32
combine over the devices). At step 1, with logits near 0, one bfloat16 ulp of every input moves ``g`` by 1/60 to
1/250 of its bfloat16 step: the run and its reruns round it alike, and what depends on the inputs only through it
(the last bias's gradient; one row's product ``x_r g_r`` per device) is not re-sampled either; two sides share that
rounding only when they round the same value up to a power of 2, which ``torch.ddp`` (``N w_r`` times its loss)
and ``torch.single`` (``1/B`` of the sum) do not. It is measured as ``T`` is, without a single bfloat16 op:
``X64g`` is the side's float64 run with an identity at each of those places whose backward rounds the gradient
to bfloat16 (``protocol.grad_rounding``; the built-ins that run ``mixed_bfloat16``, on a model of dense layers),
and ``G`` is how far that moves the updates. A value the mixed run rounds there sits within a fraction of a
bfloat16 step of the float64 run's (the reason no rerun re-samples it), so that run makes nearly the same
roundings; where the mixed run's value has moved by more, its rounding falls afresh, another sample of a rounding
of the same size: it counts twice (``BF16_GRADIENT_FACTOR = 2``, ``T``'s argument). A bug cannot raise it beyond
the size of those roundings: the run computes no bfloat16 op, a semantic bug is in both of its float64 runs alike
(its ``G`` is the rounding of the values the buggy program computes; the float64 rule judges the bug itself), and a
bfloat16-only bug is in neither. A side without that run (a plugin, another model) has ``G = 0``: the rule as it
was. Measured on the 10,000-pair run's false alarms (docs/error-rates.md, "third
session"): the named side's error repeated 97-100 % by both reruns.

**Shared error.** The side check holds each side's error *beyond the error both sides share*
against ``E_X``: elementwise ``m = min(|D_A|, |D_B|)`` where ``D_A`` and ``D_B`` have the same sign
(else ``0``), and ``R_X = |D_X| - m`` (:func:`_beyond_shared`). Why: the reruns sample only the
roundings that their move reaches. A rounding of a value the move barely shifts is made alike
in the run and in every rerun, so no ``gap(D, D')`` holds it: an mse residual ``w x - y``
dominated by the targets (which no rerun moves) rounded to bfloat16 for the backward matmul,
a sigmoid output near 0.5 whose input moves by 1e-5 against a bfloat16 step of 2^-9 there.
The error-rate hunt found such pairs at every edge it drew (pairs 419, 490, 585 of
docs/error-rates.md: momentum 1, Adam with ``beta1 = beta2 = 0``, one device at lr 0.001):
each side 2.1-2.9 times its ``E`` from float64 while the two sides agreed bit for bit or to
2.4e-5 (a torch side and a TensorFlow side, whose codes share nothing). Both recipes make that
rounding alike, so it is no difference between them. What the check loses is small and
bounded: ``R_X <= |D_A - D_B|`` elementwise (same sign: ``|D_A| - |D_B|``; opposite signs:
``m = 0``), so a one-sided error ``delta`` (a seeded bfloat16-only bug: the other side's
error is its own rounding ``r``) still fires once ``|delta| > E_X + |r|``, where the pair
check needs ``E_A + E_B + gap64``; and ``|D_A - D_B| = R_A + R_B`` keeps the pair's bound
``E_A + E_B + gap64`` a bound. The parity detail names the shared error's size. Two sides
that share one bug share its error, and they do compute the same updates: the float64 rule
still judges every semantic bug, and the signature check a side that computes in float32.

**R = 2** and both sides: one rerun is one sample, and a sample can be small: on the seed MLP
(binary inputs: a move reaches only the ones) single samples at step 1 ran from 6e-5 to 6e-4;
the issue's Intel AMX CPU judged a pair with one rerun per side against a floor of 3e-5.
Two reruns a side (four samples a pair: the two sides run the same op list up to the known
differences) make 8 runs a side in all: the case, 2 reruns, 4 float64 runs (the case's, the
reruns', the rounded one) and the one-step float32 run of the signature.

**The safety factor** ``F = BF16_FACTOR = 3``: ``benchmarks/bench_bfloat16_bound.py`` runs the
matrix's mixed rows (seed MLP and CNN) and 27 dense cases nobody tuned (ReLU, tanh/softmax and
sigmoid/tanh models; SGD, momentum, Adam; 1, 2 and 4 devices; 8 steps) and prints, per pair
and side, the largest ``(e_X - 2 T_X) / (rho_X S)`` over the steps: the factor a correct side
needs. Measured 2026-11-26 on this AMD EPYC (AVX512_BF16, no AMX): 0.86 with oneDNN (every
kernel rounds once, ``rho = 1``), 2.3 with TensorFlow's Eigen kernels (``TF_ENABLE_ONEDNN_OPTS=0``,
what a CPU without AVX512F runs; the sigmoid/tanh MLP at 4 devices, whose Eigen matmuls drift
step by step beyond what ``rho`` 1.79 covers). 3 leaves 1.3 over the worst; the seeded bugs of
``tests/test_mixed_precision.py`` exceed their bounds 21-fold here, 13-fold with Eigen.

**What the kernels do where they run** ``rho_X`` (:func:`parity_tests.running.kernels.side_factor`):
the sampled spread explains errors of one bfloat16 rounding per op result. A kernel that
rounds its partial sums to bfloat16 leaves a systematic error that a rerun repeats and so
does not sample, up to ``rho`` roundings' worth (the probe's measure). ``rho_X`` is the
largest ``rho`` of the kernels side ``X``'s recipe runs, measured at start-up on this CPU
(at least 1); the verdict's detail names the kernels that raised it. On this CPU with
oneDNN every kernel of both recipes rounds once (``rho_X = 1``); with Eigen TensorFlow's
matmuls give 1.8 and its conv filter gradient 2.1; torch's kernels round once either way.

**The bfloat16 signature** (:func:`signature_bound`, rule ``"bfloat16 computation"``, applied
by ``session.judge_pair._bf16_guard``): a side that does not compute in bfloat16 is *closer* to float64
than the rule asks, so this rule cannot see it; its one-step float32 run can. The side's
mixed run must part from its float32 run at step 1 (the loss and every combined gradient,
``perturbation.bfloat16_signature``) by more than ``BF16_SIGNATURE_FACTOR = 16`` times that
float32 run's own distance from the float64 run at step 1, ``g32`` (plus ``4 * 2**-24`` for
``g32 = 0``). A run that computes in float32 is another float32 computation of the step:
within ``2 g32`` of it by the triangle inequality through float64 (and in practice
bit-identical: the same code); a bfloat16 computation rounds every operand 2**16 times
coarser. Measured (2026-11-26, this CPU): ratio gap / g32 from 7e3 to 6e4 on the matrix rows,
132 to 1.4e3 on the error-rate hunt's smallest drawn models (a 1-input linear model, whose
step-1 loss holds the only rounding that shows), where the fixed threshold ``2**-12`` that
this replaces fired on correct runs (gaps 5e-7 to 2.3e-4). 16 is 8 times the float32
envelope and 8 times below the smallest bfloat16 ratio seen.

Without a float64 run of a side (an implementation that declares no float64), the pair is
judged by the perturbation rule alone (``perturbation.judge_perturbation`` with the first rerun).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from parity_tests.judging.bounds import FLOAT32_ABS_FLOOR
from parity_tests.judging.compare import describe_key, describe_step, step_of_row
from parity_tests.judging.gaps import _gaps, _judged_keys, _row_max, _scales
from parity_tests.judging.guards import _check_dtype, _structure
from parity_tests.judging.loss_channel import (
    LOSS_KEY,
    _carried,
    _judges_loss,
    _loss_channel_floor,
    _loss_gap,
    _loss_scale,
    _with_loss,
)
from parity_tests.judging.perturbation import (
    BF16_SIGNATURE,
    _spread,
    bfloat16_signature,
    round_bfloat16,
)
from parity_tests.judging.rules.float64_bound import judge_float64
from parity_tests.judging.verdict import Verdict, _finished, _known

__all__ = ["RULE_BF16_FLOAT64", "BF16_RERUNS", "BF16_FACTOR", "BF16_STORAGE_FACTOR", "BF16_GRADIENT_FACTOR",
           "BF16_SIGNATURE_FACTOR", "Side", "judge_bfloat16",
           "float64_reference", "rounded_reference", "signature_bound"]

#: the rule's name in verdicts (module docstring)
RULE_BF16_FLOAT64 = "bfloat16 against float64"
#: perturbed reruns per side (module docstring, "Why R = 2")
BF16_RERUNS = 2
#: the safety factor on the sampled spread (module docstring, "The safety factor")
BF16_FACTOR = 3.0
#: the storage term's factor (module docstring, "The storage term")
BF16_STORAGE_FACTOR = 2.0
#: the gradient term's factor (module docstring, "The gradient term")
BF16_GRADIENT_FACTOR = 2.0
#: the bfloat16 signature: a mixed run's step-1 gap to its float32 run over that run's gap to float64 (docstring)
BF16_SIGNATURE_FACTOR = 16.0
# rerun r's perturbation coins are seeded by case seed + r * 2**32 (no other case seed can reach them)
RERUN_SEED_STRIDE = 2**32


@dataclass(frozen=True)
class Side:
    """One side of a mixed pair: its runs and what its kernels do here.

    ``run``: the ``mixed_bfloat16`` trajectory; ``float64``: the same case in float64
    (:func:`float64_reference`); ``reruns``: the perturbed mixed reruns and ``reruns64`` the
    float64 runs of the same perturbed cases (module docstring); ``rho``:
    ``kernels.side_factor``'s ``rho_X`` (>= 1); ``kernels``: the line saying why;
    ``rounded64``: the float64 run from the inputs and initial weights rounded to bfloat16
    (:func:`rounded_reference`), or ``None`` (no storage term); ``grads64``: the float64 run rounding the
    gradients to bfloat16 where the mixed recipe does (``protocol.grad_rounding``), or ``None`` (no gradient term).
    """

    name: str
    run: Mapping[str, Any]
    float64: Mapping[str, Any]
    reruns: Sequence[Mapping[str, Any]]
    reruns64: Sequence[Mapping[str, Any]]
    rho: float = 1.0
    kernels: str = ""
    rounded64: Mapping[str, Any] | None = None
    grads64: Mapping[str, Any] | None = None


def float64_reference(case: Any) -> Any:
    """The float64 run a mixed case is held against: ``dtype`` float64 and every real optimizer
    hyperparameter rounded to float32 (the mixed runs keep them in float32, both sides; Keras
    would round ``lr`` and ``momentum`` in its float64 run anyway, ``theory.keras_rounds_hyperparameters``),
    GELUs and attention scales with exact constants (``semantics: torch``) on both sides."""
    opt = case.spec["optimizer"]
    changes = {f"optimizer.{k}": float(np.float32(v)) for k, v in opt.items()
               if k not in ("name", "semantics", "schedule") and isinstance(v, float)}
    schedule = opt.get("schedule") or {}
    if schedule.get("kind") == "step":
        changes["optimizer.schedule"] = {**schedule, "values": [float(np.float32(v)) for v in schedule["values"]]}
    # GELU constants and the attention scale in float64: TensorFlow rounds them through float32, torch does not,
    # a float64-only difference (about 1e-9 relative, far below bfloat16's 2^-8) that the mixed runs do not have
    # (theory: "not at these values"). Both sides' references take torch's exact constants, one function.
    from parity_tests.judging.attention_theory import native_attention_scales
    from parity_tests.judging.theory import native_gelus

    layers = case.spec["model"]["layers"]
    paths = [*native_gelus(layers), *(path for path, _ in native_attention_scales(case.spec))]
    changes.update({f"model.layers.{path}.semantics": "torch" for path in paths})
    return case.replace(dtype="float64", **changes)


def rounded_reference(case: Any) -> Any:
    """:func:`float64_reference` from the inputs ``x`` and the initial weights rounded to bfloat16: the values
    the layers' casts see at step 1. Its gap to the float64 run is what that rounding alone does (the
    storage term ``T`` of the module docstring), measured without a single bfloat16 op."""
    ref = float64_reference(case)
    x = ref.x if np.asarray(ref.x).dtype.kind != "f" else round_bfloat16(ref.x).astype(np.float64)  # token ids stay
    return dataclasses.replace(ref, x=x,
                               init={k: round_bfloat16(v).astype(np.float64) for k, v in ref.init.items()})


def signature_bound(f32: Mapping[str, Any], f64: Mapping[str, Any] | None) -> tuple[float, str]:
    """``(bound, why)``: how far a mixed run must be from its float32 run at step 1 to compute in bfloat16.

    ``BF16_SIGNATURE_FACTOR * g32 + FLOAT32_ABS_FLOOR`` with ``g32`` the float32 run's step-1 gap
    to the float64 run (``perturbation.bfloat16_signature``; module docstring); without a float64
    run, ``perturbation.BF16_SIGNATURE``.
    """
    if f64 is None:
        return BF16_SIGNATURE, "bfloat16 rounds every operand by up to 2^-8 (no float64 run to measure float32's own rounding)"
    g32, key = bfloat16_signature(f32, f64)
    bound = BF16_SIGNATURE_FACTOR * g32 + FLOAT32_ABS_FLOOR
    return bound, (f"{BF16_SIGNATURE_FACTOR:g} x its float32 run's own step-1 gap to float64 ({g32:.2e} at {key})"
                   f" + {FLOAT32_ABS_FLOOR:.2e}: a bfloat16 computation rounds 2^16 times coarser")


def _errors(run: Mapping[str, Any], run64: Mapping[str, Any], keys: list[str]) -> dict[str, np.ndarray]:
    """``X - X64`` per judged array and the loss (float64): the run's own rounding error."""
    out = {k: np.asarray(run[k], np.float64) - np.asarray(run64[k], np.float64) for k in keys}
    if LOSS_KEY in run and LOSS_KEY in run64:
        out[LOSS_KEY] = np.asarray(run[LOSS_KEY], np.float64) - np.asarray(run64[LOSS_KEY], np.float64)
    return out


def _moved(traj: Mapping[str, Any], keys: list[str]) -> dict[str, np.ndarray]:
    """Every judged array less its initial value (row 0): what the updates moved it by (float64)."""
    out = {}
    for k in keys:
        a = np.asarray(traj[k], np.float64)
        out[k] = a - a[:1]
    return out


def _storage(side: Side, keys: list[str], scales: dict[str, np.ndarray], like: np.ndarray) -> np.ndarray:
    """The storage term ``T``: how far the bfloat16 rounding of the inputs and weights the layers read moves the
    updates (float64, from :func:`rounded_reference`; zeros without it). The arrays' own rounding at row 0 is
    taken off: a mixed run keeps float32 masters and rounds only what its layers read."""
    if side.rounded64 is None:
        return np.zeros_like(like)
    return _spread(_row_max(_gaps(_moved(side.float64, keys), _moved(side.rounded64, keys), keys, scales))[0])


def _gradient_term(side: Side, keys: list[str], scales: dict[str, np.ndarray], like: np.ndarray) -> np.ndarray:
    """The gradient term ``G``: how far rounding the loss's gradient at the output and each device's gradients to
    bfloat16 moves the updates (float64, from ``side.grads64``; zeros without it; module docstring)."""
    if side.grads64 is None:
        return np.zeros_like(like)
    g = _row_max(_gaps(_moved(side.float64, keys), _moved(side.grads64, keys), keys, scales))[0]
    # a gradient-rounding run that overflows (or turns NaN) where the float64 run does not measures no rounding's
    # size: those rows and every later one count no gradient term (the rule as before), never an infinite bound
    finite = np.logical_and.accumulate(np.isfinite(g))
    return _spread(np.where(finite, g, 0.0))


def _zeros(arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: np.zeros_like(v) for k, v in arrays.items()}


def _beyond_shared(da: Mapping[str, np.ndarray], db: Mapping[str, np.ndarray], keys: list[str]
                   ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Each side's error beyond the error both sides share, and the shared error (module docstring, "Shared error").

    Elementwise, ``m = min(|D_A|, |D_B|)`` where ``D_A`` and ``D_B`` have the same sign (else 0), and
    ``R_X = |D_X| - m``. Returns ``(R_A, R_B, m)``, each keyed like ``keys``.
    """
    own_a, own_b, shared = {}, {}, {}
    for k in keys:
        x, y = np.asarray(da[k], np.float64), np.asarray(db[k], np.float64)
        with np.errstate(invalid="ignore"):
            m = np.where(np.sign(x) == np.sign(y), np.minimum(np.abs(x), np.abs(y)), 0.0)
        own_a[k], own_b[k], shared[k] = np.abs(x) - m, np.abs(y) - m, m
    return own_a, own_b, shared


def _side_verdict(side: Side, e: np.ndarray, arg: np.ndarray, bound: np.ndarray, keys: list[str],
                  spread: np.ndarray, factor: float, storage: np.ndarray, *,
                  distance: np.ndarray | None = None, common: np.ndarray | None = None,
                  gradient: np.ndarray | None = None) -> Verdict | None:
    """A divergence naming ``side`` when its error beyond the shared error ``e`` exceeds ``bound`` at some row.

    ``distance``: its whole distance from float64 (``e`` when not given); ``common``: the shared error
    (module docstring, "Shared error"), named in the detail where it is not 0."""
    distance = e if distance is None else distance
    with np.errstate(invalid="ignore", divide="ignore"):
        over = np.flatnonzero(e > bound)
        ratio = np.where(np.isnan(e), -1.0, e / bound)
    if not over.size:
        return None
    first, worst = int(over[0]), int(np.argmax(ratio))
    key = keys[int(arg[first])]

    def step(r: int) -> int:
        return step_of_row(keys[0], r)

    shared = "" if common is None or not common[first] > 0 else (
        f" {distance[first]:.2e}, of which beyond the error the other side shares (up to {common[first]:.2e})")
    detail = (
        f"{side.name} is farther from its float64 run than its bfloat16 arithmetic explains: distance"
        f"{shared} {e[first]:.2e} > {bound[first]:.2e} = {factor:g} x rho {side.rho:.3g} x spread {spread[first]:.2e}"
        f" + {BF16_STORAGE_FACTOR:g} x storage {storage[first]:.2e}"
        + ("" if gradient is None else f" + {BF16_GRADIENT_FACTOR:g} x gradients {gradient[first]:.2e}")
        + f" + {FLOAT32_ABS_FLOOR:.2e} first at {describe_step(key, step(first))} ({describe_key(key)});"
        f" greatest distance/bound {e[worst]:.2e} / {bound[worst]:.2e} at step {step(worst)}"
        f" (spread: the largest gap between a side's error and the error of one of its {BF16_RERUNS} reruns;"
        f" {side.kernels})"
    )
    return Verdict("divergence", RULE_BF16_FLOAT64, float(e[worst]), float(bound[worst]), None, None,
                   np.asarray(e, np.float64), np.asarray(spread, np.float64), detail,
                   per_step_bound=np.asarray(bound, np.float64), step=step(worst), key=key, first_step=step(first))


def judge_bfloat16(
    a: Side,
    b: Side,
    *,
    factor: float = BF16_FACTOR,
    expect_difference: bool = False,
    known_differences: Iterable[str] = (),
    keys: Iterable[str] | None = None,
    loss: bool | None = None,
    grads: Iterable[Mapping[str, Any]] = (),
) -> Verdict:
    """Judge a ``mixed_bfloat16`` pair against its float64 runs (module docstring).

    ``loss``: judge the mixed runs' loss between the sides (by default when ``keys`` is not given and every run
    holds one); ``False`` (``theory.reported_loss_differs``) leaves the *float64* runs' loss judged all the same,
    by the float64 rule (``FLOAT64_RTOL + S x`` the parameters' gap of the step before, ``S`` from the runs' or
    ``grads``' recorded gradients: ``loss_channel.loss_sensitivity``).

    Returns the float64 rule's verdict when the float64 runs part; else a divergence naming
    the first side (``a`` first) that is farther from float64 than ``E_X`` allows; else parity
    with ``gap(A, B)`` against ``E_A + E_B + gap64`` (``floor_a``, ``floor_b``: each side's
    greatest distance from float64; ``per_step_floor``: the spread ``S``).

    Raises:
        ValueError: a side has no rerun, or ``rho`` below 1.
    """
    known = _known(known_differences)
    if not a.reruns or not b.reruns or len(a.reruns64) != len(a.reruns) or len(b.reruns64) != len(b.reruns):
        raise ValueError("judge_bfloat16 needs at least one perturbed rerun of each side, each with its float64 run")
    if a.rho < 1 or b.rho < 1:
        raise ValueError(f"rho must be >= 1 (one rounding per op at least), got {a.rho}, {b.rho}")
    runs = [a.run, b.run, a.float64, b.float64, *a.reruns, *b.reruns, *a.reruns64, *b.reruns64]
    judged = _judged_keys(runs, keys)
    with_loss = _judges_loss(runs, keys, loss)
    # the float64 runs' loss is judged by the float64 rule even where the mixed runs' is not (``loss=False``: two
    # recipes whose logits are rounded differently, ``theory.reported_loss_differs``): they compute no bfloat16,
    # so nothing but a difference of the programs parts their losses (module docstring, "The loss")
    v64 = judge_float64(a.float64, b.float64, expect_difference=expect_difference, known_differences=known,
                        keys=judged, loss=_judges_loss((a.float64, b.float64), keys, None if loss is False else loss),
                        grads=grads)
    if v64.status != "parity":  # a semantic difference (or an error), on any CPU
        return v64
    problem = _structure([("mixed runs A vs B", a.run, b.run), ("side A vs its float64 run", a.run, a.float64),
                          ("side B vs its float64 run", b.run, b.float64),
                          *((f"side {s.name} vs its rerun", s.run, r) for s in (a, b) for r in (*s.reruns, *s.reruns64))],
                         judged)
    if problem:
        return _finished(Verdict("error", "structure", math.nan, math.nan, None, None, np.zeros(0), None, problem),
                         False, known)
    for s in (a, b):
        for t in (s.run, *s.reruns):
            _check_dtype(t, judged, np.float32, s.name)
    scales = _scales(a.float64, b.float64, judged)
    errors = {s.name: _errors(s.run, s.float64, judged) for s in (a, b)}
    spread = _spread(np.fmax.reduce([_row_max(_gaps(errors[s.name], _errors(r, r64, judged), judged, scales))[0]
                                     for s in (a, b) for r, r64 in zip(s.reruns, s.reruns64, strict=True)]))
    bounds = {}
    own_a, own_b, shared = _beyond_shared(errors[a.name], errors[b.name], judged)
    common = _spread(_row_max(_gaps(shared, _zeros(shared), judged, scales))[0])
    for s, own in ((a, own_a), (b, own_b)):
        e, arg = _row_max(_gaps(s.run, s.float64, judged, scales))
        beyond, barg = _row_max(_gaps(own, _zeros(own), judged, scales))
        storage = _storage(s, judged, scales, spread)
        gradient = _gradient_term(s, judged, scales, spread)
        bound = factor * s.rho * spread + BF16_STORAGE_FACTOR * storage + BF16_GRADIENT_FACTOR * gradient + FLOAT32_ABS_FLOOR
        bad = _side_verdict(s, _spread(beyond), barg, bound, judged, spread, factor, storage,
                            distance=_spread(e), common=common, gradient=None if s.grads64 is None else gradient)
        if bad is not None:
            return _finished(bad, expect_difference, known)
        bounds[s.name] = (_spread(e), bound)
    storage_max = max(float(np.nanmax(_storage(s, judged, scales, spread))) for s in (a, b))
    gradient_max = {s.name: float(np.nanmax(_gradient_term(s, judged, scales, spread))) for s in (a, b) if s.grads64 is not None}
    pair_gap, arg = _row_max(_gaps(a.run, b.run, judged, scales))
    gap64, _ = _row_max(_gaps(a.float64, b.float64, judged, scales))
    pair_bound = bounds[a.name][1] + bounds[b.name][1] + gap64
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = np.where(np.isnan(pair_gap), -1.0, pair_gap / pair_bound)
    worst = int(np.argmax(ratio))
    key = judged[int(arg[worst])]
    (ea, _), (eb, _) = bounds[a.name], bounds[b.name]
    shared_note = "" if not np.nanmax(common, initial=0.0) > 0 else (
        f"; beyond an error both sides share of up to {np.nanmax(common):.2e} (the same rounding in both recipes,"
        " which their reruns need not re-sample: not a difference between them)")
    detail = (
        f"bfloat16: relative gap {pair_gap[worst]:.2e} <= {pair_bound[worst]:.2e} = E_A + E_B + gap64 (tightest at"
        f" {describe_step(key, step_of_row(key, worst))}, {describe_key(key)}): each side within what its bfloat16"
        f" arithmetic explains of its float64 run, {a.name} {np.nanmax(ea):.2e} and {b.name} {np.nanmax(eb):.2e} at most"
        f"{shared_note}"
        f" (E = {factor:g} x rho x spread + {BF16_STORAGE_FACTOR:g} x storage"
        + (f" + {BF16_GRADIENT_FACTOR:g} x gradients" if gradient_max else "")
        + f" + {FLOAT32_ABS_FLOOR:.2e}; storage: the float64 run from the"
        f" inputs and weights rounded to bfloat16, up to {storage_max:.2e};"
        + ("".join(f" gradients of {n}: its float64 run rounding the output's and each device's gradients to bfloat16,"
                   f" up to {g:.2e};" for n, g in gradient_max.items()))
        + f" spread up to {np.nanmax(spread):.2e}, the largest"
        f" gap between a side's error and the error of one of its {BF16_RERUNS} reruns; rho {a.name} {a.rho:.3g},"
        f" {b.name} {b.rho:.3g}); the float64 runs agree; {a.kernels}; {b.kernels}"
    )
    v = Verdict("parity", RULE_BF16_FLOAT64, float(pair_gap[worst]), float(pair_bound[worst]), float(np.nanmax(ea)),
                float(np.nanmax(eb)), pair_gap, spread, detail, per_step_bound=pair_bound,
                step=step_of_row(key, worst), key=key)
    if with_loss:  # the pair's loss gap against the sampled loss spread (module docstring, "The loss")
        scale = _loss_scale(a.float64, b.float64)
        lspread = _spread(np.fmax.reduce([_loss_gap(errors[s.name], _errors(r, r64, judged), scale)
                                          for s in (a, b) for r, r64 in zip(s.reruns, s.reruns64, strict=True)]))
        ch = _loss_channel_floor(a.run, b.run, a.rho * lspread, b.rho * lspread, scale, factor,
                                 RULE_BF16_FLOAT64, "bfloat16")
        ch = _carried(ch, a.run, b.run, judged, scales)  # module docstring, "The loss": the parameters' gap carried
        # only between a TensorFlow and a torch side, whose recipes round different values in the forward pass
        # (module docstring, "The loss"): their losses are then apart by roundings no rerun sampled. One recipe
        # on both sides rounds the same values alike, and its loss stays judged (a bug in a logged loss)
        repeated = np.logical_or.reduce([_repeated_loss(s) for s in (a, b)]) & _recipes_differ(a, b)
        if repeated.any():
            names = [s.name for s in (a, b) if _repeated_loss(s).any()]
            ch = dataclasses.replace(ch, bound=np.where(repeated, math.inf, ch.bound), why=(
                f"the mixed reruns of {' and '.join(names)} log the run's loss bit for bit while the float64 reruns'"
                " losses move: the move did not reach the loss's bfloat16 rounding, so no rerun sampled it"))
        v = _with_loss(v, ch)
    return _finished(v, expect_difference, known)


def _recipes_differ(a: Side, b: Side) -> bool:
    """Whether ``a`` and ``b`` run different frameworks' mixed-precision recipes: read from ``Side.kernels``,
    whose line ``kernels.side_factor`` begins with the side's framework (``"tf: ..."``, ``"torch: ..."``)."""
    fa, fb = (s.kernels.partition(":")[0] if ":" in s.kernels else "" for s in (a, b))
    return bool(fa) and bool(fb) and fa != fb


def _repeated_loss(side: Side) -> np.ndarray:
    """Per step: every mixed rerun of ``side`` logs the run's loss bit for bit while a float64 rerun's loss moves.

    The sample ``D - D'`` is then the exact move ``L64' - L64`` alone: the move was absorbed by the bfloat16
    roundings (activations on a grid coarser than the move: a sigmoid near 0.5 whose input moves by 1e-5
    against a step of 2^-9), and the loss's rounding error was not re-sampled (module docstring, "The loss")."""
    run = np.asarray(side.run[LOSS_KEY], np.float64)
    same = np.logical_and.reduce([np.asarray(r[LOSS_KEY], np.float64) == run for r in side.reruns])
    moved = np.logical_or.reduce([np.asarray(r64[LOSS_KEY], np.float64) != np.asarray(side.float64[LOSS_KEY], np.float64)
                                  for r64 in side.reruns64])
    return same & moved

