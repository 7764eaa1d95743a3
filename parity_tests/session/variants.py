"""The cases a comparison runs besides the case as given: float64, the perturbed reruns, the mixed-precision extras.

A variant is made from the case alone (:func:`perturbed_case`, :func:`_resummed`, :func:`_variants`);
which implementation runs which is the plan's business (``session.executor``).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from parity_tests.contract.case import MIXED_BFLOAT16, Case
from parity_tests.judging.bfloat16 import (
    RERUN_SEED_STRIDE,
    float64_reference,
    rounded_reference,
)
from parity_tests.judging.perturbation import (
    perturb_bf16_ulp,
    perturb_scalars,
    perturb_ulp,
    shard_permutation,
)
from parity_tests.judging.theory import engine, predict
from parity_tests.protocol.errors import CaseError
from parity_tests.protocol.grad_rounding import rounds_gradients
from parity_tests.session.declared import declared as _declared
from parity_tests.session.keys import (
    BF16_RERUNS64_RUN,
    BF16_RERUNS_RUN,
    FLOAT64,
    GRADS64,
    PERTURBED_RUN,
    ROUNDED64,
    STEP1,
    Variant,
    as_given,
)

__all__ = ['PERTURBED', 'BF16_CHECK', 'BF16_RERUN_KEYS', 'BF16_RERUN64_KEYS', 'BF16_ROUNDED64', 'perturbed_case']


# the legacy texts of the variants' trajectory keys (``keys.Variant.text``), for what reads ``CaseResult.trajectories``
PERTURBED = PERTURBED_RUN.text  # "float32+perturbed": a run from perturbed weights
BF16_CHECK = STEP1.text  # "float32-step1": a mixed_bfloat16 case's one-step float32 run
BF16_RERUN_KEYS = tuple(v.text for v in BF16_RERUNS_RUN)  # a mixed_bfloat16 case's perturbed reruns
BF16_RERUN64_KEYS = tuple(v.text for v in BF16_RERUNS64_RUN)  # the float64 run of each of those reruns' moved case
BF16_ROUNDED64 = ROUNDED64.text  # "float64+bfloat16-rounded": from inputs and weights rounded to bfloat16


def perturbed_case(case: Case, seed: int | None = None) -> Case:
    """``case`` with every number a float32 run stores moved by one float32 ulp (seeded by the case seed).

    The initial weights, the inputs ``x`` and the optimizer's real hyperparameters
    (``perturbation.perturb_ulp``, ``perturbation.perturb_scalars``): the rounding of each is
    part of a float32 run's error (docs/tolerance.md, rule 3). The targets stay: they
    are labels with a valid range (``[0, 1]`` for ``sigmoid_ce``) more often than
    rounded measurements, and the inputs already make every forward pass round anew.

    A ``mixed_bfloat16`` case moves its inputs by one *bfloat16* ulp instead (the layers
    round them to bfloat16; the weights and hyperparameters stay float32 storage, moved by
    a float32 ulp; token ids are not moved, the embedding table they select is, by a bfloat16 ulp): ``perturbation.perturb_bf16_ulp``; ``judging.bfloat16`` runs each moved case
    in float64 too and says why the weights' rounding is measured apart. ``seed``
    (default: the case seed) seeds the coins: a mixed pair's second rerun is seeded by
    ``seed + 2**32`` (``judging.bfloat16``).

    A float32 case in ``split`` order also reads the rows of each device's shard in another
    seeded order (``perturbation.shard_permutation``; the dropout masks follow their rows): the
    same examples on the same device, so the same computation in exact arithmetic, but every
    sum over examples (loss mean, gradient sums, batch-norm statistics) is accumulated in
    another order. A one-ulp move cannot sample that rounding: it moves a long sum's partial
    sums by about ``sqrt(n)`` term-ulps, far below their own ulp, so the rerun would round
    them as the run did. The perturbed case then has ``rows``: ``x[j]`` is data row ``rows[j]``.
    Where theory says the N-device update is the full-batch one, the rows are permuted across
    the whole batch and the case computes it on one device (``devices`` 1, ``run_devices`` N),
    so every reduction over examples also has another length: the rounding of a sum whose
    terms repeat is the same in any order, not at another length. Only a built-in's rerun
    reads this case as it is (:func:`_rerun_of`).
    """
    seed = case.spec.get("seed", 0) if seed is None else seed
    opt = case.spec["optimizer"]
    moved = perturb_scalars({k: v for k, v in opt.items() if k not in ("name", "semantics", "schedule")}, seed)
    schedule = opt.get("schedule") or {}
    if schedule.get("kind") == "step":  # its values are learning rates stored in float32 too; lr is its first
        values = perturb_scalars({f"value{i:04d}": v for i, v in enumerate(schedule["values"])}, seed)
        steps_lr = [values.get(f"value{i:04d}", v) for i, v in enumerate(schedule["values"])]
        moved["schedule"] = {**schedule, "values": steps_lr}
        if "lr" in opt:
            moved["lr"] = steps_lr[0]
    if moved:
        case = _moved_within_range(case, opt, moved)
    if case.spec["dtype"] == MIXED_BFLOAT16:  # x is rounded to bfloat16 by the layers: move it by a bfloat16 ulp
        if np.asarray(case.x).dtype.kind != "f":  # token ids: the embedding table is what the first layer rounds
            init = perturb_ulp(case.init, seed)
            table = perturb_bf16_ulp({"0.embeddings": case.init["0.embeddings"]}, seed)  # ids: layer 0 is the embedding
            return dataclasses.replace(case, init={**init, **table})
        return dataclasses.replace(case, init=perturb_ulp(case.init, seed), x=perturb_bf16_ulp({"x": case.x}, seed)["x"])
    # token ids (an embedding's integer x) are not rounded by anything: only the weights move
    x = case.x if np.asarray(case.x).dtype.kind != "f" else perturb_ulp({"x": case.x}, seed)["x"]
    case = dataclasses.replace(case, init=perturb_ulp(case.init, seed), x=x)
    if not _reorderable(case):
        return case
    # the rows may also change device (each device then adds up other examples: another blocking
    # of every cross-device sum) exactly when theory says the N-device update is the full-batch
    # one, which no order of the batch changes; only built-ins' reruns are reordered (_rerun_of).
    # And then a built-in's rerun computes that full batch on one device: every reduction over
    # examples (the batch-norm statistics above all) has another length and blocking. A sum
    # whose terms repeat (the conv bias at every blank 3x3 window of a digit) rounds the same
    # way at each of them, in any order: reordering cannot sample that rounding, another
    # length does. (Fewer devices only relax validation: a valid case is valid on one.)
    return _resummed(case)


def _moved_within_range(case: Case, opt: dict[str, Any], moved: dict[str, Any]) -> Case:
    """``case`` with the optimizer's numbers ``moved``; one that leaves its accepted range moves the other way.

    A value at the end of its range (momentum 1, which both frameworks accept) moved one ulp
    outward is refused by validation; the ulp on the other side samples the same rounding.
    """
    for _ in range(len(moved) + 1):
        try:
            return case.replace(**{f"optimizer.{k}": v for k, v in moved.items()})
        except CaseError as e:
            key = e.field.rpartition(".")[2]
            if key not in moved or not isinstance(opt.get(key), (int, float)):
                raise
            nominal, was = np.float32(opt[key]), moved[key]
            moved[key] = float(np.nextafter(nominal, np.float32(-np.inf) if was > nominal else np.float32(np.inf)))
    return case.replace(**{f"optimizer.{k}": v for k, v in moved.items()})


def _reordered(case: Case, idx: np.ndarray, *, across: bool = False, run_devices: int | None = None) -> Case:
    """``case`` reading data row ``idx[j]`` where it read row ``j`` (inputs, targets, sample weights, dropout masks).

    ``run_devices``: the device count of the case ``case`` was made from, when ``case`` computes
    its batch on another (one device: :func:`perturbed_case`).
    """
    fields = {f.name: getattr(case, f.name) for f in dataclasses.fields(Case)}
    return _Reordered(**{**fields, "x": case.x[idx], "y": case.y[idx], "w": None if case.w is None else case.w[idx]},
                      rows=idx, across=across, run_devices=run_devices)


def _resummed(case: Case, *, one_device: bool = True) -> Case:
    """``case`` adding its sums in another order, as :func:`perturbed_case` makes a built-in's rerun do.

    The rows of each device's shard reordered and, where theory says the N-device update is the
    full-batch one (and ``one_device``), the whole batch permuted and computed on one device:
    every reduction over examples then has other partial sums (and another length), the rounding
    another kernel leaves.
    """
    data, par = case.spec["data"], case.spec["parallel"]
    across = one_device and par["devices"] > 1 and not predict(case.replace(dtype="float64").spec, engine("tf.towers"),
                                                                 engine("tf.single")).differ
    idx = shard_permutation(case.spec["steps"], data["global_batch"], par["devices"], par["shard"],
                            case.spec.get("seed", 0), across=across)
    if not across:
        return _reordered(case, idx)
    return _reordered(case.replace(**{"parallel.devices": 1}), idx, across=True, run_devices=par["devices"])


def _reorders(impl: str) -> bool:
    """Whether ``impl``'s perturbed rerun reads each shard's rows reordered: a built-in's only.

    The built-ins treat a shard as a set of examples (their float64 runs are unchanged by the
    reordering: ``tests/test_perturbation.py``). A plugin is the code under test: a bug of
    its that depends on a row's place in a shard would not reproduce in a reordered rerun, and
    would raise its floor instead of showing, so its rerun keeps the order.
    """
    found = _declared(impl)
    return found is not None and found.kind == "builtin"


def _rerun_of(case: Case, impl: str) -> Case:
    """The perturbed case ``impl`` reruns: ``case`` (:func:`perturbed_case`), in the original row order unless :func:`_reorders`."""
    if not isinstance(case, _Reordered) or case.rows is None or _reorders(impl):
        return case
    back = np.argsort(case.rows)  # x[back] is the moved data in the original order
    fields = {f.name: getattr(case, f.name) for f in dataclasses.fields(Case)}
    kept = Case(**{**fields, "x": case.x[back], "y": case.y[back], "w": None if case.w is None else case.w[back]})
    # on the case's own devices too: a plugin's bug may depend on N (an extra 1/N)
    return kept if case.run_devices is None else kept.replace(**{"parallel.devices": case.run_devices})


def _perturbed_text(case: Case, pair: tuple[str, str]) -> str:
    """How the reruns of ``pair`` were made from ``case`` (:func:`perturbed_case`), for the verdict's detail."""
    moved = "reruns with the weights, inputs and hyperparameters moved by one float32 ulp"
    if not isinstance(case, _Reordered):
        return moved
    kept = [i for i in pair if not _reorders(i)]
    if not case.across:
        how = " and the rows of each device's shard reordered"
    else:
        where = "across the devices" if case.run_devices is None else "the full batch computed on one device"
        how = f" and each step's rows reordered, {where} (the N-device update is the full-batch one)"
    return moved + how + (f" in a built-in's rerun only (kept in order: {', '.join(kept)})" if kept else "")


@dataclasses.dataclass
class _Reordered(Case):
    """A case whose data rows are read in the order ``rows`` (``perturbation.shard_permutation``).

    ``x``, ``y`` and the sample weights ``w`` are already reordered; the dropout keep-masks
    are drawn from the spec by data row (``generators.dropout_masks``) and follow the same
    order here, so every example keeps its mask and only the order of the sums changes.
    """

    rows: np.ndarray | None = dataclasses.field(default=None)
    across: bool = False  # rows moved between devices too (``perturbation.shard_permutation``)
    run_devices: int | None = None  # the original case's device count, when this one computes on one device

    def payload(self) -> dict[str, Any]:
        p = super().payload()
        if self.rows is not None and p.get("masks"):
            p["masks"] = {k: np.asarray(m)[self.rows] for k, m in p["masks"].items()}
        return p


def _reorderable(case: Case) -> bool:
    """Whether :func:`perturbed_case` also reorders the rows of each device's shard (``perturbation.shard_permutation``).

    A float32 case reading its batches in ``split`` order. Not ``mixed_bfloat16`` (its floor
    is bfloat16 rounding, 2**15 times float32's, and its figures are documented without
    reordering: docs/mixed-precision.md), not ``distributed_sampler`` (its rows are a dataset
    read epoch by epoch through a sampler's permutation, not one batch per step).
    """
    return case.spec["dtype"] == "float32" and case.spec["data"].get("order", "split") == "split"



class _Variants(dict):
    """Cases by variant, some made only when first asked for (``later``: variant -> how to make it).

    A float32 case's perturbed variant moves every weight by an ulp: a copy of the model (GPT-2
    small in float64: 1 GB, made for the case and for each mapping) that no run reads where the
    float64 rule decides every pair.
    """

    def __init__(self, made: dict[Variant, Case], later: dict[Variant, Callable[[], Case]]) -> None:
        super().__init__(made)
        self._later = later
        self._lock = threading.Lock()  # the TensorFlow and torch runs ask from two threads (_beside)

    def __missing__(self, key: Variant) -> Case:
        with self._lock:  # made once: the other thread waits for it, and then finds it made
            if dict.__contains__(self, key):
                return dict.__getitem__(self, key)
            if key not in self._later:
                raise KeyError(key)
            made = self[key] = self._later[key]()
            del self._later[key]
            return made

    def __contains__(self, key: object) -> bool:
        return super().__contains__(key) or key in self._later


def _variants(case: Case) -> dict[Variant, Case]:
    """Every run a case may need, by variant: its dtype, float64, the perturbed reruns, the mixed-precision extras."""
    dtype = case.spec["dtype"]
    variants = {as_given(dtype): case, FLOAT64: case if dtype == "float64" else case.replace(dtype="float64")}
    if dtype == "float32":
        return _Variants(variants, {PERTURBED_RUN: lambda: perturbed_case(case)})
    if dtype == MIXED_BFLOAT16:
        variants[PERTURBED_RUN] = perturbed_case(case)
        variants[STEP1] = case.replace(dtype="float32", steps=1)
        variants[FLOAT64] = float64_reference(case)  # the ground truth (judging.bfloat16)
        variants[ROUNDED64] = rounded_reference(case)
        if rounds_gradients(case.spec):  # the float64 run rounding the gradients as the mixed recipe does
            variants[GRADS64] = dataclasses.replace(variants[FLOAT64], grads_bf16=True)
        seed = case.spec.get("seed", 0)
        variants.update({key: perturbed_case(case, seed + r * RERUN_SEED_STRIDE)
                         for r, key in enumerate(BF16_RERUNS_RUN) if r})
        variants.update({k64: float64_reference(variants[key]) for key, k64 in zip(BF16_RERUNS_RUN, BF16_RERUNS64_RUN,
                                                                                    strict=True)})
    return variants
