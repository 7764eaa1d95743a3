"""The TF2 tower engine: split the global batch, one tower per device, combine, apply once.

This is the classic multi-GPU pattern of the seeds, written for TensorFlow 2:

1. the global batch ``[B, ...]`` is split into N shards (``tf.split``);
2. tower r computes its loss ``l_r`` and gradients ``g_r`` under
   ``tf.device(devices[r])``, reading the one shared set of variables;
3. the towers are combined: ``grad_mean`` averages the gradients
   (``average_gradients``), ``loss_mean`` averages the losses and
   differentiates that once;
4. one update is applied.

Both combine rules compute the same gradient in exact arithmetic (the gradient
is linear), which the property suite checks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import tensorflow as tf

from .combine import average_gradients, combine_losses, tower_weights
from .optimizers import Optimizer
from .sharding import shard_sizes, split_batch

__all__ = ["make_parallel", "TowerTrainer"]


def make_parallel(fn: Callable[..., tf.Tensor], devices: int | Sequence[str], **inputs: tf.Tensor) -> tf.Tensor:
    """Run ``fn`` once per device on a slice of every input, and concatenate the outputs.

    As in the seed that introduces it: every keyword input is split along axis 0
    (``np.array_split`` sizes, so uneven batches work), ``fn`` runs under
    ``tf.device`` of each device, and the per-device outputs are concatenated
    along axis 0 (scalar outputs are stacked into ``[N]``).

    Args:
        fn: a function of the keyword inputs, returning one tensor.
        devices: a number of devices (the first N tower devices) or device names.
        **inputs: tensors ``[B, ...]`` with the same ``B``.
    Returns:
        ``[B, ...]`` (or ``[N]`` for scalar outputs).
    """
    if isinstance(devices, int):
        from .devices import tower_devices

        devices = tower_devices(devices)
    n = len(devices)
    if not inputs:
        raise ValueError("make_parallel needs at least one keyword input to split")
    splits = {k: split_batch(tf.convert_to_tensor(v), n, "contiguous") for k, v in inputs.items()}
    outs = []
    for i, dev in enumerate(devices):
        with tf.device(dev):
            outs.append(fn(**{k: v[i] for k, v in splits.items()}))
    if outs[0].shape.rank == 0:
        return tf.stack(outs)
    return tf.concat(outs, axis=0)


class TowerTrainer:
    """Synchronous data-parallel training over towers.

    Args:
        loss_fn: ``loss_fn(params, x, y) -> scalar``, the loss of one shard.
        variables: canonical name -> ``tf.Variable`` (shared by all towers).
        optimizer: an :class:`~tfpar.optimizers.Optimizer`.
        devices: one device name per tower.
        combine: ``grad_mean`` or ``loss_mean``.
        shard: ``contiguous`` or ``strided``.
        weighting: ``equal`` or ``by_size``.
        combine_device: where gradients are averaged and the update runs
            (the seeds' "parameter server": the variables' device by default).
    """

    def __init__(
        self,
        loss_fn: Callable[[Mapping[str, tf.Tensor], tf.Tensor, tf.Tensor], tf.Tensor],
        variables: Mapping[str, tf.Variable],
        optimizer: Optimizer,
        devices: Sequence[str],
        *,
        combine: str = "grad_mean",
        shard: str = "contiguous",
        weighting: str = "equal",
        combine_device: str | None = None,
    ) -> None:
        if combine not in ("grad_mean", "loss_mean"):
            raise ValueError(f"combine must be grad_mean or loss_mean, got {combine!r}")
        self.loss_fn = loss_fn
        self.names = list(variables)
        self.variables = [variables[k] for k in self.names]
        self.optimizer = optimizer
        self.devices = list(devices)
        self.combine, self.shard, self.weighting = combine, shard, weighting
        self.combine_device = combine_device or self.variables[0].device
        self.optimizer.build(self.variables)
        self._step = tf.function(self._step_impl, reduce_retracing=True)

    def _tower_loss(self, x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        params = dict(zip(self.names, self.variables, strict=True))
        return self.loss_fn(params, x, y)

    def _step_impl(self, x: tf.Tensor, y: tf.Tensor):
        n = len(self.devices)
        xs, ys = split_batch(x, n, self.shard), split_batch(y, n, self.shard)
        weights = tower_weights(shard_sizes(int(x.shape[0]), n, self.shard), self.weighting)
        if self.combine == "grad_mean":
            losses, tower_grads = [], []
            for r, dev in enumerate(self.devices):
                with tf.device(dev), tf.name_scope(f"tower_{r}"):
                    with tf.GradientTape() as tape:
                        loss_r = self._tower_loss(xs[r], ys[r])
                    tower_grads.append(tape.gradient(loss_r, self.variables))
                losses.append(loss_r)
            with tf.device(self.combine_device):
                grads = average_gradients(tower_grads, weights)
                loss = combine_losses(losses, weights)
        else:
            with tf.GradientTape() as tape:
                losses = []
                for r, dev in enumerate(self.devices):
                    with tf.device(dev), tf.name_scope(f"tower_{r}"):
                        losses.append(self._tower_loss(xs[r], ys[r]))
                with tf.device(self.combine_device):
                    loss = combine_losses(losses, weights)
            grads = tape.gradient(loss, self.variables)
        with tf.device(self.combine_device):
            self.optimizer.apply(grads, self.variables)
        return loss, grads

    def step(self, x: np.ndarray | tf.Tensor, y: np.ndarray | tf.Tensor) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """One synchronous step on a global batch.

        Args:
            x: ``[B, *input_shape]``; y: targets ``[B, ...]``.
        Returns:
            the combined loss (a scalar) and the combined gradient applied, by name.
        """
        loss, grads = self._step(tf.convert_to_tensor(x), tf.convert_to_tensor(y))
        return loss.numpy(), {k: g.numpy() for k, g in zip(self.names, grads, strict=True)}

    def values(self) -> dict[str, np.ndarray]:
        """Current parameter values by canonical name."""
        return {k: v.numpy() for k, v in zip(self.names, self.variables, strict=True)}
