"""Run a validated case on any implementation, by name (resolved by :mod:`.registry`).

How each run is carried out (TensorFlow in this process, torch on the DDP pool) is
:mod:`.backends`'; this module is what the session layer and the command line call.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

import numpy as np

from parity_tests.contract.case import Case
from parity_tests.contract.model import nested_layers
from parity_tests.protocol.errors import CaseError
from parity_tests.protocol.memory import release_memory
from parity_tests.running import registry
from parity_tests.running.backends import check_torch_ranks, pool_timeout
from parity_tests.running.builtins import BUILTINS
from parity_tests.running.builtins import SPECS as BUILTIN_SPECS
from parity_tests.running.frameworks import installed

__all__ = ["IMPLS", "run_impl", "parse_impls", "check_dtypes", "check_refusals", "refusal", "prestart_torch"]

#: the built-in implementations (the registry lists every name: :func:`registry.names`)
IMPLS = tuple(BUILTINS)


def parse_impls(text: str, field: str = "--impls") -> list[str]:
    """``"tf.towers,my_towers.py:train"`` -> ``["tf.towers", "my_towers.py:train"]``, each name resolved.

    Names are split at commas; a plugin or recorded path may not contain one.
    """
    names = [s.strip() for s in text.split(",") if s.strip()]
    if not names:
        raise CaseError(field, "a comma-separated list of implementations (" + registry.describe_names() + ")", text)
    for n in names:
        registry.resolve(n, field)
    if len(set(names)) != len(names):
        raise CaseError(field, "each implementation once", text)
    return names


def check_dtypes(case: Case, impls: list[str], field: str = "--impls") -> None:
    """Refuse, before anything runs, an implementation that does not declare the case's dtype or one of its
    layers (``EngineSpec``), and a built-in asked to run an optimizer only plugins know
    (``contract.optimizer.builtin_refusal``)."""
    from parity_tests.contract.optimizer import builtin_refusal

    dtype = case.spec["dtype"]
    for name in impls:
        found = registry.resolve(name, field)
        refused = builtin_refusal(case.spec["optimizer"], name) if found.kind == "builtin" else None
        if refused is not None:  # an optimizer only plugins know (kept as data for them)
            raise refused
        if dtype not in found.dtypes:
            raise CaseError("dtype", f"one of {', '.join(found.dtypes)} for {name} (the dtypes it declares)", dtype)
        k = case.spec.get("parallel", {}).get("accumulate", 1)
        if k > 1 and found.spec.accumulate is False:
            takes = ", ".join(s.name for s in BUILTIN_SPECS if s.accumulate)
            raise CaseError("parallel.accumulate", f"1 for {name} (it does not declare micro-batch accumulation;"
                            f" {takes} do)", k)
        declared = found.spec.layers
        for path, layer in nested_layers(case.spec["model"].get("layers", [])):
            if declared is not None and layer["type"] not in declared:
                where = "model.layers" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path)
                raise CaseError(f"{where}.type", f"one of the layers {name} declares ({', '.join(declared)})",
                                layer["type"])


def refusal(case: Case, name: str, field: str = "--impls") -> CaseError | None:
    """What ``name`` refuses of ``case``, decided before anything runs, or ``None``: the dtypes, layers and
    optimizers it declares (:func:`check_dtypes`), then the implementation's own refusals
    (``Implementation.refuse``: a built-in TensorFlow engine's ``tfpar.refusals``, an external model on a
    built-in, more ranks than the pool holds). An unknown name raises (bad input of its own)."""
    found = registry.resolve(name, field)
    try:
        check_dtypes(case, [name], field)
        if found.refuse is not None:
            found.refuse(case)
    except CaseError as e:
        return e
    return None


def check_refusals(case: Case, impls: list[str], field: str = "--impls") -> None:
    """Ask every implementation in ``impls`` what it refuses of ``case`` before any of them runs.

    Raises:
        CaseError: the first refusal, in the order of ``impls`` (one line naming the field).
    """
    for name in impls:
        refused = refusal(case, name, field)
        if refused is not None:
            raise refused


def run_impl(case: Case, impl: str, *, progress: Callable[[int], None] | None = None) -> dict[str, np.ndarray]:
    """Run ``case`` on the implementation named ``impl`` and return its trajectory.

    Raises:
        CaseError: an unknown name, a plugin that cannot be loaded or recorded badly, a dtype
            the implementation does not declare, or a case it cannot run here.
        RunError: the implementation failed (the message names the rank, or the step a plugin was on).
    """
    check_refusals(case, [impl], "--impl")
    found = registry.resolve(impl, "--impl")
    try:
        return found.run(case, progress)
    finally:
        release_memory()  # a TensorFlow run's freed tensors, a torch job's pickled payload and results


def prestart_torch(case: Case, impls: list[str]) -> None:
    """Spawn the shared pool's workers now, when a torch implementation may run: they import torch and
    join their process groups while this process goes on (importing TensorFlow, running the TF side).

    Called by the command line before anything imports TensorFlow; the first torch job waits for the
    start-up to finish (``DDPPool.spawn``). Names that are surely TensorFlow (``tf.*``) or recorded
    runs need no pool; a plugin might be torch, so it counts.
    """
    if all(name.startswith(("tf.", "recorded:")) for name in impls) or not installed("torch"):
        return  # (no torch here: every torch name was refused already; a TensorFlow plugin needs no pool)
    from torchref.pool import MAX_SIZE, get_pool

    shared = {} if pool_timeout() is None else {"timeout": pool_timeout()}
    check_torch_ranks(min(max(case.devices, 1), MAX_SIZE))  # one line, before spawning ranks that cannot fit
    pool = get_pool(min(max(case.devices, 1), MAX_SIZE), **shared)

    def spawn() -> None:
        with contextlib.suppress(Exception):  # the first torch job starts the pool again and reports why
            pool.spawn()

    # a thread, since the first spawn waits for the forkserver to import torch (1.3 s): this
    # thread goes on to import TensorFlow meanwhile; the pool's lock makes the first job wait
    threading.Thread(target=spawn, name="tfpar-pool-spawn", daemon=True).start()
