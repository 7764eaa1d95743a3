"""``tf.mirrored``: the same synchronous step through ``tf.distribute.MirroredStrategy``.

A custom training loop as the ``tf.distribute`` guide writes it:

1. ``MirroredStrategy(devices=first N tower devices)``; on CPU devices its
   all-reduce is ``ReductionToOneDevice`` (sum on the first device, broadcast);
2. variables and the optimizer are created under ``strategy.scope()``
   (``MirroredVariable``: one copy per replica, kept identical);
3. ``experimental_distribute_values_from_function`` hands replica r exactly
   its shard of the global batch (contiguous or strided, rows in order; no
   ``tf.data`` in between, so nothing re-orders or re-batches rows);
4. replica r scales its loss with ``tf.nn.compute_average_loss``, differentiates
   it, and the optimizer's ``apply_gradients`` (inside ``strategy.run``) sums
   the replicas' gradients and updates every copy;
5. ``strategy.reduce(SUM)`` gives the step's loss.

Loss scaling and tower weights (``l_r``: replica r's mean loss over its
``n_r`` rows, ``B``: the global batch):

``by_size``
    ``compute_average_loss(per_example, global_batch_size=B)`` = ``(n_r/B) l_r``:
    the strategy's documented recipe, and its natural weighting.
``equal``
    ``compute_average_loss(per_example)`` with the default global batch size,
    ``n_r * N`` = ``l_r / N``: the classic tower programs' plain mean over towers (differs from
    ``by_size`` only for uneven shards).
``model.reduction: sum``
    per-replica ``l_r`` is a sum; it is scaled by the same weight (``1/N`` or
    ``n_r/B``) directly, as ``tf.towers`` weights it.

Loss options: the per-example losses carry Keras' label smoothing, class
weights (``cw[y_i]`` times the example's loss) and probability inputs; sample
weights multiply them, ``compute_average_loss(v * per_example, ...)`` =
``sum_i v_i l_i / B`` = ``(n_r/B)`` times Keras' ``sum_over_batch_size`` loss
of the shard. ``model.loss_semantics: torch`` (a weighted mean, ``sum v l /
sum v``, with no per-example form) scales the shard's loss by its weight
directly, as for ``sum``.

.. warning:: ``tf.nn.compute_average_loss(per_example, sample_weight=v)``
   casts the losses and the weights to float32 before multiplying them
   (``tensorflow/python/ops/losses/util.py``, ``scale_losses_by_sample_weight``,
   with a TODO saying so), even in a float64 run: about 1e-8 relative on the
   loss and its gradient. This runner multiplies by ``v`` itself, in the case
   dtype.

The all-reduce sums the gradients of the scaled losses, so the update is the
gradient of ``sum_r w_r l_r``: the same number for ``combine: grad_mean`` and
``loss_mean`` (a strategy has no separate "average the losses" program; in
exact arithmetic the two agree, and ``tf.towers`` shows they do in float64).

Batch norm and dropout: see :func:`replica_forward` (``local`` replica
statistics or ``sync`` all-reduced sums; the moving statistics are updated in
cross-replica context from replica 0's or the global statistics). Keep-masks
and sample weights are distributed by replica shard, like the rows.

``parallel.accumulate: k``: each replica cuts its shard into k contiguous micro-batches, scales
each micro-batch's loss as a global batch of ``B/k`` rows, and averages the k gradients (and
losses) before clipping and applying; batch-norm moving statistics are updated once per
micro-batch, in order. Keras' own ``gradient_accumulation_steps`` is not used: under this
strategy it raises (docs/framework-differences.md).

Optimizers: ``native`` uses Keras' own class, whose ``apply_gradients``
inside ``strategy.run`` all-reduces (SUM) and updates each copy;
``torch``/``tf`` semantics use the exact rules of :mod:`tfpar.optimizers`
applied once in cross-replica context to ``strategy.reduce(SUM)`` of the
replicas' gradients, every assignment to a ``MirroredVariable`` writing all
copies. (Both leave the copies bit-identical; :func:`run_mirrored` checks.)
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from parity_tests.protocol.recorder import Recorder
from parity_tests.protocol.specs import nested_inputs

from . import tokens
from .devices import DeviceError, tower_devices
from .losses import elementwise_loss, model_loss, sparse_softmax_ce
from .models import (
    apply_layer,
    build_variables,
    is_state,
    layer_device,
    layer_mask,
    needs_towers_fn,
    recording_activations,
    residual_output,
    update_moving,
)
from .optimizers import GradientClip, KerasOptimizer, make_clip, make_optimizer
from .refusals import (
    refuse_mirrored as check_supported,  # one place for every refusal (tfpar.refusals)
)
from .sharding import shard_sizes

__all__ = ["check_supported", "clip_scaled", "make_strategy", "per_example_loss", "replica_forward", "run_mirrored",
           "split_rows"]


def make_strategy(devices: list[str]) -> tf.distribute.MirroredStrategy:
    """A ``MirroredStrategy`` over ``devices`` whose all-reduce works on CPU devices too.

    ``ReductionToOneDevice`` sums on ``devices[0]`` and broadcasts the sum
    (NCCL, the GPU default, has no CPU kernels).
    """
    return tf.distribute.MirroredStrategy(
        devices=list(devices),
        cross_device_ops=tf.distribute.ReductionToOneDevice(reduce_to_device=devices[0]),
    )


def per_example_loss(loss: str, out: tf.Tensor, y: tf.Tensor, *, from_logits: bool = True,
                     label_smoothing: float = 0.0, class_weights: Sequence[float] | None = None) -> tf.Tensor:
    """One loss per example, ``[n]``, as Keras computes it: the mean over the example's elements.

    ``softmax_ce``: ``cw[y_i] * CE(t_i, p_i)`` with ``t = (1 - s) onehot(y) + s/k``
    (``CategoricalCrossentropy(reduction=None)``); ``sigmoid_ce``: labels
    smoothed to ``y (1 - s) + s/2``, from logits or probabilities
    (``keras.ops.binary_crossentropy``). The mean of these over a shard is
    :func:`tfpar.losses.device_loss` with ``mean`` reduction and Keras'
    semantics (``sum_over_batch_size``).
    """
    if loss == "softmax_ce":
        if not label_smoothing and class_weights is None:
            return sparse_softmax_ce(y, out)
        k = int(out.shape[-1])
        per = keras.losses.CategoricalCrossentropy(from_logits=True, label_smoothing=label_smoothing,
                                                   reduction=None, dtype=out.dtype.name)(tf.one_hot(y, k, dtype=out.dtype), out)
        return per if class_weights is None else per * tf.gather(tf.constant(list(class_weights), out.dtype), y)
    per = elementwise_loss(loss, out, y, from_logits=from_logits, label_smoothing=label_smoothing)
    return tf.reduce_mean(per, axis=list(range(1, per.shape.rank))) if per.shape.rank > 1 else per


def clip_scaled(grads: list[tf.Tensor], w: tf.Tensor, clip: GradientClip) -> list[tf.Tensor]:
    """Per-device clipping of a replica's gradient of its *scaled* loss ``w l_r``.

    ``grads`` are ``w g_r``; the result is ``w clip(g_r)``: the rule's
    coefficient is computed from the unscaled norm ``|g_r| = |w g_r| / w``,
    so the threshold means what it means on ``tf.towers`` and ``torch.ddp``.

    .. warning:: Keras' own ``global_clipnorm`` under ``MirroredStrategy``
       clips ``w g_r`` itself, in the replica, before the all-reduce
       (``BaseOptimizer._backend_apply_gradients`` clips, then
       ``_backend_update_step`` sums): per-device clipping at ``c / w``, i.e.
       ``N c`` with equal weights, not the clipping of the combined gradient.
    """
    dtype = grads[0].dtype
    if clip.semantics == "torch":  # torch's norm is of the dense gradient (an embedding's duplicates summed)
        grads = tokens.densify(grads)
    norm = tf.linalg.global_norm(grads) / w  # of an IndexedSlices: over its slices, as tf.clip_by_global_norm
    c = tf.constant(clip.global_norm, dtype)
    if clip.semantics == "torch":
        coef = tf.minimum(c / (norm + tf.constant(1e-6, dtype)), tf.constant(1.0, dtype))
    else:  # tf.clip_by_global_norm's arithmetic
        coef = c * tf.minimum(1.0 / norm, 1.0 / c)
    return [tokens.scaled(g, coef) for g in grads]


def split_rows(a: np.ndarray, n: int, shard: str) -> list[np.ndarray]:
    """Replica shards of a global batch, rows in order: ``np.array_split`` or rows r, r+N, ..."""
    if shard == "contiguous":
        return np.split(a, np.cumsum(shard_sizes(len(a), n, shard))[:-1])
    return [a[r::n] for r in range(n)]



def replica_forward(layers: list[dict], params: Mapping[str, tf.Tensor], x: tf.Tensor, *,
                    masks: Mapping[str, tf.Tensor], batch_norm: str,
                    stats: dict[str, tuple[tf.Tensor, tf.Tensor, int]],
                    acts: dict[str, tf.Tensor] | None = None) -> tf.Tensor:
    """One replica's forward pass (inside ``strategy.run``), ``[n_r, ...] -> [n_r, *output_shape]``.

    A ``batch_norm`` layer normalises with its replica's own statistics
    (``local``: ``tf.nn.moments``) or with the whole global batch's (``sync``:
    ``ReplicaContext.all_reduce(SUM)`` of ``sum x``, ``sum x^2`` and the count,
    as Keras' ``SyncBatchNormalization`` does; ``mu = S/n``, ``var = max(Q/n - mu^2, 0)``; under the
    layer's ``semantics: torch``, each replica's ``tf.nn.moments`` merged with the counts, as torch's
    ``SyncBatchNorm`` does: ``mu = sum n_r m_r / n``, ``var = sum n_r (v_r + (m_r - mu)^2) / n``).
    The all-reduce is differentiable: its gradient is the all-reduce of the
    upstream gradients, so a replica's gradient is its share of the gradient of
    every replica's loss (torch ``SyncBatchNorm``'s, not ``tf.towers``' own-loss
    gradient). ``stats[path]`` receives the layer's ``(mean, var, values per channel)``
    for the moving-statistics update, which the caller applies in cross-replica
    context; a residual or repeat holding batch norm or dropout is walked layer by layer,
    its inner layers keyed by path (``3.body.1``). ``masks`` maps a dropout layer's path (str) to its
    keep-mask. ``acts``, when given, receives every layer's output ``[n_r, ...]`` under its path (the
    index ``"3"`` at the top level, ``"3.body.1"`` inside a ``residual`` or ``repeat``): the capture
    step's ``forward`` stage.
    """
    def run(path: str, layer: dict, h: tf.Tensor) -> tf.Tensor:
        out = step(path, layer, h)
        if acts is not None:
            acts[path] = out
        return out

    def step(path: str, layer: dict, h: tf.Tensor) -> tf.Tensor:
        if layer["type"] in ("residual", "repeat") and needs_towers_fn([layer]):  # batch norm or dropout inside
            place = layer_device(layer)
            with tf.device(place) if place else contextlib.nullcontext():
                if layer["type"] == "repeat":
                    for r in range(layer["count"]):
                        for j, inner in enumerate(layer["body"]):
                            h = run(f"{path}.{r}.{j}", inner, h)
                    return h
                body, short = h, h
                for j, inner in enumerate(layer["body"]):
                    body = run(f"{path}.body.{j}", inner, body)
                for j, inner in enumerate(layer["shortcut"]):
                    short = run(f"{path}.shortcut.{j}", inner, short)
                return residual_output(layer, body, short)
        if layer["type"] != "batch_norm":
            with recording_activations() if acts is not None else contextlib.nullcontext([]) as nested:
                h = apply_layer(path, layer, params, h, layer_mask(masks, path, layer))
            if acts is not None:  # layers inside a residual / repeat without batch norm, by path
                acts.update({str(inner): hs[0] for inner, hs in nested})
            return h
        place = layer_device(layer)
        with tf.device(place) if place else contextlib.nullcontext():
            axes = list(range(h.shape.rank - 1))
            count = math.prod(h.shape[:-1])
            if batch_norm == "sync" and layer["semantics"] == "torch":  # SyncBatchNorm's merge with counts
                ctx = tf.distribute.get_replica_context()
                m_r, v_r = tf.nn.moments(h, axes)
                n_r = tf.constant(float(count), h.dtype)
                s1, c = ctx.all_reduce(tf.distribute.ReduceOp.SUM, [m_r * n_r, n_r])
                mean = s1 / c
                var = ctx.all_reduce(tf.distribute.ReduceOp.SUM, (v_r + tf.square(m_r - mean)) * n_r) / c
            elif batch_norm == "sync":
                ctx = tf.distribute.get_replica_context()
                s1, s2, c = ctx.all_reduce(tf.distribute.ReduceOp.SUM, [
                    tf.reduce_sum(h, axes), tf.reduce_sum(tf.square(h), axes), tf.constant(float(count), h.dtype)])
                mean = s1 / c
                var = tf.maximum(s2 / c - tf.square(mean), 0.0)
            else:
                mean, var = tf.nn.moments(h, axes)
            stats[path] = (mean, var, math.prod(h.shape[1:-1]))  # values per channel per example
            return tf.nn.batch_normalization(h, mean, var, offset=params[f"{path}.beta"], scale=params[f"{path}.gamma"],
                                             variance_epsilon=layer["epsilon"])

    h = x
    for i, layer in enumerate(layers):
        h = run(str(i), layer, h)
    return h


def _across_workers(strategy: tf.distribute.Strategy) -> bool:
    """Whether ``strategy``'s replicas live in several processes (``MultiWorkerMirroredStrategy``
    with a cluster): then a worker holds only its own replicas' copies, and reading "replica 0"
    or checking that every copy agrees takes a collective (``strategy.gather``)."""
    return strategy.num_replicas_in_sync > len(strategy.extended.worker_devices)


def _gather_copies(strategy: tf.distribute.Strategy, variables: list[tf.Variable]) -> Callable[[], list[tf.Tensor]]:
    """A function returning, per variable, every replica's copy flattened: ``[replicas, size]``
    (global replica order: worker 0's replicas first), the same on every worker."""

    @tf.function(autograph=False)
    def gather() -> list[tf.Tensor]:
        per = strategy.run(lambda: [tf.reshape(tf.identity(v), [1, -1]) for v in variables])
        return [strategy.gather(p, axis=0) for p in per]

    return gather


def run_mirrored(payload: Mapping[str, Any], *, progress: Callable[[int], None] | None = None,
                 strategy: tf.distribute.Strategy | None = None) -> dict[str, np.ndarray]:
    """Run a validated case through ``MirroredStrategy`` and record its trajectory.

    Args:
        payload: ``{"spec": dict, "x": [rows, ...], "y": [rows, ...], "init": {name: array}}``
            (plus ``masks`` and ``w`` for dropout and sample weights).
        progress: called with the number of steps done.
        strategy: the strategy to run under (default: :func:`make_strategy` over the first
            N tower devices). ``tf.multiworker`` passes a ``MultiWorkerMirroredStrategy``
            (:mod:`tfpar.multiworker`) whose ``num_replicas_in_sync`` is N: the same loop,
            every process holding its own replicas; replica r (global) gets shard r.
    Returns:
        ``{"loss": [steps], "param/<name>": [steps+1, ...], "grad/<name>": [steps, ...]}``
        and ``state/<name>`` ``[steps+1, ...]`` for batch-norm moving statistics;
        ``grad`` is the strategy's sum of the replicas' scaled gradients (what was applied).
        With ``payload["capture"] = k`` (one process's strategy), also step k's per-replica values
        ``device/...`` under ``tfpar.TowerTrainer.step``'s keys (:func:`_flat_capture`): a second
        trace of the step reads them with ``strategy.experimental_local_results``.
    Raises:
        DeviceError: ``parallel.devices`` exceeds the configured devices.
        ValueError: a case feature this runner does not implement (:func:`check_supported`).
    """
    spec = payload["spec"]
    check_supported(spec)
    dtype = tf.float64 if spec["dtype"] == "float64" else tf.float32
    np_dtype = np.float64 if spec["dtype"] == "float64" else np.float32
    model, par, batch = spec["model"], spec["parallel"], spec["data"]["global_batch"]
    n = par["devices"]
    bn_mode = par.get("batch_norm", "local")
    accumulate = par.get("accumulate", 1)  # micro-batches per step (k)
    if strategy is None:
        devices = tower_devices(n)
        strategy = make_strategy(devices)
    else:
        devices = list(strategy.extended.worker_devices)  # this process's replicas' devices
        if strategy.num_replicas_in_sync != n:
            raise DeviceError(f"parallel.devices is {n}, but the strategy has {strategy.num_replicas_in_sync} replicas")
    across = _across_workers(strategy)
    with strategy.scope():
        variables = build_variables(payload["init"], dtype, device=devices[0])
        names = [k for k in variables if not is_state(k)]
        var_list = [variables[k] for k in names]
        state = {k: v for k, v in variables.items() if is_state(k)}
        optimizer = make_optimizer(spec["optimizer"], names)
        optimizer.build(var_list)
    native = isinstance(optimizer, KerasOptimizer)
    sizes = shard_sizes(batch, n, par["shard"])
    weights = ([1.0 / n] * n if par["weighting"] == "equal" else [1.0] * n if par["weighting"] == "sum"
               else [s / batch for s in sizes])
    clip = make_clip(spec)
    per_device = clip is not None and clip.where == "per_device"
    # Keras applies (and all-reduces) inside the replica unless the combined gradient must be clipped first
    apply_in_replica = native and (clip is None or per_device)
    layers = model["layers"]
    bn_layers = {path: layer for path, layer, _ in nested_inputs(model["input_shape"], layers)
                 if layer["type"] == "batch_norm"}

    def scaled_loss(out: tf.Tensor, y: tf.Tensor, v: tf.Tensor | None) -> tf.Tensor:
        positions = 1  # per-token softmax_ce: every position of an example is one term of the mean
        if out.shape.rank > 2 and model["loss"] == "softmax_ce" and model.get("ignore_label") is None:
            positions = math.prod(out.shape[1:-1])
            out, y = tokens.flatten_tokens(out, y)
        if (model["reduction"] == "mean" and model.get("loss_semantics", "native") != "torch"
                and out.shape.rank == 2 and model.get("ignore_label") is None):
            per = per_example_loss(model["loss"], out, y, from_logits=model.get("from_logits", True),
                                   label_smoothing=model.get("label_smoothing", 0.0),
                                   class_weights=model.get("class_weights"))
            if v is not None:
                # weighted here, in the case dtype: compute_average_loss(sample_weight=v) would
                # round every weighted loss to float32 (see the module docstring)
                per = per * tf.cast(v, per.dtype)
            if par["weighting"] == "by_size":
                # a micro-batch's rows, each with its positions (per-token softmax_ce)
                return tf.nn.compute_average_loss(per, global_batch_size=(batch // accumulate) * positions)
            return tf.nn.compute_average_loss(per)  # default: n_r * N, i.e. l_r / N
        # a sum (compute_average_loss divides a sum), torch's loss formula (a weighted mean has no
        # per-example form), or a mean over labelled positions (ignore_label; tfpar.tokens writes Keras'
        # formula out: the Keras class inside a replica divides by the replicas too): weight the shard's loss
        r = tf.distribute.get_replica_context().replica_id_in_sync_group
        w = tf.gather(tf.constant(weights, dtype=out.dtype), r)
        return w * model_loss(model, out, y, sample_weight=v)

    def replica_step(x: tf.Tensor, y: tf.Tensor, extras: dict[str, tf.Tensor],
                     capture: bool = False) -> tuple[Any, ...]:
        # parallel.accumulate: k contiguous micro-batches of the replica's shard, each scaled as a global
        # batch of B/k rows, their losses and gradients averaged (k = 1: the shard itself)
        if accumulate == 1:
            micro = [(x, y, extras)]
        else:
            parts = {key: tf.split(e, accumulate) for key, e in extras.items()}
            micro = [(x_j, y_j, {key: p[j] for key, p in parts.items()})
                     for j, (x_j, y_j) in enumerate(zip(tf.split(x, accumulate), tf.split(y, accumulate), strict=True))]
        losses, micro_grads, stats_by_micro, micro_acts = [], [], [], []
        for x_j, y_j, extras_j in micro:
            stats: dict[str, tuple[tf.Tensor, tf.Tensor, int]] = {}
            acts: dict[str, tf.Tensor] | None = {} if capture else None
            with tf.GradientTape() as tape:
                out = replica_forward(layers, dict(zip(names, var_list, strict=True)), x_j,
                                      masks={key: m for key, m in extras_j.items() if key != "w"}, batch_norm=bn_mode,
                                      stats=stats, acts=acts)
                losses.append(scaled_loss(out, y_j, extras_j.get("w")))
            micro_grads.append(tape.gradient(losses[-1], var_list))
            stats_by_micro.append(stats)
            micro_acts.append(acts)
        loss = losses[0] if accumulate == 1 else tf.add_n(losses) / accumulate
        grads = (micro_grads[0] if accumulate == 1 else
                 [tf.add_n(list(g)) / accumulate for g in zip(*micro_grads, strict=True)])
        acts = micro_acts[0] if accumulate == 1 or not capture else {
            i: tf.concat([a[i] for a in micro_acts], 0) for i in micro_acts[0]}
        r = tf.distribute.get_replica_context().replica_id_in_sync_group
        w = tf.gather(tf.constant(weights, dtype=grads[0].dtype), r)
        cap: dict[str, Any] = {}
        if capture:
            # the replica differentiated its scaled loss w_r l_r; divided by w_r (what DDP's capture
            # hook does with N w_r) it records l_r and d l_r / d param, as tf.towers' towers do
            cap = {"x": x, "loss": loss / w, "grad": [tf.convert_to_tensor(g) / w for g in grads], "act": acts}
        if per_device:
            grads = clip_scaled(grads, w, clip)
            if capture:
                cap["clipped"] = [g / w for g in grads]
        if apply_in_replica:
            optimizer.apply(grads, var_list)  # Keras all-reduces (SUM) and updates every copy
        # static shapes, recorded while tracing: values per channel per example of each BN layer
        per_example.update({i: c for i, (_, _, c) in stats_by_micro[0].items()})
        return loss, grads, [{path: (mean, var) for path, (mean, var, _) in st.items()} for st in stats_by_micro], cap

    per_example: dict[str, int] = {}

    def first_replica(t: Any) -> tf.Tensor:
        # replica 0's value of a per-replica [C] tensor; across workers it lives in worker 0, so
        # every worker gathers ([replicas * C], replica order) and takes the first C
        local = strategy.experimental_local_results(t)[0]
        return strategy.gather(t, axis=0)[: local.shape[0]] if across else local

    def step_impl(x: Any, y: Any, extras: dict[str, Any], capture: bool) -> tuple[tf.Tensor, list[tf.Tensor], dict]:
        loss, local_grads, moments, cap = strategy.run(replica_step, args=(x, y, extras), kwargs={"capture": capture})
        total = strategy.reduce(tf.distribute.ReduceOp.SUM, loss, axis=None)
        # the strategy's sum of the replicas' gradients: what Keras' all-reduce
        # applied (native), or what the exact rule applies here
        grads = [strategy.reduce(tf.distribute.ReduceOp.SUM, g, axis=None) for g in local_grads]
        out: dict[str, Any] = {}
        if capture:  # every replica's values, in replica order (experimental_local_results)
            local = strategy.experimental_local_results
            out = {"x": tf.concat(local(cap["x"]), 0), "loss": tf.stack(local(cap["loss"])),
                   "act": {i: tf.concat(local(h), 0) for i, h in cap["act"].items()},
                   "grad": [tf.stack(local(g)) for g in cap["grad"]], "combined": list(grads)}
            if "clipped" in cap:
                out["clipped"] = [tf.stack(local(g)) for g in cap["clipped"]]
        if clip is not None and not per_device:
            grads = clip(grads)  # torch's order: clip what the all-reduce produced
        if not apply_in_replica:
            # cross-replica context: each assignment to a MirroredVariable
            # (parameters, slots, step count) writes the same value to every copy;
            # a Keras optimizer called here finds no replica context and does not
            # all-reduce again (keras/src/backend/tensorflow/optimizer.py)
            optimizer.apply(grads, var_list)
        for micro_moments in moments:  # once per micro-batch, in order (parallel.accumulate)
            for i, layer in bn_layers.items():
                # the moving statistics: the global batch's (sync), or replica 0's (local: what
                # DDP keeps, broadcasting rank 0's buffers), written to every copy
                mean, var = (first_replica(t) for t in micro_moments[i])
                rows = batch if bn_mode == "sync" else sizes[0]
                update_moving(state, i, layer, mean, var, rows // accumulate * per_example[i])
        return total, grads, out

    step = tf.function(lambda x, y, extras: step_impl(x, y, extras, False)[:2], autograph=False)
    # a second trace, used for the one captured step (docs/localisation.md stages), as TowerTrainer does
    capture_step = tf.function(lambda x, y, extras: step_impl(x, y, extras, True), autograph=False)

    x_all = tokens.inputs(payload["x"], np_dtype)  # token ids stay int64
    y_all = payload["y"]
    y_all = y_all.astype(np.int64) if model["loss"] == "softmax_ce" else np.asarray(y_all, np_dtype)
    by_row = {k: np.asarray(m) for k, m in (payload.get("masks") or {}).items()}  # dropout keep-masks
    if payload.get("w") is not None:
        by_row["w"] = np.asarray(payload["w"], np_dtype)  # sample weights

    def distribute(a: np.ndarray) -> Any:
        parts = split_rows(a, n, par["shard"])
        return strategy.experimental_distribute_values_from_function(
            lambda ctx: tf.constant(parts[ctx.replica_id_in_sync_group]))

    def read(items: list[tuple[str, tf.Variable]]) -> list[np.ndarray]:
        # every copy must agree; record the first, check the rest
        out = []
        for k, v in items:
            copies = [c.numpy() for c in strategy.experimental_local_results(v)]
            # equal_nan: copies that all hold the same NaN agree (the judge reports the NaN itself)
            if any(not np.array_equal(copies[0], c, equal_nan=True) for c in copies[1:]):
                raise RuntimeError(f"the replicas' copies of {k} differ")
            out.append(copies[0])
        return out

    held = [(k, v) for k, v in zip(names, var_list, strict=True)] + list(state.items())
    gather_all = _gather_copies(strategy, [v for _, v in held]) if across else None

    def agree(step_done: int) -> None:
        # across workers: every replica's copy, gathered, must equal replica 0's bit for bit
        # (every worker runs this collective, in the same order, and reaches the same verdict)
        if gather_all is None:
            return
        for (k, _), rows in zip(held, gather_all(), strict=True):
            bits = rows.numpy().view(np.uint8).reshape(rows.shape[0], -1)
            bad = [r for r in range(1, len(bits)) if not np.array_equal(bits[0], bits[r])]
            if bad:
                raise RuntimeError(f"replicas diverged at step {step_done}: replica {bad[0]}, parameter {k}")

    params = list(zip(names, var_list, strict=True))
    agree(0)
    rec = Recorder(dict(zip(names, read(params), strict=True)),
                   dict(zip(state, read(list(state.items())), strict=True)))  # rows spill when large
    # across workers a process holds only its own replicas' values: no capture there (tf.multiworker)
    capture = None if across else payload.get("capture")
    captured: dict[str, np.ndarray] = {}
    for k in range(spec["steps"]):
        rows = slice(k * batch, (k + 1) * batch)
        extras = {key: distribute(a[rows]) for key, a in by_row.items()}
        if capture == k + 1:
            loss, grads, cap = capture_step(distribute(x_all[rows]), distribute(y_all[rows]), extras)
            captured = _flat_capture(cap, names, sizes, k + 1)
        else:
            loss, grads = step(distribute(x_all[rows]), distribute(y_all[rows]), extras)
        rec.loss(loss.numpy())
        for name, g, val in zip(names, grads, read(params), strict=True):
            rec.grad(name, tf.convert_to_tensor(g).numpy())  # an embedding's IndexedSlices: its sum
            rec.param(name, val)
        rec.states(zip(state, read(list(state.items())), strict=True))
        agree(k + 1)
        if progress:
            progress(k + 1)
    rec.add(captured)
    return rec.finish()


def _flat_capture(cap: Mapping[str, Any], names: list[str], sizes: list[int], step: int) -> dict[str, np.ndarray]:
    """A captured step's values as the ``device/...`` arrays of ``tfpar.TowerTrainer.step`` (same keys and shapes).

    ``x`` ``[B, ...]`` (replica shards concatenated in replica order), ``sizes`` ``[N]``,
    ``loss`` ``[N]`` (``l_r``), ``act/<layer>`` ``[B, ...]``, ``grad/<name>`` ``[N, ...]``
    (``d l_r / d param``), ``clipped/<name>`` ``[N, ...]`` (per-device clipping),
    ``combined/<name>`` (the all-reduced gradient before clipping after it), ``step``.
    """
    out = {"x": cap["x"].numpy(), "sizes": np.asarray(sizes, np.int64), "loss": cap["loss"].numpy()}
    out.update({f"act/{i}": h.numpy() for i, h in cap["act"].items()})
    for key in ("grad", "clipped", "combined"):
        if key in cap:
            out.update({f"{key}/{k}": g.numpy() for k, g in zip(names, cap[key], strict=True)})
    out["step"] = np.asarray(step)
    return {f"device/{k}": v for k, v in out.items()}
