"""The perturbation rules: judging float32 and mixed_bfloat16 runs without float64 runs.

**Perturbation rule** (``"float32 perturbation floor"``, :func:`judge_perturbation`): for
implementations that cannot run float64. Each side is re-run in float32 with the numbers
it stores in float32 (initial weights, inputs, optimizer hyperparameters) moved by one float32
ulp (:func:`perturb_ulp`, :func:`perturb_scalars`) and, for a built-in, the rows of each
device's shard reordered (:func:`shard_permutation`); ``d`` comes from the float32 runs
and ``floor_X[k] = max_{j<=k} gap_j(X32, X32')``, with the same bound as the float32 rule
(the loss's plus the parameters' gap carried into it, as in the float64 rule).

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
    adds ``S[k] * pgap[k-1]`` (``loss_channel.loss_sensitivity``, the float32 runs' measured parameter
    gap): the sampled loss floors hold each side's own carried spread, not the other side's
    parameters, which the parameter channel accepts as rounding. And the parameter channel
    likewise takes the step one stage back: it does not count what the two sides' gradients,
    where their gap is rounding, carry through the update's slope measured by each side's
    rerun (``judging.update_sensitivity``): where the update amplifies one element's gradient
    rounding (Adam with ``beta2 = 0`` at ``|g|`` of a few ``eps``), each floor is a single
    draw of it and the factor 2 does not cover it (the error-rate hunt's pair 251).

Warning:
    Reordering does not re-sample every rounding another kernel leaves: a sum whose terms
    repeat rounds alike in every order (above), which is why a built-in's rerun also moves
    to one device where theory allows. With it, on the scenario matrix the rule agrees with
    the float32 rule on all 160 float32 pairs, and its bound is up to 2.4 times looser than
    that rule's on synchronized batch norm (benchmarks/bench_perturbation_floor.py;
    docs/tolerance.md, "Rule 3 against rule 2 on the scenario matrix").
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
    ``session.variants.perturbed_case``) are the ones that rule samples its spread from:

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
    layer is a dense layer with a bias: Keras rounds those logits twice (the product, then
    ``+ bias``), torch's ``nn.Linear`` once (``theory.reported_loss_differs``). For such pairs the mixed runs'
    loss channel is reported beside the verdict, not judged; their float64 runs' loss, which rounds no logit, is
    judged by the float64 rule (``judging.bfloat16.judge_bfloat16``).

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

docs/tolerance.md, "Rule 3: the perturbation floor", says the same with its measurements, and
docs/mixed-precision.md the mixed-precision figures.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from parity_tests.judging.bounds import FLOAT32_ABS_FLOOR, FLOAT32_FACTOR, SCALE_FLOOR
from parity_tests.judging.gaps import _gaps, _judged_keys, _row_max, _scales
from parity_tests.judging.guards import _check_dtype, _structure
from parity_tests.judging.loss_channel import (
    LOSS_KEY,
    _carried,
    _judges_loss,
    _loss_channel_floor,
    _loss_gap,
    _loss_scale,
    _loss_structure,
    _with_loss,
)
from parity_tests.judging.rules.float32_floor import _judge_floor
from parity_tests.judging.rules.float64_bound import _check_factor
from parity_tests.judging.update_sensitivity import carried_by_gradients
from parity_tests.judging.verdict import (
    RULE_PERTURBATION,
    RULE_STRUCTURE,
    Verdict,
    _error,
    _finished,
    _known,
)

__all__ = [
    "BF16_SIGNATURE",
    "PERTURB_STREAM",
    "bfloat16_signature",
    "round_bfloat16",
    "perturb_bf16_ulp",
    "perturb_ulp",
    "perturb_scalars",
    "shard_permutation",
    "judge_perturbation",
]

#: the least step-1 relative gap between a mixed_bfloat16 run and its float32 run (derived in the module docstring)
BF16_SIGNATURE: float = 2.0**-12
#: Second seed word of :func:`perturb_ulp`'s generator, so its coins share no stream with the case's own draws.
PERTURB_STREAM = 0x5E7B


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
    (``grad/*`` row 0): the loss measured against ``max(|mixed|, |f32|, SCALE_FLOOR)``, each
    gradient array against ``max(|mixed|, |f32|, min(SCALE_FLOOR, G))`` with ``G`` the largest
    step-1 gradient entry of either run; returns ``(gap, key)``. At least :data:`BF16_SIGNATURE`
    when the run computes in bfloat16 (module docstring); gradients that are not recorded are skipped.

    Why the gradients' floor is ``min(SCALE_FLOOR, G)``: rounding is relative, so a gradient
    scaled as a whole by ``c`` (a clip to ``1e-6``, a loss averaged over many rows) keeps its
    bfloat16-to-float32 and float32-to-float64 ratios; an absolute floor of ``1e-2`` divided both
    by ``1e-2`` instead of ``~1e-6`` and left only the step-1 loss to carry the signature (the
    error-rate hunt's pairs 265, 441, 949, 950: a clip of ``1e-6`` on a model whose logits are
    near 0, where the loss moves by 1e-6 relative: "does not compute in bfloat16" on a correct
    run whose clipped gradient is 1.2e-3 from its float32 run, 4e4 times that run's own 2.9e-8).
    ``G`` keeps what the floor is for: an array that is small beside the rest of the gradient
    (a cancelled sum, ``0`` by symmetry) is measured against the gradient's own size, not its own.
    A clipped gradient whose direction the model fixes (one weight; a two-class softmax over one
    input, ``[g, -g]``) holds only the clip's own float32 rounding, in the mixed run and the
    float32 run alike: it reads no signature and raises the bound to 16 times that rounding, and
    the loss must carry the signature (the hunt's pair 265, where it cannot: docs/error-rates.md;
    checked on 1-weight and two-class models clipped to 1e-6 under Adam: the same verdicts as
    with the floor of 1e-2, parity at 3 seeds each).
    """
    best, where = 0.0, LOSS_KEY
    keys = [LOSS_KEY] + sorted(k for k in mixed if isinstance(k, str) and k.startswith("grad/") and k in f32)
    rows = {k: (np.asarray(mixed[k][:1], dtype=np.float64), np.asarray(f32[k][:1], dtype=np.float64)) for k in keys}
    grads = [float(np.abs(x).max()) for k in keys[1:] for x in rows[k] if x.size and np.isfinite(x).all()]
    g_floor = min(SCALE_FLOOR, max(grads, default=SCALE_FLOOR))
    for key in keys:
        a, b = rows[key]  # row 0: step 1 (loss [steps], grad/* [steps, ...])
        if a.size == 0 or b.shape != a.shape:
            continue
        floor = SCALE_FLOOR if key == LOSS_KEY else g_floor
        scale = max(float(np.abs(a).max()), float(np.abs(b).max()), floor)
        if scale == 0.0:  # every gradient exactly zero on both runs: nothing to read here
            continue
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
    for code that is known to compute it (``session.variants.perturbed_case`` decides: a bug that depends
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


def _carried_text(carried: Mapping[str, np.ndarray], scales: dict[str, np.ndarray]) -> str:
    """The detail's clause for the gradients' carried gap: its greatest share of the scale, and where."""
    best, where = 0.0, ""
    for key, e in carried.items():
        rel = e.reshape(e.shape[0], -1).max(axis=1) / np.maximum(scales[key], SCALE_FLOOR)
        row = int(np.argmax(rel))
        if rel[row] > best:
            best, where = float(rel[row]), f"{key.removeprefix('param/')} at step {row}"
    return (f"; parameter gaps less what the gradients' gap (accepted as rounding) carries through the update's "
            f"slope measured by each side's rerun (up to {best:.2e} of the scale, {where})")


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
    carry_gradients: bool | None = None,
) -> Verdict:
    """Judge two float32 trajectories without float64 runs: the perturbation floor.

    Each side is re-run in float32 from its initial weights (and inputs and hyperparameters)
    moved by one float32 ulp (:func:`perturb_ulp`; ``session.variants.perturbed_case`` also reorders a
    built-in's shards); the spread is what rounding alone does to that side::

        d_p[k]     = max(||A32_p[k]||_inf, ||B32_p[k]||_inf, SCALE_FLOOR)
        floor_X[k] = max over j <= k of gap_j(X32, X32')  (X32': the perturbed run)
        bound[k]   = factor * max(floor_A[k], floor_B[k]) + FLOAT32_ABS_FLOOR

    divergence when ``gap_k(A32, B32) > bound[k]`` at any step, for the parameters
    or for the loss (whose bound adds ``S[k] * pgap[k-1]``, ``loss_channel._carried``). A side without a perturbed run (a recorded run cannot be run
    again) takes the other side's floor. Under :data:`RULE_PERTURBATION` a parameter array whose
    gradient both sides record is measured as ``(|A32 - B32| - E)+``, ``E`` what the gradients'
    accepted gap carries through the update (``update_sensitivity.carried_by_gradients``).

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
        carry_gradients: whether the parameter channel leaves out what the gradients' accepted gap
            carries (``update_sensitivity``); by default for :data:`RULE_PERTURBATION` only
            (``False``: the rule without it, as ``benchmarks/bench_update_sensitivity.py`` compares).

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
    # the float32 rule only: the bfloat16 floor and the float64 conditioning floor keep their own derivations
    if carry_gradients is None:
        carry_gradients = rule == RULE_PERTURBATION
    carried = carried_by_gradients(a32, b32, a32p, b32p, judged, factor, abs_floor) if carry_gradients else {}
    if carried:
        context += _carried_text(carried, scales)
    v = _judge_floor(a32, b32, judged, scales, fa_rows, fb_rows, factor, rule, context, abs_floor, label,
                     carried=carried)
    if with_loss:
        scale = _loss_scale(a32, b32)
        la = _spread(_loss_gap(a32, pa, scale) if own["A"] else _loss_gap(b32, pb, scale))
        lb = _spread(_loss_gap(b32, pb, scale)) if own["B"] else la
        ch = _carried(_loss_channel_floor(a32, b32, la, lb, scale, factor, rule, label, abs_floor),
                      a32, b32, judged, scales)
        v = _with_loss(v, ch)
    return _finished(v, expect_difference, known)

