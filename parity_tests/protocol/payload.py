"""What an engine is handed: the case as plain data, and the options of this one run.

Every key is declared here; an engine checks what it is handed (:func:`check_payload`)
and refuses a key nobody declared, so a new option cannot travel unnamed. The case
part is ``Case.payload()`` (``parity_tests.contract.case``); the run options are
added by the harness, lockstep and the localisation rerun.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypedDict

import numpy as np

from parity_tests.protocol.grad_rounding import GRADS_BF16

__all__ = ["Payload", "CASE_KEYS", "OPTION_KEYS", "EXACT_LOSS_SCALE", "check_payload"]


class Payload(TypedDict, total=False):
    """The payload of one run (all keys but ``spec`` optional).

    The case (``Case.payload()``):
        spec: the validated case (``case.json`` with every default filled in).
        x: ``[rows, ...]`` inputs; y: ``[rows]`` or ``[rows, K]`` targets.
        init: initial values by canonical name (``param`` and ``state`` names).
        masks: dropout keep-masks by layer path (``"3"``, ``"3.body.1"``), ``[steps, global_batch, ...]``, drawn once from the seed.
        perm: the rows each step reads, ``[steps, global_batch]`` (``data.order``; ``None``: in order).
        w: per-row sample weights ``[rows]`` or ``None``.
        capture: step k whose per-device values to record (``device/...``), or ``None``.
        grads_bf16: ``True`` in the float64 run that rounds the mixed recipe's gradients to bfloat16
            (``protocol.grad_rounding``); absent otherwise.

    The run options:
        lockstep: ``{"starts": [{"init", "opt"} | None, ...]}``: one step from each start state.
        opt_state: the optimizer state to start from, ``{"step": t, "slots": {slot: {name: array}}}``.
        export_opt_state: record the final optimizer state as ``opt/step`` and ``opt/<slot>/<name>``.
        first_step: the number of the run's first step (a plugin's ``run.first_step``; lockstep's step k).
        spill_bytes: the parent's spill threshold (``protocol.rows``), for workers started before it was set.
        keras_exact_loss_scale: a TensorFlow plugin's rerun in which Keras' distributed loss scale
            multiplies a float64 loss by ``1/N`` in float64, not by its float32(1/N)
            (``tfpar.keras_seen.keras_loss_scales_seen``; the judge's mapping, ``session.loss_scale``).
    """

    spec: dict[str, Any]
    x: np.ndarray
    y: np.ndarray
    init: dict[str, np.ndarray]
    masks: dict[str, np.ndarray]
    perm: np.ndarray | None
    w: np.ndarray | None
    capture: int | None
    grads_bf16: bool
    lockstep: dict[str, Any] | None
    opt_state: dict[str, Any] | None
    export_opt_state: bool
    first_step: int
    spill_bytes: int
    keras_exact_loss_scale: bool


#: the payload key of a TensorFlow plugin's mapped rerun in which Keras' distributed loss scale is exact: the one
#: mapping made on the program itself, since no field of the case expresses a precision Keras picks inside ``fit``
EXACT_LOSS_SCALE = "keras_exact_loss_scale"

CASE_KEYS = frozenset({"spec", "x", "y", "init", "masks", "perm", "w", "capture", GRADS_BF16})
OPTION_KEYS = frozenset({"lockstep", "opt_state", "export_opt_state", "first_step", "spill_bytes", EXACT_LOSS_SCALE})


def check_payload(payload: Mapping[str, Any], engine: str) -> Mapping[str, Any]:
    """``payload`` itself, once every key is one :class:`Payload` declares and ``spec`` is there.

    Raises:
        ValueError: naming the undeclared keys and the engine (a programming error of the tool or of a
            caller of ``run_case``, not bad input in a case file).
    """
    unknown = sorted(set(payload) - CASE_KEYS - OPTION_KEYS)
    if unknown or "spec" not in payload:
        raise ValueError(f"{engine}: a payload of the keys parity_tests.protocol.payload.Payload declares, with 'spec';"
                         f" got undeclared {unknown}" if unknown else f"{engine}: a payload without 'spec'")
    return payload
