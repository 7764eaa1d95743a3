"""TensorFlow tower loops for the error-rate hunt: equivalent rewrites and seeded bugs.

One loop, :func:`_train`, written the way a user writes tower code: one
``tf.device`` and one ``GradientTape`` per tower, variables every tower shares,
the gradients combined and applied once. It honours the case it is given, within
:data:`parity_tests.tests.hunt.corpus.TF_SUPPORTS`:

* dense layers (``none``/``relu``/``tanh``/``sigmoid``, with or without bias);
  ``mse``, ``sigmoid_ce`` (from logits) or ``softmax_ce`` (integer labels),
  ``reduction`` ``mean`` (over every element of a tower's shard) or ``sum``;
* ``float32`` or ``float64`` end to end (hyperparameters as constants of the dtype);
* ``sgd``, ``momentum`` or ``adam`` under ``semantics`` ``tf``/``native`` (Keras'
  published rules) or ``torch`` (torch's), written out in TensorFlow ops::

      momentum, Keras:  v <- m v - lr g;              p <- p + v
      momentum, torch:  b <- m b + g (b_1 = g);       p <- p - lr b
      adam, Keras:      p <- p - lr sqrt(1-b2^t)/(1-b1^t) m / (sqrt(v) + eps)
      adam, torch:      p <- p - lr/(1-b1^t) m / (sqrt(v)/sqrt(1-b2^t) + eps)

  (``m``, ``v`` the usual moving averages). Warning: the Adam rules differ
  whenever ``eps > 0``; momentum's agree for a constant rate only (Keras' buffer
  holds ``lr``, torch's does not);
* a constant rate or the contract's ``warmup_cosine`` schedule: the written-out rules
  read the contract's formula (:func:`curve`), step ``t`` at ``f(t)``, under every
  semantics (a rule written by hand has its own schedule: Keras' is a Keras
  optimizer's); :func:`keras_model` gives its Keras optimizer Keras' own
  ``CosineDecay(0.0, d, alpha=m / lr, warmup_target=lr, warmup_steps=k)``, which
  reads the updates already applied: step ``t`` at ``f(t - 1)``, in float32
  (docs/framework-differences.md, "Warm-up + cosine"). Warning: with a rate that
  changes, Keras' momentum (``v`` holds ``lr``) and torch's differ;
* N towers (``run.devices``), ``shard`` ``contiguous`` (``np.array_split``) or
  ``strided`` (rows r, r+N, ...), ``weighting`` ``equal`` (1/N) or ``by_size``
  (``n_r / B``), ``combine`` ``grad_mean`` or ``loss_mean`` (the same function:
  the derivative is linear);
* a global-norm clip ``after_combine`` or ``per_device`` (each tower's gradient
  before the combine), by the semantics' rule: TensorFlow's ``g c / max(n, c)``,
  torch's ``g min(c / (n + 1e-6), 1)``.

The rewrites (parity by construction) are :func:`add_n` (``tf.add_n`` of the
weighted gradients), :func:`stack_mean` (``tf.reduce_mean(tf.stack(...), 0)``),
:func:`concat_loss` (the towers' per-element losses concatenated, one mean, one
gradient), :func:`keras_model` (a Keras ``Sequential`` and a Keras optimizer:
``semantics: native`` only), :func:`add_n_nograds` (records no ``grads=``) and
:func:`add_n_f32` (declares float32 only: judged by the perturbation floor). Every
other plugin is :func:`add_n` with one seeded bug, marked in :func:`_train` with its
name; :data:`parity_tests.tests.hunt.corpus.BUGS` says when each one changes what
is computed.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

import tfpar
from parity_tests.tests.hunt.schedule import curve, drawn

__all__ = ["curve", "keras_cosine", "keras_load", "keras_optimizer", "shards"]

DTYPES = ("float32", "float64")
_ACT = {"relu": tf.nn.relu, "tanh": tf.tanh, "sigmoid": tf.sigmoid}


def shards(batch: int, n: int, how: str) -> list[np.ndarray]:
    """Each tower's row indices in a global batch of ``batch`` rows (``contiguous`` or ``strided``)."""
    if how == "strided":
        return [np.arange(r, batch, n) for r in range(n)]
    return np.array_split(np.arange(batch), n)


def keras_cosine(schedule: dict, lr: float):
    """Keras' own ``CosineDecay`` for the contract's ``warmup_cosine`` (``alpha`` is a fraction of the target)."""
    import keras

    return keras.optimizers.schedules.CosineDecay(0.0, schedule["decay_steps"], alpha=schedule["min_lr"] / lr,
                                                  warmup_target=lr, warmup_steps=schedule["warmup_steps"])


def _forward(w: dict, x: tf.Tensor, layers: list, bug: str | None) -> tf.Tensor:
    h = x
    for i, layer in enumerate(layers):
        h = h @ w[f"{i}.kernel"]
        if layer.get("use_bias", True):
            h = h + w[f"{i}.bias"]
        act = layer.get("activation", "none")
        if bug == "missing_activation" and i == 0:  # the first layer's activation forgotten
            act = "none"
        h = _ACT.get(act, lambda v: v)(h)
    return h


def _elements(logits: tf.Tensor, y: np.ndarray, loss: str, dt: tf.DType) -> tf.Tensor:
    """The per-element losses ``[n, k]`` (``[n]`` for softmax_ce): what a shard's mean or sum runs over."""
    if loss == "softmax_ce":
        return tf.nn.sparse_softmax_cross_entropy_with_logits(labels=tf.constant(y), logits=logits)
    yt = tf.constant(y, dt)
    if loss == "sigmoid_ce":
        return tf.nn.sigmoid_cross_entropy_with_logits(labels=yt, logits=logits)
    return tf.square(logits - yt)


def _reduce(e: tf.Tensor, reduction: str) -> tf.Tensor:
    return tf.reduce_sum(e) if reduction == "sum" else tf.reduce_mean(e)


def _clip(g: dict, c: float, rule: str, dt: tf.DType) -> dict:
    """Global-norm clip of ``g`` by ``rule``: ``tf`` (``tf.clip_by_global_norm``) or ``torch`` (``clip_grad_norm_``)."""
    keys = sorted(g)
    if rule == "tf":
        clipped, _ = tf.clip_by_global_norm([g[k] for k in keys], tf.constant(c, dt))
        return dict(zip(keys, clipped, strict=True))
    norm = tf.sqrt(tf.add_n([tf.reduce_sum(g[k] * g[k]) for k in keys]))
    scale = tf.minimum(tf.constant(c, dt) / (norm + tf.constant(1e-6, dt)), tf.constant(1.0, dt))
    return {k: g[k] * scale for k in keys}


class _Rule:
    """The case's optimizer, written out (module docstring); ``bug`` may drop Adam's bias correction."""

    def __init__(self, opt: dict, rule: str, dt: tf.DType, w: dict, bug: str | None) -> None:
        self.opt, self.rule, self.dt, self.bug = opt, rule, dt, bug
        self.slots = {k: (tf.Variable(tf.zeros_like(v)), tf.Variable(tf.zeros_like(v))) for k, v in w.items()}
        self.t = 0
        self.schedule = drawn(opt)

    def rate(self) -> float:
        """Step ``self.t``'s learning rate: ``lr``, or the contract's ``warmup_cosine`` curve ``f(t)``."""
        return self.opt["lr"] if self.schedule is None else curve(self.schedule, self.opt["lr"], self.t)

    def c(self, v: float) -> tf.Tensor:
        return tf.constant(v, self.dt)

    def apply(self, w: dict, g: dict) -> None:
        self.t += 1
        o, t, c = self.opt, self.t, self.c
        r = self.rate()
        lr = c(r)
        for k, p in w.items():
            gk = g[k]
            a, b = self.slots[k]
            if o["name"] == "sgd":
                p.assign_sub(lr * gk)
            elif o["name"] == "momentum":
                if self.rule == "tf":
                    a.assign(c(o["momentum"]) * a - lr * gk)
                    p.assign_add(a)
                else:
                    a.assign(gk if t == 1 else c(o["momentum"]) * a + gk)
                    p.assign_sub(lr * a)
            else:  # adam
                b1, b2, eps = o["beta1"], o["beta2"], o["epsilon"]
                a.assign(c(b1) * a + c(1.0 - b1) * gk)
                b.assign(c(b2) * b + c(1.0 - b2) * tf.square(gk))
                if self.bug == "adam_no_bias_correction":
                    p.assign_sub(lr * a / (tf.sqrt(b) + c(eps)))
                elif self.rule == "tf":
                    alpha = lr * tf.sqrt(c(1.0) - c(b2) ** t) / (c(1.0) - c(b1) ** t)
                    p.assign_sub(alpha * a / (tf.sqrt(b) + c(eps)))
                else:
                    bc1, bc2 = 1.0 - b1 ** t, 1.0 - b2 ** t
                    p.assign_sub(c(r / bc1) * a / (tf.sqrt(b) / c(bc2 ** 0.5) + c(eps)))


def _combine(gs: list[dict], weights: list[float], how: str, dt: tf.DType) -> dict:
    """The weighted sum of the towers' gradients, as ``tf.add_n`` or as ``tf.stack`` + a reduction."""
    n = len(gs)
    out = {}
    for k in gs[0]:
        if how == "stack_mean":
            stacked = tf.stack([g[k] for g in gs])
            if len(set(weights)) == 1:  # the plain mean over towers
                out[k] = tf.reduce_mean(stacked, axis=0) * tf.constant(weights[0] * n, dt)
            else:
                shape = [n] + [1] * (len(stacked.shape) - 1)
                out[k] = tf.reduce_sum(stacked * tf.reshape(tf.constant(weights, dt), shape), axis=0)
        elif len(set(weights)) == 1 and weights[0] == 1.0 / n:
            out[k] = tf.add_n([g[k] for g in gs]) / tf.constant(n, dt)  # the classic average_gradients
        else:
            out[k] = tf.add_n([tf.constant(wr, dt) * g[k] for wr, g in zip(weights, gs, strict=True)])
    return out


def _train(run, how: str = "add_n", bug: str | None = None) -> None:  # noqa: C901 (one loop, every mutation marked)
    spec = run.spec
    dt = tf.float64 if run.dtype == "float64" else tf.float32
    model, par, opt = spec["model"], spec["parallel"], spec["optimizer"]
    layers, loss, red = model["layers"], model["loss"], model["reduction"]
    n, batch = len(run.devices), spec["data"]["global_batch"]
    rule = "torch" if opt["semantics"] == "torch" else "tf"
    clip = par.get("clip")
    w = {k: tf.Variable(v) for k, v in run.initial.items()}
    frozen = {k for k in w if k.endswith(".bias")} if bug == "bias_frozen" else set()  # var_list without biases
    copies = [w]
    if bug == "unshared_towers":  # every tower builds its own variables; tower 0's are saved and reported
        copies += [{k: tf.Variable(v) for k, v in run.initial.items()} for _ in range(n - 1)]
    rules = [_Rule(opt, rule, dt, vs, bug) for vs in copies]
    run.begin(w)
    for t, (x, y) in enumerate(run.batches(), start=1):
        rows = shards(batch, n, par["shard"])
        if bug == "same_shard":  # every tower reads tower 0's rows
            rows = [rows[0]] * n
        if par["weighting"] == "by_size" and bug != "equal_weights_uneven":
            weights = [len(r) / batch for r in rows]
        else:  # equal_weights_uneven: a plain mean over towers whatever the case asks
            weights = [1.0 / n] * n
        scale = 0.5 if bug == "half_mse" else 1.0  # half_mse: the 1/2 (y - f)^2 convention

        def tower_loss(vs: dict, r: np.ndarray, x=x, y=y, scale=scale) -> tf.Tensor:
            e = _elements(_forward(vs, tf.constant(x[r]), layers, bug), y[r], loss, dt)
            return _reduce(e, red) * tf.constant(scale, dt)

        losses, grads = [], []
        if how == "concat_loss":  # one tape: every tower's per-element losses in one weighted mean
            with tf.GradientTape() as tape:
                parts = []
                for d, r, wr in zip(run.devices, rows, weights, strict=True):
                    with tf.device(d):
                        e = _elements(_forward(w, tf.constant(x[r]), layers, bug), y[r], loss, dt)
                        losses.append(_reduce(e, red))
                        size = 1 if red == "sum" else int(np.prod(e.shape))
                        parts.append((tf.reshape(e, [-1]), wr / size))
                coefs = {c for _, c in parts}
                if len(coefs) == 1:  # every element weighs the same: the mean (or scaled sum) of the concatenation
                    allv = tf.concat([p for p, _ in parts], axis=0)
                    total = tf.reduce_mean(allv) if red == "mean" else tf.reduce_sum(allv) * tf.constant(coefs.pop(), dt)
                else:
                    total = tf.reduce_sum(tf.concat([p * tf.constant(c, dt) for p, c in parts], axis=0))
            g = tape.gradient(total, w)
        else:
            for k, (d, r) in enumerate(zip(run.devices, rows, strict=True)):
                vs = copies[k] if bug == "unshared_towers" else w
                with tf.device(d), tf.GradientTape() as tape:
                    lk = tower_loss(vs, r)
                    objective = lk
                    if bug == "unscoped_loss_collection":  # the LOSSES collection read without the tower's scope
                        for j in range(k):
                            objective = objective + tower_loss(vs, rows[j])
                gk = tape.gradient(objective, vs)
                if clip is not None and clip["where"] == "per_device":
                    gk = _clip(gk, clip["global_norm"], rule, dt)
                losses.append(objective)
                grads.append(gk)
            if bug == "unshared_towers":  # each tower applies its own gradient to its own copy
                for k in range(n):
                    gk = grads[k]
                    if clip is not None and clip["where"] == "after_combine":
                        gk = _clip(gk, clip["global_norm"], rule, dt)
                    rules[k].apply(copies[k], gk)
                logged = tf.add_n([tf.constant(wr, dt) * lk for wr, lk in zip(weights, losses, strict=True)])
                run.record(logged, w, grads=grads[0])
                continue
            if bug == "clip_per_tower":  # each tower's gradient clipped before the combine the case clips after
                grads = [_clip(gk, clip["global_norm"], rule, dt) for gk in grads]
            g = _combine(grads, weights, how, dt)
            if bug == "grads_summed":  # add_n without the division
                g = {k: v * tf.constant(n, dt) for k, v in g.items()}
            if bug == "extra_one_over_n":  # a tower loss already divided by N, averaged once more
                g = {k: v / tf.constant(n, dt) for k, v in g.items()}
        if clip is not None and clip["where"] == "after_combine" and bug != "clip_per_tower":
            g = _clip(g, clip["global_norm"], rule, dt)
        logged = tf.add_n([tf.constant(wr, dt) * lk for wr, lk in zip(weights, losses, strict=True)])
        applied = {k: v for k, v in w.items() if k not in frozen}
        rules[0].apply(applied, {k: g[k] for k in applied})
        if bug == "extra_update_on_log_steps" and t % 3 == 0:  # sess.run([train_op, loss]) after sess.run(train_op)
            rules[0].apply(applied, {k: g[k] for k in applied})
        # ---- what is logged (the wrong-loss bugs record no grads=, as most user code)
        if bug == "last_tower_loss":
            run.record(losses[-1], w)
        elif bug == "tower0_loss":
            run.record(losses[0], w)
        elif bug == "towers_sum_loss":
            run.record(tf.add_n(losses), w)
        elif bug == "loss_after_update":  # the loss evaluated again after apply_gradients
            again = [tower_loss(w, r) for r in rows]
            run.record(tf.add_n([tf.constant(wr, dt) * lk for wr, lk in zip(weights, again, strict=True)]), w)
        elif how == "nograds":
            run.record(logged, w)
        else:
            run.record(logged, w, grads=g)


# ------------------------------------------------------------------ equivalent rewrites


@tfpar.plugin.tensorflow(dtypes=DTYPES)
def add_n(run):
    """Towers' gradients weighted and summed with ``tf.add_n`` (``add_n(g) / N`` for equal weights)."""
    _train(run, "add_n")


@tfpar.plugin.tensorflow(dtypes=DTYPES)
def stack_mean(run):
    """``tf.reduce_mean(tf.stack(grads), axis=0)`` (a weighted ``reduce_sum`` of the stack for ``by_size``)."""
    _train(run, "stack_mean")


@tfpar.plugin.tensorflow(dtypes=DTYPES)
def concat_loss(run):
    """Every tower's per-element losses concatenated, one (weighted) mean, differentiated once."""
    _train(run, "concat_loss")


@tfpar.plugin.tensorflow(dtypes=DTYPES)
def add_n_nograds(run):
    """:func:`add_n` recording no ``grads=`` (only its parameters and loss are judged)."""
    _train(run, "nograds")


@tfpar.plugin.tensorflow(dtypes=("float32",))
def add_n_f32(run):
    """:func:`add_n` declaring float32 only: a pair with it is judged by the perturbation floor."""
    _train(run, "add_n")


def keras_load(net, initial: dict) -> dict:
    """Load a ``Sequential`` of ``Dense`` layers from canonical weights; ``{canonical name: variable}``."""
    named = {}
    for i, layer in enumerate(net.layers):
        layer.kernel.assign(initial[f"{i}.kernel"])
        named[f"{i}.kernel"] = layer.kernel
        if layer.use_bias:
            layer.bias.assign(initial[f"{i}.bias"])
            named[f"{i}.bias"] = layer.bias
    return named


def keras_optimizer(opt: dict):
    """The case's optimizer as Keras' own class (``semantics: native``): Adam, or SGD with its momentum; a
    ``warmup_cosine`` schedule as Keras' own ``CosineDecay`` (:func:`keras_cosine`)."""
    import keras

    sched = drawn(opt)
    lr = opt["lr"] if sched is None else keras_cosine(sched, opt["lr"])
    if opt["name"] == "adam":
        return keras.optimizers.Adam(learning_rate=lr, beta_1=opt["beta1"], beta_2=opt["beta2"],
                                     epsilon=opt["epsilon"])
    return keras.optimizers.SGD(learning_rate=lr, momentum=opt.get("momentum", 0.0))


@tfpar.plugin.tensorflow(dtypes=DTYPES, keras=True)
def keras_model(run):
    """A Keras ``Sequential`` of ``Dense`` layers and a Keras optimizer (``semantics: native``), towers by hand.

    Keras keeps ``learning_rate`` and ``momentum`` (and Adam's bias-correction betas) in
    float32 in a float64 run: declared with ``keras=True``.
    """
    import keras

    spec = run.spec
    dt = "float64" if run.dtype == "float64" else "float32"
    model, par, opt = spec["model"], spec["parallel"], spec["optimizer"]
    n, batch = len(run.devices), spec["data"]["global_batch"]
    net = keras.Sequential([keras.Input(shape=tuple(model["input_shape"]), dtype=dt)] + [
        keras.layers.Dense(layer["units"], activation=None if layer.get("activation", "none") == "none"
                           else layer["activation"], use_bias=layer.get("use_bias", True), dtype=dt)
        for layer in model["layers"]])
    named = keras_load(net, run.initial)
    optimizer = keras_optimizer(opt)
    keys = list(named)
    variables = [named[k] for k in keys]
    clip = par.get("clip")
    tdt = tf.float64 if dt == "float64" else tf.float32
    run.begin(named)
    for x, y in run.batches():
        rows = shards(batch, n, par["shard"])
        weights = [len(r) / batch for r in rows] if par["weighting"] == "by_size" else [1.0 / n] * n
        grads, losses = [], []
        for d, r in zip(run.devices, rows, strict=True):
            with tf.device(d), tf.GradientTape() as tape:
                lk = _reduce(_elements(net(tf.constant(x[r])), y[r], model["loss"], tdt), model["reduction"])
            gk = dict(zip(keys, tape.gradient(lk, variables), strict=True))
            if clip is not None and clip["where"] == "per_device":
                gk = _clip(gk, clip["global_norm"], "tf", tdt)
            grads.append(gk)
            losses.append(lk)
        g = _combine(grads, weights, "add_n", tdt)
        if clip is not None and clip["where"] == "after_combine":
            g = _clip(g, clip["global_norm"], "tf", tdt)
        optimizer.apply_gradients([(g[k], named[k]) for k in keys])
        logged = tf.add_n([tf.constant(wr, tdt) * lk for wr, lk in zip(weights, losses, strict=True)])
        run.record(logged, named, grads=g)


# ------------------------------------------------------------------ seeded bugs (add_n with one change)


def _bug(name: str, doc: str):
    def plugin(run):
        _train(run, "add_n", name)

    plugin.__name__ = plugin.__qualname__ = name
    plugin.__doc__ = doc
    return tfpar.plugin.tensorflow(dtypes=DTYPES)(plugin)


grads_summed = _bug("grads_summed", "The towers' gradients summed, not averaged: N times the step.")
extra_one_over_n = _bug("extra_one_over_n", "The average divided by N once more: 1/N of the step.")
unshared_towers = _bug("unshared_towers", "Each tower updates its own copy of the variables; tower 0's is reported.")
same_shard = _bug("same_shard", "Every tower reads tower 0's rows of the global batch.")
equal_weights_uneven = _bug("equal_weights_uneven", "A plain mean over towers where by_size (n_r / B) is asked.")
clip_per_tower = _bug("clip_per_tower", "Each tower's gradient clipped before the combine, where the case clips after.")
unscoped_loss_collection = _bug("unscoped_loss_collection", "Tower k's loss also sums towers 0..k-1's losses.")
extra_update_on_log_steps = _bug("extra_update_on_log_steps", "Every third step applies its update twice.")
adam_no_bias_correction = _bug("adam_no_bias_correction", "Adam without its bias corrections.")
bias_frozen = _bug("bias_frozen", "The biases left out of the optimizer's variable list.")
half_mse = _bug("half_mse", "The 1/2 (y - f)^2 convention: loss and gradient halved.")
missing_activation = _bug("missing_activation", "The first layer's activation forgotten.")
last_tower_loss = _bug("last_tower_loss", "The last tower's loss logged as the step's (no grads=).")
tower0_loss = _bug("tower0_loss", "Tower 0's loss logged as the step's (no grads=).")
towers_sum_loss = _bug("towers_sum_loss", "The towers' losses summed, not averaged, in the log (no grads=).")
loss_after_update = _bug("loss_after_update", "The loss logged is evaluated after the update (no grads=).")
