"""Users' own TensorFlow training code as an implementation (docs/plugins.md).

A plugin is a function marked with :func:`tensorflow`; the parity tool calls
it with one :class:`Run`, once per run, each time in a fresh process forked from
its warm TensorFlow server (``parity_tests.running.tf_worker``)::

    import tensorflow as tf
    import tfpar

    @tfpar.plugin.tensorflow(dtypes=("float32", "float64"))
    def my_towers(run):
        w = {k: tf.Variable(v) for k, v in run.initial.items()}      # TF layouts, run.dtype
        run.begin(w)
        for x, y in run.batches():                                    # numpy global batches
            ...                                                       # split over run.devices, average, apply
            run.record(loss, w, grads=averaged)                       # once per step, after the update

and it is checked with ``tfpar compare CASE --impls my_file.py:my_towers,torch.ddp``.

Everything the run hands out is numpy (the case dtype); everything it takes
may be numpy, ``tf.Tensor`` or ``tf.Variable`` and is copied at once, so
later in-place updates of a variable cannot change what was recorded. The
checks of what was recorded (names, shapes, dtypes, number of steps) are the
parity tool's, after the run.
"""

from __future__ import annotations

import re
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from parity_tests.protocol import plugin_mark
from parity_tests.protocol.case_read import paths_read
from parity_tests.protocol.layouts import LayoutError, NamedLayouts
from parity_tests.protocol.payload import EXACT_LOSS_SCALE
from parity_tests.protocol.plugin_mark import (
    DTYPES,
    PluginDeclarationError,
    PluginMark,
    when_raised,
)
from parity_tests.protocol.plugin_run import RunBase, to_tf, to_torch
from parity_tests.protocol.rows import remove_files

__all__ = ["DTYPES", "PluginMark", "PluginDeclarationError", "PluginRaised", "tensorflow", "Run", "KerasLayerHooks",
           "to_torch", "to_tf", "run_plugin", "explain", "raised", "UNSEEDED"]


def tensorflow(fn: Callable | None = None, *, dtypes: Any = ("float32",), keras: bool = False,
               deterministic: bool = True) -> Callable:
    """Mark ``fn(run)`` as a TensorFlow plugin: called once, in the main process, with the N tower devices.

    Args:
        dtypes: the case dtypes the function can run (default ``("float32",)``).
            Declaring ``float64`` lets the tool judge semantics in float64 and
            measure float32 noise against it; a float32-only plugin is judged
            against a floor measured by perturbation (``docs/tolerance.md``).
        keras: the function trains with Keras optimizers (``keras.optimizers.SGD``, ...).
            In a float64 run Keras keeps ``learning_rate`` and ``momentum`` in float32;
            saying so lets the tool run the other side with the same rounded values and
            name the difference, as it does for its built-in TensorFlow implementations.
        deterministic: ``False`` when the function cannot compute the same numbers twice (an op
            without a deterministic kernel, a nondeterministic input pipeline): its runs are made
            with TensorFlow's op determinism off, and the judge reruns it and judges against its
            measured run-to-run spread (docs/plugins.md "Determinism").
    """
    return plugin_mark.decorator("tensorflow", "tfpar.plugin.tensorflow", fn, dtypes, keras=keras,
                                 deterministic=deterministic)


def _numpy(v: Any) -> np.ndarray:
    """A numpy copy of a numpy array, Python number, ``tf.Tensor`` or ``tf.Variable``."""
    if hasattr(v, "numpy"):
        v = v.numpy()
    return np.array(v, copy=True)


def _first_tensor(value: Any) -> Any:
    """``value``, or the first element of a tuple/list output (a layer returning ``(out, state)``)."""
    while isinstance(value, (tuple, list)) and value:
        value = value[0]
    return value


def _device_key(name: str) -> tuple[str | None, int | None]:
    """``("CPU", 1)`` of ``/device:CPU:1`` or ``/job:localhost/replica:0/task:0/device:CPU:1``."""
    import tensorflow as tf

    spec = tf.DeviceSpec.from_string(name or "")
    return spec.device_type, spec.device_index


class KerasLayerHooks:
    """Every leaf Keras layer's output on each tower in the captured step, with nothing written by the user.

    Keras 3 has no global layer hook, so for the captured step only (:meth:`arm` .. :meth:`disarm`)
    ``keras.Layer.__call__`` is wrapped (the class attribute, restored by :meth:`disarm`):

    * a *pass* is an outermost layer call (no other layer call on this thread's stack) of a
      layer holding weights: ``model(x)`` of a ``Sequential``, functional or subclassed model;
    * inside it every *leaf* layer (no sub-layers) appends ``{"name", "kind", "weights", "kept", "fed",
      "in", "out"}`` (its layer path, the names of the layers that called it from the pass's root
      down: ``model/block_2/layer_normalization``; its class; whether it holds weights of its own,
      whether its output has its first input's shape, whether its input is the very tensor the previous leaf returned (else
      code ran between them: ``tf.nn.relu`` in a subclassed model's ``call``), its input and
      output as numpy); a pass whose outputs are symbolic (a graph being traced) is dropped;
    * each pass is filed under the tower whose device holds the model's output (``tf.device``
      placement; ``MirroredStrategy`` replicas on their threads too); when every pass ran on one
      device, the first N passes are the N towers in call order. A tower's first pass is kept, its
      first k under ``parallel.accumulate: k`` (its micro-batches, rows merged: :meth:`by_tower`).

    Inside a ``tf.function`` a layer's outputs are symbolic, so while armed the hooks also set
    ``tf.config.run_functions_eagerly(True)``: the captured step's functions run op by op and the
    outputs are values. That is the same arithmetic without graph rewrites (grappler's fused
    matmul + bias + activation may round the last bit differently): only the captured step of
    the diagnosis run is affected, never a judged run. ``tf.compat.v1`` graphs run in a session
    are not seen (pass ``activations=`` there).
    """

    def __init__(self) -> None:
        self.passes: list[tuple[str, list[dict[str, Any]]]] = []
        self._local = threading.local()
        self._lock = threading.Lock()
        self._layer_cls: Any = None
        self._original: Any = None
        self._eager: bool | None = None

    def arm(self) -> None:
        """Start watching: wrap ``keras.Layer.__call__`` (when Keras is loaded) and run functions eagerly."""
        if self._layer_cls is not None or "keras" not in sys.modules:
            return  # a plugin that never imported Keras has no Keras layers to watch
        import keras
        import tensorflow as tf

        cls, original, hooks = keras.Layer, keras.Layer.__call__, self

        def __call__(layer: Any, *args: Any, **kwargs: Any) -> Any:
            return hooks._call(original, layer, args, kwargs)

        __call__.__wrapped__ = original  # type: ignore[attr-defined]
        self._layer_cls, self._original, self.passes = cls, original, []
        cls.__call__ = __call__
        self._eager = tf.config.functions_run_eagerly()
        tf.config.run_functions_eagerly(True)

    def disarm(self) -> None:
        """Stop watching: restore ``Layer.__call__`` and the eager setting (idempotent)."""
        if self._layer_cls is None:
            return
        import tensorflow as tf

        self._layer_cls.__call__ = self._original
        tf.config.run_functions_eagerly(bool(self._eager))
        self._layer_cls = self._original = None

    def _call(self, original: Callable, layer: Any, args: tuple, kwargs: dict) -> Any:
        st = self._local
        depth, current = getattr(st, "depth", 0), getattr(st, "current", None)
        if depth == 0:
            current = st.current = []
            st.last, st.path = None, []
        path = st.path = [*st.path[:depth], layer.name]  # the layer path: model/block_2/layer_normalization
        st.depth = depth + 1
        try:
            out = original(layer, *args, **kwargs)
        finally:
            st.depth = depth
        if current is None:
            return out
        import tensorflow as tf

        first, x = _first_tensor(out), _first_tensor(args)
        eager = tf.is_tensor(first) and tf.executing_eagerly() and hasattr(first, "numpy")
        subs = getattr(layer, "_flatten_layers", None)
        leaf = subs is None or next(iter(subs(include_self=False, recursive=False)), None) is None
        if depth == 0:
            st.current = None
            if leaf and eager:  # a layer called on its own is a pass of one layer
                current.append(self._entry(layer, x, first, False, path))
            if eager and layer.weights and current and all(e is not None for e in current):
                with self._lock:
                    self.passes.append((str(first.device), current))
        elif leaf:
            current.append(self._entry(layer, x, first, x is not None and x is getattr(st, "last", None), path)
                           if eager else None)
            st.last = first
        return out

    @staticmethod
    def _entry(layer: Any, x: Any, out: Any, fed: bool, path: list[str]) -> dict[str, Any]:
        shape = getattr(x, "shape", None)
        return {"name": "/".join(path), "kind": type(layer).__name__, "weights": bool(layer.weights),
                "kept": shape is not None and tuple(shape) == tuple(out.shape), "fed": fed,
                "in": None if x is None else _numpy(x), "out": _numpy(out)}

    def by_tower(self, devices: list[str], micro: int = 1) -> list[list[dict[str, Any]]] | None:
        """The passes of each of the N towers (``devices``), or ``None`` if a tower had none.

        ``micro``: the case's micro-batches per step (``parallel.accumulate``): a tower's first
        ``micro`` passes are the rows it read, merged (rows concatenated in call order, as the towers
        record them); without accumulation its first pass. Every pass on one device: the first N
        passes are the towers in call order (with micro-batches there, which pass is which tower's
        cannot be told: the first N, one micro-batch each).
        """
        from parity_tests.protocol.plugin_run import merge_passes

        n = max(len(devices), 1)
        mine: list[list[list[dict[str, Any]]]] = [[] for _ in range(n)]
        if len({d for d, _ in self.passes}) == 1 and n > 1:  # one device for all: call order
            for r, (_, leaves) in enumerate(self.passes[:n]):
                mine[r] = [leaves]
        else:
            keys = [_device_key(d) for d in devices] or [None]
            for dev, leaves in self.passes:
                key = _device_key(dev)
                r = keys.index(key) if key in keys else (0 if n == 1 else None)
                if r is not None and len(mine[r]) < max(micro, 1):
                    mine[r].append(leaves)
        return [merge_passes(m) for m in mine] if all(mine) else None


#: the case's canonical slot names -> the Keras optimizer attribute holding them, by Keras class
_KERAS_SLOT_ATTRS = {
    "SGD": {"momentum": "momentums"},
    "Adam": {"m": "_momentums", "v": "_velocities", "v_max": "_velocity_hats"},
    "AdamW": {"m": "_momentums", "v": "_velocities", "v_max": "_velocity_hats"},
    "RMSprop": {"square_avg": "_velocities", "grad_avg": "_average_gradients", "momentum": "_momentums"},
    "Adagrad": {"accumulator": "_accumulators"},
}


def _keras_slots(optimizer: Any, spec: Mapping[str, Any]) -> dict[str, list[Any]]:
    """``{canonical slot: [variable per trainable variable]}`` of a built Keras optimizer.

    For a case optimizer the tool knows, its slots (``parity_tests.protocol.optimizer_state.slot_names``) by
    :data:`_KERAS_SLOT_ATTRS`; otherwise every list attribute of per-variable slots the
    optimizer holds, named by the attribute without its leading underscore.
    """
    from parity_tests.protocol.optimizer_state import plugins_only, slot_names

    n = len(optimizer._trainable_variables)
    lists = {k: v for k, v in vars(optimizer).items() if k != "_trainable_variables" and isinstance(v, list)
             and len(v) == n and n and all(hasattr(x, "assign") for x in v)}
    table = _KERAS_SLOT_ATTRS.get(type(optimizer).__name__)
    wanted = None if plugins_only(spec) else slot_names(spec)
    if table is None or wanted is None or any(s not in table for s in wanted):
        return {k.lstrip("_"): v for k, v in lists.items()}
    return {s: lists[table[s]] for s in wanted if table[s] in lists}


class Run(NamedLayouts, RunBase):
    """What a plugin gets: the case, its data and weights, where to run, and where to report.

    Attributes:
        spec: the validated case (a plain dict, every default filled in).
        dtype: ``"float32"`` or ``"float64"``.
        steps: the number of optimizer steps to take.
        first_step: the case's number of the first of them: 1, or ``k`` when ``tfpar compare --lockstep``
            runs step ``k`` alone from the reference's state (``for t, (x, y) in enumerate(run.batches(),
            run.first_step)`` numbers steps as the case does).
        seed: the case seed.
        initial: ``{name: array}``, the initial parameters and state in TensorFlow layouts, ``dtype``.
        devices: the N tower device names, for ``tf.device`` (TensorFlow plugins).
        dropout_masks: ``{layer index (nested: its path, "3.body.1"): bool [rows, ...]}`` keep-masks of the case's dropout
            layers, by data row (empty without dropout); an attention layer with dropout has
            ``[rows, H, T, T]`` under its index, or under its path (``"3.body.1"``) when nested.
        sample_weights: ``[rows]`` per-example weights (``data.sample_weights``) or ``None``.
        capture_step: the step (1-based) whose per-device values the tool asks for
            (``run.record(..., device_grads=...)``), or ``None``: it re-runs a plugin with it set
            to localise a divergence (docs/localisation.md); values given at other steps are dropped.
        layer_hooks: record every leaf Keras layer's output at :attr:`capture_step` without
            ``activations=`` (:class:`KerasLayerHooks`); set it to ``False`` before :meth:`begin`
            to opt out (the captured step then also runs its ``tf.function`` code as graphs).
    """

    def __init__(self, payload: Mapping[str, Any], devices: list[str] | None = None) -> None:
        super().__init__(payload)  # the case, data, initial values and bookkeeping both sides share
        self.devices: list[str] = list(devices or [])
        self._layers = KerasLayerHooks()

    # ------------------------------------------------------------------ data
    def global_batches(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """``(x, y)`` of each step's global batch, ``steps`` of them, in the case's ``data.order``.

        ``split``: rows ``[k B, (k+1) B)``. ``distributed_sampler``: what the N ranks' ``DataLoader``
        over ``DistributedSampler(dataset, N, r, shuffle=False)`` read at their k-th batch, padding
        included, interleaved (row m from rank ``m mod N``: a strided split gives each tower its
        rank's rows), epoch after epoch (``tfpar.pipeline.step_rows``; docs/data-pipeline.md).
        """
        data = self.spec["data"]
        b = data["global_batch"]
        if data.get("order", "split") == "distributed_sampler":
            from .pipeline import step_rows

            n = self.spec["parallel"]["devices"]
            for k in range(self.steps):
                rows = step_rows(data["rows"], b, k, num_replicas=n, perms=self._perm)
                yield self._x[rows], self._y[rows]
            return
        for k in range(self.steps):
            yield self._x[k * b:(k + 1) * b], self._y[k * b:(k + 1) * b]

    def batches(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """TensorFlow: the global batches (splitting them over ``devices`` is the plugin's job)."""
        return self.global_batches()

    _numpy = staticmethod(_numpy)  # tf.Tensor / tf.Variable -> numpy (the module function)

    # --------------------------------------------------------------- layouts
    _rank_to_torch = staticmethod(to_torch)  # run.to_torch(a) / run.to_tf(a) by rank (RunBase: with name=, by layer)
    _rank_to_tf = staticmethod(to_tf)

    # ------------------------------------------------------------- reporting
    def begin(self, params: Any, state: Any = None) -> None:
        """Once, before the first step: the parameters (and state) as the code loaded them."""
        self._begin(params, state)
        if self.layer_hooks and self.capture_step == 1:
            self._layers.arm()

    def record(self, loss: Any, params: Any, grads: Any = None, state: Any = None, *,
               device_grads: Any = None, activations: Any = None, device_losses: Any = None,
               device_inputs: Any = None, optimizer_state: Any = None) -> None:
        """Once per step, after the update.

        Args:
            loss: the step's combined loss, computed before the update (a scalar).
            params: every parameter after the update, ``{name: value}``.
            grads: optionally, the combined gradient that was applied, ``{name: value}``.
            state: the non-trainable state after the step (batch-norm moving statistics).
            device_grads: optionally, per tower ``{name: d l_r / d param}``: each tower's gradient of
                its own loss, before clipping, weighting and combining (a list of N dicts).
            activations: optionally, per tower ``{layer name: output [n_r, ...]}`` (a list of N dicts).
            device_losses: optionally, the N towers' own losses ``l_r``.
            device_inputs: optionally, the N towers' input rows ``[n_r, ...]``.
            optimizer_state: ``--lockstep`` without :meth:`use_optimizer`: the optimizer's state
                after this step, ``{"step": t, "slots": {slot: {name: value}}}`` (TF layouts).

        The four per-device values are kept only at :attr:`capture_step` (they localise a
        divergence to a stage and a tower, docs/localisation.md); pass them every step or only then.
        Without ``activations``, the leaf Keras layers' outputs that :class:`KerasLayerHooks`
        saw on each tower stand in for them (``"leaves"``; never over what was given).
        """
        self._record(loss, params, grads, state, optimizer_state)
        if self.capture_step == len(self._steps):
            self._device = {
                "grads": None if device_grads is None else [self._named(g, "record(device_grads=[...])") for g in device_grads],
                "acts": None if activations is None else [self._named(a, "record(activations=[...])") for a in activations],
                "losses": None if device_losses is None else [_numpy(v) for v in device_losses],
                "inputs": None if device_inputs is None else [_numpy(v) for v in device_inputs],
                "leaves": self._layers.by_tower(self.devices, int(self.spec["parallel"].get("accumulate", 1)))
                if activations is None and self._layers.passes else None,
            }
            self._layers.disarm()
        elif self.layer_hooks and self.capture_step == len(self._steps) + 1:
            self._layers.arm()

    # ------------------------------------------------------------- optimizer state (lockstep)
    def use_optimizer(self, optimizer: Any, params: Mapping[str, Any]) -> None:
        """Hand your Keras optimizer to the tool (once, before the first step); ``params``: ``{name: variable}``.

        Under ``tfpar compare --lockstep`` every step runs alone from the reference's state of the
        step before: this sets ``optimizer`` to that state (``iterations`` and its slot variables,
        built over ``params`` if not built yet) and reads it back after the step. Without
        ``--lockstep`` it does nothing but remember the optimizer. The slots, by the case's
        optimizer: SGD with momentum ``momentum`` (Keras' ``momentums``), Adam/AdamW ``m``, ``v``
        (``_momentums``, ``_velocities``; AMSGrad also ``v_max``), RMSprop ``square_avg``,
        ``grad_avg``, ``momentum``, Adagrad ``accumulator``; any other optimizer (one only plugins
        know) every list of per-variable slots it holds, by attribute (``accumulated_grads``).
        A ``tf.compat.v1`` optimizer or hand-written rule: read :attr:`optimizer_state` yourself
        and pass ``run.record(..., optimizer_state=...)`` after the last step.
        """
        params = dict(params)
        if not getattr(optimizer, "built", True):
            optimizer.build(list(params.values()))
        self._optimizer = (optimizer, params)
        state = self.optimizer_state
        if state is None or not state.get("step"):
            return
        optimizer.iterations.assign(int(state["step"]))
        slots = _keras_slots(optimizer, self.spec["optimizer"])
        for slot, arrays in state["slots"].items():
            if slot not in slots:
                raise ValueError(f"run.use_optimizer: the start state has slot {slot!r}; {type(optimizer).__name__}"
                                 f" holds {', '.join(sorted(slots)) or 'none'}")
            for name, var in params.items():
                slots[slot][optimizer._get_variable_index(var)].assign(np.asarray(arrays[name]))

    def _export(self) -> dict[str, Any] | None:
        if self._opt_export is not None or self._optimizer is None:
            return self._opt_export
        optimizer, params = self._optimizer
        slots = _keras_slots(optimizer, self.spec["optimizer"])
        return {"step": int(optimizer.iterations.numpy()),
                "slots": {slot: {name: _numpy(vs[optimizer._get_variable_index(var)]) for name, var in params.items()}
                          for slot, vs in slots.items()}}

    def records(self) -> dict[str, Any]:
        """What was reported, as plain data (the parity tool checks and assembles it, then removes ``spill``)."""
        return {"begin": self._begun, "steps": self._steps, "device": self._device, "spill": self._store.close(),
                "opt_export": self._export() if self._export_optimizer else None,
                "case_read": paths_read(self.spec)}  # which fields of its case it read (protocol.case_read)


class PluginRaised(plugin_mark.PluginRaised):
    """The plugin raised (:class:`parity_tests.protocol.plugin_mark.PluginRaised`); for an unseeded random op
    under op determinism :attr:`line` says what to do (:func:`explain`)."""


UNSEEDED = "Random ops require a seed to be set when determinism is enabled"


def explain(e: BaseException) -> str:
    """The one line for an exception a plugin raised: its last line, or what to do about a known cause.

    TensorFlow refuses an unseeded random op while op determinism is on (``RuntimeError: Random
    ops require a seed ...``): a classic script's ``glorot_uniform_initializer()`` without a
    seed, ``tf.random.normal`` in eager code. Its own line says ``tf.random.set_seed(1)``, which
    does not reach a ``tf.Graph`` built later (a graph takes its seed inside ``as_default()``).
    """
    from parity_tests.protocol.frames import last_line

    if UNSEEDED in str(e):
        return ("an unseeded random op: tfpar runs TensorFlow with op determinism on, so that a run repeats"
                " bit for bit; seed it (tf.random.set_seed(run.seed), inside `with graph.as_default():` for a"
                " tf.compat.v1 graph) or declare @tfpar.plugin.tensorflow(deterministic=False)")
    return _op_error_line(e) or last_line(e)


#: a root error of a TensorFlow graph or op error: "  (0) INVALID_ARGUMENT: You must feed a value for ..."
_ROOT_ERROR = re.compile(r"^\s*(?:\(\d+\)\s*)?[A-Z][A-Z_]+: (\S.*)$")
#: the lines of an OpError's message that frame its cause: where the node was made, never what went wrong
_FRAMING = re.compile(r"^(Graph execution error:|Detected at node|\s+File \"|Node: |\s*\[\[|\d+ root error|"
                      r"\d+ successful operations|\d+ derived errors|Original stack trace|\s+\S.*\.py\", line)")


def _op_error_line(e: BaseException) -> str | None:
    """The cause of a TensorFlow ``OpError`` in one line (``None`` for any other exception).

    Its message ends with the "Original stack trace" of the node (``File ".../ops.py", line 1221, in
    from_node_def``), which is what the last line of the message would say: the first root error
    (``(0) INVALID_ARGUMENT: You must feed a value for placeholder tensor 'Placeholder' ...``), or the
    message's first line, says what went wrong.
    """
    from tensorflow.python.framework import errors_impl

    if not isinstance(e, errors_impl.OpError):
        return None
    lines = [line for line in str(getattr(e, "message", "") or "").splitlines() if line.strip()]
    root = next((m.group(1).strip() for line in lines if (m := _ROOT_ERROR.match(line))), None)
    # one root error: "Graph execution error:", "Detected at node ...", its frames, "Node: 'x'", then the cause
    text = root or next((line.strip() for line in lines if not _FRAMING.match(line)), "")
    return f"{type(e).__name__}: {text}" if text else None


def raised(e: BaseException, begun: bool, recorded: int, steps: int) -> PluginRaised:
    """A :class:`PluginRaised` for ``e``, raised after ``run.begin`` (``begun``) and ``recorded`` steps."""
    from parity_tests.protocol.frames import user_traceback

    step, when = when_raised(begun, recorded, steps)
    return PluginRaised(step, explain(e), when, user_traceback(e))


def run_plugin(fn: Callable, payload: Mapping[str, Any]) -> dict[str, Any]:
    """Call a TensorFlow plugin on the case's N tower devices; returns its records.

    Called in the fresh process of the run (``parity_tests.running.tf_worker``), where the
    devices are configured and op determinism is set.

    Raises:
        PluginRaised: the function raised (when, its line, the user's frames).
    """
    from .devices import tower_devices
    from .keras_seen import (
        keras_float32_constants_seen,
        keras_loss_scales_seen,
        keras_optimizers_seen,
    )
    from .v1_losses_seen import v1_losses_seen

    run = Run(payload, tower_devices(payload["spec"]["parallel"]["devices"]))
    # the judge's mapped rerun of a Keras program on N replicas (N not a power of two): Keras' float32 1/N made exact
    exact = bool(payload.get(EXACT_LOSS_SCALE))
    try:
        # what its Keras optimizers hold in float32, and the factor Keras scaled its distributed loss by
        # and every regularizer factor Keras holds rounded to float32 in a float64 computation
        with keras_optimizers_seen() as seen, keras_loss_scales_seen(exact=exact) as scales, \
                keras_float32_constants_seen() as constants, v1_losses_seen() as float32_losses:
            fn(run)
    except LayoutError:  # run.to_torch / run.to_tf asked what cannot be told: bad input (tf_worker)
        remove_files(run._store.close())
        raise
    except (Exception, SystemExit) as e:  # sys.exit() in a program is its end, not the tool's
        remove_files(run._store.close())  # nothing of a failed run stays on disk
        raise raised(e, run._begun is not None, len(run._steps), run.steps) from e
    except BaseException:
        remove_files(run._store.close())
        raise
    finally:
        run._layers.disarm()  # a plugin that raised or stopped early: Keras and tf.function as they were
    return {**run.records(), "keras_optimizers": seen, "keras_loss_scales": scales,
            "keras_float32_constants": constants, "float32_losses": float32_losses}
