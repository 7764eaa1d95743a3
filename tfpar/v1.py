"""``tf.v1``: the classic tower programs' graph-mode towers on ``tf.compat.v1``, as they wrote them (docs/implementations.md).

The pattern of TensorFlow's CIFAR-10 multi-GPU tutorial
(``cifar10_multi_gpu_train.py``), kept step for step:

1. one ``tf.Graph``; the variables are created once, on the CPU (the
   "parameter server"), with ``tf.compat.v1.get_variable`` and shared by all
   towers through ``variable_scope`` reuse (``AUTO_REUSE``);
2. tower r runs under ``tf.device(devices[r])`` and ``name_scope('tower_r')``
   on its shard of the global batch (``tf.split``, or strided rows);
3. each tower calls ``opt.compute_gradients(loss, colocate_gradients_with_ops=True)``;
4. ``average_gradients(tower_grads)`` averages them variable by variable
   (``expand_dims``, ``concat``, ``reduce_mean``; the first tower's variable);
5. ``opt.apply_gradients(grads, global_step=global_step)`` applies one update;
   the first tower's ``UPDATE_OPS`` (batch-norm moving statistics) run with it;
6. a ``tf.compat.v1.Session`` runs the train op, one step per ``sess.run``.

Plugging in your own model: ``model_fn(*shards) -> scalar loss`` builds one
tower; create every variable with ``tf.compat.v1.get_variable`` so the towers
share them (a ``tf.Variable`` would be duplicated per tower, which
:func:`build_towers` refuses)::

    import numpy as np
    import tensorflow as tf
    from tfpar import tower_devices
    from tfpar.devices import session_config
    from tfpar.v1 import build_towers

    v1 = tf.compat.v1

    def model_fn(x, y):  # x: [n, 5], y: [n, 1], one tower's shard
        w = v1.get_variable("w", [5, 1], tf.float64, v1.zeros_initializer())
        return tf.reduce_mean(tf.square(tf.matmul(x, w) - y))

    with tf.Graph().as_default() as graph:
        x = v1.placeholder(tf.float64, [48, 5])
        y = v1.placeholder(tf.float64, [48, 1])
        towers = build_towers(model_fn, (x, y), tower_devices(4),
                              v1.train.GradientDescentOptimizer(0.1))
        with v1.Session(graph=graph, config=session_config()) as sess:
            sess.run(v1.global_variables_initializer())
            loss, _ = sess.run([towers.loss, towers.train_op],
                               {x: np.ones([48, 5]), y: np.zeros([48, 1])})

Optimizers (:func:`make_v1_optimizer`): ``native`` semantics uses the
``tf.compat.v1.train`` classes themselves; ``torch`` and ``tf`` semantics use
:class:`ExactRuleOptimizer`, a ``tf.compat.v1.train.Optimizer`` subclass that
computes the published rule in the variables' dtype.

.. warning:: The ``tf.compat.v1.train`` optimizers keep their
   hyperparameters as float32 tensors (``convert_to_tensor`` of a Python float)
   and cast them to the variable dtype, so in a float64 run ``lr``,
   ``momentum``, ``beta1``, ``beta2`` and ``epsilon`` are rounded to float32;
   ``AdamOptimizer`` also keeps ``beta1^t`` and ``beta2^t`` in float32
   variables, multiplied by the float32 betas every step. Measured against the
   exact rule in float64: 4e-8 relative (sgd), 2e-7 (momentum), 4e-5 (adam,
   eps=1e-7, 5 steps). The formulas themselves (read from ``training_ops.cc``):

   GradientDescentOptimizer:  p <- p - lr g
   MomentumOptimizer:         a <- mu a + g;  p <- p - lr a   (torch's form)
   AdamOptimizer:             m <- m + (g - m)(1 - b1);  v <- v + (g^2 - v)(1 - b2)
                              p <- p - lr sqrt(1 - b2^t)/(1 - b1^t) m / (sqrt(v) + eps)

   This is Keras' Adam formula ("epsilon hat": eps added to the uncorrected
   sqrt(v)); torch adds eps to sqrt(v)/sqrt(1 - b2^t).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import tensorflow as tf

from parity_tests.protocol.recorder import Recorder

from .combine import tower_weights
from .devices import session_config, tower_devices
from .losses import model_loss
from .models import forward, is_state, recording_activations
from .optimizers import make_clip
from .pipeline import case_batches
from .refusals import refuse_v1 as check_supported  # one place for every refusal (tfpar.refusals)
from .sharding import shard_sizes, split_batch
from .towers import _micro_mean as towers_micro_mean

__all__ = [
    "ExactRuleOptimizer",
    "Towers",
    "average_gradients",
    "build_towers",
    "check_supported",
    "make_v1_optimizer",
    "run_v1",
]

v1 = tf.compat.v1

GradsAndVars = list[tuple[tf.Tensor, tf.Variable]]


def average_gradients(tower_grads: Sequence[Sequence[tuple[tf.Tensor, tf.Variable]]],
                      weights: Sequence[float] | None = None) -> GradsAndVars:
    """The classic ``average_gradients``: one (gradient, variable) pair per variable.

    Args:
        tower_grads: ``[N towers][V]`` lists of ``(gradient, variable)`` pairs,
            as ``opt.compute_gradients`` returns them, in the same variable order.
        weights: ``[N]`` tower weights summing to 1 (``by_size``), or ``None``
            for the plain mean of the classic tower programs.
    Returns:
        ``[V]`` pairs ``(g, v)``: ``g = (1/N) sum_r g_r`` (or ``sum_r w_r g_r``),
        of the variable's shape; ``v`` is the first tower's variable (they are
        shared, so all towers name the same one).
    """
    average_grads = []
    for grad_and_vars in zip(*tower_grads, strict=True):
        grads = []
        for g, v in grad_and_vars:
            if g is None:
                raise ValueError(f"a tower produced no gradient for {v.name} (is it used in the loss?)")
            # a leading 'tower' dimension, averaged over below
            grads.append(tf.expand_dims(g, 0))
        grad = tf.concat(axis=0, values=grads)  # [N, *shape]
        if weights is None:
            grad = tf.reduce_mean(grad, 0)
        else:
            w = tf.constant(list(weights), dtype=grad.dtype)
            grad = tf.reduce_sum(grad * tf.reshape(w, [-1] + [1] * (grad.shape.rank - 1)), 0)
        average_grads.append((grad, grad_and_vars[0][1]))
    return average_grads


class Towers(NamedTuple):
    """What :func:`build_towers` built, to run with a ``Session``.

    Attributes:
        train_op: one synchronous step (apply the combined gradient, run the
            first tower's update ops, increment ``global_step``).
        loss: the combined loss, a scalar: ``(1/N) sum_r l_r`` or ``sum_r w_r l_r``.
        grads_and_vars: ``[V]`` (combined gradient, variable) pairs applied by ``train_op``.
        tower_losses: ``[N]`` per-tower scalar losses.
        global_step: the int64 step counter ``apply_gradients`` increments.
        update_ops: the first tower's ``UPDATE_OPS``, grouped into ``train_op``.
        tower_grads: ``[N][V]`` each tower's gradient of its own loss ``d l_r / d v`` (before
            clipping and averaging; under ``loss_mean`` only when built with ``capture=True``),
            in the order of ``grads_and_vars``; empty when not built.
        tower_clipped: ``[N][V]`` each tower's gradient after ``per_device`` clipping (else empty).
        combined: ``[V]`` the combined gradient before ``after_combine`` clipping.
    """

    train_op: tf.Operation
    loss: tf.Tensor
    grads_and_vars: GradsAndVars
    tower_losses: list[tf.Tensor]
    global_step: tf.Variable
    update_ops: list[tf.Operation]
    tower_grads: Sequence[Sequence[tf.Tensor]] = ()
    tower_clipped: Sequence[Sequence[tf.Tensor]] = ()
    combined: Sequence[tf.Tensor] = ()


def _on_device(device: str) -> Callable[..., tf.Variable]:
    # a variable-scope custom getter: whatever tower asks, the variable lives on
    # the parameter device (the classic code's _variable_on_cpu)
    def getter(getter: Callable[..., tf.Variable], *args: Any, **kwargs: Any) -> tf.Variable:
        with tf.device(device):
            return getter(*args, **kwargs)

    return getter


def build_towers(
    model_fn: Callable[..., tf.Tensor],
    inputs: Sequence[tf.Tensor],
    devices: Sequence[str],
    optimizer: v1.train.Optimizer,
    *,
    combine: str = "grad_mean",
    shard: str = "contiguous",
    weighting: str = "equal",
    variables_device: str = "/device:CPU:0",
    global_step: tf.Variable | None = None,
    var_list: Sequence[tf.Variable] | None = None,
    clip: Callable[[list[tf.Tensor]], list[tf.Tensor]] | None = None,
    clip_where: str = "after_combine",
    capture: bool = False,
    accumulate: int = 1,
) -> Towers:
    """Build the classic multi-tower training step in the current (v1) graph.

    Args:
        model_fn: ``model_fn(*shards) -> scalar`` loss of one tower; creates its
            variables with ``tf.compat.v1.get_variable`` (shared by reuse).
        inputs: tensors ``[B, ...]`` with one static ``B``, split across towers.
        devices: one device name per tower (``tower_devices(n)``).
        optimizer: a ``tf.compat.v1.train.Optimizer``.
        combine: ``grad_mean`` (per-tower ``compute_gradients``, then
            :func:`average_gradients`) or ``loss_mean`` (average the tower
            losses, ``compute_gradients`` once).
        shard: ``contiguous`` (``tf.split``, ``np.array_split`` sizes) or ``strided``.
        weighting: ``equal`` (1/N) or ``by_size`` (n_r/B).
        variables_device: where variables, the combine and the update live.
        global_step: an existing step counter; by default the graph's
            ``get_or_create_global_step()``.
        var_list: the variables to train; by default every trainable variable
            of the graph once the first tower is built (``compute_gradients``'
            default, as the classic tower programs use it).
        clip: ``clip(grads) -> grads`` over one list of gradients (e.g.
            ``lambda gs: tf.clip_by_global_norm(gs, c)[0]``), or ``None``.
        clip_where: ``per_device`` clips each tower's gradients on its device
            before :func:`average_gradients` (the classic tower order; needs
            ``grad_mean``); ``after_combine`` clips the combined gradient once
            (torch's order, after DDP's allreduce).
        capture: under ``loss_mean`` also build each tower's gradient of its own loss
            (``Towers.tower_grads``, for a captured step; ``grad_mean`` has them anyway).
        accumulate: k micro-batches per tower (``parallel.accumulate``): each tower cuts its
            shard into k contiguous micro-batches (``np.array_split`` sizes) and calls
            ``model_fn`` on each; its loss is their mean ``l_r = (1/k) sum_j l_rj`` and, under
            ``grad_mean``, its gradient the mean of the k ``compute_gradients`` results,
            ``g_r = (1/k) sum_j d l_rj / d v`` (``tf.towers``' rule); ``loss_mean`` differentiates
            ``sum_r w_r l_r`` once. All k micro-batches are in one graph step: the classic programs'
            accumulator variables across ``Session.run`` calls compute the same mean. A model with
            batch norm is refused by :func:`check_supported` (its k moving-statistics updates would
            need chaining by control dependencies).
    Returns:
        :class:`Towers`.
    Raises:
        ValueError: a bad option, or ``model_fn`` created variables in a tower
            after the first (they would not be shared).
    """
    if combine not in ("grad_mean", "loss_mean"):
        raise ValueError(f"combine must be grad_mean or loss_mean, got {combine!r}")
    if clip_where not in ("after_combine", "per_device"):
        raise ValueError(f"clip_where must be after_combine or per_device, got {clip_where!r}")
    if clip is not None and clip_where == "per_device" and combine != "grad_mean":
        raise ValueError("per_device clipping needs combine grad_mean (loss_mean has no per-tower gradient)")
    n = len(devices)
    if n < 1:
        raise ValueError("build_towers needs at least one device")
    if accumulate < 1:
        raise ValueError(f"accumulate must be >= 1, got {accumulate}")
    inputs = [tf.convert_to_tensor(t) for t in inputs]
    batch = inputs[0].shape[0]
    if batch is None or any(t.shape[0] != batch for t in inputs):
        raise ValueError(f"every input needs the same static batch size, got {[t.shape[0] for t in inputs]}")
    weights = tower_weights(shard_sizes(int(batch), n, shard), weighting)
    with tf.device(variables_device):
        if global_step is None:
            global_step = v1.train.get_or_create_global_step()
        # the classic tower programs split the batch once, on the parameter device, then hand
        # each tower its slice
        shards = [split_batch(t, n, shard) for t in inputs]
    tower_losses: list[tf.Tensor] = []
    tower_grads: list[GradsAndVars] = []
    unclipped: list[list[tf.Tensor]] = []
    update_ops: list[tf.Operation] = []
    train_vars: list[tf.Variable] = list(var_list or [])
    with v1.variable_scope(v1.get_variable_scope(), reuse=v1.AUTO_REUSE, custom_getter=_on_device(variables_device)):
        for r, dev in enumerate(devices):
            before = len(v1.global_variables())
            with tf.device(dev), v1.name_scope(f"tower_{r}") as scope:
                micro = [split_batch(s[r], accumulate, "contiguous") for s in shards] if accumulate > 1 else None
                micro_losses = ([model_fn(*[m[j] for m in micro]) for j in range(accumulate)] if micro is not None
                                else [model_fn(*[s[r] for s in shards])])
                loss_r = micro_losses[0] if accumulate == 1 else tf.add_n(micro_losses) / accumulate
                if r == 0:
                    train_vars = train_vars or v1.trainable_variables()
                    # batch-norm statistics are updated from the first tower only, as the classic tower programs do
                    update_ops = v1.get_collection(v1.GraphKeys.UPDATE_OPS, scope)
                elif len(v1.global_variables()) != before:
                    raise ValueError(
                        f"model_fn created variables in tower {r}: create them with "
                        "tf.compat.v1.get_variable so that every tower shares the first tower's"
                    )
                if combine == "grad_mean":
                    if accumulate == 1:
                        pairs = optimizer.compute_gradients(loss_r, var_list=train_vars, colocate_gradients_with_ops=True)
                    else:
                        pairs = _micro_mean([optimizer.compute_gradients(l_j, var_list=train_vars,
                                                                         colocate_gradients_with_ops=True)
                                             for l_j in micro_losses])
                    unclipped.append([g for g, _ in pairs])
                    if clip is not None and clip_where == "per_device":
                        pairs = _clip_pairs(pairs, clip)
                    tower_grads.append(pairs)
                elif capture:  # d l_r / d v of this tower alone (the combined loss is differentiated once)
                    unclipped.append(v1.gradients(loss_r, train_vars, colocate_gradients_with_ops=True))
            tower_losses.append(loss_r)
    if not train_vars:
        raise ValueError("no variables to train: model_fn created no trainable variables")
    with tf.device(variables_device):
        stacked = tf.stack(tower_losses)
        loss = (tf.reduce_mean(stacked) if weights is None
                else tf.reduce_sum(stacked * tf.constant(weights, dtype=stacked.dtype)))
        if combine == "grad_mean":
            grads = average_gradients(tower_grads, weights)
        else:
            grads = optimizer.compute_gradients(loss, var_list=train_vars, colocate_gradients_with_ops=True)
            for g, v in grads:
                if g is None:
                    raise ValueError(f"no gradient for {v.name} (is it used in the loss?)")
        combined = [g for g, _ in grads]
        if clip is not None and clip_where == "after_combine":
            grads = _clip_pairs(grads, clip)
        # the loss is fetched with the train op: make sure it reads the
        # variables before the update writes them, whatever the model's dataflow
        with tf.control_dependencies([loss]):
            apply_op = optimizer.apply_gradients(grads, global_step=global_step)
        train_op = tf.group(apply_op, *update_ops, name="train_op")
    clipped = [[g for g, _ in pairs] for pairs in tower_grads] if clip is not None and clip_where == "per_device" else []
    return Towers(train_op, loss, list(grads), tower_losses, global_step, list(update_ops), unclipped, clipped, combined)


def _micro_mean(per_micro: list[GradsAndVars]) -> GradsAndVars:
    """``(1/k) sum_j g_j`` variable by variable over k micro-batches' ``(g, v)`` lists (``tfpar.towers._micro_mean``
    on each variable's k gradients: sparse gradients stay sparse, their slices concatenated)."""
    out = []
    for pairs in zip(*per_micro, strict=True):
        gs, var = [g for g, _ in pairs], pairs[0][1]
        if any(g is None for g in gs):
            raise ValueError(f"no gradient for {var.name} (is it used in the loss?)")
        out.append((towers_micro_mean(gs), var))
    return out


def _clip_pairs(pairs: GradsAndVars, clip: Callable[[list[tf.Tensor]], list[tf.Tensor]]) -> GradsAndVars:
    """``(g, v)`` pairs with the gradients clipped together (by one global norm)."""
    missing = [v.name for g, v in pairs if g is None]
    if missing:
        raise ValueError(f"no gradient for {missing[0]} (is it used in the loss?)")
    clipped = clip([g for g, _ in pairs])
    return [(g, v) for g, (_, v) in zip(clipped, pairs, strict=True)]


class ExactRuleOptimizer(v1.train.Optimizer):
    """A published update rule, computed exactly in the variable dtype, as a v1 optimizer.

    Hyperparameters are constants of the variable's dtype (exact in float64);
    the step count ``t`` (from 1) is an int64 non-slot variable. Rules
    (``g``: the gradient):

    sgd:               p <- p - lr g
    momentum, torch:   b <- mu b + g;  p <- p - lr b
    momentum, tf:      v <- mu v - lr g;  p <- p + v
    adam, torch:       m <- m + (1-b1)(g-m);  v <- b2 v + (1-b2) g^2
                       p <- p - (lr/(1-b1^t)) m / (sqrt(v)/sqrt(1-b2^t) + eps)
    adam, tf (Keras):  m <- m + (g-m)(1-b1);  v <- v + (g^2-v)(1-b2)
                       p <- p - lr sqrt(1-b2^t)/(1-b1^t) m / (sqrt(v) + eps)

    .. warning:: Adam's epsilon differs between the frameworks (see
       :mod:`tfpar.optimizers`): torch adds it to the bias-corrected sqrt(v).

    Args:
        name: ``sgd``, ``momentum`` or ``adam``.
        semantics: ``torch`` or ``tf``.
        hp: ``lr`` and the rule's hyperparameters (``momentum``; ``beta1``,
            ``beta2``, ``epsilon``).
    """

    _SLOTS = {"sgd": (), "momentum": ("momentum",), "adam": ("m", "v")}

    def __init__(self, name: str, semantics: str, hp: Mapping[str, float]) -> None:
        if name not in self._SLOTS or semantics not in ("torch", "tf"):
            raise ValueError(f"no exact rule for {name!r} with semantics {semantics!r}")
        super().__init__(use_locking=False, name=f"Exact_{name}_{semantics}")
        self.rule, self.semantics, self.hp = name, semantics, dict(hp)

    def _create_slots(self, var_list: list[tf.Variable]) -> None:
        first = min(var_list, key=lambda v: v.name)
        self._create_non_slot_variable(initial_value=tf.constant(0, tf.int64), name="t", colocate_with=first)
        for v in var_list:
            for s in self._SLOTS[self.rule]:
                self._zeros_slot(v, s, self._name)

    def _prepare(self) -> None:
        # the step this update is: read before the updates, incremented in _finish after them
        self._t = self._get_non_slot_variable("t", graph=v1.get_default_graph()) + 1

    def _c(self, key: str, var: tf.Variable) -> tf.Tensor:
        return tf.constant(self.hp[key], dtype=var.dtype.base_dtype)

    def _apply(self, grad: tf.Tensor, var: tf.Variable) -> tf.Operation:
        dt = var.dtype.base_dtype
        g = tf.cast(grad, dt)
        one = tf.constant(1.0, dt)
        if self.rule == "sgd":
            return v1.assign_sub(var, self._c("lr", var) * g).op
        lr = self._c("lr", var)
        if self.rule == "momentum":
            buf = self.get_slot(var, "momentum")
            mu = self._c("momentum", var)
            # new values are computed from one read of each slot, then written
            # once: graph mode gives no order between reads and writes otherwise
            if self.semantics == "torch":
                b = mu * buf + g
                return tf.group(v1.assign(buf, b), v1.assign_sub(var, lr * b))
            vel = buf * mu - g * lr
            return tf.group(v1.assign(buf, vel), v1.assign_add(var, vel))
        m, s = self.get_slot(var, "m"), self.get_slot(var, "v")
        b1, b2, eps = self._c("beta1", var), self._c("beta2", var), self._c("epsilon", var)
        t = tf.cast(self._t, dt)
        bc1, bc2 = one - tf.pow(b1, t), one - tf.pow(b2, t)
        if self.semantics == "torch":
            m_new = m + (one - b1) * (g - m)
            s_new = s * b2 + (one - b2) * g * g
            step = (lr / bc1) * (m_new / (tf.sqrt(s_new) / tf.sqrt(bc2) + eps))
        else:
            m_new = m + (g - m) * (one - b1)
            s_new = s + (tf.square(g) - s) * (one - b2)
            step = (m_new * (lr * tf.sqrt(bc2) / bc1)) / (tf.sqrt(s_new) + eps)
        return tf.group(v1.assign(m, m_new), v1.assign(s, s_new), v1.assign_sub(var, step))

    def _apply_dense(self, grad: tf.Tensor, var: tf.Variable) -> tf.Operation:
        return self._apply(grad, var)

    def _resource_apply_dense(self, grad: tf.Tensor, handle: tf.Variable) -> tf.Operation:
        return self._apply(grad, handle)

    def _apply_sparse(self, grad: Any, var: tf.Variable) -> tf.Operation:
        raise NotImplementedError("ExactRuleOptimizer handles dense gradients only")

    def _resource_apply_sparse(self, grad: Any, handle: tf.Variable, indices: Any) -> tf.Operation:
        raise NotImplementedError("ExactRuleOptimizer handles dense gradients only")

    def _finish(self, update_ops: list[tf.Operation], name_scope: str) -> tf.Operation:
        t = self._get_non_slot_variable("t", graph=v1.get_default_graph())
        with tf.control_dependencies(update_ops):
            inc = v1.assign_add(t, tf.constant(1, tf.int64))
        return tf.group(*update_ops, inc, name=name_scope)


def make_v1_optimizer(spec: Mapping[str, Any]) -> v1.train.Optimizer:
    """The v1 optimizer a validated case's ``optimizer`` section asks for.

    ``native``: ``GradientDescentOptimizer`` / ``MomentumOptimizer`` /
    ``AdamOptimizer`` with the nominal hyperparameters as Python floats (as a
    user writes them; float32 inside, see the module warning). ``torch`` / ``tf``:
    :class:`ExactRuleOptimizer`.
    """
    name, sem, lr = spec["name"], spec["semantics"], spec["lr"]
    if sem == "native":
        if name == "sgd":
            return v1.train.GradientDescentOptimizer(lr)
        if name == "momentum":
            return v1.train.MomentumOptimizer(lr, spec["momentum"])
        if name == "adam":
            return v1.train.AdamOptimizer(lr, spec["beta1"], spec["beta2"], spec["epsilon"])
        raise ValueError(f"no tf.compat.v1 optimizer for {name!r}")
    return ExactRuleOptimizer(name, sem, spec)



def run_v1(payload: Mapping[str, Any], *, progress: Callable[[int], None] | None = None) -> dict[str, np.ndarray]:
    """Run a validated case on the v1 graph towers and record its trajectory.

    Batch-norm layers normalise each tower with its own shard's statistics;
    their moving-statistics updates go to ``UPDATE_OPS``, of which the train op
    runs the first tower's (the classic code's rule, and what DDP keeps: rank
    0's buffers). Dropout keep-masks and sample weights are fed as inputs and
    split with the batch. Gradient clipping follows ``parallel.clip``.

    Args:
        payload: ``{"spec": dict, "x": [rows, ...], "y": [rows, ...], "init": {name: array}}``
            (plus ``masks`` and ``w`` when the case has dropout or sample weights).
        progress: called with the number of steps done.
    Returns:
        ``{"loss": [steps], "param/<name>": [steps+1, ...], "grad/<name>": [steps, ...]}``,
        and ``state/<name>`` ``[steps+1, ...]`` for batch-norm moving statistics; with
        ``payload["capture"] = k`` also step k's per-tower values ``device/...`` under
        ``tfpar.TowerTrainer.step``'s keys (:func:`_capture_fetches`), fetched with its train op.
    Raises:
        DeviceError: ``parallel.devices`` exceeds the configured devices.
        ValueError: a case feature this runner does not implement (:func:`check_supported`).
    """
    spec = payload["spec"]
    check_supported(spec)
    dtype = tf.float64 if spec["dtype"] == "float64" else tf.float32
    np_dtype = np.float64 if spec["dtype"] == "float64" else np.float32
    model, par, batch = spec["model"], spec["parallel"], spec["data"]["global_batch"]
    devices = tower_devices(par["devices"])
    init = {k: np.asarray(v, np_dtype) for k, v in payload["init"].items()}
    names = [k for k in init if not is_state(k)]
    state_names = [k for k in init if is_state(k)]
    var_name = {k: k.replace(".", "_") for k in init}  # op names: no dots, as models.py
    clip = make_clip(spec)
    capture = payload.get("capture")
    shards: list[tf.Tensor] = []  # each tower's rows, in tower order (the captured step's inputs)

    with case_batches(payload, towers=None, feed="arrays") as batches:
        x0, y0, extras0 = batches(0)
        extra_keys = sorted(extras0)

        def model_fn(x: tf.Tensor, y: tf.Tensor, *extras: tf.Tensor) -> tf.Tensor:
            def var(k: str) -> tf.Variable:
                return v1.get_variable(var_name[k], shape=init[k].shape, dtype=dtype, trainable=not is_state(k),
                                       initializer=v1.constant_initializer(init[k]))
            params = {k: var(k) for k in names}
            state = {k: var(k) for k in state_names}
            shards.append(x)
            given = dict(zip(extra_keys, extras, strict=True))
            masks = {k: m for k, m in given.items() if k != "w"}
            out = forward(model["layers"], params, x, masks=masks, state=state or None, batch_norm="local")
            return model_loss(model, out, y, sample_weight=given.get("w"))

        graph = tf.Graph()
        with graph.as_default():
            x = v1.placeholder(tf.as_dtype(x0.dtype), [batch, *x0.shape[1:]], name="x")  # int64 token ids too
            y = v1.placeholder(tf.as_dtype(y0.dtype), [batch, *y0.shape[1:]], name="y")
            extra_in = [v1.placeholder(tf.as_dtype(extras0[k].dtype), [batch, *extras0[k].shape[1:]], name=f"extra_{i}")
                        for i, k in enumerate(extra_keys)]
            # every tower's layer outputs, fetched at the captured step
            with recording_activations() if capture is not None else contextlib.nullcontext([]) as acts:
                towers = build_towers(model_fn, (x, y, *extra_in), devices, make_v1_optimizer(spec["optimizer"]),
                                      combine=par["combine"], shard=par["shard"], weighting=par["weighting"],
                                      clip=clip, clip_where=clip.where if clip is not None else "after_combine",
                                      capture=capture is not None, accumulate=par.get("accumulate", 1))
            by_var = {v.op.name: g for g, v in towers.grads_and_vars}
            order = [v.op.name for _, v in towers.grads_and_vars]
            at = [order.index(var_name[k]) for k in names]  # canonical name -> position in the towers' lists
            fetch_capture = _capture_fetches(towers, shards, acts, at, names) if capture is not None else {}
            variables = {v.op.name: v for v in v1.global_variables()}
            grads = [by_var[var_name[k]] for k in names]
            params = [variables[var_name[k]] for k in names]
            states = [variables[var_name[k]] for k in state_names]
            init_op = v1.global_variables_initializer()
        graph.finalize()  # nothing may add ops while the steps run
        with v1.Session(graph=graph, config=session_config()) as sess:
            sess.run(init_op)
            rec = Recorder(dict(zip(names, sess.run(params), strict=True)),
                           dict(zip(state_names, sess.run(states), strict=True)))  # rows spill when large
            captured: dict[str, np.ndarray] = {}
            for k in range(spec["steps"]):
                xb, yb, extras = batches(k)
                feed = {x: xb, y: yb, **{p: extras[key] for p, key in zip(extra_in, extra_keys, strict=True)}}
                if capture == k + 1:
                    # fetched with the train op: every captured tensor feeds the combined gradient (or
                    # reads the same forward values), so all of it precedes the update
                    loss, g, _, cap = sess.run([towers.loss, grads, towers.train_op, fetch_capture], feed)
                    captured = {f"device/{key}": np.asarray(v) for key, v in cap.items()}
                    captured["device/sizes"] = np.asarray(shard_sizes(batch, len(devices), par["shard"]), np.int64)
                    captured["device/step"] = np.asarray(k + 1)
                else:
                    loss, g, _ = sess.run([towers.loss, grads, towers.train_op], feed)
                rec.loss(loss)
                values, svalues = sess.run([params, states])
                for name, gv, pv in zip(names, g, values, strict=True):
                    rec.grad(name, gv)
                    rec.param(name, pv)
                rec.states(zip(state_names, svalues, strict=True))
                if progress:
                    progress(k + 1)
    rec.add(captured)
    return rec.finish()


def _capture_fetches(towers: Towers, shards: list[tf.Tensor], acts: list[tuple[int, list[tf.Tensor]]],
                     at: list[int], names: list[str]) -> dict[str, tf.Tensor]:
    """The tensors of a captured step, under the keys of ``tfpar.TowerTrainer.step``'s ``captured`` (N towers, B rows).

    ``x`` ``[B, ...]`` (the towers' shards concatenated in tower order), ``loss`` ``[N]``
    (each tower's ``l_r``), ``act/<layer>`` ``[B, ...]``, ``grad/<name>`` ``[N, ...]`` (``d l_r / d
    param``, before clipping and averaging), ``clipped/<name>`` ``[N, ...]`` (``per_device``
    clipping), ``combined/<name>`` (before ``after_combine`` clipping). ``at[j]`` is canonical
    name ``names[j]``'s position in the towers' gradient lists.
    """
    # model_fn runs one tower at a time, in tower order, and within a tower one micro-batch at a time, in row
    # order (parallel.accumulate): every list below holds the calls in row order
    calls = len(shards)
    out: dict[str, tf.Tensor] = {"x": tf.concat(shards, 0), "loss": tf.stack(towers.tower_losses)}
    layers: dict[int, list[tf.Tensor]] = {}
    for i, hs in acts:  # (i, [h]) per call
        layers.setdefault(i, []).extend(hs)
    out.update({f"act/{i}": tf.concat(hs, 0) for i, hs in layers.items() if len(hs) == calls})
    for key, per_tower in (("grad", towers.tower_grads), ("clipped", towers.tower_clipped)):
        if per_tower:
            out.update({f"{key}/{k}": tf.stack([g_r[j] for g_r in per_tower]) for k, j in zip(names, at, strict=True)})
    out.update({f"combined/{k}": towers.combined[j] for k, j in zip(names, at, strict=True)})
    return out
