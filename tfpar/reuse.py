"""Reusing a built tower trainer across runs of one structure: trace each step function once.

Most of a small ``tf.towers`` or ``tf.single`` run is not training but tracing: building the
step's graph op by op in Python (measured on the 4-tower seed MLP, 5 steps: 0.32 s a run, of
which 0.26 s is the first call's trace). A process often runs the same structure again,
from other initial weights or data: a test that runs its reference once per parametrisation,
a property that repeats a run, a script that sweeps seeds. Such a run takes a built trainer
from this cache instead of building one: its variables, optimizer and traced step functions.
(A comparison's own runs rarely share one: its float64 variant has another dtype, and its
perturbed rerun other hyperparameters, which are constants of the trace.)

What makes a reused trainer train exactly as a fresh one (``test_reuse.py`` checks it bit for
bit, with runs of another case in between):

* the *key* holds everything a trace reads from Python: the implementation, the tower
  devices, the spec's :data:`KEYED` sections (``dtype``, ``model``, ``optimizer``,
  ``parallel``), the parameters' shapes and which per-example extras the payload has. The
  builder is handed those sections only (:func:`keyed_spec`), so a builder that read another
  one would fail loudly rather than reuse wrongly. The other sections (name, steps, seeds,
  the initial-value and data recipes) reach a run only as variable values, input values and
  a number of calls. Input shapes need no key: ``tf.function`` traces again for a new input
  signature by itself;
* on reuse every trainable and state variable is assigned the new run's initial value (the
  conversion :func:`tfpar.models.build_variables` applies), and every optimizer variable
  (step counter, slots, Keras' learning-rate variable) its value as it was right after the
  optimizer was built: a snapshot taken then;
* a run takes its trainer *out* of the cache and gives it back only when it finished, so two
  runs (threads) never share one, and a run that failed half-way leaves nothing behind.

The cache holds at most :data:`MAX_ENTRIES` trainers and :data:`MAX_BYTES` of their variables;
a trainer over :data:`MAX_ENTRY_BYTES` is never kept (a large model's trace is a small part
of its run, and its memory is not). Each kept trainer also holds its traced graphs: measured,
32 kept 8-tower trainers of a small softmax model added 215 MiB of resident memory to what 32
runs without reuse leave behind (245 MiB, TensorFlow's own), about 7 MB each; hence 8 entries
(a run log of the whole suite: 153 repeats an 8-entry cache serves, 183 with 64). ``TFPAR_TRACE_CACHE=0`` turns reuse off (to rule it out
when diagnosing; every run then builds and traces its own trainer).
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tensorflow as tf

from parity_tests.protocol import settings

from .optimizers import KerasOptimizer, Optimizer

__all__ = ["MAX_ENTRIES", "MAX_BYTES", "MAX_ENTRY_BYTES", "KEYED", "Built", "TrainerCache", "CACHE", "keyed_spec",
           "structure_key", "optimizer_variables", "disabled"]

MAX_ENTRIES = 8
MAX_BYTES = 256 << 20
MAX_ENTRY_BYTES = 64 << 20
#: the spec sections a tower trainer is built from (everything its traces read from the spec)
KEYED = ("dtype", "model", "optimizer", "parallel")


def keyed_spec(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The :data:`KEYED` sections of a normalised spec (what a trainer may be built from)."""
    return {k: spec[k] for k in KEYED}


def structure_key(impl: str, devices: Sequence[str], payload: Mapping[str, Any]) -> str:
    """The key of a run's trainer: equal keys trace equal graphs (module docstring).

    Args:
        impl: ``tf.towers`` or ``tf.single``; devices: the tower devices the trainer uses.
        payload: the case payload (``spec``, ``init`` ``{name: [...]}``, optional ``w``, ``masks``).
    """
    spec = keyed_spec(payload["spec"])
    shapes = {k: list(np.shape(v)) for k, v in payload["init"].items()}
    extras = sorted(str(k) for k in (payload.get("masks") or {})) + (["w"] if payload.get("w") is not None else [])
    # the float64 run rounding the gradients (tfpar.grad_rounding) traces another graph; every other key as before
    rounded = {"grads_bf16": True} if payload.get("grads_bf16") else {}
    return json.dumps({"impl": impl, "devices": list(devices), "spec": spec, "shapes": shapes, "extras": extras,
                       **rounded}, sort_keys=True, default=_plain)


def _plain(value: Any) -> Any:
    """A JSON form of what ``json`` cannot write: numpy values whole (``str`` would abbreviate a
    long array with "...", so two different arrays could give one key), anything else by ``repr``."""
    return value.tolist() if hasattr(value, "tolist") else repr(value)


def optimizer_variables(opt: Optimizer) -> list[tf.Variable]:
    """Every variable an optimizer of :func:`tfpar.optimizers.make_optimizer` keeps (after ``build``).

    Keras' own: ``optimizer.variables`` (iterations, learning rate, slots); an exact rule's: its
    step counter and every slot.
    """
    if isinstance(opt, KerasOptimizer):
        return list(opt.opt.variables)
    return [opt.t] + [v for name in opt.slot_names for v in opt.slots[name]]


@dataclass
class Built:
    """A built trainer and what resetting it needs.

    Attributes:
        trainer: the :class:`tfpar.TowerTrainer` (its step functions trace on first call).
        state: the non-trainable state variables (batch-norm moving statistics) by canonical name.
        fresh: every optimizer variable and its value right after ``build`` (the snapshot).
    """

    trainer: Any
    state: dict[str, tf.Variable]
    fresh: list[tuple[tf.Variable, np.ndarray]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.fresh:
            self.fresh = [(v, v.numpy()) for v in optimizer_variables(self.trainer.optimizer)]

    @property
    def nbytes(self) -> int:
        """Bytes held by its variables (parameters, state, optimizer)."""
        held = list(self.trainer.variables) + list(self.state.values())
        return sum(int(np.prod(v.shape)) * v.dtype.size for v in held) + sum(a.nbytes for _, a in self.fresh)

    def reset(self, init: Mapping[str, Any]) -> None:
        """Set the trainer to the start of a run from ``init`` (canonical name -> array)."""
        named = dict(zip(self.trainer.names, self.trainer.variables, strict=True)) | self.state
        if set(named) != set(init):
            raise ValueError(f"a reused trainer holds {sorted(named)}, the run's init {sorted(init)}")
        for name, v in named.items():
            v.assign(tf.convert_to_tensor(np.asarray(init[name]), dtype=v.dtype))  # build_variables' conversion
        now = optimizer_variables(self.trainer.optimizer)
        if [id(v) for v in now] != [id(v) for v, _ in self.fresh]:
            # an optimizer that made a variable after build: its fresh state is unknown
            raise ValueError("the optimizer's variables changed since it was built")
        for v, value in self.fresh:
            v.assign(value)  # Keras' variables (KerasVariable) and tf.Variable alike
        self.trainer.captured = None


class TrainerCache:
    """Built trainers by :func:`structure_key`, least recently returned evicted first.

    ``take`` removes the entry it returns; ``give`` puts it back after a finished run.
    ``hits`` and ``misses`` count ``take``'s answers (the benchmark and the tests read them).
    """

    def __init__(self, max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_BYTES,
                 max_entry_bytes: int = MAX_ENTRY_BYTES) -> None:
        self.max_entries, self.max_bytes, self.max_entry_bytes = max_entries, max_bytes, max_entry_bytes
        self._entries: OrderedDict[str, tuple[Built, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    @staticmethod
    def enabled() -> bool:
        """False when ``TFPAR_TRACE_CACHE=0``."""
        return settings.trace_cache()

    def take(self, key: str) -> Built | None:
        """The entry for ``key``, removed from the cache, or ``None``."""
        with self._lock:
            found = self._entries.pop(key, None) if self.enabled() else None
            if found is None:
                self.misses += 1
                return None
            self.hits += 1
            return found[0]

    def give(self, key: str, built: Built) -> None:
        """Keep ``built`` for the next run of ``key`` (unless reuse is off or it is too large)."""
        size = built.nbytes
        if not self.enabled() or size > self.max_entry_bytes:
            return
        with self._lock:
            self._entries.pop(key, None)
            self._entries[key] = (built, size)
            while len(self._entries) > self.max_entries or sum(s for _, s in self._entries.values()) > self.max_bytes:
                self._entries.popitem(last=False)

    def clear(self) -> None:
        """Drop every entry (their variables and traces are freed with them)."""
        with self._lock:
            self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


#: the process's cache, used by :func:`tfpar.run_case`
CACHE = TrainerCache()


def disabled() -> contextlib.AbstractContextManager[None]:
    """Runs inside build and trace their own trainers (``TFPAR_TRACE_CACHE=0``); the variable's
    earlier value, or its absence, is restored after."""
    return settings.trace_cache_off()
