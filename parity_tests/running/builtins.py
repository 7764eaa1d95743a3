"""The built-in implementations, which :mod:`.registry` registers like any other.

``tf.towers``, ``tf.single``, ``tf.v1`` and ``tf.mirrored`` run in this process
(:func:`tfpar.run_case`), or, for a model of :data:`ISOLATE_PARAMETERS` or more, in a forked child of
the TensorFlow server (:mod:`parity_tests.running.tf_worker`); ``torch.ddp`` and ``torch.single`` in the shared
DDP worker pool (:func:`torchref.run.run_case`'s job functions).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from parity_tests.contract.case import Case
from parity_tests.protocol.engine import EngineSpec
from parity_tests.protocol.errors import CaseError
from parity_tests.protocol.rows import remove_files, spill_threshold
from parity_tests.running.backends import RunError, by_file, check_tf_devices, run_torch_job
from parity_tests.running.implementation import Implementation
from tfpar import engines as tfpar_engines
from torchref import engines as torch_engines

__all__ = ["SPECS", "BUILTINS", "IMPLEMENTATIONS", "MULTIWORKER", "ISOLATE_PARAMETERS", "run_in_server"]

#: every built-in engine's declaration, TensorFlow's then torch's (each framework's list is beside its engines)
SPECS: tuple[EngineSpec, ...] = (*tfpar_engines.SPECS, *torch_engines.SPECS)
#: the built-ins ``compare`` and the matrix run in one process, in declaration order
BUILTINS = {s.name: s.description for s in SPECS if s.in_process}


def _refuse_external(case: Case, impl: str) -> None:
    if "external" in case.spec["model"]:
        raise CaseError("model", f"a layer list for {impl} (built-in implementations build the model from"
                                 " model.layers; an external model runs only on plugins)", {"external": case.spec["model"]["external"]})


#: a built-in TensorFlow run of a model with at least this many parameters runs in a forked child of the
#: TensorFlow server (``tf_worker``), not in this process: TensorFlow keeps a run's working set resident after
#: the run (about 100 bytes per parameter in float64, docs/memory.md), so the in-process runs of a large
#: model pile up here; a child gives it all back when it exits. Smaller models stay here (no fork, warm traces).
ISOLATE_PARAMETERS = 2_000_000


def _isolated(case: Case) -> bool:
    return sum(int(np.prod(a.shape)) for a in case.init.values()) >= ISOLATE_PARAMETERS


def _run_in_child(case: Case, impl: str, progress: Callable[[int], None] | None) -> dict[str, np.ndarray]:
    """``tfpar.run_case`` in a fresh child of the TensorFlow server, which exits when it is done."""
    from parity_tests.running.tf_worker import run_case_job

    placed = [device + 1 for _, _, device in case.spec["model"].get("placement", [])]
    towers = case.devices if impl != "tf.single" else 1
    out = run_case_job(case, impl, max([towers, *placed]), builtin=impl)
    if "unsupported" in out:
        raise CaseError(*out["unsupported"])
    if "failed" in out:
        raise RunError(f"{impl} failed: {out['failed']}")
    if progress:
        progress(case.spec["steps"])
    return out["trajectory"]


def run_in_server(case: Case, impl: str) -> dict[str, np.ndarray]:
    """The TensorFlow built-in ``impl`` run on ``case`` in a fresh child of the TensorFlow server, whatever the
    model's size: for a run the judge makes on its own account (``comparison.follows_its_class``), which must
    not import TensorFlow into a tool process that needed none (only plugins ran)."""
    _refuse_external(case, impl)
    return _run_in_child(case, impl, None)


def _tensorflow(impl: str) -> Callable:
    def run(case: Case, progress: Callable[[int], None] | None) -> dict[str, np.ndarray]:
        _refuse_external(case, impl)
        if _isolated(case):
            return _run_in_child(case, impl, progress)
        tfpar = check_tf_devices(case, impl, towers=impl != "tf.single")
        try:
            return tfpar.run_case(case.payload(), impl, progress=progress)
        except tfpar.Unsupported as e:  # a valid case this implementation does not implement
            raise CaseError(e.field, e.expected) from None
        except Exception as e:  # a TensorFlow failure on a valid case: one line, not a traceback
            raise RunError(f"{impl} failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e

    return run


def _torch(impl: str) -> Callable:
    def run(case: Case, progress: Callable[[int], None] | None) -> dict[str, np.ndarray]:
        from torchref.jobs import job_ref, merge_captures  # torch-free: the ranks import the job
        from torchref.pool import MAX_SIZE

        _refuse_external(case, impl)
        n = case.devices if impl == "torch.ddp" else 1
        if n > MAX_SIZE:
            raise CaseError("parallel.devices", f"at most {MAX_SIZE} ranks", n)
        # the parent's spill threshold travels with the job (the workers were started before it was set)
        payload, files = by_file({**case.payload(), "spill_bytes": spill_threshold()})
        try:
            results = run_torch_job(impl, job_ref(payload, impl), payload, n)
        finally:
            remove_files(files)
        traj = merge_captures(results) if case.capture else results[0]
        if progress:
            progress(case.spec["steps"])
        return traj

    return run


def _refusal(spec: EngineSpec) -> Callable[[Case], None]:
    """What the engine ``spec`` refuses of a case, decided from the case alone (``Implementation.refuse``):
    an external model; for a TensorFlow engine everything its ``run_case`` refuses before it trains
    (``tfpar.refusals``, framework-free: no TensorFlow is imported for it); for ``torch.ddp`` more ranks
    than the pool holds; ``tf.multiworker`` is never run by a comparison (launched once per worker)."""
    impl = spec.name

    def refuse(case: Case) -> None:
        _refuse_external(case, impl)
        if not spec.in_process:
            _multiworker(case, None)
        if spec.framework == "tf":
            from tfpar.errors import Unsupported
            from tfpar.refusals import refuse as tf_refuse

            try:
                tf_refuse(case.spec, impl)
            except Unsupported as e:
                raise CaseError(e.field, e.expected) from None
        elif impl == "torch.ddp":
            from torchref.pool import MAX_SIZE  # torch-free

            if case.devices > MAX_SIZE:
                raise CaseError("parallel.devices", f"at most {MAX_SIZE} ranks", case.devices)

    return refuse


def _implementation(spec: EngineSpec) -> Implementation:
    tf = spec.framework == "tf"
    run = (_tensorflow if tf else _torch)(spec.name) if spec.in_process else _multiworker
    return Implementation(spec, run, refuse=_refusal(spec))


#: launched one process per worker (``python -m parity_tests.launch.tf``, TF_CONFIG); not in the built-in list the
#: matrix and ``compare`` run in one process, but resolvable, so manifests and recorded runs name it
MULTIWORKER = "tf.multiworker"


def _multiworker(case: Case, progress: Callable[[int], None] | None) -> dict[str, np.ndarray]:
    # MultiWorkerMirroredStrategy must be made before TensorFlow starts, once per process, in every
    # worker: a process that already runs TensorFlow (this one counts its tower devices) cannot join
    raise CaseError("--impl", f"{MULTIWORKER} launched once per worker with TF_CONFIG set: python -m parity_tests.launch.tf CASE"
                              f" --impl {MULTIWORKER} --out run.npz, then compare recorded:run.npz (docs/multiworker.md)")


#: every built-in, in the order listings show them (the registry registers these)
IMPLEMENTATIONS: tuple[Implementation, ...] = tuple(_implementation(s) for s in SPECS)
