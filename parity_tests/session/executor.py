"""Making a comparison's runs: each once, TensorFlow's and torch's beside each other where both fit in
memory (``running.room``), with progress, refusals and mappings that cannot run recorded.

Which runs to make is ``session.plan``'s business; how a pair is judged from them ``session.judge_pair``'s.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from parity_tests.contract.case import Case
from parity_tests.protocol.errors import CaseError
from parity_tests.running import registry
from parity_tests.session.keys import RunKey, Variant, capture_run
from parity_tests.session.variants import _rerun_of, _variants

__all__ = ["Runner", "Mapped", "Need", "Runs", "Executor"]

#: the library's messages (``tfpar compare`` shows INFO and above; ``--verbose`` DEBUG, each run)
_log = logging.getLogger("tfpar.session")
Runner = Callable[[Case, str], dict[str, np.ndarray]]


class Mapped(Protocol):
    """What a mapped run is made with: ``session.mapping.SideMapping`` or ``session.loss_scale.ExactScale``."""

    @property
    def key(self) -> str: ...  # the trajectory key suffix of its runs

    @property
    def ident(self) -> tuple[str, str]: ...  # (the implementation that runs it, key)

    @property
    def text(self) -> str: ...

    def apply(self, case: Case) -> Case: ...


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



@dataclass(frozen=True)
class _Run:
    """One run :func:`compare_case` makes: ``impl`` in ``variant``, mapped by ``mapping`` if given.

    ``serves``: the mapping this run is made for (a mapped run, or a stand-in's own run): if it
    cannot be made, that mapping's pairs are judged without a residual. ``required``: a run whose
    refusal is an error of the comparison (not for the loss channel's extra gradient). ``capture``:
    the step whose per-device values the run also records, in place (``plan.in_place_captures``):
    kept apart as that step's capture run (``keys.capture_run``), the run itself without them.
    """

    impl: str
    variant: Variant
    mapping: Mapped | None = None
    serves: Mapped | None = None
    required: bool = True
    capture: int | None = None



@dataclass(frozen=True)
class Need:
    """A run a check declares (``judge_pair``: the conditioning, the spread, a capture; ``mapping.follows_its_class``).

    ``key`` names it (a run two checks need is made once); ``case()`` makes the case it runs, asked only when
    the run is made. ``stored``: kept with the comparison's runs (``CaseResult.trajectories``), else
    made for the check alone. ``in_server``: a TensorFlow built-in's run goes to the server's child
    where this process has not imported TensorFlow (a compare of plugins alone keeps it free of
    TensorFlow's import and memory).
    """

    key: RunKey
    case: Callable[[], Case]
    stored: bool = True
    in_server: bool = False


class Runs:
    """Runs made by ``runner`` from declared needs (:meth:`make`), each once by its key.

    ``trajs``: the runs kept with the comparison (by key); ``extra``: those made for a check alone.
    The free compare's :class:`Executor` is one; ``--lockstep`` makes its one-step captures through another.
    """

    def __init__(self, runner: Runner, trajs: dict[RunKey, Any] | None = None,
                 extra: dict[RunKey, Any] | None = None) -> None:
        self.runner = runner
        self.trajs: dict[RunKey, Any] = {} if trajs is None else trajs
        self.extra: dict[RunKey, Any] = {} if extra is None else extra

    def made(self, key: RunKey) -> Any:
        """The run of ``key`` (``None`` if it was not made)."""
        return self.trajs.get(key, self.extra.get(key))

    def make(self, needs: list[Need], *, beside: bool = False) -> list[Any]:
        """Each need's run, in order: made where not made yet (once), else the one made. ``beside``: a TensorFlow
        need and a torch need are made at once (the TensorFlow one in this thread), as the first rounds' runs are."""
        def work(todo: list[Need]) -> None:
            for need in todo:
                if self.made(need.key) is not None:
                    continue
                name, c = need.key.impl, need.case()
                if need.in_server and name.startswith("tf.") and "tensorflow" not in sys.modules:
                    from parity_tests.running.builtins import run_in_server

                    traj = run_in_server(c, name)
                else:
                    traj = self.runner(c, name)
                (self.trajs if need.stored else self.extra)[need.key] = traj

        frameworks = [registry.resolve(n.key.impl, "impls").framework for n in needs]
        if beside and len(needs) == 2 and needs[0].key != needs[1].key and sorted(frameworks) == ["tf", "torch"]:
            _beside(work, [needs[frameworks.index("tf")]], [needs[frameworks.index("torch")]])
        else:
            work(needs)
        return [self.made(n.key) for n in needs]


class Executor(Runs):
    """The runs of one comparison of ``case``, made by ``runner`` into :attr:`trajs` (by :class:`keys.RunKey`).

    ``refused``: the implementations that refused the case (none of their runs is made; with
    ``skip_unsupported`` one that refuses while running is added to it, else its ``CaseError`` is raised,
    and always for the reference ``ref``). A mapping whose run cannot be made is recorded in
    :attr:`unmappable` (its pairs are judged without a residual).
    """

    def __init__(self, case: Case, ref: str, variants: dict[Variant, Case], runner: Runner, *, beside: bool,
                 progress: bool | Callable[[str], None], skip_unsupported: bool, refused: dict[str, str]) -> None:
        super().__init__(runner)
        self.case, self.ref, self.variants = case, ref, variants
        self.beside, self.progress, self.skip_unsupported, self.refused = beside, progress, skip_unsupported, refused
        self.mapped_cases: dict[RunKey, Case] = {}  # the key of a mapped run -> the case it ran
        #: (runs_as, key) of a mapping whose runs could not be made -> why
        self.unmappable: dict[tuple[str, str], str] = {}
        self._mapped_variants: dict[str, dict[Variant, Case]] = {}
        self.bar: Any = None

    def expect(self, runs: int) -> None:
        """Say that ``runs`` more runs are planned (the progress bar's total; made at the first call)."""
        if self.progress is True and self.bar is None:  # a bar on a terminal, one line per run in a log
            from parity_tests.session.progress import run_bar

            self.bar = run_bar(runs, self.case.name)
        elif self.bar is not None:
            self.bar.total += runs

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None  # a run made after the planned ones (a plugin's own mapped rerun) updates no closed bar

    def case_for(self, impl: str, d: Variant, mapping: Mapped | None) -> Case:
        """The case ``impl`` runs in variant ``d``, mapped by ``mapping``."""
        if mapping is None:
            c = self.variants[d]
        else:  # mapped first, then made the variant (a perturbed case is not re-validated)
            if mapping.key not in self._mapped_variants:
                self._mapped_variants[mapping.key] = _variants(mapping.apply(self.case))
            c = self._mapped_variants[mapping.key][d]
        return _rerun_of(c, impl) if d.perturbed else c

    def _work(self, items: list[_Run]) -> None:
        bar, progress, trajs = self.bar, self.progress, self.trajs
        for item in items:
            impl, d, mapping = item.impl, item.variant, item.mapping
            key = RunKey(impl, d, mapping.key if mapping else "")
            if key in trajs or impl in self.refused or (item.serves is not None and item.serves.ident in self.unmappable):
                continue
            if bar is not None:
                bar.set_postfix_str(key.text)
            elif callable(progress):
                progress(key.text)
            try:
                try:
                    c = self.case_for(impl, d, mapping)
                    started = time.perf_counter()
                    _log.debug("%s: run %s started", self.case.name, key)
                    if item.capture is None:
                        trajs[key] = self.runner(c, impl)
                    else:
                        trajs[key] = self._in_place(c, impl, item.capture)
                    _log.debug("%s: run %s finished in %.2f s", self.case.name, key, time.perf_counter() - started)
                    if mapping is not None:
                        self.mapped_cases[key] = c
                except CaseError as e:
                    if item.serves is not None:  # the mapping cannot be run: its pairs get no residual
                        self.unmappable[item.serves.ident] = f"{item.serves.text}: {e}"
                    elif not item.required:
                        pass
                    elif not self.skip_unsupported or impl == self.ref:
                        raise
                    else:
                        self.refused[impl] = str(e)
            except BaseException:
                if bar is not None:
                    bar.close()  # cleared, so the error line that follows starts a line of its own
                raise
            if bar is not None:
                bar.update(1)

    def _in_place(self, c: Case, impl: str, step: int) -> dict[str, Any]:
        """``impl``'s run of ``c`` recording step ``step``'s per-device values in place: the run without them
        (returned) and, where it recorded them, the whole run as that step's capture run (``capture.inside_step``
        finds it by ``keys.capture_run``, as the run it would make; for a check alone, not stored)."""
        traj = self.runner(dataclasses.replace(c, capture=step), impl)
        if "device/step" not in traj:  # a runner that does not capture: inside_step makes its own run, if asked
            return traj
        self.extra[capture_run(impl, step, c)] = traj
        return {k: v for k, v in traj.items() if not k.startswith("device/")}

    def run(self, plan: list[_Run]) -> None:
        """Make every run of ``plan`` not made yet."""
        torch_side = [item for item in plan if registry.resolve(item.impl, "impls").framework == "torch"]
        if self.beside and torch_side and len(torch_side) < len(plan):
            # the torch runs wait on the worker pool (other processes): run them beside the TensorFlow
            # runs of this process rather than after them; results and errors are the same
            _beside(self._work, [item for item in plan if item not in torch_side], torch_side)
        else:
            self._work(plan)
