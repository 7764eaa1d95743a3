"""The TF2 tower engine: split the global batch, one tower per device, combine, apply once.

This is the multi-GPU pattern of the classic tower programs (docs/implementations.md), written for TensorFlow 2:

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

import contextlib
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import tensorflow as tf

from parity_tests.protocol.rows import Keeper

from .combine import average_gradients, combine_losses, tower_weights
from .models import recording_activations
from .optimizers import GradientClip, Optimizer
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


def _micro_mean(gs: list[tf.Tensor | tf.IndexedSlices]) -> tf.Tensor | tf.IndexedSlices:
    """``(1/k) sum_j g_j`` over the k micro-batch gradients of one variable; sparse gradients
    (``IndexedSlices``) stay sparse: their rows are concatenated, as a sum of slices is."""
    k = len(gs)
    if isinstance(gs[0], tf.IndexedSlices):
        return tf.IndexedSlices(tf.concat([g.values for g in gs], 0) / k, tf.concat([g.indices for g in gs], 0),
                                gs[0].dense_shape)
    return tf.add_n(gs) / k


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
            (the classic tower programs' "parameter server": the variables' device by default).
        clip: clipping by global norm (:class:`~tfpar.optimizers.GradientClip`):
            ``where="per_device"`` clips each tower's gradients before they are
            averaged (the classic tower order; needs ``grad_mean``),
            ``"after_combine"`` clips the combined gradient. The gradient
            :meth:`step` returns is the one applied, i.e. after clipping.
        towers_fn: ``towers_fn(params, xs, ys, extras) -> [N] losses``: all towers
            at once, used instead of ``loss_fn`` for models whose towers share
            something within a step (batch-norm statistics and moving averages;
            ``tfpar.models.forward_towers``). ``extras[r]`` holds tower r's rows
            of the per-example arrays given to :meth:`step` (dropout masks). It
            places each tower's ops itself. One tape records every tower; with
            ``grad_mean`` tower r's gradient is ``d l_r / d params`` (through
            every tower, when statistics cross towers), so their weighted mean
            is the gradient of the combined loss, as in DDP.
        accumulate: k micro-batches per step (``parallel.accumulate``): each tower cuts its shard
            into k equal contiguous micro-batches and runs each through the model (batch-norm
            statistics and moving-statistics updates per micro-batch); its gradient is the mean
            ``g_r = (1/k) sum_j d l_{r,j} / d params`` and its loss ``l_r = (1/k) sum_j l_{r,j}``,
            combined as ``combine`` says (``loss_mean``: the mean over j of ``d (sum_r w_r l_{r,j})``),
            clipped per device on ``g_r`` or after combining, then applied once. ``1``: no micro-batches
            (the same program as without the argument).
        state: the variables the forward pass assigns (batch-norm moving statistics): a capture
            step puts them back after computing its values, so the plain step updates them once.
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
        clip: GradientClip | None = None,
        towers_fn: Callable[..., list[tf.Tensor]] | None = None,
        accumulate: int = 1,
        state: Mapping[str, tf.Variable] | None = None,
    ) -> None:
        if combine not in ("grad_mean", "loss_mean"):
            raise ValueError(f"combine must be grad_mean or loss_mean, got {combine!r}")
        if clip is not None and clip.where == "per_device" and combine != "grad_mean":
            raise ValueError("per_device clipping needs combine grad_mean (loss_mean has no per-tower gradient)")
        if accumulate < 1:
            raise ValueError(f"accumulate must be >= 1, got {accumulate}")
        self.clip = clip
        self.accumulate = accumulate
        self.loss_fn = loss_fn
        self.towers_fn = towers_fn
        self.state = list((state or {}).values())
        self.names = list(variables)
        self.variables = [variables[k] for k in self.names]
        self.optimizer = optimizer
        self.devices = list(devices)
        self.combine, self.shard, self.weighting = combine, shard, weighting
        self.combine_device = combine_device or self.variables[0].device
        self.optimizer.build(self.variables)
        # one trace per batch size: the split sizes are static (tf.split needs them), and a relaxed
        # trace (reduce_retracing) would leave the batch dimension unknown, so an epoch's smaller
        # last batch (a DataLoader's or tf.data's without drop_remainder) could not be split
        self.captured: dict[str, np.ndarray] | None = None
        # autograph=False: the step's loops and branches are over Python values (towers, layers,
        # flags), so autograph would rewrite nothing the graph keeps, yet its source transforms
        # were half of every trace (cProfile, 2026-11-23); the same holds for every tf.function
        # of tfpar (96 matrix runs of tf.towers, tf.mirrored, tf.single and tf.v1 hashed the
        # same with and without it); tensor-dependent control flow would fail to trace, loudly
        self._step = tf.function(self._step_impl, autograph=False)
        # One trace of a tower serves all N (two for uneven shards, which have two sizes): the step
        # calls it under each tower's tf.device. TensorFlow inlines the call before it runs, so each
        # tower runs the ops an inline trace makes, on its device (trajectories hash the same), but
        # the step's trace no longer grows with N. A capture traces its towers inline, as it
        # records their activations, and applies nothing: the captured step's update is the plain
        # step's (``step``), so a run with a capture trains bit for bit as one without (measured
        # before: another trace of the step moved the gradients of convolution, normalisation and
        # embedding models in the last bits, 18 of 444 runs of ``trajectory_hashes.py --quick``)
        self._tower_grad = tf.function(self._tower_grad_impl, autograph=False)
        self._tower_loss_fn = tf.function(self._tower_loss, autograph=False)
        self._capture_step = tf.function(lambda x, y, extra: self._step_impl(x, y, extra, capture=True, apply=False),
                                         autograph=False)

    def _tower_loss(self, x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        params = dict(zip(self.names, self.variables, strict=True))
        return self.loss_fn(params, x, y)

    def _tower_grad_impl(self, x: tf.Tensor, y: tf.Tensor) -> tuple[tf.Tensor, list[tf.Tensor]]:
        """One tower's loss ``l_r`` and gradient ``d l_r / d params``."""
        with tf.GradientTape() as tape:
            loss_r = self._tower_loss(x, y)
        return loss_r, tape.gradient(loss_r, self.variables)

    def _lockstep(self, xs: list[tf.Tensor], ys: list[tf.Tensor], extra: Mapping[str, tf.Tensor],
                  weights: list[float] | None, cap: dict | None = None) -> tuple[tf.Tensor, list[tf.Tensor]]:
        """Loss and combined gradient with every tower run at once by ``towers_fn``."""
        n = len(self.devices)
        parts = {k: split_batch(v, n, self.shard) for k, v in extra.items()}
        extras = [{k: p[r] for k, p in parts.items()} for r in range(n)]
        params = dict(zip(self.names, self.variables, strict=True))
        with tf.GradientTape(persistent=self.combine == "grad_mean" or cap is not None) as tape:
            losses = self.towers_fn(params, xs, ys, extras)
            with tf.device(self.combine_device):
                loss = combine_losses(losses, weights)
        if cap is not None:
            cap["loss"] = losses
        if self.combine == "loss_mean":
            if cap is not None:
                cap["grads"] = [tape.gradient(losses[r], self.variables) for r in range(n)]
            return loss, tape.gradient(loss, self.variables)
        tower_grads = []
        for r, dev in enumerate(self.devices):
            with tf.device(dev), tf.name_scope(f"tower_{r}"):
                g_r = tape.gradient(losses[r], self.variables)
                if cap is not None:
                    cap.setdefault("grads", []).append(g_r)
                if self.clip is not None and self.clip.where == "per_device":
                    g_r = self.clip(g_r)
            tower_grads.append(g_r)
        del tape
        if cap is not None and self.clip is not None and self.clip.where == "per_device":
            cap["clipped"] = tower_grads
        with tf.device(self.combine_device):
            return loss, average_gradients(tower_grads, weights)

    def _accumulated(self, xs: list[tf.Tensor], ys: list[tf.Tensor], extra: Mapping[str, tf.Tensor],
                     weights: list[float] | None, cap: dict | None = None) -> tuple[tf.Tensor, list[tf.Tensor]]:
        """Loss and combined gradient over ``self.accumulate`` micro-batches per tower (class docstring)."""
        n, k = len(self.devices), self.accumulate
        micro = [split_batch(t, k, "contiguous") for t in xs], [split_batch(t, k, "contiguous") for t in ys]
        parts = {key: [split_batch(p, k, "contiguous") for p in split_batch(v, n, self.shard)] for key, v in extra.items()}
        params = dict(zip(self.names, self.variables, strict=True))
        per_tower = self.combine == "grad_mean" or cap is not None
        losses: list[list[tf.Tensor]] = [[] for _ in range(n)]  # l_{r,j}
        grads: list[list[list[tf.Tensor]]] = [[] for _ in range(n)]  # d l_{r,j} / d params
        combined: list[list[tf.Tensor]] = []  # loss_mean: d (sum_r w_r l_{r,j}) / d params
        for j in range(k):
            xs_j, ys_j = [m[j] for m in micro[0]], [m[j] for m in micro[1]]
            with tf.GradientTape(persistent=True) as tape:
                if self.towers_fn is not None:
                    ls = self.towers_fn(params, xs_j, ys_j, [{key: p[r][j] for key, p in parts.items()} for r in range(n)])
                else:
                    ls = []
                    for r, dev in enumerate(self.devices):
                        with tf.device(dev), tf.name_scope(f"tower_{r}"):
                            ls.append(self._tower_loss(xs_j[r], ys_j[r]))
                with tf.device(self.combine_device):
                    total = combine_losses(ls, weights)
            for r, dev in enumerate(self.devices):
                losses[r].append(ls[r])
                if per_tower:
                    with tf.device(dev), tf.name_scope(f"tower_{r}"):
                        grads[r].append(tape.gradient(ls[r], self.variables))
            if self.combine == "loss_mean":
                with tf.device(self.combine_device):
                    combined.append(tape.gradient(total, self.variables))
            del tape
        tower_losses, tower_grads = [], []
        for r, dev in enumerate(self.devices):
            with tf.device(dev):
                tower_losses.append(tf.add_n(losses[r]) / k)
                if per_tower:
                    tower_grads.append([_micro_mean([g[v] for g in grads[r]]) for v in range(len(self.variables))])
        if cap is not None:
            cap["loss"], cap["grads"] = tower_losses, list(tower_grads)
        with tf.device(self.combine_device):
            loss = combine_losses(tower_losses, weights)
            if self.combine == "loss_mean":
                return loss, [_micro_mean([g[v] for g in combined]) for v in range(len(self.variables))]
        if self.clip is not None and self.clip.where == "per_device":
            for r, dev in enumerate(self.devices):
                with tf.device(dev):
                    tower_grads[r] = self.clip(tower_grads[r])
            if cap is not None:
                cap["clipped"] = tower_grads
        with tf.device(self.combine_device):
            return loss, average_gradients(tower_grads, weights)

    def _step_impl(self, x: tf.Tensor, y: tf.Tensor, extra: Mapping[str, tf.Tensor] | None = None,
                   capture: bool = False, apply: bool = True):
        n = len(self.devices)
        xs, ys = split_batch(x, n, self.shard), split_batch(y, n, self.shard)
        weights = tower_weights(shard_sizes(int(x.shape[0]), n, self.shard), self.weighting)
        cap: dict | None = {} if capture else None
        with recording_activations() if capture else contextlib.nullcontext() as acts:
            if self.accumulate > 1:
                loss, grads = self._accumulated(xs, ys, extra or {}, weights, cap)
            elif self.towers_fn is not None:
                loss, grads = self._lockstep(xs, ys, extra or {}, weights, cap)
            elif self.combine == "grad_mean":
                tower = self._tower_grad if cap is None and n > 1 else self._tower_grad_impl
                losses, tower_grads = [], []
                for r, dev in enumerate(self.devices):
                    with tf.device(dev), tf.name_scope(f"tower_{r}"):
                        loss_r, g_r = tower(xs[r], ys[r])
                        if cap is not None:
                            cap.setdefault("grads", []).append(g_r)
                        if self.clip is not None and self.clip.where == "per_device":
                            g_r = self.clip(g_r)
                        tower_grads.append(g_r)
                    losses.append(loss_r)
                if cap is not None:
                    cap["loss"] = losses
                    if self.clip is not None and self.clip.where == "per_device":
                        cap["clipped"] = tower_grads
                with tf.device(self.combine_device):
                    grads = average_gradients(tower_grads, weights)
                    loss = combine_losses(losses, weights)
            else:
                tower_loss = self._tower_loss_fn if cap is None and n > 1 else self._tower_loss
                with tf.GradientTape(persistent=cap is not None) as tape:
                    losses = []
                    for r, dev in enumerate(self.devices):
                        with tf.device(dev), tf.name_scope(f"tower_{r}"):
                            losses.append(tower_loss(xs[r], ys[r]))
                    with tf.device(self.combine_device):
                        loss = combine_losses(losses, weights)
                grads = tape.gradient(loss, self.variables)
                if cap is not None:
                    cap["loss"] = losses
                    cap["grads"] = [tape.gradient(losses[r], self.variables) for r in range(n)]
        with tf.device(self.combine_device):
            if cap is not None:
                cap["combined"] = list(grads)
            if self.clip is not None and self.clip.where == "after_combine":
                grads = self.clip(grads)
            if apply:
                self.optimizer.apply(grads, self.variables)
        if cap is None:
            return loss, grads
        cap["x"] = tf.concat(xs, axis=0)
        layers: dict[int, list[tf.Tensor]] = {}
        for i, hs in acts:  # per-tower forward calls append one tower at a time, in tower order
            layers.setdefault(i, []).extend(hs)
        k = self.accumulate  # micro-batch j of every tower, then j + 1: put each tower's rows together
        cap["acts"] = {str(i): tf.concat([hs[j * n + r] for r in range(n) for j in range(k)], axis=0)
                       for i, hs in layers.items() if len(hs) == n * k}
        cap["loss"] = tf.stack(cap["loss"])
        for key in ("grads", "clipped"):
            if key in cap:
                cap[key] = [tf.stack([g_r[j] for g_r in cap[key]]) for j in range(len(self.names))]
        return loss, grads, cap

    def step(self, x: np.ndarray | tf.Tensor, y: np.ndarray | tf.Tensor,
             extra: Mapping[str, np.ndarray | tf.Tensor] | None = None,
             capture: bool = False) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """One synchronous step on a global batch.

        Args:
            x: ``[B, *input_shape]``; y: targets ``[B, ...]``.
            extra: more per-example arrays ``[B, ...]`` (dropout masks), split
                like ``x`` and handed to ``towers_fn``.
            capture: also keep this step's per-tower values in :attr:`captured`: a second
                trace of the step computes them from the same parameters and applies nothing,
                then the plain step trains (so the run's trajectory is the one without a capture).
        Returns:
            the combined loss (a scalar) and the combined gradient applied, by name.

        :attr:`captured` after a capture step (N towers, B rows, shards concatenated in tower order)::

            x [B, ...], sizes [N], loss [N] (each tower's own loss l_r),
            act/<layer> [B, ...] (each layer's output), grad/<name> [N, ...] (d l_r / d param,
            before clipping and weighting), clipped/<name> [N, ...] (per_device clipping),
            combined/<name> [...] (the combined gradient before after_combine clipping)

        numpy arrays, or past the spill threshold :class:`~parity_tests.protocol.rows.RowArray` s (files).
        """
        if extra and self.towers_fn is None:
            raise ValueError("per-example extras (dropout masks) need a towers_fn")
        extra = {k: tf.convert_to_tensor(v) for k, v in (extra or {}).items()}
        x, y = tf.convert_to_tensor(x), tf.convert_to_tensor(y)
        if capture:
            kept = [tf.identity(v) for v in self.state]  # the moving statistics before the capture's forward pass
            _, _, cap = self._capture_step(x, y, extra)
            for v, before in zip(self.state, kept, strict=True):
                v.assign(before)
            sizes = shard_sizes(int(x.shape[0]), len(self.devices), self.shard)
            # each tensor let go as its copy is made: the captured step is N + 2 copies of the model, not held
            # twice, and past the spill threshold each copy goes to a file as it is made (protocol.rows.Keeper)
            keep = Keeper()
            out = {"x": keep(cap.pop("x").numpy()), "sizes": np.asarray(sizes, np.int64), "loss": keep(cap.pop("loss").numpy())}
            acts = cap.pop("acts")
            out.update({f"act/{i}": keep(acts.pop(i).numpy()) for i in list(acts)})
            for key, prefix in (("grads", "grad"), ("clipped", "clipped")):
                if key in cap:
                    stacked = cap.pop(key)
                    out.update({f"{prefix}/{k}": keep(stacked.pop(0).numpy()) for k in self.names})
            out.update({f"combined/{k}": keep(tf.convert_to_tensor(g).numpy())
                        for k, g in zip(self.names, cap["combined"], strict=True)})
            del cap
            self.captured = out
        loss, grads = self._step(x, y, extra)
        # an embedding's IndexedSlices gradient is recorded as the dense sum it stands for
        return loss.numpy(), {k: tf.convert_to_tensor(g).numpy() for k, g in zip(self.names, grads, strict=True)}

    def values(self) -> dict[str, np.ndarray]:
        """Current parameter values by canonical name."""
        return {k: v.numpy() for k, v in zip(self.names, self.variables, strict=True)}
