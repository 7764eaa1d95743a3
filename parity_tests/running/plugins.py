"""Users' plugins (docs/plugins.md): finding them by name, and checking what they recorded.

A plugin name is ``path/to/file.py:function`` (relative to the current folder,
or absolute) or ``package.module:function``. :func:`resolve_plugin` imports it
(so that every mistake is one line of bad input before anything runs) and reads
its decorator: a module that imports TensorFlow in a fresh process of the
TensorFlow server (``tf_worker``, never in this one: its top level may set
process-wide state), any other here. A TensorFlow plugin runs in a fresh process
per run (:func:`run_isolated`), a torch plugin on the pool's ranks, reset before
and after (``torchref.fresh``). :func:`assemble` turns what the
plugin reported through ``run.begin``/``run.record`` into a trajectory,
checking every name, shape, dtype and the number of steps;
:func:`replica_divergence` compares the parameter digests every DDP rank
recorded. This module imports neither TensorFlow nor torch: importing the
user's module does, as that module says.
"""

from __future__ import annotations

import re
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from parity_tests.contract.specs import param_specs
from parity_tests.protocol import user_code
from parity_tests.protocol.engine import EngineSpec
from parity_tests.protocol.errors import CaseError
from parity_tests.protocol.optimizer_state import plugins_only
from parity_tests.protocol.plugin_mark import KINDS, MARK, describe
from parity_tests.protocol.rows import RowList, remove_files, spill_threshold
from parity_tests.protocol.trajectory import Finding, Trajectory
from parity_tests.running.backends import RunError
from parity_tests.running.frameworks import missing_module, require

__all__ = ["PluginTarget", "is_plugin_name", "resolve_plugin", "assemble", "replica_divergence",
           "plugin_failure", "layer_outputs", "hooks_line_up", "case_numbering", "MARK", "KINDS", "PluginFailed", "run_isolated",
           "raised_line"]

_DECORATORS = "@tfpar.plugin.tensorflow(...), @torchref.plugin.distributed(...) or @torchref.plugin.single(...)"


@dataclass(frozen=True)
class PluginTarget:
    """A resolved plugin.

    Attributes:
        name: the name as given (``"my_towers.py:train"``).
        kind: ``tensorflow``, ``distributed`` or ``single``.
        dtypes: the dtypes its decorator declares.
        location: how a worker process imports it: ``{"path", "module_name", "attr"}`` or ``{"module", "attr"}``.
        source: the file the function's module was loaded from (hashed into manifests).
        fn: the function itself, where this process imported its module (``None`` for a TensorFlow
            plugin: its module is imported only in the fresh process of each run).
    """

    name: str
    kind: str
    dtypes: tuple[str, ...]
    location: dict[str, str]
    source: Path | None
    fn: Callable[..., Any] | None
    keras: bool = False
    #: ``False``: the plugin cannot run deterministically (its decorator says so); the judge measures its spread
    deterministic: bool = True


def is_plugin_name(name: str) -> bool:
    """``file.py:fn`` or ``module:fn`` (and not ``recorded:...``)."""
    return ":" in name and not name.startswith("recorded:")


def _last_line(e: BaseException) -> str:
    return traceback.format_exception_only(type(e), e)[-1].strip()


_TF_IMPORT = re.compile(r"^\s*(import|from)\s+(tensorflow|tfpar|keras)\b", re.MULTILINE)


def _imports_tensorflow(source: Path | None) -> bool:
    """Whether a module's source imports TensorFlow, Keras or ``tfpar`` at a line of its own."""
    try:
        text = source.read_text(errors="replace") if source else ""
    except OSError:
        return False
    return bool(_TF_IMPORT.search(text))


def _import_here(location: dict[str, str], field: str, name: str) -> Any:
    """The function at ``location``, its module imported in this process (``protocol.user_code``); an import
    that raises is one line naming ``field`` (a missing framework names the extra to install)."""
    try:
        module = user_code.import_module(location)
    except Exception as e:
        absent = missing_module(e, name, field)
        if absent is not None:  # a torch plugin where torch is not installed: name the extra
            raise absent from None
        raise CaseError(field, f"{user_code.where(location)} to import cleanly ({name}); it raised {_last_line(e)}") from None
    return getattr(module, location["attr"], None)


def _inspect_isolated(location: dict[str, str], field: str, name: str) -> dict[str, Any]:
    """:func:`describe` of the plugin, its module imported in a fresh process of the TensorFlow server.

    A TensorFlow program's top level may set process-wide state (``tf.compat.v1.disable_eager_execution()``,
    ``keras.config.set_floatx``): imported here, it would change this process, where the built-in
    TensorFlow implementations run. So this process never imports it; each run imports it afresh.
    """
    from parity_tests.running.backends import RunError
    from parity_tests.running.tf_worker import WorkerDied, get_worker, job_context

    try:
        out = get_worker().run({**job_context(), "location": location, "inspect": True})
    except WorkerDied as e:
        raise RunError(f"{name} could not be imported: {e}") from None
    if "input" in out:
        raise CaseError(field, out["input"].replace(" to import cleanly;", f" to import cleanly ({name});"))
    return out["described"]


def resolve_plugin(name: str, field: str = "--impls") -> PluginTarget:
    """Find the plugin ``name`` and read its decorator.

    A module that imports TensorFlow (or Keras, or ``tfpar``) is imported in a fresh process of
    the TensorFlow server (:func:`_inspect_isolated`), never in this one; any other module here.

    Raises:
        CaseError: (one line, naming ``field``) no such file or module, an import error
            (its last line), no such function, a function without a plugin decorator,
            or a decorator given an unknown dtype.
    """
    location, path = user_code.locate(name, field)
    where, attr = user_code.split_name(name, field)
    fn = None
    if _imports_tensorflow(path):
        require("tf", name, field)  # imported in the TensorFlow server, which needs TensorFlow
        info = _inspect_isolated(location, field, name)
    else:
        fn = _import_here(location, field, name)
        info = describe(fn)
    if not info["found"]:
        raise CaseError(field, f"a function named {attr!r} in {where}", name)
    if not info["callable"]:
        raise CaseError(field, f"{attr!r} in {where} to be a function", info["type"])
    mark = info["mark"]
    if mark is None:
        raise CaseError(field, f"{attr} in {where} to carry one of {_DECORATORS}; it has none", name)
    source = Path(info["file"] or path) if path else None
    return PluginTarget(name, mark["kind"], tuple(mark["dtypes"]), location, source, fn, mark["keras"],
                        mark["deterministic"])


# ------------------------------------------------------------------ checking what was recorded


def _expected_names(spec: Mapping[str, Any], initial: Mapping[str, np.ndarray],
                    begun: Mapping[str, Mapping[str, np.ndarray]], impl: str) -> tuple[list[str], list[str]]:
    """(parameter names, state names) the plugin must record every step."""
    model = spec["model"]
    if "external" in model:  # the plugins' own names: begin() says which are state
        params, state = list(begun["params"]), list(begun["state"])
        both = sorted(set(params) & set(state))
        if both:
            raise CaseError(impl, f"each name either a parameter or state in run.begin(); {both[0]!r} is both")
        known = set(initial)
        for n in [*params, *state]:
            if n not in known:
                raise CaseError(impl, "run.begin() names among the initial weights (" + _listing(known) + ")", n)
        missing = sorted(known - set(params) - set(state))
        if missing:
            raise CaseError(impl, f"run.begin() to report every initial weight; {missing[0]!r} is missing")
        return params, state
    specs = param_specs(model["input_shape"], model["layers"])
    return [s.name for s in specs if s.trainable], [s.name for s in specs if not s.trainable]


def _listing(names: Any) -> str:
    names = sorted(names)
    text = ", ".join(names[:8])
    return text + (f", ... ({len(names)} names)" if len(names) > 8 else "")


def _check_named(values: Mapping[str, np.ndarray], want: list[str], initial: Mapping[str, np.ndarray],
                 dtype: np.dtype, impl: str, where: str, what: str) -> None:
    missing = [n for n in want if n not in values]
    if missing:
        raise CaseError(impl, f"{where} to report {what} {missing[0]!r} (every one of: {_listing(want)})")
    extra = sorted(set(values) - set(want))
    if extra:
        raise CaseError(impl, f"{where} to report only {what} names ({_listing(want)})", extra[0])
    for n in want:
        a = values[n]
        if tuple(a.shape) != tuple(initial[n].shape):
            raise CaseError(impl, f"{where}: {what} {n!r} of shape {list(initial[n].shape)} (the initial weight's,"
                                  " TensorFlow layout: run.to_tf converts from torch's)", f"shape {list(a.shape)}")
        if a.dtype != dtype:
            raise CaseError(impl, f"{where}: {what} {n!r} in {dtype} (the run's dtype)", str(a.dtype))


def assemble(records: Mapping[str, Any], spec: Mapping[str, Any], initial: Mapping[str, np.ndarray],
             impl: str) -> dict[str, np.ndarray]:
    """Check a plugin's records and build its trajectory (docs/case-format.md, "Trajectories").

    Args:
        records: ``{"begin": {"params", "state"} | None, "steps": [{"loss", "params", "grads", "state"}, ...]}``.
        spec: the validated case; initial: the initial weights by name.
        impl: the plugin's name (for messages).
    Returns:
        ``{"loss": [steps], "param/<n>": [steps+1, ...], "grad/<n>": [steps, ...] (if recorded), "state/<n>": [steps+1, ...]}``.
    Raises:
        CaseError: a missing ``begin``, too few or too many steps, a name missing or extra, a
            wrong shape or dtype; the message names the step and the name. Non-finite values are
            not bad input: they are left for the judge, which reports them as a finding.
    """
    dtype = np.dtype(spec["dtype"])
    steps = spec["steps"]
    begun, rows = records.get("begin"), records.get("steps") or []
    if begun is None:
        raise CaseError(impl, "a call to run.begin(params) before the first step (the parameters as loaded)"
                              + (f"; it recorded {len(rows)} step(s) without one" if rows else ""))
    if len(rows) != steps:
        raise CaseError(impl, f"run.record(...) once per step: {steps} call(s) (the case's steps)", f"{len(rows)} call(s)")
    pnames, snames = _expected_names(spec, initial, begun, impl)
    _check_named(begun["params"], pnames, initial, dtype, impl, "run.begin()", "parameter")
    _check_named(begun["state"], snames, initial, dtype, impl, "run.begin()", "state")
    with_grads = rows[0]["grads"] is not None
    for k, r in enumerate(rows, start=1):
        where = f"step {k} run.record()"
        loss = np.asarray(r["loss"])
        if loss.size != 1 or loss.dtype.kind not in "fiu":
            raise CaseError(impl, f"{where}: the loss as one number", f"an array of shape {list(loss.shape)}")
        _check_named(r["params"], pnames, initial, dtype, impl, where, "parameter")
        _check_named(r["state"], snames, initial, dtype, impl, where, "state")
        if (r["grads"] is not None) != with_grads:
            raise CaseError(impl, f"{where}: grads=... at every step or at none (step 1 {'did' if with_grads else 'did not'})")
        if with_grads:
            _check_named(r["grads"], pnames, initial, dtype, impl, where, "gradient")
    traj = Trajectory({"loss": np.array([np.asarray(r["loss"]).reshape(()) for r in rows], dtype)})

    # row by row (RowList reads each RowRef as it appends): a large model's rows go to a RowArray file
    for n in pnames:
        traj[f"param/{n}"] = RowList([begun["params"][n], *(r["params"][n] for r in rows)]).finish()
    if with_grads:
        for n in pnames:
            traj[f"grad/{n}"] = RowList([r["grads"][n] for r in rows]).finish()
    for n in snames:
        traj[f"state/{n}"] = RowList([begun["state"][n], *(r["state"][n] for r in rows)]).finish()
    return traj


def replica_divergence(ranks: list[Mapping[str, Any]], impl: str) -> Finding | None:
    """The first place where a rank's parameters differ bitwise from rank 0's, as a finding, or ``None``.

    ``ranks[r]["digests"]``: per row (row 0 = ``run.begin``, row k = after step k) ``{name: digest}``;
    ``ranks[r]["grad_norms"]`` (optional): per step ``{name: |g|}`` of the gradient the rank applied.
    The finding's line says it for a person; its data (``protocol.trajectory.Finding``) says it for the
    judge: ``{"kind": "replicas", "step", "rank", "name", "norms"}`` with ``norms`` ``[[rank, |g|], ...]``
    (rank 0 and every rank whose norm differs; every rank where none does) or ``None`` where the ranks
    recorded no gradient. A rank that recorded a different number of steps than rank 0 is bad input
    (``CaseError``).
    """
    want = ranks[0]["digests"]
    for r, rec in enumerate(ranks[1:], start=1):
        if len(rec["digests"]) != len(want):
            raise CaseError(impl, f"every rank to call run.begin() once and run.record() once per step; rank {r}"
                                  f" reported {len(rec['digests'])} row(s), rank 0 {len(want)}")
    for row, names in enumerate(want):
        for r, rec in enumerate(ranks[1:], start=1):
            for n in sorted(names):
                if rec["digests"][row].get(n) != names[n]:
                    when = "at run.begin()" if row == 0 else f"at step {row}"
                    text, norms = _applied(ranks, row, n)
                    return Finding(f"replicas diverged {when}: rank {r}, parameter {n} (not bitwise equal to rank 0's;"
                                   " DDP keeps every replica identical, so some update bypassed it)" + text,
                                   {"kind": "replicas", "step": row, "rank": r, "name": n, "norms": norms})
    return None


def _applied(ranks: list[Mapping[str, Any]], row: int, name: str) -> tuple[str, list[list[float]] | None]:
    """Which ranks applied which gradient at step ``row``: the line's words and ``[[rank, |g|], ...]``.

    The norms: each rank's ``|g|`` of ``name`` (``run.record(grads=...)``), rank 0 first, then the ranks
    that differ from it (every rank where none does); ``("", None)`` where the ranks recorded no gradient.
    """
    norms = [rec.get("grad_norms") or [] for rec in ranks]
    if row < 1 or any(len(x) < row or name not in x[row - 1] for x in norms):
        return "", None
    g = [x[row - 1][name] for x in norms]
    if g[0] == 0.0:
        return "", None
    apart = [r for r in range(1, len(g)) if g[r] != g[0]]
    if not apart:
        return (f"; every rank applied a gradient of the same norm in {name} at step {row} ({g[0]:.4g})",
                [[r, float(v)] for r, v in enumerate(g)])
    shown = ", ".join(f"rank {r} {g[r]:.4g} ({g[r] / g[0]:.3g}x)" for r in apart[:8])
    return ((f"; the gradient applied at step {row} differs between the ranks: |g| of {name} rank 0 {g[0]:.4g}, "
             f"{shown}" + (f" and {len(apart) - 8} more" if len(apart) > 8 else "")),
            [[0, float(g[0])]] + [[r, float(g[r])] for r in apart])


_RAISED = re.compile(r"PluginRaised: ((?:at|before|after) step \d+): (.*)$")
_INPUT = re.compile(r"PluginInputError: (.*)$")


def plugin_failure(impl: str, detail: str, rank: int | None = None) -> tuple[str, str, str] | None:
    """Read a rank's report: ``("raised", one line, the user's frames)`` / ``("input", one line, "")``, or ``None``.

    ``rank``: the rank whose report it is, named in the line (``raised at step 2 on rank 1: ...``).
    """
    lines = detail.rstrip().splitlines()
    last = lines[-1].strip() if lines else ""
    m = _RAISED.search(last)
    if m:
        frames = "\n".join(lines[:-1])
        return "raised", raised_line(impl, m.group(1), m.group(2), rank), frames + ("\n" if frames else "")
    m = _INPUT.search(last)
    if m:
        return "input", m.group(1), ""
    return None


# ------------------------------------------------------------------ running a plugin


def layer_outputs(leaves: list[Mapping[str, Any]], names: dict[str, str] | None = None,
                  weighted: dict[str, bool] | None = None) -> dict[str, np.ndarray]:
    """Leaf layers' outputs in call order, grouped into layers named ``"0"``, ``"1"``, ... (the forward stage's names).

    Args:
        leaves: ``[{"name", "weights", "kept", "fed", "in", "out"}]`` from ``torchref.plugin.LayerHooks``
            or ``tfpar.plugin.KerasLayerHooks``: one per leaf module / layer of one forward pass.
    Returns:
        ``{str(i): output}``: layer ``i`` starts at a leaf that holds weights or changes the shape
        (``Linear``, ``Dense``, ``Conv2d``, ``BatchNorm``, ``Flatten``, pooling) and takes in the
        weightless, shape-keeping leaves called after it (``ReLU``, ``Tanh``, ``Dropout``, Keras'
        ``Activation``). Its output is what the next layer received (so ``torch.relu(self.l0(x))``
        written in a ``forward``, which no hook sees, is part of layer 0), or the last leaf's own
        output where the next layer was fed exactly that tensor (a torch ``nn.Flatten`` of an image
        is then taken in Keras' order) and for the last layer.

    Keras folds an activation into its layer (``Dense(6, activation="tanh")``) where torch
    writes ``nn.Linear(5, 6), nn.Tanh()``; grouping so, the same network gets the same layer
    numbers on both sides, and the numbers of the case's layer list (``dense`` with its
    ``activation``) that the built-ins record. Framework names (``dense_1``, ``module.2``)
    cannot line up and are not used to match; ``names``, when given, receives each layer's own
    name for a person reading (the Keras layer path or the torch module's qualified name of
    the leaf that starts it, and its class: ``blocks.2.body.1 LayerNorm``); ``weighted`` whether
    that leaf holds weights (:func:`case_numbering` lines the layers up with the case's by it).
    """
    out: dict[str, np.ndarray] = {}
    i = -1
    for leaf in leaves:
        if i < 0 or leaf["weights"] or not leaf["kept"]:
            if i >= 0 and not leaf.get("fed", True) and leaf.get("in") is not None:
                out[str(i)] = np.asarray(leaf["in"])  # what ran between the two layers belongs to the first
            i += 1
            if names is not None:  # the plugin's own name of the leaf that starts the layer, and its class
                names[str(i)] = f"{leaf['name']} {leaf.get('kind', '')}".strip()
            if weighted is not None:
                weighted[str(i)] = bool(leaf["weights"])
        out[str(i)] = np.asarray(leaf["out"])
    return out


_UNNUMBERED = ("dropout", "activation", "residual", "repeat")


def case_numbering(spec: Mapping[str, Any], outputs: Mapping[str, Any], weighted: Mapping[str, bool]) -> dict[str, str] | None:
    """The case's layer index of each hook layer (``{"0": "1", "1": "2"}``), or ``None`` where they cannot be lined up.

    The hooks number the layers they see, ``0``, ``1``, ...; a layer the plugin computes in code
    (``x.flatten(1)`` or ``F.max_pool2d`` in a ``forward``) is no module, so from there the hooks'
    numbers run short of the case's (its canonical paths, docs/localisation.md): a plugin that flattens in code
    calls its first ``Linear`` layer 0, where the case's layer 0 is the ``flatten``. Lined up in
    order by what each layer is: a hook layer that starts at a leaf holding weights is the case's
    next layer with parameters (weightless case layers before it ran in code); a weightless one
    (``Flatten``, pooling) the case's next weightless layer; either, when its output (per example,
    TensorFlow layout) is not that layer's, a weightless case layer right after it whose output it
    is (code after the module belongs to the layer before: a ``Conv2d`` whose output is pooled in
    code is the pooling layer's output). A case layer with parameters is never skipped.

    Args:
        spec: the case (a flat layer list: :func:`hooks_line_up`).
        outputs: ``{hook layer: [rows, ...]}`` (:func:`layer_outputs`); weighted: whether each starts
            at a leaf with weights.
    """
    from parity_tests.contract.specs import layer_shapes

    model = spec["model"]
    layers = model.get("layers", ())
    shapes = layer_shapes(model["input_shape"], list(layers))[1:]
    with_params = {p.name.split(".", 1)[0] for p in param_specs(model["input_shape"], list(layers))}
    params = [str(j) in with_params for j in range(len(layers))]
    out: dict[str, str] = {}
    j = 0
    for key in sorted(outputs, key=int):
        shape = tuple(np.shape(outputs[key])[1:])
        while j < len(layers) and params[j] != weighted.get(key, False):
            if params[j]:  # a layer with parameters the hooks did not see: not this numbering
                return None
            j += 1
        k = j
        while k < len(layers) and tuple(shapes[k]) != shape and k + 1 < len(layers) and not params[k + 1]:
            k += 1
        if k >= len(layers) or tuple(shapes[k]) != shape:
            return None
        out[key], j = str(k), k + 1
    return out


def hooks_line_up(spec: Mapping[str, Any]) -> bool:
    """Whether the layer hooks' numbering can be set beside the case's (and so the built-ins') layers.

    Not when the case lists a ``dropout`` layer: a plugin applies the case's masks in code between
    two layers, where no hook sees a boundary, so its layers would be numbered one short of the
    case's from there and layer 0 would hold the masked output. Nor when it lists a standalone
    ``activation`` (the hooks fold it into the layer before, the case numbers it on its own) or a
    ``residual`` / ``repeat`` (the built-ins record their inner layers by path, ``3.body.1``, and
    the residual's add is code no hook sees: the hooks' flat numbers would sit beside other
    layers' outputs). External models have no case numbering: both sides are plugins, numbered alike.
    """
    model = spec["model"]
    # nor where the hooks' grouping cannot follow the case's list: a standalone activation joins the
    # layer before it, and a residual's add or a repeat's copies are code and leaves the case numbers by path
    return "external" in model or not any(layer.get("type") in _UNNUMBERED for layer in model.get("layers", ()))


def device_arrays(per_device: list[Mapping[str, Any] | None], step: int | None, impl: str,
                  initial: Mapping[str, np.ndarray], *, hooks: bool = True,
                  spec: Mapping[str, Any] | None = None) -> dict[str, np.ndarray]:
    """The ``device/...`` arrays (docs/localisation.md stages) of what a plugin reported per device at ``step``.

    Args:
        per_device: per tower / rank ``{"grads": {name: array} | None, "acts": {layer: array} | None,
            "losses": scalar | None, "inputs": array | None}`` (``None`` entries: nothing reported),
            and optionally ``"leaves"``: what the layer hooks saw, used when ``acts`` is ``None``
            (:func:`layer_outputs`).
        step: the captured step; initial: the initial weights (gradient names and shapes are checked).
        hooks: the ``"leaves"`` are numbered as the case's layers (:func:`hooks_line_up`); else their
            layers are ``hooks.0``, ``hooks.1``, ... (another plugin's hook layers are numbered alike).
        spec: the case: with ``hooks``, each hook layer takes the index of the case's layer it is
            (:func:`case_numbering`; ``hooks.<i>`` where they cannot be lined up). Without it, the
            hooks' own order stands for the case's.
    Returns:
        ``device/step``, and what every device reported: ``device/x`` ``[B, ...]`` and ``device/sizes``
        ``[N]``, ``device/loss`` ``[N]``, ``device/grad/<name>`` ``[N, ...]``, ``device/act/<layer>``
        ``[B, ...]`` (rows concatenated in device order), as the built-ins record them, and for the
        hooks' layers ``device/name/<layer>``: the plugin's own name of the layer (a string). Without
        ``device_inputs``, ``device/sizes`` is the row count of the hooks' layer outputs per device.
    Raises:
        CaseError: a device gradient under a name that is not a parameter, or of the wrong shape.
    """
    if step is None or not per_device or any(d is None for d in per_device):
        return {}
    out: dict[str, np.ndarray] = {"device/step": np.asarray(step)}
    if all(d["inputs"] is not None for d in per_device):
        out["device/x"] = np.concatenate([np.asarray(d["inputs"]) for d in per_device], axis=0)
        out["device/sizes"] = np.asarray([len(d["inputs"]) for d in per_device], np.int64)
    if all(d["losses"] is not None for d in per_device):
        out["device/loss"] = np.stack([np.asarray(d["losses"]).reshape(()) for d in per_device])
    if all(d["grads"] is not None for d in per_device):
        for name in per_device[0]["grads"]:
            want = initial.get(name)
            for r, d in enumerate(per_device):
                g = d["grads"].get(name)
                if want is None or g is None or np.shape(g) != np.shape(want):
                    raise CaseError(impl, f"step {step} run.record(device_grads=...): device {r}'s gradient of"
                                          f" {name!r} with the parameter's shape {list(np.shape(want))}"
                                          if want is not None else
                                          f"step {step} run.record(device_grads=...): parameter names as in"
                                          f" run.begin(); {name!r} is not one", None if g is None else list(np.shape(g)))
            out[f"device/grad/{name}"] = np.stack([d["grads"][name] for d in per_device])
    # hook layers are numbered as the case's top-level layers where the numbering lines up (hooks_line_up),
    # else "hooks.<i>": compared only with another plugin's hook layers, never set beside a built-in's
    prefix = "" if hooks else "hooks."
    names: dict[str, str] = {}
    weighted: dict[str, bool] = {}
    hooked = [layer_outputs(d["leaves"], names if r == 0 else None, weighted if r == 0 else None)
              if d["acts"] is None and d.get("leaves") else None for r, d in enumerate(per_device)]
    number = {k: f"{prefix}{k}" for k in (hooked[0] or {})}
    if hooks and spec is not None and "external" not in spec["model"] and hooked[0]:
        case = case_numbering(spec, hooked[0], weighted)
        number = ({k: case[k] for k in hooked[0]} if case is not None else {k: f"hooks.{k}" for k in hooked[0]})
    names = {number[k]: v for k, v in names.items() if k in number}
    prefix = ""  # the names are numbered now
    acts = [d["acts"] if d["acts"] is not None else
            ({number.get(k, f"hooks.{k}"): v for k, v in h.items()} if h is not None else None)
            for d, h in zip(per_device, hooked, strict=True)]
    if all(h is not None for h in hooked) and per_device and per_device[0].get("leaves"):
        # the rows each device's model received (its first leaf's input): matched by content across the
        # sides where the devices hold other rows (localise.stage_chain), never compared as values
        firsts = [d["leaves"][0].get("in") for d in per_device]
        if all(f is not None and np.ndim(f) >= 1 for f in firsts):
            out["device/rows"] = np.concatenate([np.asarray(f).reshape(len(f), -1) for f in firsts], axis=0)
    if all(a is not None for a in acts):
        for layer in acts[0]:
            if all(layer in a for a in acts):
                out[f"device/act/{layer}"] = np.concatenate([np.asarray(a[layer]) for a in acts], axis=0)
                if layer in names and per_device[0]["acts"] is None:
                    out[f"device/name/{layer}"] = np.asarray(names[layer])  # for a person reading
        if "device/sizes" not in out and all(d["acts"] is None for d in per_device):
            # the hooks saw each device's rows: their count names a device without device_inputs=
            rows = [{len(v) for v in a.values() if np.ndim(v)} for a in acts]
            if all(len(r) == 1 for r in rows):
                out["device/sizes"] = np.asarray([r.pop() for r in rows], np.int64)
    return out if len(out) > 1 else {}


def _tf_devices(device: Mapping[str, Any] | None) -> list[Mapping[str, Any] | None]:
    """A TensorFlow plugin's per-tower lists (``device_grads=[...]`` etc.) as one entry per tower."""
    lists = {k: v for k, v in (device or {}).items() if v is not None}
    n = max((len(v) for v in lists.values()), default=0)
    return [{k: (lists[k][r] if k in lists and len(lists[k]) == n else None)
             for k in ("grads", "acts", "losses", "inputs", "leaves")} for r in range(n)]


class PluginFailed(RunError):
    """A plugin raised while it ran: the one line (``str``) and the user's own frames (:attr:`frames`).

    A :class:`~parity_tests.running.backends.RunError` (exit 1); the command prints the line,
    then the frames on stderr; a Python traceback of it shows them as its note.
    """

    def __init__(self, line: str, frames: str = "") -> None:
        super().__init__(line)
        self.frames = frames
        if frames:  # shown under the line wherever Python prints the exception (a failing pytest test)
            self.add_note(frames.rstrip("\n"))


def raised_line(impl: str, when: str, line: str, rank: int | None = None) -> str:
    """``my.py:train raised at step 3: KeyError: 'lr'`` (``on rank 1`` where a DDP rank raised alone)."""
    return f"{impl} raised {when}" + (f" on rank {rank}" if rank is not None else "") + f": {line}"


def run_isolated(target: PluginTarget, case: Any, impl: str) -> dict[str, Any]:
    """Run a TensorFlow plugin in a fresh process (``tf_worker``); its records.

    Raises:
        PluginFailed: the plugin raised (the line names when, and carries the user's frames).
        CaseError: its module failed to import there (a module that imports differently the
            second time), or the case asks for more devices than the process can make.
        RunError: the process died without reporting.
    """
    from parity_tests.running.tf_worker import run_case_job

    out = run_case_job(case, impl, case.devices, location=target.location, deterministic=target.deterministic)
    if "input" in out:
        raise CaseError(impl, out["input"])
    if "raised" in out:
        r = out["raised"]
        raise PluginFailed(raised_line(impl, r["when"], r["line"]), r["frames"])
    return out["records"]


def optimizer_arrays(records: Mapping[str, Any], case: Any, impl: str) -> dict[str, np.ndarray]:
    """``opt/step`` and ``opt/<slot>/<name>`` of a plugin's run, where ``--lockstep`` asked for its optimizer state.

    The plugin hands its optimizer over with ``run.use_optimizer`` (or passes
    ``run.record(..., optimizer_state=...)``); a case whose optimizer keeps state (anything but
    ``sgd`` with a constant schedule) cannot go on without it: one line of bad input.
    """
    if not getattr(case, "extra", {}).get("export_opt_state"):
        return {}
    state = records.get("opt_export")
    opt = case.spec["optimizer"]
    if state is None:
        if opt["name"] == "sgd" and opt.get("schedule", {"kind": "constant"})["kind"] == "constant" \
                and not plugins_only(opt):
            return {}
        raise CaseError(impl, "a call to run.use_optimizer(optimizer, params) before the first step (or"
                              " run.record(..., optimizer_state=...)): under --lockstep each step starts from the"
                              f" reference's optimizer state, and {opt['name']!r} keeps one")
    out = {"opt/step": np.asarray(int(state["step"]), np.int64)}
    out.update({f"opt/{slot}/{name}": np.asarray(a) for slot, arrays in state["slots"].items() for name, a in arrays.items()})
    return out


def plugin_implementation(target: PluginTarget, *, name: str | None = None) -> Any:
    """The registry entry of a resolved plugin (``name``: an entry point's short name, else ``target.name``)."""
    from parity_tests.running.backends import by_file, run_torch_job
    from parity_tests.running.implementation import Implementation

    impl = name or target.name

    def run_tensorflow(case: Any, progress: Callable[[int], None] | None) -> dict[str, np.ndarray]:
        records = run_isolated(target, case, impl)  # its own process: this one needs no TensorFlow
        try:
            traj = assemble(records, case.spec, case.init, impl)
        finally:
            remove_files(records.get("spill", ()))  # assembled (or refused): the run's own files go
        traj.update(device_arrays(_tf_devices(records.get("device")), case.capture, impl, case.init,
                                  hooks=hooks_line_up(case.spec), spec=case.spec))
        traj.meta["keras_optimizers"] = records.get("keras_optimizers", [])
        traj.meta["keras_loss_scales"] = records.get("keras_loss_scales", [])
        traj.meta["keras_float32_constants"] = records.get("keras_float32_constants", [])  # (judging.precision_leak)
        traj.meta["float32_losses"] = records.get("float32_losses", [])  # tf.compat.v1.losses in float32 (same)
        traj.meta["case_read"] = records.get("case_read")  # protocol.case_read: what of its case it read
        traj.update(optimizer_arrays(records, case, impl))
        if progress:
            progress(case.spec["steps"])
        return traj

    def run_torch(case: Any, progress: Callable[[int], None] | None) -> dict[str, np.ndarray]:
        from torchref.plugin import run_plugin_rank
        from torchref.pool import MAX_SIZE

        n = case.devices if target.kind == "distributed" else 1
        if n > MAX_SIZE:
            raise CaseError("parallel.devices", f"at most {MAX_SIZE} ranks", n)

        def failure(detail: str, rank: int) -> Exception | None:
            found = plugin_failure(impl, detail, rank if n > 1 else None)
            if found is None:
                return None
            return PluginFailed(found[1], found[2]) if found[0] == "raised" else CaseError(impl, found[1])

        # the parent's spill threshold travels with the job (the workers were started before it was set)
        payload, files = by_file({**case.payload(), "spill_bytes": spill_threshold()})
        job = {"location": target.location, "kind": target.kind, "payload": payload,
               "deterministic": target.deterministic}
        try:
            ranks = run_torch_job(impl, run_plugin_rank, job, n, on_failure=failure)
        finally:
            remove_files(files)
        try:
            traj = Trajectory(assemble(ranks[0], case.spec, case.init, impl))
        finally:
            remove_files(ranks[0].get("spill", ()))  # assembled (or refused): rank 0's files go
        traj.update(device_arrays([r.get("device") for r in ranks], case.capture, impl, case.init,
                                  hooks=hooks_line_up(case.spec), spec=case.spec))
        traj.update(optimizer_arrays(ranks[0], case, impl))
        traj.meta["torch_optimizers"] = ranks[0].get("torch_optimizers", [])  # torchref.torch_seen
        traj.meta["case_read"] = ranks[0].get("case_read")  # protocol.case_read: what of its case it read
        finding = replica_divergence(ranks, impl)
        if finding:
            traj.findings.append(finding)
        if progress:
            progress(case.spec["steps"])
        return traj

    torch_side = target.kind in ("distributed", "single")
    declared = EngineSpec(impl, "plugin", "torch" if torch_side else "tf", parallel=target.kind != "single",
                          dtypes=target.dtypes, keras=target.keras, captures=True,
                          description=f"plugin {target.name} ({KINDS[target.kind]})")
    return Implementation(declared, run_torch if torch_side else run_tensorflow, plugin=target)
