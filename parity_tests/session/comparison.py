"""Judge one case across implementations: run them, apply the tolerance model and theory, explain.

The first implementation is the reference; every other one is judged against
it. A float64 case is judged by the float64 rule. A float32 case is also run
in float64 on every implementation, so each side's own float32 noise floor is
known (``rules.judge_float32``) -- unless a side of a pair declares only
float32 (its registry ``dtypes``, e.g. a user's plugin): that pair is judged by
the perturbation floor (``perturbation.judge_perturbation``), each side re-run in
float32 with its initial weights, inputs and hyperparameters moved by one float32
ulp and the rows of each device's shard reordered (:func:`perturbed_case`, seeded
by the case seed), and no float64 run is
asked of it. A side that cannot be re-run (a recorded run) takes the other
side's floor. Every pair goes through ``pair.judge_sides`` (the rule and every guard).

Theory (``theory.predict``) says which pairs must differ at the case's values
(expected differences) and which documented small effects apply (known
differences). Where a built-in side of a pair can be run with the other side's
semantics (``theory.mapping_changes``: the other framework's optimizer rule, with
Keras' float32 hyperparameters where the other side is Keras; by-size weighting,
clipping after the combine, synchronized batch norm, ...), it is run so, and the
pair is judged again with the difference mapped away: ``pair.resolve`` calls a
divergence an expected difference only when that residual is parity, and reports
the gap without the mapping beside the verdict.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import sys
import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from parity_tests.contract.case import MIXED_BFLOAT16, Case
from parity_tests.judging.bfloat16 import (
    BF16_RERUNS,
    RERUN_SEED_STRIDE,
    float64_reference,
    rounded_reference,
    signature_bound,
)
from parity_tests.judging.bfloat16 import Side as BF16Side
from parity_tests.judging.bounds import FLOAT64_RTOL
from parity_tests.judging.compare import first_nonfinite
from parity_tests.judging.factor import attach as attach_factor
from parity_tests.judging.localise import bound_at, localise, refinable, stage_chain, with_layer
from parity_tests.judging.loss_only import attach as attach_loss_only
from parity_tests.judging.pair import OK_STATUSES, Side, judge_sides, resolve
from parity_tests.judging.perturbation import (
    bfloat16_signature,
    judge_perturbation,
    perturb_bf16_ulp,
    perturb_scalars,
    perturb_ulp,
    shard_permutation,
)
from parity_tests.judging.precision_leak import leak_text, loss_in_float32
from parity_tests.judging.theory import (
    LOSS_SCALE,
    Prediction,
    engine,
    keras_bias_add_layers,
    mapping_changes,
    predict,
    reported_loss_differs,
    stage_of,
)
from parity_tests.judging.verdict import (
    RULE_BF16_PERTURBATION,
    RULE_BF16_SIGNATURE,
    RULE_CONDITIONING,
    RULE_FLOAT64,
    Verdict,
    _json,
    exit_status,
)
from parity_tests.judging.zero_gradient import zero_gradients
from parity_tests.protocol.errors import CaseError
from parity_tests.protocol.vocabulary import LOCAL_COMBINES
from parity_tests.running import registry
from parity_tests.running.harness import refusal, run_impl
from parity_tests.running.room import available_bytes, fits_beside, tf_bytes, torch_bytes
from parity_tests.session.loss_scale import ExactScale, loss_scales

__all__ = ["PairResult", "CaseResult", "compare_case", "perturbed_case", "OK_STATUSES", "FLOORS", "PERTURBED",
           "SideMapping", "STAND_INS", "choose_mapping", "keras_rounding_of", "held_roundings", "MAPPED", "inside_step",
           "NOT_EQUIVALENT", "writes_own_rule", "torch_rule_of", "torch_rule_from",
           "own_rules", "follows_its_class", "rule_runs", "stand_in_leg", "residual_unjudged"]

UNSUPPORTED = "unsupported"  # the implementation does not implement a field of this case
#: the library's messages (``tfpar compare`` shows INFO and above; ``--verbose`` DEBUG, each run)
_log = logging.getLogger("tfpar.session")
Runner = Callable[[Case, str], dict[str, np.ndarray]]
#: how a float32 case's noise floor is measured: ``auto`` (float64 runs where both sides of a pair
#: declare float64, else the perturbation), or one of the two for every pair (the benchmark compares them)
FLOORS = ("auto", "float64", "perturbation")
PERTURBED = "float32+perturbed"  # the trajectory key suffix of a run from perturbed weights
#: a mixed_bfloat16 case's one-step float32 run, against which each side's bfloat16 signature is measured
BF16_CHECK = "float32-step1"
#: a mixed_bfloat16 case's perturbed reruns (judging.bfloat16: ``BF16_RERUNS`` of them, each with its own coins)
BF16_RERUN_KEYS = (PERTURBED, *(f"{PERTURBED}-{r + 1}" for r in range(1, BF16_RERUNS)))
#: the float64 run of each of those reruns' moved case (judging.bfloat16: the spread is of errors)
BF16_RERUN64_KEYS = tuple(f"float64+{key}" for key in BF16_RERUN_KEYS)
#: the float64 run from the inputs and initial weights rounded to bfloat16 (judging.bfloat16: the storage term)
BF16_ROUNDED64 = "float64+bfloat16-rounded"
#: roundings a step of the float64 bound's envelope holds (``D sqrt(n)``, ``bounds``): how far one rounding
#: of every input, measured, can grow in a step (``_Judged.conditioned``)
CONDITIONING_ROUNDINGS = 20 * 100
MAPPED = "+mapped"  # the trajectory key suffix of a run with the predicted differences mapped away
#: what a pair's line and report.json say when its mapping ran on a stand-in that does not compute what the
#: plugin computes (``_Judged.residual``)
NOT_EQUIVALENT = "residual not judged: no equivalent run"
#: the implementation whose float64 run bounds the loss's sensitivity when neither side records a gradient
GRAD_SOURCE = "grads"


@dataclass
class PairResult:
    """The verdict on ``impl`` against ``reference``."""

    reference: str
    impl: str
    verdict: Verdict
    prediction: Prediction
    mapping: str | None = None  # what was mapped before judging again, if anything
    unmapped_gap: float | None = None  # the gap with nothing mapped (the pair as it ran)
    #: docs/localisation.md: where the two runs first part (``judging.localise``), for every verdict but parity
    localisation: dict[str, Any] | None = None
    #: the pair judged with the predicted differences mapped away (``pair.resolve``), or ``None``
    residual: Verdict | None = None
    notes: tuple[str, ...] = ()  # what the report says beside the verdict (a prediction dropped, ...)
    #: the runs ``verdict`` judged, ``(name, key suffix)`` per side: ``None`` for the pair as it ran; a
    #: built-in's mapped runs (suffix ``SideMapping.key``) where the verdict is the residual's
    judged: tuple[tuple[str, str], tuple[str, str]] | None = None
    #: why the residual was not judged although a mapping was run (:data:`NOT_EQUIVALENT`), or ``None``
    residual_not_judged: str | None = None

    def __repr__(self) -> str:
        v = self.verdict
        return f"PairResult({self.reference} vs {self.impl}: {v.status}, {v.rule}, gap {v.gap:.3g}, bound {v.bound:.3g})"

    def where(self) -> str:
        """The line that says where the pair parted: ``impl: where: STAGE at step K, layer L (explanation)``,
        or the verdict's first line where there is no localisation (``""`` for parity)."""
        loc = self.localisation or {}
        if loc.get("stage"):
            layer = f", layer {loc['layer']}" if loc.get("layer") else ""
            return f"{self.impl}: where: {loc['stage']} at step {loc['first_bad_step']}{layer} ({loc['explanation']})"
        if self.verdict.status == "parity":
            return ""
        return f"{self.impl}: {self.verdict.detail.splitlines()[0] if self.verdict.detail else self.verdict.status}"

    @property
    def as_expected(self) -> bool:
        """Parity where theory predicts none, a divergence where it predicts one (or not applicable)."""
        return self.verdict.status in OK_STATUSES or self.verdict.status == UNSUPPORTED

    def to_dict(self) -> dict[str, Any]:
        r = self.residual
        return {
            "reference": self.reference,
            "impl": self.impl,
            "status": self.verdict.status,  # docs/tolerance.md, "The verdict"
            "verdict": {**self.verdict.to_dict(),
                        **({"localisation": self.localisation} if self.localisation is not None else {})},
            "expected_differences": list(self.prediction.expected),
            "known_differences": list(self.prediction.known),
            "absent_differences": list(self.prediction.absent),
            "mapping": self.mapping,
            "unmapped_gap": self.unmapped_gap,
            "residual": None if r is None else {"status": r.status, "rule": r.rule, "gap": _json(r.gap),
                                                "bound": _json(r.bound), "first_step": r.first_step, "key": r.key},
            "residual_not_judged": self.residual_not_judged,
            "notes": list(self.notes),
            "as_expected": self.as_expected,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PairResult:
        pred = Prediction(tuple(d["expected_differences"]), tuple(d["known_differences"]),
                          absent=tuple(d.get("absent_differences", ())))
        return cls(d["reference"], d["impl"], Verdict.from_dict(d["verdict"]), pred, d["mapping"], d["unmapped_gap"],
                   d["verdict"].get("localisation"), notes=tuple(d.get("notes", ())),
                   residual_not_judged=d.get("residual_not_judged"))


#: the final line of a summary, by the worst status among the pairs
_HEADLINES = (("error", "ERROR"), ("divergence", "DIVERGENCE"), ("unexpected_parity", "DIVERGENCE (unexpected parity)"),
              ("inconclusive", "INCONCLUSIVE"), ("unsupported", "DIVERGENCE"),
              ("expected_difference", "EXPECTED DIFFERENCE (as theory predicts)"), ("parity", "PARITY"))


@dataclass
class CaseResult:
    """Everything ``tfpar compare`` found for one case."""

    case: Case
    impls: list[str]
    pairs: list[PairResult]
    trajectories: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)  # "impl@dtype" -> traj
    seconds: float = 0.0

    @property
    def parity(self) -> bool:
        """True when every pair is at parity."""
        return all(p.verdict.status == "parity" for p in self.pairs)

    @property
    def ok(self) -> bool:
        """Every pair at parity or an expected difference (``compare``'s exit status 0, docs/tolerance.md, "The verdict")."""
        return all(p.verdict.status in OK_STATUSES for p in self.pairs)

    @property
    def as_expected(self) -> bool:
        return all(p.as_expected for p in self.pairs)

    @property
    def exit_status(self) -> int:
        """``tfpar compare``'s exit status: 0 every pair parity or an expected difference, 1 a divergence or
        an unexpected parity, else 3 a pair inconclusive or an error (``judging.verdict.exit_status``)."""
        return exit_status(p.verdict.status for p in self.pairs)

    def _table(self) -> list[str]:
        """The case's line, then one row per pair: pair, verdict, rule, gap, bound."""
        c = self.case
        head = (f"case {c.name}: {c.spec['dtype']}, {c.devices} device(s), {c.spec['parallel']['combine']}, "
                f"{c.spec['optimizer']['name']} ({c.spec['optimizer']['semantics']}), {c.spec['steps']} steps")
        w = max([30, *(len(f"{p.reference} vs {p.impl}") for p in self.pairs)])  # plugin paths are long
        rows = [head, f"{'pair':<{w}} {'verdict':<20} {'rule':<26} {'gap':>10} {'bound':>10}"]
        for p in self.pairs:
            v = p.verdict
            rows.append(f"{p.reference + ' vs ' + p.impl:<{w}} {v.status:<20} {v.rule:<26} {v.gap:>10.3g} {v.bound:>10.3g}")
        return rows

    def _headline(self) -> str:
        statuses = {p.verdict.status for p in self.pairs}
        verdict = next((text for status, text in _HEADLINES if status in statuses), "PARITY")
        return f"verdict: {verdict} ({self.seconds:.1f} s)"

    def __repr__(self) -> str:
        """The summary's table and verdict line, without the notes (:meth:`summary` has them) or any array."""
        return "\n".join(["CaseResult: " + self._table()[0], *self._table()[1:], self._headline()])

    def summary(self) -> str:
        """A table a person reads in a terminal, then one line per finding."""
        rows = self._table()
        notes = []
        for p in self.pairs:
            v = p.verdict
            if p.localisation and p.localisation.get("stage"):
                notes.append("  " + p.where())
                if p.verdict.status == "divergence" and p.localisation.get("loss_only"):  # judging.loss_only (issue 37)
                    notes.append(f"  {p.impl}: loss alone: {p.localisation['loss_only']['text']}")
            for e in p.prediction.expected:
                notes.append(f"  {p.impl}: expected difference: {e}")
            for k in p.prediction.known:
                notes.append(f"  {p.impl}: known difference: {k}")
            for a in p.prediction.absent:
                notes.append(f"  {p.impl}: not at these values: {a}")
            if p.mapping:
                r = p.residual
                with_it = (f"{p.residual_not_judged}; " if p.residual_not_judged else
                           "" if r is None else f"{r.status}, gap {r.gap:.3g} (bound {r.bound:.3g}); ")
                notes.append(f"  {p.impl}: with it mapped ({p.mapping}): {with_it}gap without the mapping"
                             f" {p.unmapped_gap:.3g}")
            notes.extend(f"  {p.impl}: {n}" for n in p.notes)
            notes.extend(f"  {p.impl}: not judged: {u}" for u in v.unjudged)
            if v.status not in ("parity",):
                notes.extend("  " + line for line in v.detail.splitlines())
        for key, traj in self.trajectories.items():
            bad = first_nonfinite(traj, key)
            if bad:
                notes.append(f"  non-finite: {bad}")
        return "\n".join([*rows, *notes, self._headline()])

    def to_dict(self) -> dict[str, Any]:
        return {
            "case": self.case.spec,
            "impls": self.impls,
            "parity": self.parity,
            "ok": self.ok,
            "as_expected": self.as_expected,
            "seconds": round(self.seconds, 3),
            "pairs": [p.to_dict() for p in self.pairs],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CaseResult:
        """A stored result (no trajectories); the case is rebuilt from its spec."""
        from parity_tests.contract.case import case_from_dict

        return cls(case_from_dict(d["case"]), list(d["impls"]), [PairResult.from_dict(p) for p in d["pairs"]],
                   {}, float(d["seconds"]))


def _loss_reported(verdict: Verdict, a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> Verdict:
    """A mixed pair whose losses are different quantities (``theory.reported_loss_differs``): say so, with the gap."""
    la, lb = np.asarray(a["loss"], np.float64), np.asarray(b["loss"], np.float64)
    gap = float(np.max(np.abs(la - lb) / np.maximum(np.maximum(np.abs(la), np.abs(lb)), 1e-2))) if la.size else 0.0
    first, _, rest = verdict.detail.partition("\n")
    note = (f"; loss reported, not judged: Keras rounds the logits twice (product, then + bias), torch once"
            f" (greatest relative loss gap {gap:.2e})")
    return dataclasses.replace(verdict, detail=first + note + (("\n" + rest) if rest else ""))


def _bf16_guard(verdict: Verdict, ref: str, impl: str, trajs: dict[str, dict[str, np.ndarray]]) -> Verdict:
    """A side of a mixed_bfloat16 pair whose run matches its float32 run at step 1 does not compute in bfloat16.

    ``judging.bfloat16.signature_bound``: such a side is *closer* to float64 than bfloat16
    arithmetic, so the bfloat16 rule cannot find it; this check does. Its mixed run must part
    from its float32 run at step 1 by more than ``BF16_SIGNATURE_FACTOR`` times that float32
    run's own distance from float64 (``perturbation.BF16_SIGNATURE`` where no float64 run was made).
    """
    if verdict.status in ("error", "inconclusive", UNSUPPORTED):  # nothing moved: no signature to read either
        return verdict
    for side in (ref, impl):
        mixed, f32 = trajs.get(f"{side}@{MIXED_BFLOAT16}"), trajs.get(f"{side}@{BF16_CHECK}")
        if mixed is None or f32 is None:
            continue
        gap, key = bfloat16_signature(mixed, f32)
        bound, how = signature_bound(f32, trajs.get(f"{side}@float64"))
        if gap <= bound:
            detail = (f"{side} does not compute in bfloat16: its mixed_bfloat16 run matches its float32 run at step 1"
                      f" (greatest relative gap {gap:.2e} at {key}, expected > {bound:.2e}: {how}); between the"
                      f" implementations: {verdict.detail}")
            return dataclasses.replace(verdict, status="divergence", rule=RULE_BF16_SIGNATURE, gap=gap, bound=bound,
                                       detail=detail, key=key, step=1, first_step=1)
    return verdict


def _bf16_sides(trajs: dict[str, dict[str, np.ndarray]], impl: str, suffix: str = "") -> bool:
    """Whether ``impl`` has the runs ``judging.bfloat16`` holds a mixed side by: its float64 run and its reruns."""
    return all(f"{impl}@{key}{suffix}" in trajs
               for key in (MIXED_BFLOAT16, "float64", BF16_ROUNDED64, *BF16_RERUN_KEYS, *BF16_RERUN64_KEYS))


def _tf_kernels(spec: dict[str, Any]) -> dict[str, Any] | None:
    """TensorFlow's kernel probe here, for theory's mixed-precision predictions (``None`` for other dtypes)."""
    if spec["dtype"] != MIXED_BFLOAT16:
        return None
    from parity_tests.running import kernels

    return kernels.probe("tf")["ops"]


def _bf16_side(case: Case, impl: str, trajs: dict[str, dict[str, np.ndarray]], suffix: str = "",
               bias_add: bool = False) -> BF16Side:
    """One side of a mixed pair, with what its framework's kernels do on this CPU (``running.kernels``).

    ``bias_add``: the pair is two TensorFlow sides, which both sum Keras' ``bias_add`` gradients as
    ``BiasAddGrad`` does here; against torch that is a predicted difference (``theory.bias_add_differences``).
    """
    from parity_tests.running import kernels

    framework = registry.resolve(impl, "impls").framework
    terms = max((n for _, _, n in keras_bias_add_layers(case.spec, most=True)), default=None) if bias_add else None
    rho, why = kernels.side_factor(case.spec["model"]["layers"], framework, bias_add, terms)
    return BF16Side(impl, trajs[f"{impl}@{MIXED_BFLOAT16}{suffix}"], trajs[f"{impl}@float64{suffix}"],
                    [trajs[f"{impl}@{key}{suffix}"] for key in BF16_RERUN_KEYS],
                    [trajs[f"{impl}@{key}{suffix}"] for key in BF16_RERUN64_KEYS], rho, why,
                    trajs[f"{impl}@{BF16_ROUNDED64}{suffix}"])


def _declared(impl: str) -> registry.Implementation | None:
    """The registry's entry for ``impl`` (``None`` for a name only a custom runner knows)."""
    try:
        return registry.resolve(impl)
    except CaseError:
        return None


def _runs_float64(impl: str) -> bool:
    found = _declared(impl)
    return found is None or "float64" in found.dtypes


def _rerunnable(impl: str) -> bool:
    found = _declared(impl)
    return found is None or found.rerunnable


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


def _floor_rules(case: Case, impls: list[str], floor: str) -> dict[str, str]:
    """Per judged impl: ``"float64"`` or ``"perturbation"`` (a float64 case: always ``"float64"``)."""
    if floor not in FLOORS:
        raise ValueError(f"floor must be one of {', '.join(FLOORS)}, got {floor!r}")
    ref = impls[0]
    if case.spec["dtype"] == "float64":
        return {impl: "float64" for impl in impls[1:]}
    if case.spec["dtype"] == MIXED_BFLOAT16:  # no float64 run computes in bfloat16: always measured by perturbation
        return {impl: "perturbation" for impl in impls[1:]}
    if floor != "auto":
        return {impl: floor for impl in impls[1:]}
    # float64 runs only where both sides of the pair declare they can make them
    return {impl: "float64" if _runs_float64(ref) and _runs_float64(impl) else "perturbation" for impl in impls[1:]}


def _unrefused(impls: list[str], rules: dict[str, str], refused: Mapping[str, str]) -> tuple[list[str], dict[str, str]]:
    """``impls`` and ``rules`` without the implementations that refused the case (none of their runs is planned)."""
    return [i for i in impls if i not in refused], {i: r for i, r in rules.items() if i not in refused}


def _plan(case: Case, impls: list[str], rules: dict[str, str]) -> list[tuple[str, str]]:
    """The runs to make, ``(impl, variant)``; variant ``float32``, ``float64``, ``mixed_bfloat16`` or :data:`PERTURBED`."""
    ref, dtype = impls[0], case.spec["dtype"]
    plan: list[tuple[str, str]] = [(impl, dtype) for impl in impls]
    for impl, rule in rules.items():
        for side in (ref, impl):
            if rule == "float64" and dtype == "float32":
                plan.append((side, "float64"))
            elif rule == "perturbation" and _rerunnable(side):
                plan.append((side, PERTURBED))
    if dtype == MIXED_BFLOAT16:  # each side's bfloat16 signature (_bf16_guard), float64 run and further reruns
        plan.extend((impl, BF16_CHECK) for impl in impls if _rerunnable(impl))
        plan.extend((impl, key) for key in ("float64", BF16_ROUNDED64) for impl in impls if _runs_float64(impl))
        plan.extend((impl, key) for key in BF16_RERUN_KEYS[1:] for impl in impls if _rerunnable(impl))
        plan.extend((impl, key) for key in BF16_RERUN64_KEYS for impl in impls if _rerunnable(impl) and _runs_float64(impl))
    return _float64_first(plan)


def _float64_first(plan: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """float64 runs first (a stable sort: the order within is kept): what a run leaves behind in the
    allocators (measured: 0.2-0.4 GB after a 25 M-parameter TensorFlow run) adds to the next run's
    peak, so the runs with twice the float32 working set go while the least is retained."""
    return sorted(dict.fromkeys(plan), key=lambda item: item[1] != "float64")


def _beside(work: Callable[[list], None], here: list, there: list) -> None:
    """``work(here)`` in this thread while ``work(there)`` runs in another; the first error is raised.

    The other thread is a daemon: on an error or Ctrl-C here it is not waited for (its pool job
    ends when the pool is shut down at exit, which leaves no worker behind).
    """
    failed: list[BaseException] = []

    def run() -> None:
        try:
            work(there)
        except BaseException as e:  # handed to the caller's thread
            failed.append(e)

    thread = threading.Thread(target=run, name="tfpar-torch-runs", daemon=True)
    thread.start()
    work(here)
    thread.join()
    if failed:
        raise failed[0]


#: the built-in that computes what a plugin of each kind computes (framework, splits the batch)
STAND_INS = {("tf", True): "tf.towers", ("tf", False): "tf.single", ("torch", True): "torch.ddp",
             ("torch", False): "torch.single"}


@dataclass(frozen=True)
class SideMapping:
    """Make ``side`` compute what ``other`` computes: run ``runs_as`` with ``changes`` (``theory.mapping_changes``).

    ``runs_as`` is ``side`` itself when it is a built-in. When ``side`` is a plugin (the tool
    never asks a plugin to read a mapped value), it is the built-in of the same kind
    (:data:`STAND_INS`), and the residual is judged through it: ``side`` against the built-in
    as it runs, and ``other`` against the built-in mapped. Both at parity means the pair's gap
    is the predicted one (the triangle inequality through the built-in's two runs).
    """

    side: str
    other: str
    changes: dict[str, Any]
    runs_as: str
    #: a stand-in's own changes, so that as it runs it computes what the plugin computes (a TensorFlow
    #: plugin's Keras optimizer holds its own float32 hyperparameters, or none): ``None`` for none
    plain: SideMapping | None = None

    @property
    def stand_in(self) -> bool:
        return self.runs_as != self.side

    @property
    def ident(self) -> tuple[str, str]:
        return self.runs_as, self.key

    @property
    def key(self) -> str:
        """The trajectory key suffix of the mapped runs (one per mapping: pairs may map the same side differently)."""
        digest = hashlib.sha256(repr(sorted((k, repr(v)) for k, v in self.changes.items())).encode()).hexdigest()[:8]
        return f"{MAPPED}:{digest}"

    @property
    def text(self) -> str:
        shown = ", ".join(f"{k} {'removed' if v is ... else v}" for k, v in self.changes.items()
                          if not (v is ... and k.startswith("parallel.") and k != "parallel.clip"))
        through = f" (standing in for {self.side})" if self.stand_in else ""
        return f"{self.runs_as}{through} run with {shown}"

    def apply(self, case: Case) -> Case:
        return case.replace(**self.changes)


def keras_rounding_of(impl: str, traj: Any) -> str | None:
    """What a TensorFlow plugin's Keras optimizer held in float32, from what its run saw.

    ``floatx_float32`` / ``floatx_float64``: every Keras optimizer it made was made under that
    ``keras.config.floatx()`` (its learning-rate variable's dtype, ``tfpar.keras_seen``); ``none``: it
    made no Keras optimizer (its own rule, hyperparameters exact); ``ambiguous``: optimizers of
    both kinds. ``None`` for a built-in or an implementation that does not report it.
    """
    found = _declared(impl)
    if found is None or found.kind == "builtin" or found.framework != "tf":
        return None
    seen = getattr(traj, "meta", {}).get("keras_optimizers")
    if seen is None:
        return None
    # Keras' classes only: a tf.compat.v1 optimizer (``family``) holds what it was given (as before it was seen)
    dtypes = {o.get("lr_dtype") for o in seen if not o.get("family")}
    if not dtypes:
        return "none"
    if len(dtypes) > 1:
        return "ambiguous"
    return {"float32": "floatx_float32", "float64": "floatx_float64"}.get(dtypes.pop(), "ambiguous")


def held_roundings(impls: list[str], trajs: dict[str, Any], dtype: str) -> dict[str, str | None]:
    """:func:`keras_rounding_of` for each implementation, read from the run whose numbers decide.

    A float32 case is decided by its float64 runs where they exist: what a plugin's optimizer held
    there (a plugin that follows docs/plugins.md's Keras recipe, ``set_floatx(run.dtype)``, holds its
    learning rate in float64 in its float64 run, and in float32 in its float32 run, where every
    number is float32 anyway) is what the mapping must reproduce. Without a float64 run (a
    float32-only plugin, judged by the perturbation), the case dtype's run.
    """
    return {impl: keras_rounding_of(impl, trajs.get(f"{impl}@float64", trajs.get(f"{impl}@{dtype}", {})))
            for impl in impls}


def writes_own_rule(impl: str, traj: Any) -> bool:
    """Whether the TensorFlow plugin ``impl`` made no optimizer of a framework's class in the run ``traj``.

    Neither a Keras optimizer nor a ``tf.compat.v1`` one (``tfpar.keras_seen``): its update rule is
    what its code writes out (``theory.predict``'s ``own``). ``False`` for a built-in, a torch side
    or a run that does not report it (:func:`torch_rule_of` says it for a torch plugin).
    """
    found = _declared(impl)
    if found is None or found.kind == "builtin" or found.framework != "tf":
        return False
    seen = getattr(traj, "meta", {}).get("keras_optimizers")
    return seen is not None and not seen


def torch_rule_of(impl: str, traj: Any) -> str | None:
    """Why the torch plugin ``impl``'s update rule is not torch's class for the case, from its run; ``None`` if it is.

    Read from what the run made (``torchref.torch_seen``): the optimizer handed to
    ``run.use_optimizer`` where there is one, else every ``torch.optim`` optimizer it made. No
    ``torch.optim`` class at all: its rule is its own code's (Keras' Adam written out, a
    ``torch.optim.Optimizer`` subclass with its own ``step``); one whose class or values are not
    what the case's optimizer makes (``torch.optim.Adam`` where the case says ``adamw``, another
    ``eps``): its rule is another. ``None`` also for a built-in, a TensorFlow side, and a run that
    does not report it (a recorded run).
    """
    found = _declared(impl)
    if found is None or found.kind == "builtin" or found.framework != "torch":
        return None
    seen = getattr(traj, "meta", {}).get("torch_optimizers")
    return None if seen is None else torch_rule_from(seen)


def torch_rule_from(seen: list[dict[str, Any]]) -> str | None:
    """:func:`torch_rule_of` from a run's records (``torchref.torch_seen``): ``None`` where it runs torch's class
    for the case at the case's values (the handed optimizer where there is one, else every ``torch.optim`` one)."""
    handed = [o for o in seen if o.get("handed")]
    steps = handed or [o for o in seen if o.get("family") == "torch.optim"]
    if all(o.get("family") != "torch.optim" for o in steps):  # none, or a handed one with a step of its own
        made = ", ".join(sorted({o["rule"] for o in (steps or seen)}))
        return ("made no torch.optim optimizer" + (f" (only {made}, with a step of its own)" if made else "")
                + ", so its update rule is its own code's")
    other = next((o for o in steps if not o.get("case_rule")), None)
    if other is not None:
        return f"made {other['differs']}: its update rule is not torch's for the case's optimizer"
    return None


def own_rules(impls: list[str], trajs: dict[str, Any], dtype: str) -> dict[str, str]:
    """The implementations of ``impls`` whose update rule is not their framework's class for the case, and why.

    A TensorFlow plugin that made no Keras or ``tf.compat.v1`` optimizer (:func:`writes_own_rule`);
    a torch plugin that made no ``torch.optim`` optimizer, or one that is not the case's
    (:func:`torch_rule_of`). Read from the run whose numbers decide (its float64 run where it made one).
    """
    out: dict[str, str] = {}
    for impl in impls:
        traj = trajs.get(f"{impl}@float64", trajs.get(f"{impl}@{dtype}", {}))
        if writes_own_rule(impl, traj):
            out[impl] = "made no Keras or tf.compat.v1 optimizer, so its update rule is its own code's"
        elif (why := torch_rule_of(impl, traj)) is not None:
            out[impl] = why
    return out


def rule_runs(trajs: dict[str, Any], runner: Runner, case64: Case) -> Callable[[str, Mapping[str, Any]], Any]:
    """``float64_run(name, changes)`` for :func:`follows_its_class`: ``name``'s float64 run of ``case64`` with
    ``changes``, made once into ``trajs``: the pair's own float64 run where there is one and nothing changes;
    else under a key of its own (``name@float64+rule``: a built-in with its class's rule, a plugin judged
    without a float64 run), so that no other rule reads it as the pair's."""
    def float64_run(name: str, changes: Mapping[str, Any]) -> Any:
        if not changes and f"{name}@float64" in trajs:
            return trajs[f"{name}@float64"]
        key = f"{name}@float64+rule"
        if key not in trajs:
            c = case64.replace(**changes)
            if name.startswith("tf.") and "tensorflow" not in sys.modules:
                # a TensorFlow built-in runs in this process, which a compare of plugins alone keeps free of
                # TensorFlow (its import, its memory): this check's run goes to the server's child instead
                from parity_tests.running.builtins import run_in_server

                trajs[key] = run_in_server(c, name)
            else:
                trajs[key] = runner(c, name)
        return trajs[key]

    return float64_run


#: the case changes that make the built-in of each framework run that framework's own class's rule with the
#: case's numbers exact, as a rule written out by hand holds them (``contract.optimizer``)
CLASS_RULE = {"tf": {"optimizer.semantics": "tf", "optimizer.keras_rounding": "none"},
              "torch": {"optimizer.semantics": "torch"}}


def follows_its_class(own: Mapping[str, str], float64_run: Callable[[str, Mapping[str, Any]], Mapping[str, Any]],
                      spec: Mapping[str, Any]) -> dict[str, str]:
    """``own`` without the plugins whose own code computes what their framework's class does for the case.

    A plugin that makes no optimizer of its framework (``own_rules``) may still write out exactly
    that framework's rule (a TF program with Keras' Adam by hand, as the hunt's rewrites do):
    theory's optimizer predictions then hold for it as for the class. Read from the runs, not
    assumed: the plugin's float64 run against the built-in of its kind (:data:`STAND_INS`) running
    that class's rule with exact numbers (:data:`CLASS_RULE`), every parameter at every step by the
    float64 rule (``float64_run(name, changes)``: each made once, also where the pair itself is
    judged in float32). At parity its rule is the class's (it
    leaves ``own``); apart, or where it cannot run float64, its rule stays its own (a TF program
    with torch's AdamW by hand parts from Keras' AdamW at the first update). A plugin whose run
    parts from the built-in for another reason (a loss term the case cannot express) stays too:
    theory then predicts no optimizer difference for it, as before this check. Under a
    learning-rate schedule the built-in's class rule follows the case's curve, as a rule written out
    does: parity there says the plugin's update rule is the class's and its rate the curve, not
    Keras' ``CosineDecay`` (one step late), so its schedule stays its own (theory's ``own_schedule``:
    every plugin of ``own_rules``, whatever this check finds).
    """
    from parity_tests.judging.rules import judge_float64

    out = dict(own)
    for impl in own:
        found = _declared(impl)
        if found is None or found.kind == "builtin" or "float64" not in found.dtypes or not found.rerunnable:
            continue
        run = float64_run(impl, {})
        try:
            stand = float64_run(STAND_INS[(found.framework, found.parallel)], CLASS_RULE[found.framework])
        except CaseError:  # a case the built-in cannot run so (an optimizer only plugins know): stays its own
            continue
        keys = [k for k in run if k.startswith("param/") and k in stand]
        if keys and judge_float64(stand, run, keys=keys, loss=False).status == "parity":
            del out[impl]
    return out


def choose_mapping(spec: dict[str, Any], ref: str, impl: str, pred: Prediction,
                   rounding: dict[str, str | None], own: Collection[str] = ()) -> SideMapping | None:
    """The side of ``(ref, impl)`` to run with the predicted differences mapped away, and how (or ``None``).

    A side can be mapped when every *expected* difference has a mapping onto it
    (``theory.mapping_changes``); known differences are mapped where they can be. A built-in
    side runs mapped itself; a plugin side through its stand-in (:class:`SideMapping`), unless
    the model is external (no built-in runs it). The judged implementation is tried first, then
    the reference, built-ins before stand-ins. ``rounding``: per TensorFlow plugin, what its Keras
    optimizer held (:func:`keras_rounding_of`); ``own``: the plugins whose rule is their code's (:func:`own_rules`).
    """
    if not any(d.mapping for d in pred.differences):
        return None
    direct, through = [], []
    for side, other in ((impl, ref), (ref, impl)):
        found = _declared(side)
        if found is None:
            continue
        if found.kind == "builtin":
            direct.append((side, other, side))
        elif "external" not in spec["model"]:  # a plugin or a recorded run: through a built-in of its kind
            through.append((side, other, STAND_INS[(found.framework, found.parallel)]))
    for side, other, runs_as in direct + through:
        changes: dict[str, Any] = {}
        fits = True
        for d in pred.differences:
            if d.mapping == LOSS_SCALE:  # mapped on the program itself (loss_scale.ExactScale), beside this mapping
                continue
            held = rounding.get(other)
            c = (None if d.mapping is None or held == "ambiguous"
                 else mapping_changes(d.mapping, spec, engine(runs_as), engine(other), held, own))
            if c is None or any(k in changes and changes[k] != v for k, v in c.items()):
                if d.expected:
                    fits = False
                    break
                continue
            changes.update(c)
        if fits and changes:
            # a stand-in first computes as the plugin does (its own Keras roundings), then as the other side
            plain = (mapping_changes("optimizer", spec, engine(runs_as), engine(side), rounding.get(side), own)
                     if runs_as != side and spec["optimizer"]["semantics"] in ("native", "tf") else None)
            if plain and all(k.startswith("optimizer.") and spec["optimizer"].get(k[len("optimizer."):], "none") == v
                             for k, v in plain.items()):
                plain = None  # the stand-in as the case is given already computes so (else the same run twice)
            merged = {**(plain or {}), **changes}
            if merged.get("optimizer.semantics", spec["optimizer"]["semantics"]) != "tf" \
                    and merged.get("optimizer.keras_rounding", "none") != "none":
                # the plugin's own Keras roundings belong to Keras' rule: mapped onto the other framework's rule
                # (``semantics: torch``, exact numbers) they go with it (else the mapped case is invalid and the
                # pair loses its mapping: a model.fit program against a torch port under native Adam)
                merged["optimizer.keras_rounding"] = "none"
            return SideMapping(side, other, merged, runs_as, SideMapping(side, side, plain, runs_as) if plain else None)
    return None


def stand_in_leg(plain: Verdict, stage: Callable[[], str | None],
                 m: SideMapping, apart: str | None = None) -> tuple[Verdict | None, str | None]:
    """What the stand-in's leg says of a residual judged through it: ``(decides, not_judged)``.

    ``plain``: the plugin ``m.side`` judged against its stand-in ``m.runs_as`` as it runs (the
    plugin's own roundings, :attr:`SideMapping.plain`), by the pair's rule; ``stage()``: where
    they part (``localise``'s stage), asked only when they do. The free compare
    (:meth:`_Judged.residual`) and ``--lockstep`` (each step's one-step runs) both decide by it:

    * ``(None, None)``: at parity (inconclusive, nothing moving, shows nothing): the stand-in computes what the plugin
      computes, and the mapped leg is the pair's residual;
    * ``(verdict, None)``: they part at the update, from the same gradient: the plugin's optimizer
      step is not the rule of its kind that theory predicted from (a torch port that decays every
      parameter), so no predicted optimizer difference explains its gap: that leg is the
      residual, a divergence naming the plugin;
    * ``(None, reason)``: they part before it (the loss, the gradients: a loss term no case field
      expresses): the stand-in computes another program, its mapped leg says nothing about the
      pair, and no residual is judged (``reason`` starts with :data:`NOT_EQUIVALENT`). Likewise
      where they part anywhere and theory predicts that they do (``apart``: its expected
      differences between the stand-in and the plugin, e.g. Keras' ``CosineDecay`` a step late in
      the built-in, the plugin's own rate on the curve): a known difference of the stand-in is not
      the plugin's fault, and the stand-in is no equivalent run.
    """
    if plain.status == "parity":
        return None, None
    if apart and plain.status != "inconclusive":  # the stand-in differs by what theory predicts: not equivalent
        return None, (f"{NOT_EQUIVALENT}: {m.runs_as}, standing in for {m.side}, does not compute what {m.side}"
                      f" computes, as predicted ({apart}; {plain.status} by {plain.rule}, gap {plain.gap:.3g})")
    # inconclusive is no showing: where nothing moves the vacuity rule reports a loss that differs (a loss term
    # the stand-in lacks: the L2 program at lr 1e-7, whose stand-in's mapped leg then made a divergence)
    if plain.status != "inconclusive" and stage() == "update":
        return dataclasses.replace(plain, detail=(
            f"{m.side} against {m.runs_as}, the built-in of its kind, from the same gradient: its update"
            f" is not the optimizer rule theory predicts for it: {plain.detail}")), None
    first = plain.detail.splitlines()[0] if plain.detail else ""
    # an error (both non-finite at the same place, an array missing) shows no difference, but no equivalence either
    does = "cannot be shown to compute" if plain.status in ("error", "inconclusive") else "does not compute"
    return None, (f"{NOT_EQUIVALENT}: {m.runs_as}, standing in for {m.side}, {does} what {m.side}"
                  f" computes ({plain.status} by {plain.rule}, gap {plain.gap:.3g} against {plain.bound:.3g}: {first})")


def residual_unjudged(final: Verdict, not_judged: str | None) -> Verdict:
    """``final`` (``pair.resolve``'s verdict) saying, once and with why, that no residual was judged (:func:`stand_in_leg`).

    Only on a verdict that is not ``parity``, ``inconclusive`` or ``error``; it replaces
    ``pair.resolve``'s own line for a pair without a mapping ("no side ... can map it away").
    """
    if not not_judged or final.status in ("parity", "inconclusive", "error"):
        return final
    kept = tuple(u for u in final.unjudged if not u.startswith("whether the predicted difference explains"))
    return dataclasses.replace(final, unjudged=(*kept, f"whether the predicted difference explains the whole gap: {not_judged}"))


def _capture_key(name: str, case: Case) -> str:
    return f"{name}|{case.spec['dtype']}|{sorted((k, str(v)) for k, v in case.spec['optimizer'].items())}" \
           f"|{sorted((k, str(v)) for k, v in case.spec['parallel'].items())}|{case.spec['model'].get('loss_semantics')}"


def _up_to(case: Case, name: str, step: int) -> Case:
    """``case`` cut to its first ``step`` steps, for a built-in's capture run of that step; else ``case`` itself.

    The chain reads only the captured step (its per-device values and the gradient it applied),
    and a built-in's step ``k`` does not depend on the steps after it: a schedule's rate is a
    function of ``k``, split data's step ``k`` reads rows ``[kB, (k+1)B)`` and the dropout masks
    are drawn row by row (``generators.dropout_masks``), so the first steps of the shorter case
    are the longer one's, bit for bit (tests/test_capture_builtins.py). Not cut: a plugin's run (the
    user's program may read the step count), a ``distributed_sampler`` dataset (its default size is
    ``steps x B``), the combines whose devices draw an order over all steps (``async``), a case of a
    kind of its own (``_Reordered``: ``Case.replace`` makes a plain case) and a case that does not
    validate shorter.
    """
    declared = registry.resolve(name, "impls")
    if (declared.kind != "builtin" or type(case) is not Case or step >= case.spec["steps"]
            or case.spec["data"].get("order", "split") != "split" or case.spec["parallel"]["combine"] in LOCAL_COMBINES):
        return case
    try:
        return case.replace(steps=step)
    except CaseError:
        return case


def inside_step(where: dict[str, Any], verdict: Verdict, sides: tuple[tuple[str, Case], tuple[str, Case]],
                 runner: Runner, captured: dict, *, beside: bool = False, stop: bool = False) -> dict[str, Any]:
    """``where`` (:func:`localise.refinable`) refined by the stage chain of its first bad step (docs/localisation.md), when both sides capture.

    ``sides``: ``(name, case)`` of the reference and the judged implementation, each the case
    that side ran (the case dtype or float64, mapped where the verdict judged a mapped run).
    ``beside``: a TensorFlow side's capture run and a torch side's run at once (the default runner's
    torch runs wait on the worker pool, as :func:`compare_case`'s runs do); the same runs either way.
    ``stop``: a built-in's capture run stops after the captured step (:func:`_up_to`).
    """
    step = where["first_bad_step"]
    missing = [name for name, _ in sides if not registry.resolve(name, "impls").captures]
    if missing:
        return {**where, "explanation": where["explanation"] + f" (per-device values: {', '.join(missing)} does not"
                                                                 " record them)"}
    keys = [(step, _capture_key(name, c)) for name, c in sides]

    def run(todo: list[int]) -> None:
        for i in todo:
            if keys[i] not in captured:
                name, c = sides[i]
                captured[keys[i]] = runner(dataclasses.replace(_up_to(c, name, step) if stop else c, capture=step), name)

    frameworks = [registry.resolve(name, "impls").framework for name, _ in sides]
    if beside and keys[0] != keys[1] and sorted(frameworks) == ["tf", "torch"]:
        _beside(run, [frameworks.index("tf")], [frameworks.index("torch")])
    else:
        run([0, 1])
    trajs = [captured[key] for key in keys]
    chain = stage_chain(trajs[0], trajs[1], step, bound_at(verdict, step), sides[0][1].spec)
    if chain is None:
        return {**where, "explanation": where["explanation"] + " (per-device values: not recorded at this step)"}
    if chain["stage"] is None:  # every captured stage agrees: keep what the recorded channels said
        return {**where, "chain": chain["chain"],
                "explanation": where["explanation"] + " (" + chain["explanation"].split(": ", 1)[-1] + ")"}
    return attach_factor(chain, trajs[0], trajs[1], sides[0][1].spec, (trajs[0], trajs[1]))  # issue 37: the factor


def _against_theory(where: dict[str, Any], pred: Prediction) -> dict[str, Any]:
    """Say whether a predicted difference appeared first at the stage theory names for it.

    A *known* difference of the pair that acts at an earlier stage (GPT-2's float64 GELU constants in
    the forward pass, before Adam's epsilon placement in the update) may show there first: the runs
    then part where theory says they may, and the note names it.
    """
    stages = [d.stage for d in pred.differences if d.expected]
    stage = stages[0] if stages else stage_of(pred.expected[0])
    seen = where.get("stage")
    known = next((d.text.split(":")[0] for d in pred.differences
                  if not d.expected and seen is not None and seen in (d.stage, d.first_visible)), None)
    note = (f"; theory predicted it first at {stage}: " + (
        "it appeared there" if seen == stage else "it did not appear" if seen is None else
        f"it appeared first at {seen}, where the known difference '{known}' acts" if known else
        f"it appeared first at {seen}"))
    return {**where, "predicted_stage": stage, "as_predicted": seen == stage or known is not None,
            "explanation": where["explanation"] + note}


def _records_grads(traj: Any) -> bool:
    params = [k for k in traj if isinstance(k, str) and k.startswith("param/")]
    return bool(params) and all(f"grad/{k[len('param/'):]}" in traj for k in params)


class _Variants(dict):
    """Cases by variant, some made only when first asked for (``later``: variant -> how to make it).

    A float32 case's perturbed variant moves every weight by an ulp: a copy of the model (GPT-2
    small in float64: 1 GB, made for the case and for each mapping) that no run reads where the
    float64 rule decides every pair.
    """

    def __init__(self, made: dict[str, Case], later: dict[str, Callable[[], Case]]) -> None:
        super().__init__(made)
        self._later = later
        self._lock = threading.Lock()  # the TensorFlow and torch runs ask from two threads (_beside)

    def __missing__(self, key: str) -> Case:
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


def _variants(case: Case) -> dict[str, Case]:
    """Every run a case may need, by variant: its dtype, float64, the perturbed reruns, the mixed-precision extras."""
    dtype = case.spec["dtype"]
    variants = {dtype: case, "float64": case if dtype == "float64" else case.replace(dtype="float64")}
    if dtype == "float32":
        return _Variants(variants, {PERTURBED: lambda: perturbed_case(case)})
    if dtype == MIXED_BFLOAT16:
        variants[PERTURBED] = perturbed_case(case)
        variants[BF16_CHECK] = case.replace(dtype="float32", steps=1)
        variants["float64"] = float64_reference(case)  # the ground truth (judging.bfloat16)
        variants[BF16_ROUNDED64] = rounded_reference(case)
        seed = case.spec.get("seed", 0)
        variants.update({key: perturbed_case(case, seed + r * RERUN_SEED_STRIDE)
                         for r, key in enumerate(BF16_RERUN_KEYS) if r})
        variants.update({k64: float64_reference(variants[key]) for key, k64 in zip(BF16_RERUN_KEYS, BF16_RERUN64_KEYS,
                                                                                    strict=True)})
    return variants


def compare_case(
    case: Case,
    impls: list[str],
    *,
    progress: bool | Callable[[str], None] = False,
    runner: Runner | None = None,
    skip_unsupported: bool = False,
    floor: str = "auto",
    stages: bool = True,
) -> CaseResult:
    """Run ``case`` on every implementation in ``impls`` and judge each against ``impls[0]``.

    Args:
        case: a validated case.
        impls: two or more implementation names; the first is the reference.
        progress: ``True`` for a progress bar on stderr, or a callable given a label per run.
        runner: ``runner(case, impl) -> trajectory`` (default: :func:`harness.run_impl`).
        skip_unsupported: when an implementation other than the reference refuses the
            case as not implemented (``CaseError``), record the pair as ``unsupported``
            instead of raising (what the matrix does for rows a path cannot run).
        floor: for a float32 case, how each side's noise floor is measured: ``"auto"``
            (float64 runs where both sides declare float64, else the one-ulp
            perturbation), ``"float64"`` or ``"perturbation"`` for every pair.
        stages: for a pair not at parity whose first bad step breaks inside the step (the loss or
            the combined gradient), run both sides once more recording that step's per-device
            values and name the first stage that breaks (:func:`localise.stage_chain`); costs
            one run per side and step, only for such pairs.
    """
    for name in impls:  # every name resolved before theory reads what kind of implementation it is
        registry.resolve(name, "impls")
    from parity_tests.session.noise import check_recorded_mix, recorded_runs

    check_recorded_mix(case, impls)  # two recorded float32 runs beside runnable ones: no rule judges their pair
    if recorded_runs(case, impls):
        raise CaseError("impls", "a runnable implementation beside the recorded float32 runs (a pair of two recorded"
                                 " float32 runs has no float64 or perturbed run to be judged by; judge them with"
                                 " parity_tests.session.noise.noise_or_bug_all, as tfpar compare does)",
                        ",".join(impls))
    refused: dict[str, str] = {}
    for name in impls:  # every implementation's refusal before any of them runs (harness.refusal)
        no = refusal(case, name)
        if no is not None and (not skip_unsupported or name == impls[0]):
            raise no
        if no is not None:
            refused[name] = str(no)
    default_runner = runner is None
    # the default runner's TensorFlow and torch runs go beside each other where both fit in memory
    # (parity_tests.running.room); a large model's go one after another, with the same results
    beside = default_runner and fits_beside(case)
    runner = runner or (lambda c, i: run_impl(c, i))
    t0 = time.perf_counter()
    dtype = case.spec["dtype"]
    variants = _variants(case)
    f64 = variants["float64"] if dtype != MIXED_BFLOAT16 else case.replace(dtype="float64")
    ref = impls[0]
    rules = _floor_rules(case, impls, floor)
    # theory reads the float64 spec (the runs that decide a float32 case), but a mixed case's own
    theory_spec = case.spec if dtype == MIXED_BFLOAT16 else f64.spec
    tf_kernels = _tf_kernels(theory_spec)
    preds = {impl: predict(theory_spec, engine(ref), engine(impl), kernels=tf_kernels) for impl in impls[1:]}
    if default_runner and not beside:  # why a large model's compare takes longer than its runs side by side
        need = (tf_bytes(case) + torch_bytes(case)) / 1e9
        _log.info("%s: TensorFlow and torch runs one after another, not beside each other: together about %.1f GB"
                  " in float64, %.1f GB available (docs/memory.md)", case.name, need, available_bytes() / 1e9)
    bar = None
    if progress is True:  # a bar on a terminal, one line per run in a log
        from parity_tests.session.progress import run_bar

        bar = run_bar(len(_plan(case, *_unrefused(impls, rules, refused))), case.name)
    trajs: dict[str, dict[str, np.ndarray]] = {}
    mapped_cases: dict[str, Case] = {}  # the key of a mapped run -> the case it ran
    unmappable: dict[tuple[str, str], str] = {}  # (runs_as, key) of a mapping whose runs could not be made -> why

    mapped_variants: dict[str, dict[str, Case]] = {}

    def case_for(impl: str, d: str, mapping: SideMapping | None) -> Case:
        if mapping is None:
            c = variants[d]
        else:  # mapped first, then made the variant (a perturbed case is not re-validated)
            if mapping.key not in mapped_variants:
                mapped_variants[mapping.key] = _variants(mapping.apply(case))
            c = mapped_variants[mapping.key][d]
        return _rerun_of(c, impl) if d.startswith(PERTURBED) else c

    def work(items: list[_Run]) -> None:
        for item in items:
            impl, d, mapping = item.impl, item.variant, item.mapping
            key = f"{impl}@{d}" + (mapping.key if mapping else "")
            if key in trajs or impl in refused or (item.serves is not None and item.serves.ident in unmappable):
                continue
            if bar is not None:
                bar.set_postfix_str(key)
            elif callable(progress):
                progress(key)
            try:
                try:
                    c = case_for(impl, d, mapping)
                    started = time.perf_counter()
                    _log.debug("%s: run %s started", case.name, key)
                    trajs[key] = runner(c, impl)
                    _log.debug("%s: run %s finished in %.2f s", case.name, key, time.perf_counter() - started)
                    if mapping is not None:
                        mapped_cases[key] = c
                except CaseError as e:
                    if item.serves is not None:  # the mapping cannot be run: its pairs get no residual
                        unmappable[item.serves.ident] = f"{item.serves.text}: {e}"
                    elif not item.required:
                        pass
                    elif not skip_unsupported or impl == ref:
                        raise
                    else:
                        refused[impl] = str(e)
            except BaseException:
                if bar is not None:
                    bar.close()  # cleared, so the error line that follows starts a line of its own
                raise
            if bar is not None:
                bar.update(1)

    def run_all(plan: list[_Run]) -> None:
        torch_side = [item for item in plan if registry.resolve(item.impl, "impls").framework == "torch"]
        if beside and torch_side and len(torch_side) < len(plan):
            # the torch runs wait on the worker pool (other processes): run them beside the TensorFlow
            # runs of this process rather than after them; results and errors are the same
            _beside(work, [item for item in plan if item not in torch_side], torch_side)
        else:
            work(plan)

    run_all([_Run(impl, d) for impl, d in _plan(case, *_unrefused(impls, rules, refused))])
    # second round: what the first runs decide. The mapped runs (a TensorFlow plugin's Keras
    # optimizer says what it held), and a gradient for the loss channel where no side records one
    rounding = held_roundings(impls, trajs, dtype)
    own = own_schedule = own_rules(impls, trajs, dtype)  # own_schedule: their rates are their code's (theory)
    if "external" not in case.spec["model"]:  # (no built-in runs an external model)
        own = follows_its_class(own, rule_runs(trajs, runner, variants["float64"]), case.spec)
    # Keras' distribution loss scale, read from each float64 run: a pair judged without float64 runs (the
    # perturbation rule) sees only float32 runs, whose float32(1/N) is float32 arithmetic's own
    scales = loss_scales(impls, trajs)
    preds = {impl: predict(theory_spec, engine(ref), engine(impl), held=rounding, kernels=tf_kernels, own=own,
                           own_schedule=own_schedule,
                           scales=scales if rules.get(impl) == "float64" else None) for impl in impls[1:]}
    mappings: dict[str, SideMapping | None] = {}
    apart: dict[tuple[str, str], str] = {}  # a stand-in and its plugin: what theory expects to differ between them
    exact: dict[str, tuple[ExactScale, ...]] = {}  # per pair, its programs rerun with the loss scale exact
    second: list[_Run] = []
    for impl in impls[1:]:
        if impl in refused:
            continue
        m = mappings[impl] = choose_mapping(theory_spec, ref, impl, preds[impl], rounding, own)
        needed = ["float64"] if dtype == "float64" else (
            [dtype, "float64"] if rules[impl] == "float64" else
            [dtype, "float64", BF16_ROUNDED64, *BF16_RERUN_KEYS, *BF16_RERUN64_KEYS] if dtype == MIXED_BFLOAT16
            else [dtype, PERTURBED])
        if any(d.mapping == LOSS_SCALE for d in preds[impl].differences) and rules[impl] == "float64":
            exact[impl] = tuple(ExactScale(x, f) for x in (ref, impl) if (f := scales.get(x)) is not None)
            second.extend(_Run(e.side, d, e, serves=e) for e in exact[impl] for d in needed)
        if m is None:
            continue
        second.extend(_Run(m.runs_as, d, m, serves=m) for d in needed)
        if m.stand_in:  # the built-in as the plugin runs, against the plugin it stands in for
            second.extend(_Run(m.runs_as, d, m.plain, serves=m) for d in needed)
            plain_spec = m.plain.apply(case.replace(dtype=theory_spec["dtype"])).spec if m.plain else theory_spec
            differs = predict(plain_spec, engine(m.runs_as), engine(m.side), held=rounding, kernels=tf_kernels, own=own,
                              own_schedule=own_schedule).expected
            if differs:
                apart[(m.runs_as, m.side)] = "; ".join(t.split(":")[0] for t in differs)
    grads_from = _grads_source(case, impls, rules, trajs, refused)
    if grads_from is not None:
        second.append(_Run(grads_from, "float64", required=False))
    second = _float64_first_runs(second)
    if bar is not None:
        bar.total += len(second)
    run_all(second)
    if bar is not None:
        bar.close()
    grads = [trajs[f"{grads_from}@float64"]] if grads_from is not None and f"{grads_from}@float64" in trajs else []

    judged = _Judged(case, variants, rules, trajs, mapped_cases, grads, runner, stages, beside=beside, apart=apart)
    for impl, ex in exact.items():  # a rerun that could not be made: that pair's loss scale is not mapped
        if any(e.ident in unmappable or f"{e.side}@{dtype}{e.key}" not in trajs for e in ex):
            exact[impl] = ()
    pairs = []
    for impl in impls[1:]:
        if impl in refused:
            nan = float("nan")
            verdict = Verdict(UNSUPPORTED, "not implemented", nan, nan, None, None, np.array([]), None,
                              f"{impl} does not run this case: {refused[impl]}")
            pairs.append(PairResult(ref, impl, verdict, preds[impl]))
            continue
        m = mappings.get(impl)
        note = ()
        if m is not None and (m.ident in unmappable or f"{m.runs_as}@{dtype}{m.key}" not in trajs):
            note = (f"could not map the predicted difference ({unmappable.get(m.ident, m.text)})",)
            m = None
        pair = judged.pair(ref, impl, preds[impl], m, exact.get(impl, ()))
        pairs.append(dataclasses.replace(pair, notes=pair.notes + note))
    return CaseResult(case, list(impls), pairs, trajs, time.perf_counter() - t0)


@dataclass
class _Judged:
    """What :func:`compare_case` ran, and how to judge one pair from it."""

    case: Case
    variants: dict[str, Case]
    rules: dict[str, str]
    trajs: dict[str, dict[str, np.ndarray]]
    mapped_cases: dict[str, Case]
    grads: list[dict[str, np.ndarray]]
    runner: Runner
    stages: bool
    captured: dict[Any, dict[str, np.ndarray]] = field(default_factory=dict)
    beside: bool = False  # capture runs of a TensorFlow and a torch side at once (the default runner, room for both)
    #: (stand-in, plugin) -> the differences theory expects between them as the stand-in runs (:func:`stand_in_leg`)
    apart: dict[tuple[str, str], str] = field(default_factory=dict)

    def side(self, name: str, suffix: str = "") -> Side:
        """``name``'s runs (``suffix``: a mapping's key for its mapped runs)."""
        d = self.case.spec["dtype"]
        return Side(self.trajs[f"{name}@{d}{suffix}"], self.trajs.get(f"{name}@float64{suffix}"),
                    self.trajs.get(f"{name}@{PERTURBED}{suffix}"))

    def verdict(self, ref: str, impl: str, a: tuple[str, str] | None = None, b: tuple[str, str] | None = None) -> Verdict:
        """``pair.judge_sides`` on the pair ``(ref, impl)`` by its rule, with the mixed-precision guards.

        ``a``, ``b``: ``(name, suffix)`` of the runs that stand for each side (default: the side's own
        runs as it ran), e.g. a built-in's mapped runs.
        """
        dtype = self.case.spec["dtype"]
        mixed = dtype == MIXED_BFLOAT16
        loss_differs = reported_loss_differs(self.case.spec, engine(ref), engine(impl))
        perturbation = ({"rule": RULE_BF16_PERTURBATION, "perturbed": "inputs moved by one bfloat16 ulp, weights and"
                         " hyperparameters by one float32 ulp", "loss": False if loss_differs else None} if mixed else
                        {"perturbed": _perturbed_text(self.variants[PERTURBED], (ref, impl))}
                        if PERTURBED in self.variants and self.rules[impl] == "perturbation" else None)
        sa, sb = self.side(*(a or (ref, ""))), self.side(*(b or (impl, "")))
        bf16 = None  # a mixed pair whose sides ran float64 and their reruns: held against float64 (judging.bfloat16)
        if mixed and all(_bf16_sides(self.trajs, *s) for s in (a or (ref, ""), b or (impl, ""))):
            sides = (a or (ref, ""), b or (impl, ""))
            both_tf = all(registry.resolve(n, "impls").framework == "tf" for n, _ in sides)
            bf16 = tuple(_bf16_side(self.case, n, self.trajs, x, both_tf) for n, x in sides)
        v = judge_sides(dtype, sa, sb, rule=self.rules[impl], grads=self.grads, perturbation=perturbation,
                        bfloat16=bf16, zero=zero_gradients(self.case.spec))
        if a is None and b is None:  # a plugin declared deterministic=False: against its run-to-run spread
            v = _within_spread(v, ref, impl, self.variants, dtype, self.trajs, self.runner)
        if loss_differs:
            v = _loss_reported(v, sa.run, sb.run)
        if mixed:
            v = _bf16_guard(v, ref, impl, self.trajs)
        return v

    def residual(self, ref: str, impl: str, m: SideMapping | None, exact: tuple[ExactScale, ...] = ()
                 ) -> tuple[Verdict | None, tuple[tuple[str, str], tuple[str, str]], str | None]:
        """The pair judged with ``m``'s differences mapped away, the runs that decided it, and why it was not.

        A built-in side: the pair with that side's mapped runs. A plugin side, through its stand-in
        ``S``: the other side against ``S`` mapped, judged only once ``S`` is shown to compute what
        the plugin computes: the plugin against ``S`` as it runs (:attr:`SideMapping.plain`: the
        plugin's own roundings) by the same rule. Parity there and parity of the mapped leg give
        the pair's residual by the triangle inequality through ``S``'s two runs (each within the
        rule's bound). Where ``S`` and the plugin part, where they part says which:

        * at the update, from the same gradient (``localise``'s stage ``update``): the plugin's
          optimizer step is not the rule of its kind that theory predicted from (a torch port
          that decays every parameter), so no predicted optimizer difference explains its gap:
          that leg is the residual, a divergence naming the plugin;
        * before it (the loss, the gradients): ``S`` computes another loss (a loss term no case
          field expresses, the TF2 custom-loop tutorial's kernel regularizers): its mapped leg
          says nothing about the plugin, so no residual is judged (``None``, and the reason,
          which the report gives as "residual not judged: no equivalent run"): the pair is then
          resolved as one without a mapping (``pair.resolve``: the stage where it parts against
          theory's). A stand-in that computes another program never makes a divergence of its own.

        ``exact``: the programs of the pair rerun with Keras' distribution loss scale exact
        (``session.loss_scale``): such a side is its exact rerun wherever it takes part, beside
        ``m`` (which may be ``None``: the loss scale is then the only mapping).
        """
        keys = {e.side: e.key for e in exact}

        def own_run(name: str) -> tuple[str, str]:
            return name, keys.get(name, "")

        if m is None:
            a, b = own_run(ref), own_run(impl)
            return self.verdict(ref, impl, a, b), (a, b), None
        mapped = (m.runs_as, m.key)
        a, b = (own_run(ref), mapped) if m.side == impl else (mapped, own_run(impl))
        if m.stand_in:
            own, stand = own_run(m.side), (m.runs_as, m.plain.key if m.plain else "")
            plain = self.verdict(ref, impl, stand, own)
            decides, not_judged = stand_in_leg(plain, lambda: self.localised(plain, stand, own).get("stage"), m,
                                               self.apart.get((m.runs_as, m.side)))
            if decides is not None:
                return decides, (stand, own), None
            if not_judged is not None:
                return None, ((ref, ""), (impl, "")), not_judged
        return self.verdict(ref, impl, a, b), (a, b), None

    def localised(self, verdict: Verdict, a: tuple[str, str], b: tuple[str, str]) -> dict[str, Any]:
        """The localisation (docs/localisation.md) of ``verdict`` from the arrays its rule judged (refined by a capture)."""
        # float64 when the float64 rule decided (also in a float32 case, where 1e-10 would call
        # float32 rounding a difference), mapped as judged
        d = "float64" if verdict.rule == RULE_FLOAT64 and f"{a[0]}@float64{a[1]}" in self.trajs else self.case.spec["dtype"]
        runs = [self.trajs[f"{n}@{d}{suffix}"] for n, suffix in (a, b)]
        where = localise(runs[0], runs[1], verdict)
        if self.stages and refinable(where, runs[0], runs[1]):
            cases = [self.mapped_cases[f"{n}@{d}{suffix}"] if suffix else self.variants[d] for n, suffix in (a, b)]
            where = inside_step(where, verdict, ((a[0], cases[0]), (b[0], cases[1])), self.runner, self.captured,
                                beside=self.beside, stop=True)
        if "factor" not in where:  # issue 37: a constant scale at the first bad stage (judging.factor)
            where = attach_factor(where, runs[0], runs[1], self.case.spec)
        # issue 37: would the logged loss alone (rtol 1e-3) have shown it, in the case dtype as a user logs it
        d0 = self.case.spec["dtype"]
        logged = [self.trajs.get(f"{n}@{d0}{s}", r) for (n, s), r in zip((a, b), runs, strict=True)]
        where = attach_loss_only(where, logged[0], logged[1], self.case.spec)
        return dict(with_layer(where, self.case.spec))  # the layer (path and type) its name belongs to

    def pair(self, ref: str, impl: str, pred: Prediction, m: SideMapping | None,
             exact: tuple[ExactScale, ...] = ()) -> PairResult:
        """The pair judged as it ran and, with ``m`` (and ``exact``: programs rerun with Keras' distribution loss
        scale exact), with the predicted differences mapped away (``pair.resolve``)."""
        as_ran = ((ref, ""), (impl, ""))
        v = self.verdict(ref, impl)
        mapped_any = m is not None or bool(exact)
        residual, decided, not_judged = self.residual(ref, impl, m, exact) if mapped_any else (None, as_ran, None)
        text = "; ".join(([m.text] if m is not None else []) + [e.text for e in exact]) or None
        where = self.localised(v, *as_ran) if v.status not in ("parity", "inconclusive") else None
        res = resolve(v, pred, residual=residual, stage=(where or {}).get("stage"), mapping=text)
        final = residual_unjudged(res.verdict, not_judged)
        if final.status in ("parity", "inconclusive"):
            where = None
        elif residual is not None and res.from_residual and residual.status != "parity":
            where = self.localised(residual, *decided)  # where what the mapping does not explain parts
        elif where is None:
            where = self.localised(v, *as_ran)
        if where is not None and pred.expected:
            where = _against_theory(where, pred)
        notes = res.notes
        if final.status == "divergence" and final.rule == RULE_FLOAT64:
            final, note = self.conditioned(final, decided if res.from_residual else as_ran)
            notes += (note,) if note else ()
            where = None if final.status == "inconclusive" else where
        leaks = tuple(leak_text(name) for name in (ref, impl) if loss_in_float32(self.trajs.get(f"{name}@float64")))
        if leaks and final.key == "loss" and final.status not in ("parity", "inconclusive"):
            first, _, rest = final.detail.partition("\n")
            final = dataclasses.replace(final, detail=first + "; " + "; ".join(leaks) + (("\n" + rest) if rest else ""))
        return PairResult(ref, impl, final, pred, text, v.gap if mapped_any else None, where, residual,
                          notes + leaks, decided if res.from_residual else None, not_judged)

    def conditioned(self, verdict: Verdict, sides: tuple[tuple[str, str], tuple[str, str]]) -> tuple[Verdict, str]:
        """A float64 divergence held against how far one float64 ulp of the inputs moves each run (``RULE_CONDITIONING``).

        The float64 bound assumes a stable run: rounding carried from step to step without
        growing (``bounds``: ``gap <= 2 u D sqrt(n) T``). An ill-conditioned run (Adam with
        ``beta2 = 0`` dividing by a gradient element that cancels to ``1e-10``, a chaotic learning
        rate) amplifies the last bit of a sum into the leading digits, and two correct
        implementations part by as much. Each side that can run again does so in float64 from
        initial weights and inputs moved by one float64 ulp (a built-in also adding its sums in
        another order, :func:`_resummed`): its spread ``s`` is what one rounding of every input
        becomes, so the run's own ``D sqrt(n)`` roundings a step over ``T`` steps can become
        ``2 D sqrt(n) T s`` (the float64 bound's envelope, ``D = 20``, ``n = 1e4``, with ``u``
        replaced by the measured ``s``). A stable run spreads by about ``1e-16`` and the bound
        stays far below any divergence, which then stands. Where the gap is within it the float64
        runs cannot tell a difference from amplified rounding: the pair is ``inconclusive``, and
        the detail says to judge it with ``--lockstep`` (every step from the same state).
        Returns the verdict and a line for the report.
        """
        from parity_tests.session.spread import nondeterministic

        if any(nondeterministic(name) for name, _ in sides):  # its reruns would measure its own run-to-run
            return verdict, ""  # noise, not conditioning: judged against that spread already (judging.spread)
        runs, reruns, cases = [], [], []
        for name, suffix in sides:
            key = f"{name}@float64{suffix}"
            found = _declared(name)
            if key not in self.trajs or (found is not None and not found.rerunnable):
                return verdict, ""
            c = self.mapped_cases.get(key) or self.variants["float64"]
            seed = c.spec.get("seed", 0)
            moved = dataclasses.replace(c, init=perturb_ulp(c.init, seed, np.float64),
                                        x=c.x if np.asarray(c.x).dtype.kind != "f"
                                        else perturb_ulp({"x": c.x}, seed, np.float64)["x"])
            if _reorders(name) and _reorderable(c.replace(dtype="float32")):
                # on its own devices: the spread of this computation, not of the full batch's
                moved = _resummed(moved, one_device=False)
            runs.append(self.trajs[key])
            reruns.append(self.runner(moved, name))
            cases.append((c, moved))
        factor = 2 * CONDITIONING_ROUNDINGS * self.case.spec["steps"]
        checked = judge_perturbation(runs[0], runs[1], a32p=reruns[0], b32p=reruns[1], rule=RULE_CONDITIONING,
                                     perturbed="float64 reruns from weights and inputs moved by one float64 ulp",
                                     dtype=np.float64, abs_floor=FLOAT64_RTOL, factor=factor,
                                     known_differences=verdict.known_differences)
        spread = max(checked.floor_a or 0.0, checked.floor_b or 0.0)
        if checked.status != "parity":
            return verdict, (f"the float64 runs are well conditioned here: one float64 ulp of the inputs moves them"
                             f" by at most {spread:.2g}, which rounding cannot amplify to the gap")
        unsteady = self.unreproduced(verdict, sides, runs, reruns, cases)
        if unsteady is not None:
            return unsteady
        return dataclasses.replace(checked, status="inconclusive", detail=(
            f"inconclusive: ill-conditioned float64 runs: one float64 ulp of the weights and inputs moves each run by"
            f" up to {spread:.2g}, and the run's own rounding can grow as far as the two runs are apart (judge it"
            f" with --lockstep, every step from the same state); {checked.detail}; by the float64 bound:"
            f" {verdict.detail.splitlines()[0]}")), "ill-conditioned: the float64 rule cannot separate the gap from rounding"


    def unreproduced(self, verdict: Verdict, sides: tuple[tuple[str, str], tuple[str, str]],
                     runs: list[dict[str, np.ndarray]],
                     reruns: list[dict[str, np.ndarray]], cases: list[tuple[Case, Case]],
                     ) -> tuple[Verdict, str] | None:
        """Whether the conditioning floor measured a side that does not reproduce itself, and the verdict then.

        A one-ulp rerun measures conditioning only if the run is a function of its inputs. A
        plugin with an order left to thread timing (the TF1 cifar10 trainer's moving averages,
        grouped with the update but not after it: each average reads its variable before or
        after the step) may take another order in that rerun, and its spread is then the race's,
        not rounding's: the pair would be called ill-conditioned for a program that is merely
        not deterministic. So, before that answer, each side runs the same moved case again and,
        where that repeats bit for bit, the case as judged again. Deterministic runs repeat bit
        for bit (the frameworks' op determinism is on; a built-in's resummed order is fixed by
        its seed). Where a repeat differs, the side is nondeterministic, the two runs' gap from
        the same inputs is its run-to-run spread, and the divergence is judged against that
        spread as a plugin declared ``deterministic=False`` is (``spread``). Both repeats, not
        one: a rare order seen in the moved rerun is unlikely to recur in its repeat, and a rare
        order in the judged run unlikely to recur in its own (a test plugin alternating two
        orders run by run is caught by the first).

        Returns ``None`` (every side reproduces itself: the conditioning answer stands) or the
        verdict and the report's line.
        """
        from parity_tests.session.spread import spread_rows, within_spread

        spreads, named = [], []
        for (name, _), run, moved_run, (case, moved) in zip(sides, runs, reruns, cases, strict=True):
            pair = [moved_run, self.runner(moved, name)]  # the moved run first: a reran order shows there most
            if _same_run(*pair):
                pair = [run, self.runner(case, name)]
                if _same_run(*pair):
                    spreads.append(None)
                    continue
            spreads.append(spread_rows(pair))
            named.append(name)
        if not named:
            return None
        zero = next(s for s in spreads if s is not None)
        spreads = [s if s is not None else (np.zeros_like(zero[0]), None) for s in spreads]
        greatest = max(float(np.nanmax(s[0], initial=0.0)) for s in spreads)
        line = (f"{' and '.join(named)} does not reproduce itself: two float64 runs from the same inputs differ by up"
                f" to {greatest:.2g} (an order left to thread timing?), so its one-ulp rerun measured that, not"
                f" conditioning; judged against its run-to-run spread (declare it deterministic=False, or fix the race)")
        judged = within_spread(verdict, spreads[0], spreads[1],
                               f"{' and '.join(named)} rerun from the same inputs")
        return dataclasses.replace(judged, detail=f"{line}; {judged.detail}"), line


def _same_run(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether two runs of the same case recorded the same numbers, bit for bit (NaN equal to NaN)."""
    if a.keys() != b.keys():
        return False
    return all(np.array_equal(np.asarray(a[k]), np.asarray(b[k]),
                              equal_nan=np.asarray(a[k]).dtype.kind in "fc") for k in a)


def _within_spread(verdict: Verdict, ref: str, impl: str, variants: dict[str, Case], dtype: str,
                   trajs: dict[str, dict[str, np.ndarray]], runner: Runner) -> Verdict:
    """A divergence with a nondeterministic plugin on a side, judged against its run-to-run spread (``spread``)."""
    from parity_tests.session.spread import judge_with_spread

    d = "float64" if verdict.rule == RULE_FLOAT64 and f"{ref}@float64" in trajs else dtype
    if f"{ref}@{d}" not in trajs or f"{impl}@{d}" not in trajs:
        return verdict

    def rerun(name: str, i: int) -> dict[str, np.ndarray]:
        key = f"{name}@{d}+rerun{i}"
        if key not in trajs:
            trajs[key] = runner(variants[d], name)
        return trajs[key]

    return judge_with_spread(verdict, (ref, impl), (trajs[f"{ref}@{d}"], trajs[f"{impl}@{d}"]), rerun)


@dataclass(frozen=True)
class _Run:
    """One run :func:`compare_case` makes: ``impl`` in ``variant``, mapped by ``mapping`` if given.

    ``serves``: the mapping this run is made for (a mapped run, or a stand-in's own run): if it
    cannot be made, that mapping's pairs are judged without a residual. ``required``: a run whose
    refusal is an error of the comparison (not for the loss channel's extra gradient).
    """

    impl: str
    variant: str
    mapping: SideMapping | None = None
    serves: SideMapping | None = None
    required: bool = True


def _float64_first_runs(plan: list[_Run]) -> list[_Run]:
    """Each run once (by what it computes), float64 first (:func:`_float64_first`)."""
    seen: dict[tuple[str, str, str], _Run] = {}
    for item in plan:
        seen.setdefault((item.impl, item.variant, item.mapping.key if item.mapping else ""), item)
    return sorted(seen.values(), key=lambda item: item.variant != "float64")


def _grads_source(case: Case, impls: list[str], rules: dict[str, str], trajs: dict[str, Any],
                  refused: dict[str, str]) -> str | None:
    """A built-in whose float64 run gives the loss channel a gradient where neither side of a float64-rule pair records one.

    ``loss_channel.loss_sensitivity``: the loss of step ``k`` is judged against its bound only where a
    gradient bounds how the parameters' rounding moves it (or where both sides start the step from
    the same numbers). ``None`` when every such pair has a gradient, the model is external (no
    built-in runs it), or the built-ins refuse the case.
    """
    ref = impls[0]
    wanting = [impl for impl in impls[1:] if impl not in refused and rules[impl] == "float64"
               and not any(_records_grads(trajs.get(f"{n}@float64", {})) for n in (ref, impl))]
    if not wanting or "external" in case.spec["model"]:
        return None
    for name in ("tf.single", "torch.single"):
        if f"{name}@float64" in trajs:
            return name
    return "tf.single"
