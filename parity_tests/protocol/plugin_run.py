"""The run object both sides' plugins get: what ``tfpar.plugin.Run`` and ``torchref.plugin.Run`` share.

A plugin is handed ``run``: the case (``spec``, ``dtype``, ``steps``, ``first_step``,
``seed``), its data and initial values (``initial`` in TensorFlow layouts,
``dropout_masks``, ``sample_weights``, :meth:`RunBase.dataset`,
:meth:`RunBase.epoch_order`), what the tool asks for (``capture_step``,
``optimizer_state``), and where it reports (``begin``, ``record``, in the framework
subclasses). The attributes and their meaning are docs/plugins.md's; this base
holds them once, so the two sides cannot drift apart. Framework tensors become numpy
through :meth:`RunBase._numpy`, which each side overrides.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from parity_tests.protocol.case_read import ReadSpec
from parity_tests.protocol.payload import check_payload
from parity_tests.protocol.rows import RowStore

__all__ = ["RunBase", "to_torch", "to_tf", "merge_passes"]


def to_torch(a: Any) -> np.ndarray:
    """TensorFlow layout -> torch layout: dense ``[in, out]`` -> ``[out, in]``, conv ``[kh, kw, in, out]`` -> ``[out, in, kh, kw]``."""
    a = np.asarray(a)
    return a.T.copy() if a.ndim == 2 else (a.transpose(3, 2, 0, 1).copy() if a.ndim == 4 else a)


def to_tf(a: Any) -> np.ndarray:
    """torch layout -> TensorFlow layout (the inverse of :func:`to_torch`)."""
    a = np.asarray(a)
    return a.T.copy() if a.ndim == 2 else (a.transpose(2, 3, 1, 0).copy() if a.ndim == 4 else a)


def merge_passes(passes: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One pass of the rows of several (a step's micro-batches): each leaf's input and output concatenated
    along rows, in call order (what the layer hooks of both sides saw: ``{"name", "kind", "in", "out", ...}``
    per leaf). Passes through other leaves (another model) or without a row axis: the first alone."""
    first = passes[0]
    if len(passes) == 1 or any([(e["name"], e["kind"]) for e in p] != [(e["name"], e["kind"]) for e in first]
                               for p in passes[1:]):
        return first
    out = []
    for i, leaf in enumerate(first):
        merged = dict(leaf)
        for key in ("in", "out"):
            parts = [p[i][key] for p in passes]
            if all(v is None for v in parts):
                continue
            if not all(v is not None and np.ndim(v) >= 1 for v in parts):
                return first
            try:
                merged[key] = np.concatenate(parts, axis=0)
            except ValueError:  # not rows of one layer (shapes apart beyond the row axis)
                return first
        out.append(merged)
    return out


class RunBase:
    """The case, its data and initial values, and the bookkeeping of what a plugin reports.

    Args:
        payload: the run's payload (``protocol.payload.Payload``): every key declared.
    """

    def __init__(self, payload: Mapping[str, Any]) -> None:
        check_payload(payload, "a plugin's run")  # every key declared (parity_tests.protocol.payload)
        spec = payload["spec"]
        # what the plugin reads of its case is recorded (protocol.case_read: the judge maps a difference on it only so)
        self.spec: dict[str, Any] = ReadSpec(spec)
        self.dtype: str = spec["dtype"]
        self.steps: int = spec["steps"]
        # the case's number of the first step this run takes: 1, or k when lockstep runs step k alone
        # from the reference's state (count steps from it: code tied to a step number fires there too)
        self.first_step: int = int(payload.get("first_step", 1))
        self.seed: int = spec.get("seed", 0)
        np_dtype = np.dtype(self.dtype)
        self.initial: dict[str, np.ndarray] = {k: np.asarray(v, np_dtype) for k, v in payload["init"].items()}
        # top-level dropout by its index (int); one inside a residual or repeat body, and an attention
        # layer's where it is nested, by its path ("3.body.1")
        self.dropout_masks: dict[int | str, np.ndarray] = {int(k) if k.isdigit() else k: np.asarray(v)
                                                           for k, v in (payload.get("masks") or {}).items()}
        w = payload.get("w")
        self.sample_weights: np.ndarray | None = None if w is None else np.asarray(w, np_dtype)
        x = np.asarray(payload["x"])
        self._x = x if x.dtype.kind in "iu" else x.astype(np_dtype)  # token ids stay integers
        y = np.asarray(payload["y"])
        self._y = y.astype(np_dtype) if y.dtype.kind == "f" else y  # class labels stay integers
        self._perm = payload.get("perm")
        self._begun: dict[str, dict[str, Any]] | None = None
        self._steps: list[dict[str, Any]] = []
        # a large model's recorded values go to a file past the spill threshold (parity_tests.protocol.rows)
        self._store = RowStore()
        self.capture_step: int | None = payload.get("capture")
        self._device: dict[str, Any] | None = None
        self.layer_hooks: bool = True
        #: ``--lockstep``: the reference's optimizer state to start from, ``{"step": t, "slots": {slot: {name:
        #: array}}}`` (TF layouts), or ``None`` (a fresh optimizer); ``use_optimizer`` loads it
        self.optimizer_state: dict[str, Any] | None = payload.get("opt_state")
        self._export_optimizer = bool(payload.get("export_opt_state"))
        self._optimizer: tuple[Any, dict[str, Any]] | None = None
        self._opt_export: dict[str, Any] | None = None

    # ------------------------------------------------------------------ data
    def dataset(self) -> tuple[np.ndarray, np.ndarray]:
        """``(x, y)``: the dataset the case reads, ``data.rows`` rows with ``distributed_sampler`` (else ``steps x B``)."""
        d = self.spec["data"].get("rows", self.steps * self.spec["data"]["global_batch"])
        return self._x[:d], self._y[:d]

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The row order of epoch ``epoch`` (0-based): the case's ``perm[epoch mod E]``, or ``0..rows-1``."""
        d = len(self.dataset()[0])
        if self._perm is None:
            return np.arange(d)
        p = np.asarray(self._perm, np.int64).reshape(-1, d)
        return p[epoch % len(p)]

    # ------------------------------------------------------------- reporting
    @staticmethod
    def _numpy(v: Any) -> np.ndarray:
        """A numpy copy of a value the plugin reported (each framework's subclass converts its tensors)."""
        return np.array(v, copy=True)

    def _named(self, values: Any, what: str) -> dict[str, np.ndarray]:
        """``{name: numpy copy}`` of a reported dict (``{}`` for ``None``); ``what`` names the call in errors."""
        if values is None:
            return {}
        if not isinstance(values, Mapping):
            raise TypeError(f"run.{what} takes a dict {{name: value}}, got {type(values).__name__}")
        return {str(k): self._numpy(v) for k, v in values.items()}

    def _keep(self, values: dict[str, np.ndarray]) -> dict[str, Any]:
        return {k: self._store.put(v) for k, v in values.items()}

    def _begin(self, params: Any, state: Any) -> None:
        """What ``begin`` keeps: the parameters (and state) as the code loaded them."""
        if self._begun is not None:
            raise RuntimeError("run.begin() was called twice; call it once, before the first step")
        self._begun = {"params": self._keep(self._named(params, "begin(params)")),
                       "state": self._keep(self._named(state, "begin(state=...)"))}

    def _record(self, loss: Any, params: Any, grads: Any, state: Any, optimizer_state: Any) -> None:
        """What ``record`` keeps of every step: loss, parameters, gradients, state, a hand-written optimizer state."""
        if optimizer_state is not None:
            self._opt_export = {"step": int(optimizer_state["step"]),
                                "slots": {s: self._named(v, "record(optimizer_state=...)")
                                          for s, v in optimizer_state.get("slots", {}).items()}}
        self._steps.append({"loss": self._numpy(loss), "params": self._keep(self._named(params, "record(params)")),
                            "grads": None if grads is None else self._keep(self._named(grads, "record(grads=...)")),
                            "state": self._keep(self._named(state, "record(state=...)"))})
