"""Noise or bug? Two (or more) recorded float32 runs of one case, judged against what rounding explains.

    tfpar compare case.json --impls recorded:tf.npz,recorded:torch.npz      # two backends, two machines, ...
    tfpar compare case.json --impls recorded:a.npz,recorded:b.npz,recorded:c.npz   # b and c, each against a

Two runs recorded elsewhere (``tfpar run``: one device and ``MirroredStrategy``, TensorFlow and torch,
two machines) cannot be run again, so neither gives the float64 run (rule 2) nor the one-ulp perturbed
rerun (rule 3) that a float32 verdict is judged against. The bound comes from runs that *can* be made
here: for each recorded side, the built-in of its kind (the recorded built-in itself, else ``tf.towers``,
``tf.single``, ``torch.ddp`` or ``torch.single`` by framework and by whether it splits the batch) runs the
case in float32 and in float64, and its float32-against-float64 gap is that kind's rounding floor:

    floor_S[k] = max over j <= k of gap_j(S32, S64)              (S: the stand-in of a side, every channel)
    bound[k]   = 2 max(floor_SA[k], floor_SB[k]) + 4 u           (u = 2^-24: the triangle inequality, rule 2)

and the pair is ``parity`` ("within what rounding explains") when ``gap_k(A32, B32) <= bound[k]`` at
every step, else ``divergence``. Never the recorded runs' own distance to float64: a recorded run with
a bug would widen its own bound. Each recorded run is also held against its stand-in's float64 run,
``gap_k(X32, S64)`` against ``2 floor_S[k] + 4 u``, which says *which* side is off where one is.

What this bound assumes, said with it: the recorded runs compute what their stand-ins compute (the same
case, the same update rule), and their machines round with the same unit roundoff in about the same
number of operations as this machine's built-ins do. A recorded run made on other hardware (another CPU's
kernels, a GPU's reductions) rounds differently in the last bits but not by orders of magnitude more; a
gap tens of times over the bound is not rounding on any of them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from parity_tests.contract.case import Case
from parity_tests.judging.bounds import FLOAT32_ABS_FLOOR, FLOAT32_FACTOR
from parity_tests.judging.localise import row_gaps
from parity_tests.protocol.errors import CaseError
from parity_tests.running import registry

__all__ = ["float32_bound", "NoiseSide", "NoiseResult", "stand_in", "noise_or_bug", "noise_or_bug_all", "recorded_runs",
           "summary_of", "check_recorded_mix"]


def float32_bound(floor: np.ndarray | float) -> np.ndarray | float:
    """The float32 rule's bound on a floor (``judging.bounds``: ``FLOAT32_FACTOR x floor + FLOAT32_ABS_FLOOR``,
    2 x floor + 4 x 2^-24; derivation in docs/tolerance.md), the one every float32 verdict uses."""
    return FLOAT32_FACTOR * floor + FLOAT32_ABS_FLOOR


def stand_in(name: str) -> str:
    """The built-in whose rounding stands for the recorded run ``name`` (its own name when it is a built-in)."""
    impl = registry.resolve(name, "--impls")
    recorded_as = impl.description.split("a recorded run of ", 1)[-1].split(" on ", 1)[0]
    if recorded_as in ("tf.towers", "tf.single", "tf.v1", "tf.mirrored", "torch.ddp", "torch.single"):
        return recorded_as
    if impl.framework == "tf":
        return "tf.towers" if impl.parallel else "tf.single"
    return "torch.ddp" if impl.parallel else "torch.single"


def _gaps(a: Mapping[str, Any], b: Mapping[str, Any]) -> tuple[np.ndarray, list[str]]:
    """``[steps+1]`` greatest row gap over every parameter, state and gradient array, and the loss
    (row k+1 is step k's: the loss of step k is judged with the parameters after it); the channel names."""
    steps = len(a["loss"])
    worst = np.zeros(steps + 1)
    names: list[str] = [""] * (steps + 1)
    for key in sorted(set(a) & set(b)):
        if not key.startswith(("param/", "state/", "grad/", "loss")):
            continue
        g = row_gaps(a[key], b[key]) if key != "loss" else row_gaps(np.asarray(a[key])[:, None], np.asarray(b[key])[:, None])
        g = np.nan_to_num(g, nan=0.0, posinf=np.inf)
        if key.startswith("grad/") or key == "loss":
            g = np.concatenate([[0.0], g])  # step k's gradient and loss sit beside the parameters after step k
        for k in range(min(len(g), steps + 1)):
            if g[k] > worst[k]:
                worst[k], names[k] = g[k], key
    return worst, names


@dataclass
class NoiseSide:
    """One recorded run: its stand-in, the stand-in's floor, and the run's own distance to float64."""

    name: str
    stand_in: str
    floor: np.ndarray          # [steps+1], running max of gap(S32, S64)
    to_float64: np.ndarray     # [steps+1], gap(X32, S64)

    @property
    def off(self) -> int | None:
        """The first step where this run is farther from float64 than twice its stand-in's floor, or None."""
        over = np.flatnonzero(self.to_float64 > float32_bound(self.floor))
        return int(over[0]) if len(over) else None


@dataclass
class NoiseResult:
    """The verdict on two recorded runs (``status`` ``parity`` or ``divergence``) and how it was reached."""

    status: str
    gap: float
    bound: float
    first_step: int | None
    channel: str | None
    sides: tuple[NoiseSide, NoiseSide]
    per_step_gap: np.ndarray = field(repr=False)
    per_step_bound: np.ndarray = field(repr=False)

    def summary(self) -> str:
        a, b = self.sides
        head = (f"noise or bug: {a.name} vs {b.name}: " + (
            f"within what rounding explains (gap {self.gap:.3g} <= bound {self.bound:.3g} at every step)"
            if self.status == "parity" else
            f"NOT rounding: gap {self.gap:.3g} over the bound {self.bound:.3g}, first at step {self.first_step}"
            f" ({self.channel})"))
        how = (f"  bound = 2 x max(floor of {a.stand_in}, floor of {b.stand_in}) + 4 x 2^-24, each floor the"
               " built-in's own float32-against-float64 gap on this case, run here (a recorded run cannot be rerun"
               " in float64 or from perturbed inputs; its own distance to float64 would include a bug)")
        lines = [head, how]
        for s in self.sides:
            off = s.off
            lines.append(f"  {s.name}: against {s.stand_in}'s float64 run: " + (
                f"off from step {off} (gap {s.to_float64[off]:.3g} > {float32_bound(s.floor[off]):.3g})" if off is not None
                else f"within rounding at every step (at most {float(np.max(s.to_float64)):.3g})"))
        return "\n".join(lines)


def noise_or_bug(case: Case, names: tuple[str, str], runner: Callable[[Case, str], Mapping[str, Any]], *,
                 cache: dict[tuple[str, str], Mapping[str, Any]] | None = None) -> NoiseResult:
    """Judge two recorded float32 runs ``names`` of ``case`` against the rounding floors of their stand-ins.

    Args:
        case: the case both recorded (float32).
        names: ``("recorded:a.npz", "recorded:b.npz")``.
        runner: ``runner(case, impl) -> trajectory`` (``harness.run_impl``), for the recorded runs and the
            stand-ins' float32 and float64 runs.
        cache: ``{(impl, dtype): trajectory}`` shared between calls (:func:`noise_or_bug_all`): each recorded
            run is read, and each stand-in run, once.
    """
    c64 = case.replace(dtype="float64")
    cache = {} if cache is None else cache

    def got(name: str, dt: str) -> Mapping[str, Any]:
        if (name, dt) not in cache:
            cache[(name, dt)] = runner(case if dt == "float32" else c64, name)
        return cache[(name, dt)]

    runs = [got(n, "float32") for n in names]
    sides = []
    for name, run in zip(names, runs, strict=True):
        s = stand_in(name)
        floor = np.maximum.accumulate(_gaps(got(s, "float32"), got(s, "float64"))[0])
        sides.append(NoiseSide(name, s, floor, _gaps(run, got(s, "float64"))[0]))
    gap, chan = _gaps(runs[0], runs[1])
    bound = float32_bound(np.maximum(sides[0].floor, sides[1].floor))
    over = np.flatnonzero(gap > bound)
    k = int(over[0]) if len(over) else int(np.argmax(gap / bound))
    return NoiseResult("divergence" if len(over) else "parity", float(gap[k]), float(bound[k]),
                       k if len(over) else None, chan[k] if len(over) else None, (sides[0], sides[1]), gap, bound)


def noise_or_bug_all(case: Case, names: Sequence[str], runner: Callable[[Case, str], Mapping[str, Any]]
                     ) -> list[NoiseResult]:
    """Two or more recorded float32 runs: each after the first judged against the first (the reference, as
    ``tfpar compare`` pairs its implementations), by :func:`noise_or_bug`; every run and stand-in run made once.

    Returns:
        one :class:`NoiseResult` per pair ``(names[0], names[i])``, ``i >= 1``, in order.
    """
    cache: dict[tuple[str, str], Mapping[str, Any]] = {}
    return [noise_or_bug(case, (names[0], other), runner, cache=cache) for other in names[1:]]


def summary_of(results: Sequence[NoiseResult]) -> str:
    """The lines ``tfpar compare`` prints for :func:`noise_or_bug_all`'s results, one block per pair."""
    if len(results) <= 1:
        return "\n".join(r.summary() for r in results)
    head = (f"noise or bug: {len(results) + 1} recorded runs, each against {results[0].sides[0].name} (the first):"
            f" {sum(r.status == 'parity' for r in results)} within rounding, {sum(r.status != 'parity' for r in results)}"
            " not")
    return "\n".join([head, *(r.summary() for r in results)])


def recorded_runs(case: Case, impls: Sequence[str]) -> bool:
    """Whether ``impls`` is the case :func:`noise_or_bug_all` answers: two or more recorded runs of a float32 case.

    (The ordinary comparison cannot judge them: a float32 pair is judged against each side's float64 run or
    its run from perturbed inputs, and a recorded run can make neither; it stopped with a traceback from
    ``judge_perturbation``.)
    """
    return len(impls) >= 2 and case.spec["dtype"] == "float32" and all(i.startswith("recorded:") for i in impls)


def check_recorded_mix(case: Case, impls: Sequence[str]) -> None:
    """Refuse (``CaseError`` on ``--impls``, before anything runs) a float32 comparison that pairs two recorded runs
    beside runnable implementations: the ordinary comparison pairs the first with each other one, and a pair of
    two recorded runs has neither side's float64 run nor perturbed rerun to be judged by (it stopped with a
    traceback from ``judge_perturbation``). Recorded runs alone go to :func:`noise_or_bug_all`."""
    if case.spec["dtype"] != "float32" or recorded_runs(case, impls) or not impls[0].startswith("recorded:"):
        return
    also = [i for i in impls[1:] if i.startswith("recorded:")]
    if also:
        raise CaseError("--impls", "recorded float32 runs either alone (noise or bug: each judged against the first)"
                                   " or after a runnable implementation named first (a pair of two recorded runs has no"
                                   " float64 or perturbed run to be judged by)", ",".join([impls[0], *also]))
