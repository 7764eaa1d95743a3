"""What an implementation declares it is, where every layer can read it without running it.

Each built-in engine states its :class:`EngineSpec` beside its ``run_case``, in its
framework's list (``tfpar/engines.py``, ``torchref/engines.py``, framework-free
modules); the registry (``parity_tests.running.registry``) builds the built-in
implementations from those lists and declares every implementation it registers
(built-ins, plugins, recorded runs) here, with :func:`declare`. Theory
(``parity_tests.judging.theory``), lockstep, recorded runs, the matrix and the
implementations table in docs/implementations.md read the declarations, so adding
an engine touches its own module and its framework's list. The judge imports no
part of the runner: this is all it knows of one.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

__all__ = ["EngineSpec", "declare", "declared", "table"]


@dataclass(frozen=True)
class EngineSpec:
    """One implementation's declaration.

    Attributes:
        name: as the user writes it (``tf.towers``, ``my_ddp.py:train``, ``recorded:run.npz``).
        kind: ``builtin``, ``plugin`` or ``recorded``.
        framework: ``tf`` or ``torch``.
        parallel: whether it splits the global batch over devices (towers, ranks).
        dtypes: the case dtypes it runs.
        keras: whether its optimizers are Keras' (the float64 hyperparameter rounding applies).
        captures: whether it records a captured step's per-device values.
        rerunnable: ``False`` for a recorded run (it cannot be rerun from perturbed weights).
    """

    name: str
    kind: str
    framework: str
    parallel: bool
    dtypes: tuple[str, ...]
    keras: bool = False
    captures: bool = False
    rerunnable: bool = True
    description: str = ""
    #: ``parallel.combine`` modes it runs (``None``: not declared, a plugin's or a recorded run's)
    combines: tuple[str, ...] | None = None
    #: ``data.order`` values it runs
    orders: tuple[str, ...] | None = None
    #: ``optimizer.name`` values it runs
    optimizers: tuple[str, ...] | None = None
    #: ``model.layers[*].type`` values it builds, nested ones included (``None``: not declared)
    layers: tuple[str, ...] | None = None
    #: lockstep: one trainer runs on and loads each start state (``tfpar.lockstep``)
    stepwise: bool = False
    #: lockstep: loads and exports optimizer state (so it takes part whatever the optimizer)
    stateful: bool = False
    #: whose optimizer classes it runs under ``native``: ``keras``, ``tf.compat.v1`` or ``torch``
    optimizer_family: str = ""
    #: per-device gradient under synchronized batch norm: ``own_loss`` (a tower differentiates its own
    #: loss through the shared statistics) or ``share`` (an all-reduce's share of the whole batch's)
    sync_bn_gradient: str = "share"
    #: whether it runs ``parallel.accumulate`` > 1 (micro-batches per step); ``None``: not declared (a
    #: plugin reads the field from the spec itself)
    accumulate: bool | None = None
    #: a run with ``capture = k`` trains bit for bit as the run without it (its per-device values computed from
    #: the same parameters beside the step, not by another trace of it): the session makes a pair's float64 run
    #: and the capture of its step 1 as one run (``session.plan.in_place_captures``); the proof on every engine
    #: that declares it is ``benchmarks/trajectory_hashes.py --capture 1 --check`` against its plain runs' hashes
    captures_in_place: bool = False
    #: it makes the float64 run that rounds a mixed recipe's gradients to bfloat16 (payload ``grads_bf16``,
    #: ``protocol.grad_rounding``): the built-ins that run ``mixed_bfloat16``; a plugin declares dtypes only
    rounds_gradients: bool = False
    #: where its runner lives, ``module:function`` (for docs and listings)
    entry: str = ""
    #: listed among the built-ins the matrix and ``compare`` run in one process (``tf.multiworker`` is
    #: launched one process per worker instead)
    in_process: bool = True


_lock = threading.Lock()
_declared: dict[str, EngineSpec] = {}


def declare(spec: EngineSpec) -> EngineSpec:
    """Record ``spec`` under its name (a later declaration of the name replaces it)."""
    with _lock:
        _declared[spec.name] = spec
    return spec


def declared(name: str) -> EngineSpec | None:
    """The declaration of ``name``, if it was declared in this process."""
    with _lock:
        return _declared.get(name)


def table(specs: tuple[EngineSpec, ...]) -> str:
    """The implementations table of docs/implementations.md, as Markdown, from the declarations."""
    def cell(values: tuple[str, ...] | None) -> str:
        return "all" if values is None else ", ".join(values) if values else "-"

    rows = ["| name | framework | splits the batch | dtypes | combine | data order | optimizers | lockstep | captures |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for s in specs:
        lockstep = "stepwise" if s.stepwise else "loads state" if s.stateful else "stateless optimizers"
        rows.append(f"| `{s.name}` | {s.framework} | {'yes' if s.parallel else 'no'} | {cell(s.dtypes)} | "
                    f"{cell(s.combines)} | {cell(s.orders)} | {cell(s.optimizers)} | "
                    f"{lockstep if s.in_process else '-'} | {'yes' if s.captures else 'no'} |")
    return "\n".join(rows) + "\n"
