"""Classic TensorFlow tower bugs, as plugins: a correct tower loop and its mutants.

:func:`reference` is a correct multi-tower training loop written the way a user
writes one (``tf.device`` per tower, a ``GradientTape`` per tower, the
gradients combined and applied once to variables every tower shares). It runs
the dense/batch-norm models of the mutation cases (``test_mutants.py``) in the
case's dtype with plain SGD, a constant or step learning-rate schedule,
``equal`` or ``by_size`` weighting, an optional global-norm clip after the
combine, and local batch norm (each tower normalises with its own shard; the
moving statistics kept are tower 0's, as DDP keeps rank 0's).

Every other plugin here is the same loop with one change (``bug=...``): a
mutant (a classic tower bug that the judge must detect) or a control (an
equivalent rewrite that the judge must accept). Each mutation point in
:func:`_towers` is marked with the name of the plugin that takes it.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

import tfpar

DTYPES = ("float32", "float64")


def _lr(spec: dict, t: int) -> float:
    """The learning rate of step ``t`` (1, 2, ...): constant, or a step schedule."""
    opt = spec["optimizer"]
    sched = opt.get("schedule", {"kind": "constant"})
    if sched["kind"] == "step":
        return sched["values"][sum(1 for b in sched["boundaries"] if b < t)]
    return opt["lr"]


def _forward(w: dict, x: np.ndarray, y: np.ndarray, layers: list, dt: tf.DType) -> tuple[tf.Tensor, dict]:
    """A shard's mean sigmoid cross-entropy, and each batch-norm layer's batch (mean, biased variance, count)."""
    h = tf.constant(x)
    stats = {}
    for i, layer in enumerate(layers):
        if layer["type"] == "dense":
            h = h @ w[f"{i}.kernel"]
            if layer.get("use_bias", True):
                h = h + w[f"{i}.bias"]
            act = layer.get("activation", "none")
            h = {"relu": tf.nn.relu, "tanh": tf.tanh, "sigmoid": tf.sigmoid}.get(act, lambda v: v)(h)
        elif layer["type"] == "batch_norm":
            mean = tf.reduce_mean(h, axis=0)
            var = tf.reduce_mean(tf.square(h - mean), axis=0)
            stats[i] = (mean, var, int(h.shape[0]))
            eps = tf.constant(layer["epsilon"], dt)
            h = (h - mean) / tf.sqrt(var + eps) * w[f"{i}.gamma"] + w[f"{i}.beta"]
        else:
            raise ValueError(f"layer type {layer['type']!r} is not in this plugin")
    return tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=tf.constant(y), logits=h)), stats


def _update_moving(state: dict, stats: dict, layers: list, dt: tf.DType) -> None:
    """``moving <- m moving + (1 - m) batch``; the variance unbiased under ``semantics: torch``."""
    for i, (mean, var, count) in stats.items():
        m = layers[i]["momentum"]
        if layers[i]["semantics"] == "torch":
            var = var * tf.constant(count / (count - 1), dt)
        mm, mv = state[f"{i}.moving_mean"], state[f"{i}.moving_variance"]
        mm.assign(tf.constant(m, dt) * mm + tf.constant(1.0 - m, dt) * mean)
        mv.assign(tf.constant(m, dt) * mv + tf.constant(1.0 - m, dt) * var)


def _clip(g: dict, c: float, dt: tf.DType) -> dict:
    """``tf.clip_by_global_norm``'s rule: scale by ``c / max(norm, c)``."""
    keys = sorted(g)
    clipped, _ = tf.clip_by_global_norm([g[k] for k in keys], tf.constant(c, dt))
    return dict(zip(keys, clipped, strict=True))


def _towers(run, bug: str | None = None) -> None:
    spec = run.spec
    dt = tf.float64 if run.dtype == "float64" else tf.float32
    layers = spec["model"]["layers"]
    par = spec["parallel"]
    n = len(run.devices)
    batch = spec["data"]["global_batch"]
    clip = par.get("clip")
    is_state = [k for k in run.initial if k.endswith(("moving_mean", "moving_variance"))]
    w = {k: tf.Variable(v) for k, v in run.initial.items() if k not in is_state}
    state = {k: tf.Variable(v) for k, v in run.initial.items() if k in is_state}
    copies = [w] * n
    if bug == "unshared_towers":  # every tower builds its own variables (no reuse): tower 0's are recorded
        copies = [w] + [{k: tf.Variable(v) for k, v in run.initial.items() if k not in is_state} for _ in range(n - 1)]
    run.begin(w, state)
    global_step = run.first_step - 1  # the case's count of updates before this run (lockstep: k - 1)
    for t, (x, y) in enumerate(run.batches(), start=run.first_step):
        lr = _lr(spec, global_step + 1)
        xs, ys = np.array_split(x, n), np.array_split(y, n)
        if par["weighting"] == "by_size" and bug != "equal_weights_uneven":
            weights = [len(xr) / batch for xr in xs]
        else:  # equal_weights_uneven: a plain mean over towers whatever the case says
            weights = [1.0 / n] * n
        grads, losses, tower_stats, raw = [], [], [], []
        if bug == "loss_mean":  # control: combine the losses, differentiate once
            with tf.GradientTape() as tape:
                for k, d in enumerate(run.devices):
                    with tf.device(d):
                        loss, stats = _forward(w, xs[k], ys[k], layers, dt)
                    losses.append(loss)
                    tower_stats.append(stats)
                total = tf.add_n([tf.constant(wk, dt) * lk for wk, lk in zip(weights, losses, strict=True)])
            g = tape.gradient(total, w)
        else:
            for k, d in enumerate(run.devices):
                vs = copies[k]
                with tf.device(d), tf.GradientTape() as tape:
                    loss, stats = _forward(vs, xs[k], ys[k], layers, dt)
                    objective = loss
                    if bug == "unscoped_loss_collection":  # tf.get_collection(LOSSES) without the tower's scope
                        for j in range(k):
                            objective = objective + _forward(vs, xs[j], ys[j], layers, dt)[0]
                gk = tape.gradient(objective, vs)
                raw.append(gk)  # the tower's gradient as its tape gave it, reported for localisation
                if clip is not None and bug == "clip_per_tower":  # clipped before the average, not after
                    gk = _clip(gk, clip["global_norm"], dt)
                grads.append(gk)
                losses.append(objective if bug == "unscoped_loss_collection" else loss)
                tower_stats.append(stats)
                if bug == "lr_schedule_per_tower":  # apply_gradients(global_step=...) in every tower
                    global_step += 1
            if bug == "grads_summed":
                g = {k: tf.add_n([gr[k] for gr in grads]) for k in w}
            elif bug == "extra_one_over_n":
                g = {k: tf.add_n([gr[k] for gr in grads]) / n / n for k in w}
            elif bug == "stacked_reduce_mean":  # control: the mean of a stacked tensor
                g = {k: tf.reduce_mean(tf.stack([gr[k] for gr in grads]), axis=0) for k in w}
            elif bug == "scaled_before_sum":  # control: each tower's gradient times 1/N, then summed
                g = {k: tf.add_n([gr[k] * tf.constant(1.0 / n, dt) for gr in grads]) for k in w}
            elif bug == "unshared_towers":  # each tower applies its own gradient to its own copy
                g = grads[0]
            elif par["weighting"] == "by_size" and bug != "equal_weights_uneven":
                g = {k: tf.add_n([tf.constant(wk, dt) * gr[k] for wk, gr in zip(weights, grads, strict=True)]) for k in w}
            else:
                g = {k: tf.add_n([gr[k] for gr in grads]) / n for k in w}
        if bug != "lr_schedule_per_tower":
            global_step += 1
        if clip is not None and bug != "clip_per_tower":
            g = _clip(g, clip["global_norm"], dt)
        applies = 2 if bug == "extra_update_on_log_steps" and t % 3 == 0 else 1  # the logging branch steps again
        for _ in range(applies):
            if bug == "unshared_towers":
                for vs, gr in zip(copies, grads, strict=True):
                    for k in vs:
                        vs[k].assign_sub(tf.constant(lr, dt) * gr[k])
            else:
                for k in w:
                    w[k].assign_sub(tf.constant(lr, dt) * g[k])
        if tower_stats and tower_stats[0]:
            if bug == "bn_stats_last_tower":
                _update_moving(state, tower_stats[-1], layers, dt)
            elif bug == "bn_stats_all_towers":  # every tower's UPDATE_OPS run, one after another
                for stats in tower_stats:
                    _update_moving(state, stats, layers, dt)
            elif bug != "bn_stats_none":  # bn_stats_none: the update ops never run
                _update_moving(state, tower_stats[0], layers, dt)
        if bug == "last_tower_loss":
            logged = losses[-1]
        else:
            logged = tf.add_n([tf.constant(wk, dt) * lk for wk, lk in zip(weights, losses, strict=True)])
        run.record(logged, w, grads=g, state=state, device_grads=raw or None, device_losses=losses, device_inputs=xs)


@tfpar.plugin.tensorflow(dtypes=DTYPES)
def reference(run):
    """Correct towers: shared variables, the (weighted) mean gradient applied once per step."""
    _towers(run)


# ------------------------------------------------------------------ mutants (must be detected)


@tfpar.plugin.tensorflow(dtypes=DTYPES)
def unshared_towers(run):
    """Each tower has its own copy of the variables and updates it with its own gradient; tower 0's is recorded."""
    _towers(run, "unshared_towers")


@tfpar.plugin.tensorflow(dtypes=DTYPES)
def grads_summed(run):
    """The towers' gradients are summed, not averaged."""
    _towers(run, "grads_summed")


@tfpar.plugin.tensorflow(dtypes=DTYPES)
def extra_one_over_n(run):
    """The average is divided by N once more (a loss already divided by N, then averaged)."""
    _towers(run, "extra_one_over_n")


@tfpar.plugin.tensorflow(dtypes=DTYPES)
def lr_schedule_per_tower(run):
    """The global step is incremented once per tower, so the schedule runs N times too fast."""
    _towers(run, "lr_schedule_per_tower")


@tfpar.plugin.tensorflow(dtypes=DTYPES)
def bn_stats_last_tower(run):
    """Batch-norm moving statistics from the last tower's shard instead of tower 0's."""
    _towers(run, "bn_stats_last_tower")


@tfpar.plugin.tensorflow(dtypes=DTYPES)
def bn_stats_all_towers(run):
    """Every tower's moving-statistics update runs (N updates per step)."""
    _towers(run, "bn_stats_all_towers")


@tfpar.plugin.tensorflow(dtypes=DTYPES)
def bn_stats_none(run):
    """The moving-statistics updates never run (UPDATE_OPS not attached to the train op)."""
    _towers(run, "bn_stats_none")


@tfpar.plugin.tensorflow(dtypes=DTYPES)
def equal_weights_uneven(run):
    """A plain mean over towers where the case asks for weights n_r/B (uneven shards)."""
    _towers(run, "equal_weights_uneven")


@tfpar.plugin.tensorflow(dtypes=DTYPES)
def clip_per_tower(run):
    """Each tower's gradient clipped to the global norm, then averaged (the case clips after the average)."""
    _towers(run, "clip_per_tower")


@tfpar.plugin.tensorflow(dtypes=DTYPES)
def unscoped_loss_collection(run):
    """Tower k's loss is the sum of the loss collection: towers 0..k's losses, not its own."""
    _towers(run, "unscoped_loss_collection")


@tfpar.plugin.tensorflow(dtypes=DTYPES)
def extra_update_on_log_steps(run):
    """Every third step (a logging step) applies the update twice."""
    _towers(run, "extra_update_on_log_steps")


@tfpar.plugin.tensorflow(dtypes=DTYPES)
def last_tower_loss(run):
    """The last tower's loss is reported as the step's loss (training itself is right)."""
    _towers(run, "last_tower_loss")


# ------------------------------------------------------------------ controls (must be accepted)


@tfpar.plugin.tensorflow(dtypes=DTYPES)
def loss_mean(run):
    """Control: the towers' losses averaged under one tape, differentiated once."""
    _towers(run, "loss_mean")


@tfpar.plugin.tensorflow(dtypes=DTYPES)
def stacked_reduce_mean(run):
    """Control: ``tf.reduce_mean(tf.stack(grads), axis=0)`` instead of ``add_n / N``."""
    _towers(run, "stacked_reduce_mean")


@tfpar.plugin.tensorflow(dtypes=DTYPES)
def scaled_before_sum(run):
    """Control: each tower's gradient times 1/N, then summed (exact: 1/N is a power of two at N = 4)."""
    _towers(run, "scaled_before_sum")
