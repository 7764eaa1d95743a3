"""Lockstep judging (``tfpar compare --lockstep``): every step from the reference's state of the step before.

A free run lets errors compound: in a chaotic float32 run (a long run, a large learning
rate) rounding grows past any bound, and a semantic difference that starts at step 40
hides behind the rounding that grew from step 1. In lockstep, step ``k`` of every
implementation starts from the *reference's* parameters, non-trainable state (batch-norm
moving statistics) and optimizer state (slots, step counter, hence the schedule's
position) after step ``k - 1``, and only that one step is judged::

    S_0        = the case's initial values, a fresh optimizer
    S_k        = Ref(S_{k-1}, batch k)                  the reference's own sequence
    gap_k(X)   = gap(Ref(S_{k-1}, batch k), X(S_{k-1}, batch k))

so a gap cannot be carried from one step into the next. The first step whose one-step
gap exceeds its bound is the first bad step (``first_bad_step``, docs/localisation.md). Where that
step breaks inside the step (``localise.refinable``), both sides run it once more from the
same start with capture on (:func:`captured_step`) and its stage chain names the stage and
device (``capture.inside_step``, as a free comparison does at its first bad step).

Design: one-step runs from a start state carried in the payload (not a bisection by
replay from recorded states: a bisection needs the states anyway, judges ``log2 T`` steps
where this judges all ``T`` and so also gives the per-step curve, and would stop at *a*
bad step where the curve shows every one). The reference's sequence is its own lockstep
chain: on ``tf.towers``/``tf.single`` one trainer runs on and exports its optimizer state
after every step (:mod:`tfpar.lockstep`), elsewhere each one-step run starts from the
previous one's result. That chain is bit for bit the reference's free run (loading a state
is exact), so the reference's one-step gap against itself is 0 by construction.

Bounds, per step (``docs/lockstep.md``):

* float64 case: the float64 rule of :func:`~parity_tests.judging.rules.judge_float64`
  on the two one-step runs (bound ``FLOAT64_RTOL``, derived for up to 200 steps: one step
  is far inside it; the loss's bound is ``FLOAT64_RTOL`` since both start alike).
* float32 case: the float32 rule of :func:`~parity_tests.judging.rules.judge_float32`
  with one-step float64 runs *from the same float32 start state* (exact in float64)::

      floor_X[k] = gap(X32(S_{k-1}), X64(S_{k-1}))
      bound[k]   = 2 max(floor_Ref[k], floor_X[k]) + 4 * 2**-24

  The triangle inequality through the two float64 one-step runs holds exactly as in the
  free rule, since all four runs start from the same numbers; the float64 one-step runs
  are judged by the float64 rule first.

Supported: ``data.order: split``, ``parallel.combine`` ``grad_mean``/``loss_mean``. The
optimizer state is loaded and exported by ``tf.towers``, ``tf.single``, ``torch.ddp`` and
``torch.single`` (``tfpar.optimizers.load_state``, ``torchref.optimizers.load_state``) and by
plugins, which hand their optimizer over (``run.use_optimizer``, docs/plugins.md "Lockstep");
every other implementation (``tf.v1``, ``tf.mirrored``) takes part when the case's
optimizer has no state (``sgd`` with a constant schedule), where a one-step run from
``run.initial`` is already lockstep. Native momentum buffers differ between the frameworks
by a factor ``-lr``: such cases are refused (``semantics: tf`` or ``torch`` run them).
"""

from __future__ import annotations

import copy
import dataclasses
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from parity_tests.contract.case import Case
from parity_tests.contract.generators import dropout_masks
from parity_tests.judging.bounds import FLOAT32_ABS_FLOOR, FLOAT32_FACTOR, FLOAT64_RTOL, SCALE_FLOOR
from parity_tests.judging.compare import relative_gap
from parity_tests.judging.factor import attach as attach_factor
from parity_tests.judging.localise import localise, refinable, with_layer
from parity_tests.judging.loss_only import attach as attach_loss_only
from parity_tests.judging.pair import Side, judge_sides, with_findings
from parity_tests.judging.precision_leak import not_float64
from parity_tests.judging.rules.spread import Spread
from parity_tests.judging.theory import LOSS_SCALE, Prediction, engine, predict
from parity_tests.judging.verdict import RULE_FLOAT32, RULE_FLOAT64, exit_status
from parity_tests.judging.zero_gradient import ZeroGradients, zero_gradients
from parity_tests.protocol.errors import CaseError
from parity_tests.protocol.hyper import keras_scale_factor
from parity_tests.protocol.optimizer_state import nested_state
from parity_tests.protocol.payload import EXACT_LOSS_SCALE
from parity_tests.protocol.trajectory import Finding, Trajectory, finding_data
from parity_tests.running import registry
from parity_tests.running.builtins import SPECS
from parity_tests.running.harness import check_refusals, run_impl
from parity_tests.session.comparison import (
    CaseResult,
    SideMapping,
    choose_mapping,
    compare_case,
    follows_its_class,
    held_roundings,
    inside_step,
    own_rules,
    rule_runs,
    stand_in_apart,
)
from parity_tests.session.declared import declared as _declared
from parity_tests.session.executor import Runs
from parity_tests.session.keys import FLOAT64, RunKey, as_given
from parity_tests.session.loss_scale import ExactScale, ExactScaleCase
from parity_tests.session.residual import resolve_pair, scale_checked
from parity_tests.session.spread import SPREAD_RERUNS, judge_with_spread, nondeterministic

__all__ = ["STEPWISE", "STATEFUL", "LockstepPair", "LockstepResult", "check_lockstep", "lockstep_compare",
           "one_step_runs", "captured_step", "free_findings", "loss_scale_of_runs"]

#: the run-to-run spread check (``judging.rules.spread``), as the free compare makes it
SPREAD = Spread()

#: run every step in one trainer, loading each start state (:mod:`tfpar.lockstep`): as the engines declare
STEPWISE = tuple(s.name for s in SPECS if s.stepwise)
#: load and export optimizer state, so they take part whatever the optimizer
STATEFUL = tuple(s.name for s in SPECS if s.stateful)
Runner = Callable[[Case, str], dict[str, np.ndarray]]
BAD = ("divergence", "error")


@dataclass
class _Lockstep(Case):
    """A case whose payload carries lockstep's extras (a start state, the plan of a stepwise run)."""

    masks: dict[str, np.ndarray] | None = field(default=None)
    extra: dict[str, Any] = field(default_factory=dict)

    def payload(self) -> dict[str, Any]:
        p = super().payload()
        if self.masks is not None:  # step k's rows of the whole case's masks (a 1-step spec would draw others)
            p["masks"] = self.masks
        p.update(self.extra)
        return p


def _stateless(spec: Mapping[str, Any]) -> bool:
    opt = spec["optimizer"]
    return opt["name"] == "sgd" and (opt.get("schedule") or {"kind": "constant"})["kind"] == "constant"


def check_lockstep(case: Case, impls: list[str]) -> None:
    """Refuse, before anything runs, what lockstep cannot do (one line naming the field).

    Raises:
        CaseError: ``data.order`` not ``split``, ``parallel.combine`` not ``grad_mean``/``loss_mean``,
            a recorded run, an implementation that cannot load optimizer state for a case whose
            optimizer has one, a float32 case on an implementation that cannot run float64, or
            ``native`` momentum buffers (different quantities per framework).
    """
    spec = case.spec
    order = spec["data"].get("order", "split")
    if order != "split":
        raise CaseError("data.order", "split for --lockstep (step k's rows must be known without the sampler's epochs)",
                        order)
    combine = spec["parallel"]["combine"]
    if combine not in ("grad_mean", "loss_mean"):
        raise CaseError("parallel.combine", "grad_mean or loss_mean for --lockstep (with param_mean and async each"
                                            " device holds its own parameters: no single start state)", combine)
    opt = spec["optimizer"]
    if opt["semantics"] == "native" and (opt["name"] in ("momentum", "nesterov")
                                         or (opt["name"] == "rmsprop" and opt["momentum"])):
        raise CaseError("optimizer.semantics", "tf or torch for --lockstep with a momentum buffer (native Keras'"
                                               " velocity holds the learning rate, torch's buffer does not)", "native")
    for name in impls:
        found = registry.resolve(name, "--impls")
        if not found.rerunnable:
            raise CaseError("--impls", f"implementations that can run from a start state for --lockstep ({name} is"
                                       " a recorded run)", name)
        if spec["dtype"] == "float32" and "float64" not in found.dtypes:
            raise CaseError("dtype", f"float64 among the dtypes {name} declares, for --lockstep on a float32 case (each"
                                     " step's float32 bound is measured against one-step float64 runs)", spec["dtype"])
        if not _stateless(spec) and name not in STATEFUL and found.kind != "plugin":
            raise CaseError("optimizer", f"sgd with a constant schedule for --lockstep with {name} (only "
                                         f"{', '.join(STATEFUL)} load optimizer state)", opt["name"])


def _start(traj: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """The state after a one-step trajectory: ``{"init": {name: array}, "opt": {"step", "slots"} | None}``."""
    init = {k.split("/", 1)[1]: np.asarray(v[-1]) for k, v in traj.items() if k.startswith(("param/", "state/"))}
    return {"init": init, "opt": nested_state(traj)}


def _judged(traj: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A one-step trajectory without the optimizer-state entries (not judged: parameters carry their effect).

    What the run found of itself (DDP replicas out of sync) stays with it (``pair.with_findings``).
    """
    return with_findings(traj, {k: v for k, v in traj.items() if not k.startswith("opt/")})


def _carried(case: Case) -> dict[str, Any]:
    """The payload options of ``case`` that its one-step runs keep: Keras' loss scale made exact
    (``session.loss_scale.ExactScaleCase``, the mapped rerun of a ``model.fit`` program)."""
    return {EXACT_LOSS_SCALE: True} if isinstance(case, ExactScaleCase) else {}


def _kept(out: Mapping[str, Any], traj: dict[str, Any], *, findings: bool = True) -> dict[str, Any]:
    """``traj`` carrying what run ``out`` found of itself (replicas out of sync; not with ``findings=False``: one
    step of a stepwise run, whose findings are the whole run's) and saw of itself (``meta``: the Keras loss
    scale it applied, :func:`loss_scale_of_runs`)."""
    meta = getattr(out, "meta", None)
    kept = with_findings(out, traj) if findings else traj
    if meta:
        kept = kept if isinstance(kept, Trajectory) else Trajectory(kept)
        kept.meta = dict(meta)
    return kept


def loss_scale_of_runs(runs: list[Mapping[str, Any]]) -> float | None:
    """``float32(1/N) N``, the factor Keras' distribution loss scale put on these float64 one-step runs' losses and
    gradients (``protocol.hyper.keras_scale_factor`` of what each run saw); ``None``: exact, or not a Keras run.

    Read from the runs themselves, never assumed from the program's kind (``session.loss_scale``)."""
    return keras_scale_factor([e for r in runs for e in getattr(r, "meta", {}).get("keras_loss_scales", ())])


def _one_step(case: Case, k: int, start: Mapping[str, Any], masks: Mapping[str, np.ndarray]) -> _Lockstep:
    """``case``'s step ``k`` (from 0) alone, from ``start``: data rows ``[kB, (k+1)B)``, ``steps: 1``
    (``case``'s own payload options kept: :func:`_carried`)."""
    b = case.spec["data"]["global_batch"]
    rows = slice(k * b, (k + 1) * b)
    spec = copy.deepcopy(case.spec)
    spec["steps"] = 1
    init = {n: np.asarray(start["init"][n], np.float64) for n in case.init}
    return _Lockstep(spec=spec, x=case.x[rows], y=case.y[rows], init=init,
                     w=None if case.w is None else case.w[rows], masks={i: m[rows] for i, m in masks.items()},
                     extra={**_carried(case), "opt_state": start["opt"], "export_opt_state": True,
                            "first_step": k + 1})


def one_step_runs(case: Case, impl: str, starts: list[dict[str, Any]] | None, *,
                  runner: Runner | None = None) -> list[dict[str, np.ndarray]]:
    """Step ``k`` of ``case`` on ``impl`` from ``starts[k]``, for every ``k``; ``starts=None``: ``impl``'s own chain.

    Args:
        case: the case (its dtype is the runs' dtype).
        impl: an implementation name.
        starts: ``steps`` start states (:func:`_start` of the reference's run of the step before;
            ``None`` entries' optimizer: fresh), or ``None`` for the chain (each step from the
            previous result: the reference's own sequence).
        runner: ``runner(case, impl) -> trajectory`` (default :func:`harness.run_impl`).
    Returns:
        ``steps`` one-step trajectories (``loss`` [1], ``param/*`` [2, ...], ``grad/*`` [1, ...],
        ``state/*`` [2, ...], ``opt/*`` the optimizer state after the step where exported).
    """
    runner = runner or run_impl
    steps = case.spec["steps"]
    if impl in STEPWISE:
        plan = None if starts is None else [{"init": s["init"], "opt": s["opt"]} for s in starts]
        whole = _Lockstep(spec=case.spec, x=case.x, y=case.y, init=case.init, w=case.w,
                          extra={**_carried(case), "lockstep": {"starts": plan}})
        out = runner(whole, impl)
        return [_kept(out, {k[len("lockstep/"):]: v[i] for k, v in out.items() if k.startswith("lockstep/")},
                      findings=False) for i in range(steps)]
    masks = dropout_masks(case.spec)
    runs: list[dict[str, np.ndarray]] = []
    start = {"init": case.init, "opt": None}
    for k in range(steps):
        if starts is not None:
            start = starts[k]
        out = runner(_one_step(case, k, start, masks), impl)
        traj = _kept(out, dict(out))  # what the run found of itself (replicas out of sync) stays, and its meta
        runs.append(traj)
        if starts is None:
            start = _start(traj)
    return runs


def one_step_run(case: Case, impl: str, k: int, start: Mapping[str, Any], *,
                 runner: Runner | None = None) -> dict[str, np.ndarray]:
    """Step ``k`` of ``case`` on the plugin ``impl`` from ``start`` once more (a nondeterministic plugin's repeat)."""
    out = (runner or run_impl)(_one_step(case, k, start, dropout_masks(case.spec)), impl)
    return _kept(out, dict(out))


def captured_step(case: Case, impl: str, k: int, start: Mapping[str, Any], *,
                  runner: Runner | None = None) -> dict[str, np.ndarray]:
    """Step ``k`` (from 0) of ``case`` on ``impl`` from ``start``, recording its per-device values.

    The one-step run of :func:`one_step_runs` with ``capture = 1``: its ``device/...`` arrays
    (``device/step`` 1) are what the stage chain (:func:`~parity_tests.judging.localise.stage_chain`)
    reads; ``tf.towers``/``tf.single`` run it through their stepwise path (which loads optimizer state).
    """
    runner = runner or run_impl
    one = dataclasses.replace(_one_step(case, k, start, dropout_masks(case.spec)), capture=1)
    if impl not in STEPWISE:
        out = runner(one, impl)
        return with_findings(out, dict(out))
    one.extra = {**one.extra, "lockstep": {"starts": [{"init": start["init"], "opt": start["opt"]}]}}
    out = runner(one, impl)
    traj = {key[len("lockstep/"):]: v[0] for key, v in out.items() if key.startswith("lockstep/")}
    traj.update({key: v for key, v in out.items() if key.startswith("device/")})
    return traj


@dataclass
class LockstepPair:
    """Lockstep's verdict on ``impl`` against ``reference``, step by step.

    Attributes:
        status: ``parity``, ``divergence``, ``expected_difference`` (theory predicts one),
            ``unexpected_parity`` or ``error``.
        rule: ``float64 bound`` or ``float32 noise floor`` (applied to each step's one-step runs).
        one_step_gap, bound: ``[steps]`` each step's one-step gap and its bound (the channel,
            parameters or loss, nearest its bound).
        step_status: ``[steps]`` each step's verdict.
        free_gap, free_bound: ``[steps]`` the free run's accumulated gap after each step and its bound.
        first_bad_step: the first step (from 1) whose one-step gap exceeds its bound, or ``None``.
        key, detail: the array and the message of that step's verdict.
    """

    reference: str
    impl: str
    status: str
    rule: str
    one_step_gap: np.ndarray
    bound: np.ndarray
    step_status: list[str]
    free_gap: np.ndarray
    free_bound: np.ndarray
    first_bad_step: int | None = None
    key: str | None = None
    detail: str = ""
    #: the first bad step's one-step runs and verdict ``(ref, impl, verdict)`` (the arrays the deciding
    #: rule judged: the float64 runs where the float64 rule decided), for its localisation
    first_runs: Any = field(default=None, repr=False, compare=False)
    #: the localisation (docs/localisation.md) of the first bad step (its stage chain where both sides capture), or ``None``
    localisation: dict[str, Any] | None = None
    #: why no residual was judged at the first step where the stand-in's leg parted before the update
    #: (``mapping.stand_in_leg``: "residual not judged: no equivalent run: ..."), or ``None``
    residual_not_judged: str | None = None
    #: what was mapped for the residual, one line (a stand-in's mapping; a ``model.fit`` program rerun with Keras'
    #: distribution loss scale exact, ``session.loss_scale``), as the free pair's ``mapping``; ``None``: nothing
    mapping: str | None = None
    #: the sides whose first bad step is localised from their rerun with the loss scale exact (``first_runs``)
    first_exact: tuple[str, ...] = field(default=(), repr=False, compare=False)

    def __repr__(self) -> str:
        first = "" if self.first_bad_step is None else f", first bad step {self.first_bad_step}"
        return f"LockstepPair({self.reference} vs {self.impl}: {self.status}, {self.rule}{first})"

    def where_line(self) -> str:
        """``impl: where: STAGE, device D (NAME), layer L; FACTOR`` from the first bad step's localisation, or ``""``."""
        where = self.localisation or {}
        if not where.get("stage"):
            return ""
        device = "" if where.get("device") is None else f", device {where['device']}"
        factor = (where.get("factor") or {}).get("text")  # judging.factor: the constant scale at that stage
        return (f"{self.impl}: where: {where['stage']}{device}" + (f" ({where['name']})" if where.get("name") else "")
                + (f", layer {where['layer']}" if where.get("layer") and not str(where.get("name")).startswith("layer ")
                   else "") + (f"; {factor}" if factor else ""))

    def to_dict(self) -> dict[str, Any]:
        return {"reference": self.reference, "impl": self.impl, "status": self.status, "rule": self.rule,
                "one_step_gap": self.one_step_gap, "bound": self.bound, "step_status": self.step_status,
                "free_gap": self.free_gap, "free_bound": self.free_bound, "first_bad_step": self.first_bad_step,
                "key": self.key, "detail": self.detail, "localisation": self.localisation,
                "residual_not_judged": self.residual_not_judged, "mapping": self.mapping}


@dataclass
class LockstepResult:
    """The free comparison and lockstep's per-step verdicts (``pairs[i]`` judges ``free.pairs[i]``'s pair)."""

    free: CaseResult
    pairs: list[LockstepPair]
    seconds_free: float = 0.0
    seconds_lockstep: float = 0.0

    @property
    def parity(self) -> bool:
        """Every pair at parity in lockstep (``tfpar compare --lockstep``'s exit status 0)."""
        return all(p.status == "parity" for p in self.pairs)

    @property
    def as_expected(self) -> bool:
        return all(p.status in ("parity", "expected_difference") for p in self.pairs)

    @property
    def free_stands(self) -> list[Any]:
        """The free comparison's pairs whose verdict says something is wrong (``divergence``, ``error``,
        ``unexpected_parity``) where lockstep's verdict on the same pair does not.

        Lockstep's one-step runs can miss what a free run shows: a program that counts its own steps
        (``enumerate(run.batches(), 1)`` instead of ``run.first_step``) runs its step-2 code only in the
        free run. A free ``inconclusive`` (a chaotic run, the conditioning floor) is what lockstep
        resolves; a free verdict that names a wrong result is never overruled by it.
        """
        mine = {p.impl: p.status for p in self.pairs}
        return [fp for fp in self.free.pairs if fp.verdict.status in (*BAD, "unexpected_parity")
                and mine.get(fp.impl) in (None, "parity", "expected_difference", "inconclusive")]

    @property
    def ok(self) -> bool:
        """``tfpar compare --lockstep``'s exit status 0: every lockstep verdict parity or an expected difference,
        and no free verdict that says something is wrong (:attr:`free_stands`): the exit status follows the
        worst verdict printed, the free comparison's ``inconclusive`` excepted (lockstep is what resolves it)."""
        return self.as_expected and not self.free_stands

    @property
    def exit_status(self) -> int:
        """``tfpar compare --lockstep``'s exit status from the worst verdict printed, as
        :attr:`CaseResult.exit_status`: lockstep's verdicts and the free comparison's that stand
        (:attr:`free_stands`: a free ``inconclusive`` is lockstep's to resolve). 0 exactly when :attr:`ok`."""
        return exit_status([*(p.status for p in self.pairs), *(fp.verdict.status for fp in self.free_stands)])

    def _rows(self, *, notes: bool) -> list[str]:
        """Lockstep's header and one row per pair (with ``notes``: each first bad step's line and where)."""
        w = max([30, *(len(f"{p.reference} vs {p.impl}") for p in self.pairs)])
        rows = [f"lockstep (every step from {self.pairs[0].reference}'s state of the step before):"
                if self.pairs else "lockstep: no pairs",
                f"{'pair':<{w}} {'verdict':<20} {'first bad step':>14} {'worst gap/bound':>16} {'free gap/bound':>15}"]
        for p in self.pairs:
            with np.errstate(divide="ignore", invalid="ignore"):
                worst, free = (_nanmax(gap / bound) for gap, bound in ((p.one_step_gap, p.bound),
                                                                         (p.free_gap, p.free_bound)))
            first = "-" if p.first_bad_step is None else str(p.first_bad_step)
            rows.append(f"{p.reference + ' vs ' + p.impl:<{w}} {p.status:<20} {first:>14} {worst:>16.3g} {free:>15.3g}")
            if not notes:
                continue
            if p.first_bad_step is not None:
                rows.append(f"  {p.impl}: step {p.first_bad_step}: {p.detail.splitlines()[0]}")
            if p.residual_not_judged:
                rows.append(f"  {p.impl}: {p.residual_not_judged}")
            if p.where_line():
                rows.append("  " + p.where_line())
            if p.status == "divergence" and (p.localisation or {}).get("loss_only"):  # judging.loss_only (issue 37)
                rows.append(f"  {p.impl}: loss alone: {p.localisation['loss_only']['text']}")
        statuses = {p.status for p in self.pairs}
        verdict = ("PARITY" if self.parity else "EXPECTED DIFFERENCE (as theory predicts)" if self.as_expected else
                   "INCONCLUSIVE" if statuses <= {"parity", "expected_difference", "inconclusive"} else "DIVERGENCE")
        for fp in self.free_stands:
            rows.append(f"  {fp.impl}: the free comparison's {fp.verdict.status} stands (lockstep's one-step runs do not"
                        " show it: a program whose steps depend on its own count, not run.first_step?)")
        rows.append(f"lockstep verdict: {verdict} (free {self.seconds_free:.1f} s, lockstep {self.seconds_lockstep:.1f} s)")
        return rows

    def summary(self) -> str:
        """The free comparison's table, then one lockstep line per pair."""
        return "\n".join([self.free.summary(), *self._rows(notes=True)])

    def __repr__(self) -> str:
        """The free comparison's table and lockstep's, without notes or arrays."""
        return "\n".join(["LockstepResult: " + repr(self.free).removeprefix("CaseResult: "), *self._rows(notes=False)])

    def plot(self) -> bytes:
        """PNG: one panel per pair, the one-step gap and its bound beside the free run's gap and bound, per step."""
        import io

        # never pyplot: the user's backend (a notebook's inline one) and figures stay theirs
        from matplotlib.figure import Figure

        fig = Figure(figsize=(5.0 * max(len(self.pairs), 1), 3.4))
        axes = fig.subplots(1, max(len(self.pairs), 1), squeeze=False)
        for ax, p in zip(axes[0], self.pairs, strict=False):
            steps = np.arange(1, len(p.step_status) + 1)
            tiny = 1e-18  # an exact zero on the log scale
            for values, style, label in ((p.one_step_gap, "-", "one-step gap (lockstep)"), (p.bound, "--", "its bound"),
                                         (p.free_gap, "-", "free-run gap"), (p.free_bound, "--", "free-run bound")):
                color = "tab:blue" if "free" not in label else "tab:gray"
                ax.semilogy(steps, np.maximum(np.nan_to_num(np.asarray(values, float), nan=tiny), tiny), style,
                            color=color, label=label, linewidth=1.1, marker="." if style == "-" else None, markersize=3)
            if p.first_bad_step is not None:
                ax.axvline(p.first_bad_step, color="tab:red", linewidth=0.8, label=f"first bad step {p.first_bad_step}")
            ax.set_title(f"{p.reference} vs {p.impl}"[:70], fontsize=8)
            ax.set_xlabel("step")
            ax.grid(True, alpha=0.3)
        axes[0][0].set_ylabel("relative gap")
        axes[0][0].legend(fontsize=7, frameon=False)
        fig.suptitle(f"{self.free.case.name}: lockstep one-step gaps beside the free run", fontsize=10)
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=90)
        return buf.getvalue()

    def markdown(self) -> str:
        """The lockstep section of ``report.md``: one verdict line per pair, then the per-step table."""
        lines = ["", "## Lockstep", "",
                 f"Every step k of every implementation started from {self.pairs[0].reference if self.pairs else '-'}'s"
                 " parameters, state and optimizer state after step k-1; one-step gap against its bound, beside the"
                 " free run's accumulated gap (docs/lockstep.md).", "", "![lockstep](lockstep.png)", "",
                 "| pair | lockstep verdict | first bad step | rule |", "| --- | --- | --- | --- |"]
        for p in self.pairs:
            lines.append(f"| {p.reference} vs {p.impl} | {p.status} | {p.first_bad_step or '-'} | {p.rule} |")
        for p in self.pairs:
            lines += ["", f"### {p.reference} vs {p.impl}", "",
                      "| step | one-step gap | bound | verdict | free-run gap | free bound |", "| --- | --- | --- | --- | --- | --- |"]
            for k in range(len(p.step_status)):
                lines.append(f"| {k + 1} | {p.one_step_gap[k]:.3g} | {p.bound[k]:.3g} | {p.step_status[k]} | "
                             f"{p.free_gap[k]:.3g} | {p.free_bound[k]:.3g} |")
        return "\n".join(lines) + "\n"

    def to_dict(self) -> dict[str, Any]:
        return {**self.free.to_dict(), "lockstep": {"parity": self.parity, "seconds": round(self.seconds_lockstep, 3),
                                                    "pairs": [p.to_dict() for p in self.pairs]}}


def _nanmax(ratios: np.ndarray) -> float:
    """The greatest of ``ratios`` ignoring NaN; NaN where all are (no free comparison: ``free=False``), without
    numpy's All-NaN RuntimeWarning; 0 for none."""
    return 0.0 if not ratios.size else float("nan") if np.isnan(ratios).all() else float(np.nanmax(ratios))


def _row_gap(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray], scales: Mapping[str, np.ndarray]) -> np.ndarray:
    """``max_p ||a_p[k] - b_p[k]||_inf / d_p[k]`` over the ``param/`` and ``state/`` arrays (the tolerance model's gap)."""
    return np.max([relative_gap(a[k], b[k], scale=d, scale_floor=SCALE_FLOOR) for k, d in scales.items()], axis=0)


def _free_curves(free: CaseResult, ref: str, impl: str, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """The free run's accumulated gap after steps 1..T and its bound.

    float32 case: the float32 rule's gap between the two float32 runs and its bound
    ``2 max(floor_A, floor_B) + 4 * 2**-24`` (each side's float32-vs-float64 gap), with the
    tolerance model's shared denominator, whichever rule decided the free verdict (in a
    chaotic run the float64 rule decides, and its gap is not the float32 one).
    float64 case: the float64 rule's gap, bound ``FLOAT64_RTOL``.
    """
    nan = np.full(steps, np.nan)
    pair = next((p for p in free.pairs if p.impl == impl), None)
    if pair is None:  # no free comparison was asked for
        return nan, nan
    t = free.runs

    (na, sa), (nb, sb) = pair.judged or ((ref, ""), (impl, ""))  # the runs the free verdict judged
    dtype = as_given(free.case.spec["dtype"])
    a, b, a64, b64 = (t.get(RunKey(n, variant, suffix)) for n, suffix, variant in
                      ((na, sa, dtype), (nb, sb, dtype), (na, sa, FLOAT64), (nb, sb, FLOAT64)))
    if any(r is None for r in (a, b, a64, b64)):
        return nan, nan
    keys = sorted(k for k in a if k.startswith(("param/", "state/")) and k in b)
    scales = {k: np.maximum(np.maximum(np.abs(a64[k]).reshape(len(a64[k]), -1).max(axis=1),
                                       np.abs(b64[k]).reshape(len(b64[k]), -1).max(axis=1)), SCALE_FLOOR)
              for k in keys}
    gap = _row_gap(a, b, scales)[1:steps + 1]
    if dtype == "float64":
        return gap, np.full(steps, FLOAT64_RTOL)
    with np.errstate(invalid="ignore"):
        floor = np.fmax(_row_gap(a, a64, scales), _row_gap(b, b64, scales))[1:steps + 1]
    return gap, FLOAT32_FACTOR * floor + FLOAT32_ABS_FLOOR


def _renumber(text: str, step: int) -> str:
    """A one-step verdict's text with its "step 1" (the only step of that run) named as the case's step."""
    return re.sub(r"\bstep 1\b", f"step {step}", text)


#: where a finding (``running.plugins.replica_divergence``) says it happened: row 0 is ``run.begin()``
_FOUND_AT = re.compile(r"\bat (?:run\.begin\(\)|step (\d+))")


def free_findings(free: CaseResult, impl: str) -> dict[int, list[str]]:
    """What ``impl``'s runs of the free comparison found of themselves (DDP replicas out of sync), by step (from 1).

    A replica divergence is a property of the program, not of a start state: where the free run of
    a DDP job had a rank drop or double its update at step k, lockstep's step k is a divergence too,
    also when its one-step run does not repeat it (a program that counts its own steps). A finding
    at ``run.begin()`` belongs to step 1.
    """
    out: dict[int, list[str]] = {}
    for run, traj in (free.runs or {}).items():
        if run.impl != impl:
            continue
        key = run.text
        for found in getattr(traj, "findings", ()):
            data = finding_data(found)
            m = _FOUND_AT.search(found) if "step" not in data else None  # a finding without data: its line
            step = max(int(data["step"]), 1) if "step" in data else int(m.group(1)) if m and m.group(1) else 1
            line = Finding(f"in the free run ({key}): {found}", data)
            if found not in " ".join(out.get(step, [])):  # each run of it (float32, float64) finds the same
                out.setdefault(step, []).append(line)
    return out


def _with_found(traj: Mapping[str, Any], found: list[str]) -> Mapping[str, Any]:
    """``traj`` (judged arrays) carrying ``found`` as findings, unless the one-step run found something itself."""
    if not found or getattr(traj, "findings", None):
        return traj
    out = Trajectory(traj)
    out.meta.update(getattr(traj, "meta", None) or {})  # what the run read of itself stays (as pair.with_findings)
    out.findings.extend(found)
    return out


#: a pair's per-step statuses, worst first: the status of the whole pair is the first one found
_WORST = ("error", "divergence", "unexpected_parity", "expected_difference")


class _StepLegs:
    """One lockstep step's one-step runs, as ``residual.resolve_pair`` reads them: a leg names a run of the step (``a``,
    ``b``, their exact reruns ``ae``, ``be``, the mapped built-in ``sm``, the stand-in ``s``)."""

    def __init__(self, k: int, side: Callable[[str, int], Side], stage: Callable[..., str | None],
                 runs: Mapping[str, Any], dtype: str, rule: str, zero: ZeroGradients | None,
                 spread: Callable[[Any, str, str, int], Any] | None = None) -> None:
        self.k, self._side, self._stage, self.runs, self.dtype, self.rule, self.zero = k, side, stage, runs, dtype, rule, zero
        self._spread = spread

    def as_ran(self) -> Any:
        return self.verdict("a", "b")

    def verdict(self, a: str, b: str) -> Any:
        v = judge_sides(self.dtype, self._side(a, self.k), self._side(b, self.k), rule=self.rule, zero=self.zero)
        # a plugin declared deterministic=False on a leg of its own one-step runs: against its run-to-run spread, as
        # the free compare judges it (judge_pair._within_spread)
        return self._spread(v, a, b, self.k) if self._spread is not None else v

    def stage(self, a: str, b: str, verdict: Any, refine: bool = False) -> str | None:
        return self._stage(a, b, self.k, verdict, refine)

    def leaky(self, legs: Any) -> bool:
        # a float64 one-step run whose loss is float32 (judging.precision_leak): a loss-only parting is no wrong loss
        return any(not_float64(self.runs[n + "64"][self.k]) for n in legs if n + "64" in self.runs)


def _builtin_computes(name: str) -> str | None:
    """Why ``name`` computes the case as given (``mapping.stand_in_leg``'s ``computes``) where it is a built-in, else
    ``None`` (``--lockstep`` makes no run of a plugin's built-in to show it: the free compare does)."""
    found = _declared(name)
    return f"{name} is a built-in: it computes the case as given" if found is not None and found.kind == "builtin" else None


def _judge_steps(ref: str, impl: str, dtype: str, runs: dict[str, list | None], pred: Prediction,
                 mapping: SideMapping | None, free: CaseResult, zero: ZeroGradients | None = None,
                 leg_refine: Callable[[int, dict[str, Any], Any], dict[str, Any]] | None = None,
                 exact: tuple[ExactScale, ...] = (), apart: str | None = None,
                 rerun: Callable[[str, int, bool, int], Mapping[str, Any]] | None = None) -> LockstepPair:
    """Every step's one-step runs judged through ``pair.judge_sides`` and ``pair.resolve``, as the free compare judges.

    ``runs``: ``a``, ``b`` (the case dtype), ``a64``, ``b64`` (float64), and with a mapping the
    mapped built-in's ``sm``/``sm64`` and, when it stands in for a plugin, its own ``s``/``s64``.
    ``zero``: the case's zero-gradient parameters (``judging.zero_gradient``).

    A residual through a stand-in is judged by the free compare's rule (``mapping.stand_in_leg``):
    at each step the plugin against the stand-in as it runs, from the same start; where they part
    before the update (a loss term the case cannot express) no residual is judged at that step and
    the step is resolved as one without a mapping (by the stage where its runs part); where they
    part at the update, that leg decides. ``leg_refine(step, where, verdict)``: the stage chain of
    that leg's step (``capture.inside_step``), asked where the recorded channels cannot tell
    the stage (no gradient recorded); once per stage they name, the first step that needs it.

    ``exact``: the pair's programs rerun with Keras' distribution loss scale exact (``session.loss_scale``),
    whose one-step runs are ``ae``/``ae64`` (the reference) and ``be``/``be64`` from the same starts: such a
    side is its exact rerun wherever the residual takes part, beside ``mapping`` (which may be ``None``: the
    loss scale is then the only mapping), as the free compare's ``judge_pair._Judged.residual``. ``apart``: what
    theory expects to differ between a stand-in and its plugin (``mapping.stand_in_apart``), as the free compare.
    ``rerun(leg, k, float64, i)``: the ``i``-th more one-step run of step ``k`` of the side of ``leg`` (``"a"``,
    ``"b"``) from the same start, made when asked: a divergence with a nondeterministic plugin on a leg of its own
    runs is judged against the spread of step ``k``'s repeats (``spread.judge_with_spread``), as the free compare.
    """
    steps = len(runs["b"])
    # each side as the residual sees it: its rerun with the loss scale exact where it has one
    own_a = "ae" if any(e.side == ref for e in exact) and runs.get("ae") is not None else "a"
    own_b = "be" if any(e.side == impl for e in exact) and runs.get("be") is not None else "b"
    exact_text = "; ".join(e.text for e in exact) or None
    text = "; ".join(([mapping.text] if mapping is not None else []) + ([exact_text] if exact_text else [])) or None
    decided: list[tuple[str, str]] = []  # per step, the runs whose verdict decided it
    gaps, bounds, status, verdicts = np.zeros(steps), np.zeros(steps), [], []
    rule = "float64"
    # each side's replicas as its free runs found them, at their step: the free compare's "replicas in sync" rule
    found = {"a": free_findings(free, ref), "b": free_findings(free, impl)}
    not_judged: str | None = None
    refined: dict[Any, str | None] = {}  # the leg's stage as the recorded channels name it -> as its chain names it

    def side(name: str, k: int) -> Side:
        run, f64 = runs.get(name), runs.get(name + "64")
        extra = found.get(name[:1], {}).get(k + 1, [])  # an exact rerun (ae, be) is its side's program
        return Side(_with_found(_judged(run[k]), extra), None if f64 is None else _with_found(_judged(f64[k]), extra))

    def stage(x: str, y: str, k: int, verdict: Any, refine: bool = False) -> str | None:
        """Where runs ``x`` and ``y`` of step ``k`` part (the arrays ``verdict``'s rule judged)."""
        f64 = dtype != "float64" and verdict.rule == RULE_FLOAT64
        rx, ry = (_judged(runs[n + ("64" if f64 else "")][k]) for n in (x, y))
        where = dict(localise(rx, ry, verdict))
        if refine and leg_refine is not None and refinable(where, rx, ry):
            if where.get("stage") not in refined:
                refined[where.get("stage")] = leg_refine(k + 1, where, verdict).get("stage")
            return refined[where.get("stage")]
        return where.get("stage")

    def spread(v: Any, x: str, y: str, k: int) -> Any:
        """``v`` (legs ``x``, ``y`` of step ``k``) within a nondeterministic plugin's run-to-run spread at that step."""
        own = (x in ("a", "b"), y in ("a", "b"))  # a side's own one-step runs (not a mapped or exact rerun)
        names = tuple(ref if n[:1] == "a" else impl if n[:1] == "b" else n for n in (x, y))
        if rerun is None or not SPREAD.applies(v) or not any(o and nondeterministic(n)
                                                               for o, n in zip(own, names, strict=True)):
            return v
        d64 = dtype == "float64" or v.rule == RULE_FLOAT64
        judged = tuple(_judged(runs[n + ("64" if d64 and dtype != "float64" else "")][k]) for n in (x, y))
        legs = dict(zip(names, (x, y), strict=True))
        return judge_with_spread(v, names, judged, lambda name, i: _judged(rerun(legs[name], k, d64, i)), own=own)

    for k in range(steps):
        r = resolve_pair(_StepLegs(k, side, stage, runs, dtype, rule, zero, spread), "a", "b", pred,  # as the free compare
                         impl_is_b=mapping is None or mapping.side == impl, mapping=mapping, mapped="sm",
                         stand="s" if mapping is not None and mapping.stand_in else None,
                         exact_a="ae" if own_a != "a" else None, exact_b="be" if own_b != "b" else None,
                         exact_text=exact_text, apart=apart)
        residual, res, why = r.residual, r.resolution, r.not_judged
        # the sum reduction's exact ratio, where no residual was judged: both one-step runs start from one state, so
        # it holds at every step (the free compare can read it at step 1 only)
        v, scale = scale_checked(r, free.case.spec, engine(ref), engine(impl),
                                 *(_judged(runs[n][k]) if runs.get(n) is not None else None for n in ("a64", "b64")),
                                 exact=bool(exact))
        computes = (_builtin_computes(mapping.other) if v.status == "expected_difference" and why is not None
                    and scale is None and not exact and not apart and mapping is not None and mapping.stand_in else None)
        if computes is not None:
            # still no equivalent run, the other side a built-in: the stand-in's leg decides where it parts before the
            # update (mapping.stand_in_leg's computes; the free compare also asks it of a plugin shown to compute the case)
            again = resolve_pair(_StepLegs(k, side, stage, runs, dtype, rule, zero, spread), "a", "b", pred,
                                 impl_is_b=mapping.side == impl, mapping=mapping, mapped="sm", stand="s",
                                 apart=apart, computes=computes)
            if again.not_judged is None:
                r, v = again, again.final
                residual, res, why = r.residual, r.resolution, r.not_judged
        # where what the loss scale's mapping does not explain parts, the exact reruns are the step's runs
        # (localised from them: the unmapped runs part first at the loss, by the factor itself)
        decided.append(r.decided if mapping is None and residual is not None and res.from_residual
                       and residual.status != "parity" else (r.staged[1], r.staged[2]))
        not_judged = not_judged or why
        gaps[k], bounds[k] = v.gap, v.bound
        status.append(v.status)
        verdicts.append(v)
    bad = [k for k, st in enumerate(status) if st in ("divergence", "error", "unexpected_parity")]
    found = next((st for st in _WORST if st in status), None)
    overall = found or ("inconclusive" if status and all(st == "inconclusive" for st in status) else "parity")
    free_gap, free_bound = _free_curves(free, ref, impl, steps)
    pair = LockstepPair(ref, impl, overall, RULE_FLOAT64 if dtype == "float64" else RULE_FLOAT32, gaps, bounds,
                        status, free_gap, free_bound, residual_not_judged=not_judged, mapping=text)
    first = bad[0] if bad else next((k for k, st in enumerate(status) if st == "expected_difference"), None)
    if first is not None:
        k = first
        pair.first_bad_step, pair.key, pair.detail = k + 1, verdicts[k].key, _renumber(verdicts[k].detail, k + 1)
        # the arrays the deciding rule judged (as compare_case localises): float64 where the float64 rule decided
        f64 = dtype != "float64" and verdicts[k].rule == RULE_FLOAT64
        x, y = decided[k]
        a, b = (runs[x + "64"], runs[y + "64"]) if f64 else (runs[x], runs[y])
        pair.first_runs = (a[k], b[k], verdicts[k])
        pair.first_exact = tuple(name for name, run in ((ref, x), (impl, y)) if run.endswith("e"))
    return pair


def _localise(pair: LockstepPair, free_pair: Any, chain: Callable[[dict[str, Any], Any], dict[str, Any]] | None = None,
              pair_spec: Mapping[str, Any] | None = None,
              logged: tuple[Mapping[str, Any] | None, Mapping[str, Any] | None] | None = None) -> None:
    """The localisation (docs/localisation.md) of lockstep's first bad step (its one-step runs), on ``pair`` and the free pair.

    ``chain(where, verdict)``, when given, refines a stage inside the step (``localise.refinable``)
    by the stage chain of that step re-run from the same start with capture on (``capture.inside_step``).
    As the free comparison's localisation does (issue 37): the ``factor`` at the first bad stage, read from
    that step's one-step runs (``judging.factor``; the chain's capture where it ran), and ``loss_only``
    (``judging.loss_only``) from ``logged``, the free runs' logged losses of the pair in the case dtype
    (what a user compares), where the free comparison kept them.
    """
    first = pair.first_runs
    if first is None:
        # a free divergence is not rounding (its bound says so): lockstep missing it does not explain it away
        if free_pair is not None and free_pair.localisation is not None and pair.status == "parity" \
                and free_pair.verdict.status not in (*BAD, "unexpected_parity"):
            free_pair.localisation = {**free_pair.localisation, "explanation": (
                f"{free_pair.localisation.get('explanation', '')}; lockstep: every one-step gap within its bound, so"
                " the free-run gap is rounding carried and amplified from step to step, not a semantic difference"
            ).lstrip("; ")}
        return
    a, b, verdict = first
    where = dict(localise(_judged(a), _judged(b), verdict))
    if chain is not None and refinable(where, _judged(a), _judged(b)):
        where = dict(chain(where, verdict))
    if "factor" not in where and pair_spec is not None:  # the one-step runs' step 1 (before it is renumbered)
        where = attach_factor(where, _judged(a), _judged(b), pair_spec)
    where["first_bad_step"] = pair.first_bad_step
    where["explanation"] = f"lockstep (from {pair.reference}'s state after step {pair.first_bad_step - 1}): " + (
        _renumber(str(where.get("explanation") or ""), pair.first_bad_step) or pair.detail.splitlines()[0])
    if logged is not None and logged[0] is not None and logged[1] is not None:
        where = attach_loss_only(where, logged[0], logged[1], pair_spec)
    where = dict(with_layer(where, pair_spec)) if pair_spec is not None else where
    pair.localisation = where
    if free_pair is not None:
        free_pair.localisation = where


def lockstep_compare(case: Case, impls: list[str], *, runner: Runner | None = None,
                     progress: Callable[[str], None] | None = None, free: bool = True,
                     stages: bool = True) -> LockstepResult:
    """Judge ``case`` on ``impls`` in lockstep against ``impls[0]``, beside the free comparison.

    Args:
        case: a validated case (``data.order: split``, ``grad_mean`` or ``loss_mean``).
        impls: two or more implementation names; the first is the reference.
        runner: ``runner(case, impl) -> trajectory`` (default :func:`harness.run_impl`).
        progress: called with a label before each group of runs.
        free: also run the free comparison (:func:`compare_case`) for the accumulated-gap curve.
        stages: where the first bad step breaks inside the step (``localise.refinable``), run both
            sides once more at that step, from the same start with capture on, and name the first
            stage of its chain that breaks (one more run per side; the reference's run is shared).
    Returns:
        a :class:`LockstepResult`; ``result.free`` is what ``compare_case`` gives, with each
        pair's localisation taken from lockstep's first bad step (also ``pair.localisation``).
    Raises:
        CaseError: what lockstep does not support (:func:`check_lockstep`), or what the
            implementations refuse.
    """
    if len(impls) < 2:
        raise CaseError("--impls", "at least two implementations to compare", ",".join(impls))
    check_refusals(case, impls)  # every implementation's refusal before any of them runs
    if case.spec["dtype"] == "mixed_bfloat16":  # its steps are judged against float64 runs: no bfloat16 floor
        raise CaseError("dtype", "float32 or float64 with --lockstep (mixed_bfloat16 is judged without it:"
                                 " docs/mixed-precision.md)", case.spec["dtype"])
    check_lockstep(case, impls)
    note = progress or (lambda _label: None)
    t0 = time.perf_counter()
    free_result = compare_case(case, impls, runner=runner) if free else CaseResult(case, list(impls), [])
    t1 = time.perf_counter()
    dtype, ref = case.spec["dtype"], impls[0]
    f64 = case if dtype == "float64" else case.replace(dtype="float64")
    note(f"{RunKey(ref, as_given(dtype))} lockstep chain")
    chain = one_step_runs(case, ref, None, runner=runner)
    starts = [{"init": case.init, "opt": None}] + [_start(t) for t in chain[:-1]]
    runs64: dict[tuple[str, str], list] = {}

    def float64_runs(impl: str, mapping: SideMapping | ExactScale | None) -> list:
        """``impl``'s float64 one-step runs from the reference's starts (float32 starts: exact in float64)."""
        key = (impl, "" if mapping is None else mapping.key)
        if key not in runs64:
            c = mapping.apply(f64) if mapping is not None else f64
            if dtype == "float64" and impl == ref and mapping is None:
                runs64[key] = chain
            else:
                note(f"{RunKey(impl, FLOAT64)}" + (" mapped" if mapping else "") + " one-step runs")
                runs64[key] = one_step_runs(c, impl, starts, runner=runner)
        return runs64[key]

    # first bad step and the sides captured as their rerun with the loss scale exact -> the capture runs
    # capture.inside_step declared there (a capture's key is its side, step and spec: an exact rerun has its own)
    captured: dict[tuple[int, tuple[str, ...]], Runs] = {}

    def captures(step: int, exact_sides: tuple[str, ...] = ()) -> Runs:
        """What makes ``step``'s capture runs: each side's one step from the reference's start, once."""
        if (step, exact_sides) not in captured:
            captured[step, exact_sides] = Runs(
                lambda cc, name: captured_step(cc, name, step - 1, starts[step - 1], runner=runner))
        return captured[step, exact_sides]

    def chain_at(step: int, impl: str, exact: tuple[ExactScale, ...] = ()) -> Callable[[dict[str, Any], Any], dict[str, Any]]:
        """The stage chain of ``step`` for the pair (ref, impl): both sides from the reference's start, captured
        (``exact``: those sides rerun with Keras' loss scale exact, as the runs that decided the step)."""
        def refine(where: dict[str, Any], verdict: Any) -> dict[str, Any]:
            # the dtype the deciding rule judged (compare_case does the same)
            d64 = dtype == "float64" or verdict.rule == RULE_FLOAT64
            c = f64 if d64 else case
            mapped = {e.side: e.apply(c) for e in exact}
            note(f"{ref} and {impl}: step {step} captured")
            return inside_step(where, verdict, ((ref, mapped.get(ref, c)), (impl, mapped.get(impl, c))),
                               captures(step, tuple(sorted(mapped))))

        return refine

    def leg_at(mapping: SideMapping) -> Callable[[int, dict[str, Any], Any], dict[str, Any]]:
        """The stage chain of a step of the stand-in's leg: the stand-in as the plugin runs against the plugin."""
        def refine(step: int, where: dict[str, Any], verdict: Any) -> dict[str, Any]:
            c = f64 if dtype == "float64" or verdict.rule == RULE_FLOAT64 else case
            stand = mapping.plain.apply(c) if mapping.plain else c
            note(f"{mapping.runs_as} and {mapping.side}: step {step} captured")
            return inside_step(where, verdict, ((mapping.runs_as, stand), (mapping.side, c)), captures(step))

        return refine

    repeats: dict[tuple[str, int, bool], list] = {}

    def spread_reruns(ref: str, impl: str) -> Callable[[str, int, bool, int], Mapping[str, Any]]:
        """The pair's one-step repeats (``_judge_steps``' ``rerun``): made once per side, step and dtype, when asked."""
        def rerun(leg: str, k: int, d64: bool, i: int) -> Mapping[str, Any]:
            name = ref if leg == "a" else impl
            if (name, k, d64) not in repeats:
                note(f"{name}: step {k + 1} repeated for its run-to-run spread")
                c = f64 if d64 else case
                repeats[name, k, d64] = [one_step_run(c, name, k, starts[k], runner=runner) for _ in range(SPREAD_RERUNS)]
            return repeats[name, k, d64][i]

        return rerun

    held = held_roundings(impls, free_result.runs, dtype)
    own = own_schedule = own_rules(impls, free_result.runs, dtype)  # (theory.predict's own_schedule)
    if "external" not in case.spec["model"]:  # the free compare's runs of each rule's check, made there once
        own = follows_its_class(own, rule_runs(Runs(runner or run_impl, free_result.runs), f64), case.spec)
    pairs = []
    for impl in impls[1:]:
        runs: dict[str, list | None] = {"a64": float64_runs(ref, None), "b64": float64_runs(impl, None)}
        # Keras' distribution loss scale, read from each side's float64 one-step runs (never assumed): the free
        # compare's prediction and its mapping, the program rerun with the factor exact (session.loss_scale)
        scales = {ref: loss_scale_of_runs(runs["a64"]), impl: loss_scale_of_runs(runs["b64"])}
        pred = predict(f64.spec, engine(ref), engine(impl), held=held, own=own, own_schedule=own_schedule,
                       scales=scales)
        mapping = choose_mapping(f64.spec, ref, impl, pred, held, own, own_schedule)
        exact: tuple[ExactScale, ...] = ()
        if any(d.mapping == LOSS_SCALE for d in pred.differences):
            exact = tuple(ExactScale(x, f) for x in (ref, impl) if (f := scales[x]) is not None)
        for e in exact:  # each such side's one-step runs again, from the same starts, with the factor exact
            name = "ae" if e.side == ref else "be"
            runs[name + "64"] = float64_runs(e.side, e)
            runs[name] = runs[name + "64"] if dtype == "float64" else one_step_runs(
                e.apply(case), e.side, starts, runner=runner)
        if dtype == "float64":
            runs["a"], runs["b"] = runs["a64"], runs["b64"]
        else:
            note(f"{RunKey(impl, as_given('float32'))} one-step runs")
            runs["a"], runs["b"] = chain, one_step_runs(case, impl, starts, runner=runner)
        if mapping is not None:
            try:
                runs["sm64"] = float64_runs(mapping.runs_as, mapping)
                runs["sm"] = runs["sm64"] if dtype == "float64" else one_step_runs(
                    mapping.apply(case), mapping.runs_as, starts, runner=runner)
                if mapping.stand_in:  # as the plugin runs (its own Keras roundings, mapping.plain)
                    runs["s64"] = float64_runs(mapping.runs_as, mapping.plain)
                    runs["s"] = runs["s64"] if dtype == "float64" else one_step_runs(
                        mapping.plain.apply(case) if mapping.plain else case, mapping.runs_as, starts, runner=runner)
            except CaseError:
                mapping = None  # the side cannot run the mapped case: judged without a residual
        apart = stand_in_apart(mapping, case, f64.spec, held, own, own_schedule) if mapping is not None else None
        pair = _judge_steps(ref, impl, dtype, runs, pred, mapping, free_result, zero_gradients(case.spec),
                            leg_at(mapping) if stages and mapping is not None and mapping.stand_in else None, exact,
                            apart, spread_reruns(ref, impl))
        free_pair = next((fp for fp in free_result.pairs if fp.impl == impl), None)
        refine = chain_at(pair.first_bad_step, impl, tuple(e for e in exact if e.side in pair.first_exact)) \
            if stages and pair.first_bad_step else None
        _localise(pair, free_pair, refine, case.spec,
                  (free_result.runs.get(RunKey(ref, as_given(dtype))), free_result.runs.get(RunKey(impl, as_given(dtype)))))
        pairs.append(pair)
    return LockstepResult(free_result, pairs, t1 - t0, time.perf_counter() - t1)
