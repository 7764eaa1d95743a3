"""The capture runs that refine a localisation: both sides' per-device values at the first bad step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from parity_tests.contract.case import Case
from parity_tests.judging.factor import attach as attach_factor
from parity_tests.judging.localise import bound_at, stage_chain
from parity_tests.judging.verdict import Verdict
from parity_tests.protocol.errors import CaseError
from parity_tests.protocol.vocabulary import LOCAL_COMBINES
from parity_tests.running import registry
from parity_tests.session.executor import Need, Runs
from parity_tests.session.keys import capture_run

__all__ = ['inside_step']


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
                runs: Runs, *, beside: bool = False, stop: bool = False) -> dict[str, Any]:
    """``where`` (:func:`localise.refinable`) refined by the stage chain of its first bad step (docs/localisation.md), when both sides capture.

    ``sides``: ``(name, case)`` of the reference and the judged implementation, each the case
    that side ran (the case dtype or float64, mapped where the verdict judged a mapped run).
    The capture runs are declared (``executor.Need``) and made by ``runs``, once per side and case
    (two pairs that capture the same side's same case share its run). ``beside``: a TensorFlow
    side's capture run and a torch side's run at once (the default runner's torch runs wait on the
    worker pool, as :func:`compare_case`'s runs do); the same runs either way. ``stop``: a built-in's
    capture run stops after the captured step (:func:`_up_to`). These runs are asked for only after
    the verdict that needs them (a pair not at parity whose first bad step breaks inside the step).
    """
    step = where["first_bad_step"]
    missing = [name for name, _ in sides if not registry.resolve(name, "impls").captures]
    if missing:
        return {**where, "explanation": where["explanation"] + f" (per-device values: {', '.join(missing)} does not"
                                                                 " record them)"}

    def made(name: str, c: Case) -> Callable[[], Case]:
        return lambda: dataclasses.replace(_up_to(c, name, step) if stop else c, capture=step)

    # a capture's identity is the case it captures (``keys.capture_run``): a pair's float64 run that captured this
    # step in place (``plan.in_place_captures``) is found by it, and two pairs capturing one side share its run
    needs = [Need(capture_run(name, step, c), made(name, c), stored=False) for name, c in sides]
    trajs = runs.make(needs, beside=beside)
    chain = stage_chain(trajs[0], trajs[1], step, bound_at(verdict, step), sides[0][1].spec)
    if chain is None:
        return {**where, "explanation": where["explanation"] + " (per-device values: not recorded at this step)"}
    if chain["stage"] is None:  # every captured stage agrees: keep what the recorded channels said
        return {**where, "chain": chain["chain"],
                "explanation": where["explanation"] + " (" + chain["explanation"].split(": ", 1)[-1] + ")"}
    return attach_factor(chain, trajs[0], trajs[1], sides[0][1].spec, (trajs[0], trajs[1]))  # issue 37: the factor

