"""The case contract (``parity-case/1``): loading, validation and defaults.

Validation happens once, here, at the edge. What leaves this module is a
:class:`Case`: a normalised plain-dict ``spec`` (every default filled in) and
the numpy arrays it needs (``x``, ``y``, ``init``), which is all that crosses
into ``tfpar`` and ``torchref``. Every problem raises :class:`CaseError`
naming the field.

See ``docs/case-format.md`` for the user-facing description.
"""

from __future__ import annotations

import copy
import json
import os
import weakref
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from parity_tests.contract.fields import choice, integer, need, no_extra, number, obj
from parity_tests.contract.generators import GENERATORS, INIT_KINDS, draw_init, generate_data
from parity_tests.contract.model import (
    LAYER_TYPES,
    LOSSES,
    is_external,
    validate_external_model,
    validate_model,
)
from parity_tests.contract.optimizer import SEMANTICS, check_no_decay, validate_optimizer
from parity_tests.contract.parallel import (
    COMBINES,
    SHARDS,
    WEIGHTINGS,
    check_accumulate,
    check_combine_model,
    validate_parallel,
)
from parity_tests.contract.specs import ParamSpec, nested_inputs, param_specs
from parity_tests.contract.tokens import (
    FACTS_KEY,
    check_labelled,
    per_token,
    takes_tokens,
    token_facts,
    token_ids,
)
from parity_tests.protocol.errors import CaseError
from parity_tests.protocol.optimizer_state import OPTIMIZERS
from parity_tests.protocol.vocabulary import ORDERS

__all__ = [
    "SCHEMA",
    "Case",
    "load_case",
    "case_from_dict",
    "with_changes",
    "write_case",
    "LAYER_TYPES",
    "LOSSES",
    "OPTIMIZERS",
    "SEMANTICS",
    "COMBINES",
    "SHARDS",
    "WEIGHTINGS",
    "DTYPES",
    "MIXED_BFLOAT16",
    "MIXED_COMBINES",
    "ORDERS",
]

SCHEMA = "parity-case/1"
# these bounds keep a mistyped size from making the tool allocate tens of gigabytes; the
# parameter bound is twice the largest model issue 11 runs to a verdict (100 M parameters: a
# row of its trajectory is 800 MB in float64, spilled to files, parity_tests.protocol.rows)
MAX_PARAMETERS = 200_000_000
MAX_INPUT_VALUES = 50_000_000
#: ``mixed_bfloat16``: float32 master weights and trajectory, layers computed in bfloat16
#: (Keras' ``mixed_bfloat16`` policy, torch's CPU autocast; docs/mixed-precision.md)
MIXED_BFLOAT16 = "mixed_bfloat16"
DTYPES = ("float32", "float64", MIXED_BFLOAT16)
#: the combine rules a mixed-precision case runs with (tf.towers, tf.single, torch.ddp, torch.single)
MIXED_COMBINES = ("grad_mean", "loss_mean")
_TOP_KEYS = {"schema", "name", "dtype", "model", "init", "data", "optimizer", "parallel", "steps", "seed", "description"}


def with_changes(raw: dict[str, Any], **changes: Any) -> dict[str, Any]:
    """A deep copy of a case dict with dotted fields set: ``with_changes(raw, **{"parallel.devices": 4})``.

    A value of ``...`` (``Ellipsis``) removes the field; a numeric part indexes a list
    (``"model.layers.1.semantics"``).
    """
    out = copy.deepcopy(raw)
    for dotted, value in changes.items():
        node = out
        parts = dotted.split(".")
        for part in parts[:-1]:
            node = node[int(part)] if isinstance(node, list) else node[part]
        if value is ...:
            node.pop(parts[-1], None)
        elif isinstance(node, list):
            node[int(parts[-1])] = value
        else:
            node[parts[-1]] = value
    return out


@dataclass
class Case:
    """A validated case.

    Attributes:
        spec: the normalised case dictionary (plain JSON data, defaults filled in).
        x: inputs, float64 ``[steps * global_batch, *input_shape]``; int64 token ids when the
            model's first layer is an ``embedding`` (``contract.tokens``).
        y: targets, float64 ``[rows, *output_shape]``, or int64 ``[rows, *output_shape[:-1]]`` for
            ``softmax_ce`` (one label per row, or per token).
        init: initial value of every parameter by canonical name, float64.
        source: the case file it was loaded from, if any.
        perm: with ``data.order: distributed_sampler``, optional int64 ``[epochs, rows]``:
            epoch e reads the dataset in the order ``perm[e mod epochs]`` (a shuffle drawn in numpy).

    With ``data.order: distributed_sampler`` ``x`` and ``y`` hold the dataset,
    ``data.rows`` rows, which the run reads epoch after epoch.
    """

    spec: dict[str, Any]
    x: np.ndarray
    y: np.ndarray
    init: dict[str, np.ndarray]
    source: Path | None = field(default=None)
    perm: np.ndarray | None = field(default=None)
    w: np.ndarray | None = field(default=None)
    #: a step (1-based) whose per-device values the implementations should record (``device/...``
    #: arrays, docs/localisation.md stages); set by localisation with ``dataclasses.replace``, never from a file
    capture: int | None = field(default=None)
    #: the float64 run that rounds the gradients to bfloat16 where the mixed recipe does (``protocol.grad_rounding``;
    #: ``judging.bfloat16``'s gradient term); set by the session with ``dataclasses.replace``, never from a file
    grads_bf16: bool = field(default=False)

    @property
    def name(self) -> str:
        return self.spec["name"]

    @property
    def devices(self) -> int:
        return self.spec["parallel"]["devices"]

    def payload(self) -> dict[str, Any]:
        """Everything an implementation needs, as plain data (picklable).

        ``masks``: the dropout keep-masks by layer path (``generators.dropout_masks``),
        drawn here once so that every implementation gets the same ones.
        """
        from parity_tests.contract.generators import dropout_masks

        return {"spec": self.spec, "x": self.x, "y": self.y, "init": self.init, "masks": dropout_masks(self.spec),
                "perm": self.perm, "w": self.w, "capture": self.capture,
                **({"grads_bf16": True} if self.grads_bf16 else {})}  # only in that run: every other payload as before

    def replace(self, **changes: Any) -> Case:
        """A copy with top-level or dotted spec fields changed and re-validated.

        ``case.replace(dtype="float64", **{"parallel.devices": 4})``
        """
        raw = with_changes(self.spec, **changes)
        raw["init"] = {"arrays": True}
        raw["data"] = {"arrays": True, **{k: raw["data"][k] for k in ("global_batch", *_ORDER_KEYS) if k in raw["data"]}}
        return case_from_dict(raw, x=self.x, y=self.y, init=self.init, perm=self.perm, w=self.w)


def _load_npz(base: Path | None, name: Any, path: str) -> dict[str, np.ndarray]:
    if not isinstance(name, str) or not name:
        raise CaseError(path, "a file name (relative to the case file's folder)", name)
    if base is None:
        raise CaseError(path, "arrays given directly (this case was not loaded from a file)")
    f = (base / name).resolve()
    if not f.is_file():
        raise CaseError(path, f"an existing .npz file; {f} does not exist")
    try:
        with np.load(f, allow_pickle=False) as z:
            return {k: np.asarray(z[k]) for k in z.files}
    except (ValueError, OSError, zipfile.BadZipFile, EOFError) as e:
        raise CaseError(path, f"a readable .npz file (numpy arrays, no pickles); {f.name} could not be read: {type(e).__name__}") from None


#: initial weights some case validated, by id: a case made from another (``Case.replace``: each dtype, mapping and
#: capture run of a comparison) shares them instead of copying them (0.24 GB a case at 29.5 M parameters)
_VALIDATED: weakref.WeakValueDictionary[int, np.ndarray] = weakref.WeakValueDictionary()


def _weights(a: np.ndarray, path: str) -> np.ndarray:
    """An initial weight checked and made float64 (:func:`_check_array`), or, when a case validated this very
    array already, the array itself. Nothing writes a case's weights (engines copy them into their variables)."""
    if _VALIDATED.get(id(a)) is a:
        return a
    out = _check_array(a, path)
    _VALIDATED[id(out)] = out
    return out


def _check_array(a: np.ndarray, path: str, *, integer: bool = False) -> np.ndarray:
    if integer:
        if a.dtype.kind not in "iu" and not (a.dtype.kind == "f" and np.all(np.isfinite(a)) and np.all(a == np.round(a))):
            raise CaseError(path, "integer class labels", f"array of dtype {a.dtype}")
        return a.astype(np.int64)
    if a.dtype.kind not in "fiub":
        raise CaseError(path, "a numeric array", f"array of dtype {a.dtype}")
    a = a.astype(np.float64)
    if not np.all(np.isfinite(a)):
        bad = tuple(int(i) for i in np.argwhere(~np.isfinite(a))[0])
        raise CaseError(path, f"finite numbers (found {a[bad]} at index {bad})")
    return a


def _external_init(i: dict, base: Path | None, arrays: dict | None) -> tuple[dict, dict[str, np.ndarray]]:
    """An external model's weights: every array of the npz, under the plugins' own names."""
    if arrays is not None and i.get("arrays"):
        raw, spec = arrays, {"arrays": True}
    elif "npz" in i:
        no_extra(i, {"npz"}, "init")
        raw, spec = _load_npz(base, i["npz"], "init.npz"), {"npz": i["npz"]}
    else:
        raise CaseError("init", '{"npz": FILE} under the plugins\' own parameter names (an external model has no layer'
                                ' list to draw weights for)', i)
    if not raw:
        raise CaseError("init.npz", "at least one array (the model's initial weights)")
    out = {str(k): _weights(np.asarray(v), f"init[{k!r}]") for k, v in raw.items()}
    n_values = sum(a.size for a in out.values())
    if n_values > MAX_PARAMETERS:
        raise CaseError("init", f"at most {MAX_PARAMETERS:,} parameter values in all (these weights have {n_values:,})")
    return spec, out


def _external_data(d: Any, base: Path | None, steps: int, devices: int,
                   arrays) -> tuple[dict, np.ndarray, np.ndarray, np.ndarray | None]:
    """An external model's data: ``x`` and ``y`` of any per-example shape, rows first.

    ``data.order`` as for any case (:func:`_order`): ``distributed_sampler`` with ``data.rows``
    (and an optional ``perm`` array in the npz) lets a DDP program keep its own
    ``DataLoader`` + ``DistributedSampler`` over ``run.dataset()``.
    """
    d = obj(d, "data")
    batch = integer(need(d, "global_batch", "data"), "data.global_batch", 1, 10_000_000)
    if batch < devices:
        raise CaseError("data.global_batch", f"at least parallel.devices = {devices} rows, so every device gets one", batch)
    for key in ("sample_weights", "generator"):
        if key in d:
            raise CaseError(f"data.{key}", 'no value for an external model (its data is {"npz": FILE, "global_batch": B})', d[key])
    order, rows = _order(d, batch, steps, devices)
    if arrays is not None and d.get("arrays"):
        spec, (x, y, perm) = {"arrays": True, "global_batch": batch}, arrays
    elif "npz" in d:
        no_extra(d, {"npz", "global_batch", "order", "rows"}, "data")
        z = _load_npz(base, d["npz"], "data.npz")
        for key in ("x", "y"):
            if key not in z:
                raise CaseError(f"data.npz[{key!r}]", f"an array named {key!r} in {d['npz']}")
        spec, x, y, perm = {"npz": d["npz"], "global_batch": batch}, z["x"], z["y"], z.get("perm")
    else:
        raise CaseError("data", '{"npz": FILE, "global_batch": B} for an external model', d)
    x, y = np.asarray(x), np.asarray(y)
    need_rows = f"steps x global_batch = {steps} x {batch} = {rows}" if order == "split" else f"data.rows = {rows}"
    if x.ndim < 1 or x.shape[0] < rows:
        raise CaseError("data.x", f"at least {need_rows} rows", f"shape {list(x.shape)}")
    if y.ndim < 1 or y.shape[0] != x.shape[0]:
        raise CaseError("data.y", f"one target per row of x ({x.shape[0]} rows)", f"shape {list(y.shape)}")
    if x[:rows].size > MAX_INPUT_VALUES:
        raise CaseError("data", f"at most {MAX_INPUT_VALUES:,} input values in all")
    y = _check_array(y[:rows], "data.y", integer=y.dtype.kind in "iu")
    if order != "split":  # carried only when not the default, so older cases keep their spec
        spec.update(order=order, rows=rows)
    # integer x (token ids for a plugin's embedding) stays integer, as integer labels do
    return spec, _check_array(x[:rows], "data.x", integer=x.dtype.kind in "iu"), y, _perm(perm, order, rows)


def _init(i: Any, base: Path | None, specs: list[ParamSpec], arrays: dict | None) -> tuple[dict, dict[str, np.ndarray]]:
    i = obj(i, "init")
    if arrays is not None and i.get("arrays"):
        raw, spec = arrays, {"arrays": True}
    elif "npz" in i:
        no_extra(i, {"npz"}, "init")
        raw, spec = _load_npz(base, i["npz"], "init.npz"), {"npz": i["npz"]}
    elif "seed" in i:
        no_extra(i, {"seed", "kind", "stddev"}, "init")
        seed = integer(i["seed"], "init.seed", 0, 2**32 - 1)
        kind = choice(i.get("kind", "normal"), "init.kind", INIT_KINDS)
        stddev = number(i.get("stddev", 1.0), "init.stddev", lo=0.0, lo_open=True)
        spec = {"seed": seed, "kind": kind, "stddev": stddev}
        drawn = draw_init(specs, seed, kind, stddev)  # float64 and finite by construction
        _VALIDATED.update({id(v): v for v in drawn.values()})
        return spec, drawn
    else:
        raise CaseError("init", 'either {"npz": FILE} or {"seed": S, "kind": "normal"|"glorot_uniform"}', i)
    out = {}
    for s in specs:
        if s.name not in raw:
            raise CaseError(f"init[{s.name!r}]", f"an array of shape {list(s.shape)} (missing from the weights)")
        a = np.asarray(raw[s.name])
        if tuple(a.shape) != s.shape:
            raise CaseError(f"init[{s.name!r}]", f"shape {list(s.shape)}", f"shape {list(a.shape)}")
        out[s.name] = _weights(a, f"init[{s.name!r}]")
    extra = sorted(set(raw) - {s.name for s in specs})
    if extra:
        raise CaseError(f"init[{extra[0]!r}]", "only the model's parameters (" + ", ".join(s.name for s in specs) + ")")
    return spec, out


_ORDER_KEYS = ("order", "rows", "sample_weights")  # data options carried by replace/write_case


def _order(d: dict, batch: int, steps: int, devices: int) -> tuple[str, int]:
    """``data.order`` and the number of data rows the run reads (the dataset's length D).

    ``split``: ``steps x global_batch`` rows, step k reads ``[k B, (k+1) B)``.
    ``distributed_sampler``: a dataset of ``data.rows`` rows (default ``steps x
    global_batch``) read epoch after epoch as N ``DataLoader``s over
    ``DistributedSampler`` read it: ``ceil(D / B)`` steps per epoch, the last one
    smaller and, when N does not divide D, holding ``N ceil(D/N) - D`` padded
    repeats of the epoch's first rows (see ``docs/data-pipeline.md``).
    """
    order = choice(d.get("order", "split"), "data.order", ORDERS)
    if order == "split":
        if "rows" in d:
            raise CaseError("data.rows", "no value with data.order split (it reads steps x global_batch rows;"
                                         " rows is the dataset length of data.order distributed_sampler)", d["rows"])
        return order, steps * batch
    if batch % devices:
        raise CaseError("data.global_batch", f"a multiple of parallel.devices = {devices} with data.order distributed_sampler"
                                             " (every rank's DataLoader takes global_batch / devices rows)", batch)
    return order, integer(d.get("rows", steps * batch), "data.rows", 1, 10_000_000)


def _perm(p: Any, order: str, rows: int) -> np.ndarray | None:
    """The optional ``perm`` array: int64 ``[epochs, rows]``, each row a permutation of ``range(rows)``."""
    if p is None:
        return None
    p = np.asarray(p)
    if order != "distributed_sampler":
        raise CaseError("data.perm", "no 'perm' array with data.order split (a permutation orders the epochs of"
                                     " data.order distributed_sampler)")
    if p.dtype.kind not in "iu":
        raise CaseError("data.perm", "integer row indices", f"array of dtype {p.dtype}")
    p = p.reshape(1, -1) if p.ndim == 1 else p
    if p.ndim != 2 or p.shape[1] != rows or p.size > MAX_INPUT_VALUES:
        raise CaseError("data.perm", f"shape [{rows}] or [epochs, {rows}] (rows = data.rows), at most {MAX_INPUT_VALUES:,} values",
                        f"shape {list(np.shape(p))}")
    p = p.astype(np.int64)
    want = np.arange(rows)
    for e, row in enumerate(p):
        if not np.array_equal(np.sort(row), want):
            raise CaseError(f"data.perm[{e}]", f"a permutation of 0..{rows - 1} (every row index once)")
    return p


def _data(d: Any, base: Path | None, model: dict, in_shape, out_shape, steps: int, devices: int,
          arrays) -> tuple[dict, np.ndarray, np.ndarray, np.ndarray | None]:
    d = obj(d, "data")
    batch = integer(need(d, "global_batch", "data"), "data.global_batch", 1, 10_000_000)
    if batch < devices:
        raise CaseError("data.global_batch", f"at least parallel.devices = {devices} rows, so every device gets one", batch)
    order, rows = _order(d, batch, steps, devices)
    values = rows * int(np.prod(in_shape, dtype=np.int64))
    if values > MAX_INPUT_VALUES:
        what = f"steps x global_batch x input size = {steps} x {batch}" if order == "split" else f"data.rows x input size = {rows}"
        raise CaseError("data", f"at most {MAX_INPUT_VALUES:,} input values in all ({what} x {int(np.prod(in_shape))} = {values:,})")
    loss = model["loss"]
    if arrays is not None and d.get("arrays"):
        spec = {"arrays": True, "global_batch": batch}
        x, y, perm = arrays
    elif "npz" in d:
        no_extra(d, {"npz", "global_batch", *_ORDER_KEYS}, "data")
        z = _load_npz(base, d["npz"], "data.npz")
        for key in ("x", "y"):
            if key not in z:
                raise CaseError(f"data.npz[{key!r}]", f"an array named {key!r} in {d['npz']}")
        spec = {"npz": d["npz"], "global_batch": batch}
        x, y, perm = z["x"], z["y"], z.get("perm")
    elif "generator" in d:
        no_extra(d, {"generator", "seed", "global_batch", *_ORDER_KEYS}, "data")
        perm = None
        gen = choice(d["generator"], "data.generator", tuple(GENERATORS))
        seed = integer(d.get("seed", 0), "data.seed", 0, 2**32 - 1)
        _, need_in, need_out, losses = GENERATORS[gen]
        if need_in is not None and tuple(in_shape) != need_in:
            raise CaseError("model.input_shape", f"{list(need_in)} for data.generator {gen!r}", list(in_shape))
        if need_out is not None and tuple(out_shape) != need_out:
            raise CaseError("model.layers", f"an output of shape {list(need_out)} for data.generator {gen!r}; the model outputs {list(out_shape)}")
        if loss not in losses:
            raise CaseError("model.loss", f"one of {', '.join(losses)} for data.generator {gen!r}", loss)
        if gen == "blobs" and len(in_shape) != 1:
            raise CaseError("model.input_shape", "a 1-D input for data.generator 'blobs'", list(in_shape))
        if (gen == "tokens") != takes_tokens(model) or (gen == "tokens" and (len(in_shape) != 1 or len(out_shape) != 2)):
            raise CaseError("data.generator", "'tokens' exactly for a token model (model.layers[0] an embedding) with"
                            " input [T] and per-token logits [T, k]", gen)
        spec = {"generator": gen, "seed": seed, "global_batch": batch}
        x, y = generate_data(gen, seed, rows, in_shape, out_shape, loss,
                             vocab=model["layers"][0]["input_dim"] if gen == "tokens" else None)
    else:
        raise CaseError("data", 'either {"npz": FILE, "global_batch": B} or {"generator": NAME, "seed": S, "global_batch": B}', d)
    x = np.asarray(x)
    y = np.asarray(y)
    if x.ndim < 1 or tuple(x.shape[1:]) != tuple(in_shape):
        raise CaseError("data.x", f"shape [rows, {', '.join(map(str, in_shape))}] (rows first, then model.input_shape)".replace(", ]", "]"), f"shape {list(x.shape)}")
    want_y = (x.shape[0], *out_shape[:-1]) if loss == "softmax_ce" else (x.shape[0], *out_shape)
    if tuple(y.shape) != want_y:
        what = ("one integer label per row" + (" and token" if len(out_shape) > 1 else "") if loss == "softmax_ce"
                else "targets shaped like the model output")
        raise CaseError("data.y", f"shape {list(want_y)} ({what})", f"shape {list(y.shape)}")
    if x.shape[0] < rows:
        need_rows = f"steps x global_batch = {steps} x {batch} = {rows}" if order == "split" else f"data.rows = {rows}"
        raise CaseError("data.x", f"at least {need_rows} rows", f"{x.shape[0]} rows")
    x = token_ids(x[:rows], model) if takes_tokens(model) else _check_array(x[:rows], "data.x")
    if loss == "softmax_ce":
        y = _check_array(y[:rows], "data.y", integer=True)
        k = out_shape[-1]
        outside = ((y < 0) | (y >= k)) & (y != model.get("ignore_label", 0))
        if outside.any():
            bad = int(y[outside][0])
            also = f" or ignore_label {model['ignore_label']}" if "ignore_label" in model else ""
            raise CaseError("data.y", f"class labels in [0, {k}){also} for a {k}-way softmax_ce", bad)
    else:
        y = _check_array(y[:rows], "data.y")
        if loss == "sigmoid_ce" and y.size and (y.min() < 0 or y.max() > 1):
            raise CaseError("data.y", "labels in [0, 1] for sigmoid_ce", float(y.min() if y.min() < 0 else y.max()))
    if order != "split":  # carried only when not the default, so older cases keep their spec
        spec.update(order=order, rows=rows)
    return spec, x, y, _perm(perm, order, rows)


# ---------------------------------------------------------------- entry points


def _check_batch_norm_rows(model: dict, in_shape: tuple[int, ...], batch: int, devices: int, micro: int = 1) -> None:
    """Batch statistics need two values per channel on every device (torch refuses one; a variance of one value is 0).

    Nested batch norm (``3.body.1``) counts too, with its own input shape; with ``parallel.accumulate``
    (``micro`` micro-batches per shard) each micro-batch is a batch for batch norm."""
    rows = batch // devices // micro  # the smallest shard's micro-batch, in either shard order
    for path, layer, shape in nested_inputs(in_shape, model["layers"]):
        if layer["type"] != "batch_norm":
            continue
        per_channel = rows * int(np.prod(shape[:-1], dtype=np.int64))
        if per_channel < 2:
            where = f"model.layers[{path}]" if path.isdigit() else f"layer {path}"
            per = f"{devices} devices x 2" if micro == 1 else f"{devices} devices x {micro} micro-batches x 2"
            raise CaseError("data.global_batch", f"at least {2 * devices * micro} rows ({per}) so that "
                            f"batch norm ({where}) sees 2 values per channel on every device", batch)


def _check_sampler_batch_norm(model: dict, in_shape: tuple[int, ...], data: dict, devices: int, steps: int) -> None:
    """With distributed_sampler an epoch's last batch is smaller: batch norm needs 2 values there too."""
    batch, rows = data["global_batch"], data["rows"]
    per_epoch = -(-rows // batch)
    if steps < per_epoch:
        return
    rank_last = -(-rows // devices) - (per_epoch - 1) * (batch // devices)  # each rank's, padding included
    single_last = rows - (per_epoch - 1) * batch  # one device's, unpadded
    for last in (rank_last, single_last):
        try:
            _check_batch_norm_rows(model, in_shape, last, 1)
        except CaseError:
            raise CaseError("data.rows", f"a dataset length whose epoch ends in batches batch norm can use (the last"
                            f" step gives each of {devices} devices {rank_last} rows and one device {single_last};"
                            " batch norm needs 2 values per channel)", rows) from None


def _sample_weights(d: dict, base: Path | None, rows: int, model: dict, parallel: dict, data_spec: dict,
                    given: np.ndarray | None) -> np.ndarray | None:
    """``data.sample_weights``: one positive weight per example, or ``None``.

    ``true``: the array ``w`` of the data npz; ``{"seed": S, "low": 0.5, "high": 2.0}``:
    drawn in numpy, ``U[low, high)``. The loss weighs example i by ``w_i``; how a
    shard's weighted loss is normalised is the loss rule's (``docs/layers.md``):
    Keras divides by the number of examples, the torch idiom by the sum of the weights.
    """
    v = d.get("sample_weights")
    if v is None:
        return None
    path = "data.sample_weights"
    if data_spec.get("order", "split") != "split":
        raise CaseError(path, "none with data.order distributed_sampler (its padding repeats rows)", v)
    if parallel["combine"] not in ("grad_mean", "loss_mean"):
        raise CaseError(path, f"none with parallel.combine {parallel['combine']} (grad_mean and loss_mean take them)", v)
    if model.get("class_weights") is not None or model.get("label_smoothing", 0.0):
        raise CaseError(path, "none together with model.class_weights or model.label_smoothing (one weighting at a time)", v)
    if given is not None and d.get("arrays"):
        w = np.asarray(given)
    elif v is True:
        if "npz" not in d:
            raise CaseError(path, 'true only with "npz" data (the array "w"), or {"seed": S, "low": a, "high": b}', v)
        z = _load_npz(base, d["npz"], "data.npz")
        if "w" not in z:
            raise CaseError("data.npz['w']", f"an array named 'w' in {d['npz']} (data.sample_weights is true)")
        w = z["w"]
    elif isinstance(v, dict):
        no_extra(v, {"seed", "low", "high"}, path)
        seed = integer(v.get("seed", 0), f"{path}.seed", 0, 2**32 - 1)
        low = number(v.get("low", 0.5), f"{path}.low", lo=0.0, lo_open=True)
        high = number(v.get("high", 2.0), f"{path}.high", lo=low)
        w = np.random.default_rng(seed).uniform(low, high, size=rows)
    else:
        raise CaseError(path, 'true (the npz array "w") or {"seed": S, "low": a, "high": b}', v)
    w = _check_array(np.asarray(w), path)
    if w.shape[:1] != (w.shape[0],) or w.ndim != 1 or w.shape[0] < rows:
        raise CaseError(path, f"one weight per data row: shape [{rows}]", f"shape {list(w.shape)}")
    w = w[:rows]
    if np.any(w <= 0):
        raise CaseError(path, "positive weights", float(w[w <= 0][0]))
    return w


def case_from_dict(
    raw: Any,
    base_dir: str | os.PathLike | None = None,
    *,
    x: np.ndarray | None = None,
    y: np.ndarray | None = None,
    init: dict[str, np.ndarray] | None = None,
    perm: np.ndarray | None = None,
    w: np.ndarray | None = None,
) -> Case:
    """Validate a case given as a dictionary.

    Args:
        raw: the case, as parsed from JSON.
        base_dir: folder that relative npz paths are resolved against.
        x, y, init: arrays given directly, used when the case says
            ``"data": {"arrays": true, ...}`` / ``"init": {"arrays": true}``
            (how the hypothesis strategies build cases in memory).
        perm: with ``x``: the data's optional ``perm`` array (``data.order: distributed_sampler``).
        w: with ``x``: the per-example sample weights (``data.sample_weights``).
    Returns:
        a :class:`Case`.
    Raises:
        CaseError: naming the field, on any bad input.
    """
    raw = obj(raw, "case")
    no_extra(raw, _TOP_KEYS, "")
    schema = raw.get("schema", SCHEMA)
    if schema != SCHEMA:
        raise CaseError("schema", f"{SCHEMA!r}", schema)
    name = raw.get("name", "case")
    if not isinstance(name, str) or not name or len(name) > 200 or any(c in name for c in "/\\\0"):
        raise CaseError("name", "a short name without slashes", name)
    dtype = choice(raw.get("dtype", "float32"), "dtype", DTYPES)
    if is_external(need(raw, "model", "")):
        return _external_case(raw, name, dtype, base_dir, x, y, init, perm)
    model, in_shape, out_shape = validate_model(need(raw, "model", ""))
    parallel = validate_parallel(need(raw, "parallel", ""))
    check_combine_model(parallel, model["layers"], raw.get("data"))
    if parallel["weighting"] == "sum" and model["reduction"] != "sum":
        raise CaseError("parallel.weighting", "equal or by_size with model.reduction mean (sum adds the devices' losses:"
                        " with a mean reduction that is N times the mean)", "sum")
    if dtype == MIXED_BFLOAT16 and parallel["combine"] not in MIXED_COMBINES:
        raise CaseError("parallel.combine", f"{' or '.join(MIXED_COMBINES)} with dtype {MIXED_BFLOAT16}"
                                            " (mixed precision runs on the synchronous paths)", parallel["combine"])
    steps = integer(need(raw, "steps", ""), "steps", 1, 100_000)
    optimizer = validate_optimizer(need(raw, "optimizer", ""))
    seed = integer(raw.get("seed", 0), "seed", 0, 2**32 - 1)
    base = Path(base_dir) if base_dir is not None else None
    specs = param_specs(in_shape, model["layers"])
    check_no_decay(optimizer, [sp.name for sp in specs if sp.trainable])
    n_params = sum(int(np.prod(sp.shape)) for sp in specs)
    if n_params > MAX_PARAMETERS:
        raise CaseError("model.layers", f"at most {MAX_PARAMETERS:,} parameter values in all (this model has {n_params:,})")
    init_spec, init_arrays = _init(need(raw, "init", ""), base, specs, init)
    data_spec, xs, ys, perms = _data(need(raw, "data", ""), base, model, in_shape, out_shape, steps, parallel["devices"],
                                     (x, y, perm) if x is not None else None)
    check_accumulate(parallel, data_spec["global_batch"], data_spec.get("order", "split"))
    _check_batch_norm_rows(model, in_shape, data_spec["global_batch"], parallel["devices"], parallel.get("accumulate", 1))
    check_labelled(ys, model, data_spec, parallel, steps)
    facts = token_facts(xs, ys, model, data_spec, parallel, steps)
    if facts is not None:  # derived here every time (replace and write_case drop it), for theory
        data_spec[FACTS_KEY] = facts
    if per_token(model, out_shape) and need(raw, "data", "").get("sample_weights") is not None:
        raise CaseError("data.sample_weights", "none with a per-token softmax_ce (one weight per row, not per token)",
                        raw["data"]["sample_weights"])
    weights = _sample_weights(need(raw, "data", ""), base, len(xs), model, parallel, data_spec, w)
    if weights is not None:
        data_spec["sample_weights"] = raw["data"]["sample_weights"]
    if data_spec.get("order") == "distributed_sampler":
        # the padded list is dealt out like cards: rank r reads entries r, r+N, ... (strided)
        if need(raw, "parallel", "").get("shard", "strided") != "strided":
            raise CaseError("parallel.shard", "strided (or absent) with data.order distributed_sampler"
                                              " (DistributedSampler gives rank r the rows r, r+N, ...)", parallel["shard"])
        parallel["shard"] = "strided"
        _check_sampler_batch_norm(model, in_shape, data_spec, parallel["devices"], steps)
    spec = {
        "schema": SCHEMA,
        "name": name,
        "dtype": dtype,
        "model": model,
        "init": init_spec,
        "data": data_spec,
        "optimizer": optimizer,
        "parallel": parallel,
        "steps": steps,
        "seed": seed,
    }
    return Case(spec=spec, x=xs, y=ys, init=init_arrays, source=None, perm=perms, w=weights)


def _external_case(raw: dict, name: str, dtype: str, base_dir: Any, x: Any, y: Any, init: Any,
                   perm: Any = None) -> Case:
    """A case whose model lives in the plugins (``"model": {"external": ...}``, docs/plugins.md)."""
    model = validate_external_model(raw["model"])
    parallel = validate_parallel(need(raw, "parallel", ""))
    if parallel["combine"] not in ("grad_mean", "loss_mean"):
        raise CaseError("parallel.combine", "grad_mean or loss_mean for an external model", parallel["combine"])
    steps = integer(need(raw, "steps", ""), "steps", 1, 100_000)
    optimizer = validate_optimizer(need(raw, "optimizer", ""))
    seed = integer(raw.get("seed", 0), "seed", 0, 2**32 - 1)
    base = Path(base_dir) if base_dir is not None else None
    init_spec, init_arrays = _external_init(obj(need(raw, "init", ""), "init"), base, init)
    check_no_decay(optimizer, sorted(init_arrays))  # the plugins' own names (their non-trainable state too)
    data_spec, xs, ys, perms = _external_data(need(raw, "data", ""), base, steps, parallel["devices"],
                                              (x, y, perm) if x is not None else None)
    if data_spec.get("order") == "distributed_sampler":  # the padded list is dealt out like cards (strided)
        if need(raw, "parallel", "").get("shard", "strided") != "strided":
            raise CaseError("parallel.shard", "strided (or absent) with data.order distributed_sampler"
                                              " (DistributedSampler gives rank r the rows r, r+N, ...)", parallel["shard"])
        parallel["shard"] = "strided"
    model["input_shape"] = list(xs.shape[1:])  # from the data: the tool has no layer list to derive it
    spec = {"schema": SCHEMA, "name": name, "dtype": dtype, "model": model, "init": init_spec, "data": data_spec,
            "optimizer": optimizer, "parallel": parallel, "steps": steps, "seed": seed}
    return Case(spec=spec, x=xs, y=ys, init=init_arrays, source=None, perm=perms)


def load_case(path: str | os.PathLike) -> Case:
    """Load and validate ``case.json`` (npz paths relative to its folder)."""
    p = Path(path)
    if not p.is_file():
        raise CaseError("CASE", f"an existing case.json file; {p} does not exist")
    try:
        raw = json.loads(p.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise CaseError("CASE", f"a UTF-8 JSON file; {p} is not text") from None
    except json.JSONDecodeError as e:
        raise CaseError("CASE", f"valid JSON; {p.name} line {e.lineno} column {e.colno}: {e.msg}") from None
    case = case_from_dict(raw, p.parent)
    case.source = p
    return case


def write_case(case: Case, folder: str | os.PathLike, *, name: str | None = None) -> Path:
    """Write ``case.json`` with ``weights.npz`` and ``data.npz`` beside it (replayable anywhere).

    Files are written to temporary names and renamed into place, so a crash
    leaves no half-written case. Returns the path of ``case.json``.
    """
    from parity_tests.protocol.atomic import atomic_write_bytes, atomic_write_npz

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    spec = copy.deepcopy(case.spec)
    if name:
        spec["name"] = name
    spec["init"] = {"npz": "weights.npz"}
    spec["data"] = {"npz": "data.npz", **{k: case.spec["data"][k] for k in ("global_batch", *_ORDER_KEYS) if k in case.spec["data"]}}
    atomic_write_npz(out / "weights.npz", case.init)
    extra = {**({"perm": case.perm} if case.perm is not None else {}), **({"w": case.w} if case.w is not None else {})}
    if case.w is not None:
        spec["data"]["sample_weights"] = True  # the weights travel in data.npz
    atomic_write_npz(out / "data.npz", {"x": case.x, "y": case.y, **extra})
    atomic_write_bytes(out / "case.json", (json.dumps(spec, indent=2) + "\n").encode())
    return out / "case.json"
