"""``async``: asynchronous data parallelism on a deterministic schedule.

The classic tower programs' asynchronous variant: every device applies its own gradient to the
shared parameters as soon as it has it, with no averaging. Real asynchrony is
a race; here the race is replaced by a *seeded schedule*, so that two
implementations can be compared update for update.

Schedule, for N devices, staleness s and ``order_seed``:

* one case step k (k = 0, 1, ...) is N *applications*: every device applies
  one gradient computed on its shard of step k's global batch;
* the order of step k is ``orders[k]``, where
  ``rng = numpy.random.default_rng(order_seed)`` is created once per run and
  ``orders[k] = rng.permutation(N)`` is drawn for k = 0, 1, ... in turn;
  application j (j = 0..N-1) of step k is device ``orders[k][j]``'s;
* versions: ``theta_{k,0}`` are the parameters at the start of step k, and
  application j turns ``theta_{k,j}`` into ``theta_{k,j+1}``
  (``theta_{k+1,0} = theta_{k,N}``);
* staleness: the device at position j computed its gradient on
  ``theta_{k, max(0, j - s)}``: it missed at most s of the step's earlier
  applications, and every device reads parameters no older than the start of
  the step (a barrier per step). ``s = 0``: each device reads the parameters
  right after the previous application (sequential SGD over the shards);
  ``s >= N - 1``: every device reads ``theta_{k,0}`` (a fully stale round).

Update of application j (device r = ``orders[k][j]``, weight ``w_r``: 1/N for
``equal``, n_r/B for ``by_size``)::

    g_r = d l_r / d theta  at theta_{k, max(0, j-s)}      (clipped first with parallel.clip per_device)
    theta_{k,j+1}, S <- update(theta_{k,j}, S, N w_r g_r)

with one optimizer (one state S, one step counter t): t counts applications,
so Adam's bias correction and a learning-rate schedule see t = kN + j + 1.
(``N w_r = 1`` for ``equal`` weighting; for ``by_size`` the factor makes a
fully stale round of plain SGD equal ``grad_mean`` with lr N: see below.)

Recorded trajectory: ``param/<name>[k+1] = theta_{k+1,0}`` (after all N
applications of step k); ``loss[k] = sum_r w_r l_r``, each device's loss at
the parameters it read. No ``grad/*``: N gradients are applied per step, none
of them combined.

Identities (checked by the property tests): N = 1 is the single-device run;
plain SGD with ``s >= N - 1`` gives ``theta_{k+1,0} = theta_{k,0} - lr N
sum_r w_r g_r``, i.e. ``grad_mean`` with the learning rate times N.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from parity_tests.protocol.recorder import Recorder
from parity_tests.protocol.shards import application_orders, read_position

from .combine import combine_losses, tower_weights
from .devices import tower_devices
from .local_sgd import shard_loss_fn, step_batches
from .models import build_variables, is_state
from .optimizers import GradientClip, Optimizer, make_clip, make_optimizer
from .sharding import shard_sizes, split_batch

__all__ = ["AsyncTrainer", "run_async"]


class AsyncTrainer:
    """One set of shared variables; devices compute gradients on the versions the schedule says; one optimizer applies them.

    Args:
        loss_fn: ``loss_fn(params, x, y, masks) -> scalar``, the loss of one shard.
        variables: canonical name -> ``tf.Variable`` (the shared parameters, on the
            combine device: the classic tower programs' parameter server).
        optimizer: applies every device's gradient, in order.
        devices: one device name per tower; tower r computes its gradients there.
        staleness: ``s >= 0`` (module docstring).
        shard: ``contiguous`` or ``strided``; weighting: ``equal`` or ``by_size``.
        clip: ``where="per_device"``: each device's gradient is clipped before it is applied.
    """

    def __init__(
        self,
        loss_fn: Callable[..., tf.Tensor],
        variables: Mapping[str, tf.Variable],
        optimizer: Optimizer,
        devices: Sequence[str],
        *,
        staleness: int = 0,
        shard: str = "contiguous",
        weighting: str = "equal",
        clip: GradientClip | None = None,
    ) -> None:
        if staleness < 0:
            raise ValueError(f"staleness must be >= 0, got {staleness}")
        if clip is not None and clip.where != "per_device":
            raise ValueError("async clips each device's own gradient: clip.where must be per_device")
        self.loss_fn, self.clip = loss_fn, clip
        self.names = list(variables)
        self.variables = [variables[k] for k in self.names]
        self.optimizer = optimizer
        self.devices = list(devices)
        self.staleness, self.shard, self.weighting = staleness, shard, weighting
        self.combine_device = self.variables[0].device
        self.optimizer.build(self.variables)
        # one traced gradient function per device (its placement is part of the trace);
        # the schedule itself runs in Python, so a new order never retraces anything
        self._grads = [tf.function(self._grad_fn(r, dev), reduce_retracing=True, autograph=False) for r, dev in enumerate(self.devices)]
        self._apply = tf.function(self._apply_impl, reduce_retracing=True, autograph=False)

    def _grad_fn(self, r: int, dev: str) -> Callable[..., tuple[tf.Tensor, list[tf.Tensor]]]:
        def grad(x: tf.Tensor, y: tf.Tensor, masks: Mapping[str, tf.Tensor], scale: tf.Tensor):
            with tf.device(dev), tf.name_scope(f"tower_{r}"):
                with tf.GradientTape() as tape:
                    loss = self.loss_fn(dict(zip(self.names, self.variables, strict=True)), x, y, masks)
                g = tape.gradient(loss, self.variables)
                if self.clip is not None:
                    g = self.clip(g)
                # equal weighting: scale is None and the gradient is applied as it is
                return loss, [gi if scale is None else gi * scale for gi in g]

        return grad

    def _apply_impl(self, grads: list[tf.Tensor]) -> None:
        with tf.device(self.combine_device):
            self.optimizer.apply(grads, self.variables)

    def step(self, x: np.ndarray, y: np.ndarray, masks: Mapping[str, np.ndarray] | None, order: Sequence[int]) -> np.ndarray:
        """The N applications of one step, in ``order``; returns ``sum_r w_r l_r`` (a scalar).

        Args:
            x: ``[B, *input_shape]``; y: ``[B, ...]``; masks: layer index -> ``[B, ...]``.
            order: ``[N]``, a permutation of the devices: position j applies ``order[j]``'s gradient.
        """
        n = len(self.devices)
        if sorted(int(d) for d in order) != list(range(n)):
            raise ValueError(f"order must be a permutation of 0..{n - 1}, got {list(order)}")
        x, y = tf.convert_to_tensor(x), tf.convert_to_tensor(y)
        xs, ys = split_batch(x, n, self.shard), split_batch(y, n, self.shard)
        ms = {k: split_batch(tf.convert_to_tensor(m), n, self.shard) for k, m in (masks or {}).items()}
        weights = tower_weights(shard_sizes(int(x.shape[0]), n, self.shard), self.weighting)
        losses: dict[int, tf.Tensor] = {}
        pending: dict[int, list[tf.Tensor]] = {}
        for i in range(n):
            # version theta_{k,i} is current: every device that reads it computes its gradient now
            for j in range(i, n):
                if read_position(j, self.staleness) != i:
                    continue
                r = int(order[j])
                scale = None if weights is None else tf.constant(n * weights[r], dtype=self.variables[0].dtype)
                losses[r], pending[j] = self._grads[r](xs[r], ys[r], {k: m[r] for k, m in ms.items()}, scale)
            self._apply(pending.pop(i))
        with tf.device(self.combine_device):
            return combine_losses([losses[r] for r in range(n)], weights).numpy()

    def values(self) -> dict[str, np.ndarray]:
        """Current parameter values by canonical name."""
        return {k: v.numpy() for k, v in zip(self.names, self.variables, strict=True)}


def run_async(payload: Mapping[str, Any], *, progress: Callable[[int], None] | None = None) -> dict[str, np.ndarray]:
    """``tf.towers`` for ``parallel.combine: async``: train on the schedule and record the trajectory.

    Returns:
        ``{"loss": [steps], "param/<name>": [steps+1, ...]}`` (module docstring: what each row holds).
    """
    spec = payload["spec"]
    par = spec["parallel"]
    dtype, batches = step_batches(payload)
    devices = tower_devices(par["devices"])
    variables = build_variables({k: v for k, v in payload["init"].items() if not is_state(k)}, dtype, device=devices[0])
    optimizer = make_optimizer(spec["optimizer"], list(variables))
    trainer = AsyncTrainer(shard_loss_fn(spec["model"]), variables, optimizer, devices,
                           staleness=par["staleness"], shard=par["shard"], weighting=par["weighting"],
                           clip=make_clip(spec))
    orders = application_orders(par["devices"], spec["steps"], par["order_seed"])
    rec = Recorder(trainer.values(), grads=False)  # rows spill when large (protocol.rows)
    for k in range(spec["steps"]):
        x, y, masks = batches(k)
        rec.loss(trainer.step(x, y, masks, orders[k]))
        rec.params(trainer.values())
        if progress:
            progress(k + 1)
    return rec.finish()
