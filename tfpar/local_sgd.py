"""``param_mean``: local SGD over towers, every device updating its own copy, parameters averaged every ``period`` steps.

The classic tower programs' third way of combining towers: each device applies its own update
to its own copy of the parameters, then the copies are averaged. Precisely,
for N devices with weights ``w_r`` (``equal``: 1/N; ``by_size``: n_r/B) and
``period`` p, step k = 1, 2, ...:

1. device r computes ``l_r`` and ``g_r = d l_r / d theta_r`` on its shard of
   step k's global batch, at *its own* parameters ``theta_r``;
2. device r applies its own optimizer to its own copy:
   ``theta_r, s_r <- update(theta_r, s_r, g_r)`` (``s_r``: its optimizer state,
   slots and step counter; with ``parallel.clip`` ``per_device``, ``g_r`` is
   clipped first);
3. if ``k % p == 0``: ``theta_r <- sum_q w_q theta_q`` for every r.

The optimizer state ``s_r`` is *never* averaged (as in torch's
``PeriodicModelAverager``, which averages ``parameters()`` only): each device
keeps its own momentum / Adam moments for the whole run.

Recorded trajectory: ``param/<name>[k]`` = ``sum_r w_r theta_r`` after step k
(on an averaging step this *is* every device's copy; between averages it is
the weighted mean of copies that differ); ``loss[k-1]`` = ``sum_r w_r l_r``,
each ``l_r`` at device r's own copy before step k. No ``grad/*``: no single
combined gradient is ever applied.

Identity (checked by the property tests): with plain SGD (any lr schedule,
weight decay included) or momentum and ``period = 1``, the copies start every
step equal, so ``sum_r w_r (theta - lr g_r) = theta - lr sum_r w_r g_r``: the
``grad_mean`` update. It fails for Adam (``m / sqrt(v)`` is not linear in g)
and for ``period > 1`` (the gradients are taken at different parameters).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from parity_tests.protocol.recorder import Recorder

from . import tokens
from .combine import combine_losses, tower_weights
from .devices import tower_devices
from .losses import model_loss
from .models import forward, is_state
from .optimizers import GradientClip, Optimizer, make_clip, make_optimizer
from .sharding import shard_sizes, split_batch

__all__ = ["LocalSGDTrainer", "run_param_mean", "step_batches", "shard_loss_fn"]


class LocalSGDTrainer:
    """N copies of the variables (one per tower device), N optimizers, periodic weighted averages.

    Args:
        loss_fn: ``loss_fn(params, x, y, masks) -> scalar``, the loss of one shard
            (``masks``: layer index -> that shard's dropout keep-mask).
        init: canonical name -> initial value (numpy), trainable parameters only.
        make_optimizer: builds one fresh optimizer (called once per device).
        devices: one device name per tower; copy r and its optimizer slots live there.
        dtype: the variables' dtype.
        period: local steps between averages (>= 1).
        shard: ``contiguous`` or ``strided``; weighting: ``equal`` or ``by_size``.
        combine_device: where the average is computed (default: the first device).
        clip: ``where="per_device"`` clips each device's gradient before its own
            update (the only place there is: no gradient is combined).
    """

    def __init__(
        self,
        loss_fn: Callable[..., tf.Tensor],
        init: Mapping[str, np.ndarray],
        make_optimizer: Callable[[], Optimizer],
        devices: Sequence[str],
        *,
        dtype: tf.DType,
        period: int = 1,
        shard: str = "contiguous",
        weighting: str = "equal",
        combine_device: str | None = None,
        clip: GradientClip | None = None,
    ) -> None:
        if period < 1:
            raise ValueError(f"period must be >= 1, got {period}")
        if clip is not None and clip.where != "per_device":
            raise ValueError("param_mean clips each device's own gradient: clip.where must be per_device")
        self.loss_fn, self.clip = loss_fn, clip
        self.names = list(init)
        self.devices = list(devices)
        self.period, self.shard, self.weighting = period, shard, weighting
        self.combine_device = combine_device or self.devices[0]
        self.copies: list[list[tf.Variable]] = []
        self.optimizers: list[Optimizer] = []
        for r, dev in enumerate(self.devices):
            with tf.device(dev):
                copy = [tf.Variable(np.asarray(init[k]), dtype=dtype, name=f"{k.replace('.', '_')}_dev{r}")
                        for k in self.names]
                opt = make_optimizer()
                opt.build(copy)
            self.copies.append(copy)
            self.optimizers.append(opt)
        self.steps_done = 0
        self.weights: list[float] | None = None
        # three functions rather than one with a Python flag: each is traced once per run
        self._local = tf.function(self._local_impl, reduce_retracing=True, autograph=False)
        self._mean_only = tf.function(lambda: self._mean_impl(assign=False), autograph=False)
        self._average = tf.function(lambda: self._mean_impl(assign=True), autograph=False)

    def _mean_impl(self, *, assign: bool) -> list[tf.Tensor]:
        """``sum_r w_r theta_r`` per variable, ``[V]`` tensors (a plain mean for ``equal``); ``assign``: into every copy."""
        out = []
        with tf.device(self.combine_device):
            for i in range(len(self.names)):
                stacked = tf.stack([copy[i] for copy in self.copies], axis=0)  # [N, *shape]
                if self.weights is None:
                    out.append(tf.reduce_mean(stacked, axis=0))
                else:
                    w = tf.reshape(tf.constant(self.weights, dtype=stacked.dtype), [-1] + [1] * (stacked.shape.rank - 1))
                    out.append(tf.reduce_sum(stacked * w, axis=0))
            if assign:
                for copy in self.copies:
                    for v, m in zip(copy, out, strict=True):
                        v.assign(m)
        return out

    def _local_impl(self, x: tf.Tensor, y: tf.Tensor, masks: Mapping[str, tf.Tensor]) -> tf.Tensor:
        """Every device's own step on its own copy; returns ``sum_r w_r l_r``."""
        n = len(self.devices)
        xs, ys = split_batch(x, n, self.shard), split_batch(y, n, self.shard)
        ms = {k: split_batch(m, n, self.shard) for k, m in masks.items()}
        losses = []
        for r, dev in enumerate(self.devices):
            copy = self.copies[r]
            with tf.device(dev), tf.name_scope(f"tower_{r}"):
                with tf.GradientTape() as tape:
                    loss_r = self.loss_fn(dict(zip(self.names, copy, strict=True)), xs[r], ys[r],
                                          {k: m[r] for k, m in ms.items()})
                g_r = tape.gradient(loss_r, copy)
                if self.clip is not None:
                    g_r = self.clip(g_r)
                self.optimizers[r].apply(g_r, copy)
            losses.append(loss_r)
        with tf.device(self.combine_device):
            return combine_losses(losses, self.weights)

    def step(self, x: np.ndarray, y: np.ndarray, masks: Mapping[str, np.ndarray] | None = None
             ) -> tuple[np.ndarray, dict[str, np.ndarray], bool]:
        """One local step on every device, then the average if this step ends a period.

        Args:
            x: ``[B, *input_shape]``; y: targets ``[B, ...]``; masks: layer index ->
                keep-mask ``[B, ...]`` (split like ``x``).
        Returns:
            the combined loss ``sum_r w_r l_r`` (before the step), the weighted mean
            of the copies after it by name, and whether the copies were averaged.
        """
        n = len(self.devices)
        weights = tower_weights(shard_sizes(int(np.shape(x)[0]), n, self.shard), self.weighting)
        if self.steps_done and weights != self.weights:
            raise ValueError("every step's global batch must have the same size (the weights are fixed per run)")
        self.weights = weights
        self.steps_done += 1
        average = self.steps_done % self.period == 0
        m = {k: tf.convert_to_tensor(v) for k, v in (masks or {}).items()}
        loss = self._local(tf.convert_to_tensor(x), tf.convert_to_tensor(y), m)
        mean = self._average() if average else self._mean_only()
        return loss.numpy(), {k: v.numpy() for k, v in zip(self.names, mean, strict=True)}, average

    def copy_values(self, r: int) -> dict[str, np.ndarray]:
        """Device r's copy, by canonical name."""
        return {k: v.numpy() for k, v in zip(self.names, self.copies[r], strict=True)}


def step_batches(payload: Mapping[str, Any]) -> tuple[tf.DType, Callable[[int], tuple[np.ndarray, np.ndarray, dict]]]:
    """The case dtype and ``batches(k) -> (x, y, masks)``: step k's rows of the data and dropout masks."""
    spec = payload["spec"]
    dtype = tf.float64 if spec["dtype"] == "float64" else tf.float32
    x = tokens.inputs(payload["x"], dtype.as_numpy_dtype)  # token ids stay int64
    y = np.asarray(payload["y"])
    y = y.astype(np.int64) if spec["model"]["loss"] == "softmax_ce" else y.astype(dtype.as_numpy_dtype)
    masks = payload.get("masks") or {}
    batch = spec["data"]["global_batch"]

    def batches(k: int):
        rows = slice(k * batch, (k + 1) * batch)
        return x[rows], y[rows], {i: np.asarray(m[rows]) for i, m in masks.items()}

    return dtype, batches


def shard_loss_fn(model: Mapping[str, Any]) -> Callable[..., tf.Tensor]:
    """``loss_fn(params, x, y, masks)``: the case's loss of one shard (dense/conv/pool/flatten/dropout layers)."""

    def loss_fn(params, x, y, masks):
        return model_loss(model, forward(model["layers"], params, x, masks=masks or None), y)

    return loss_fn


def run_param_mean(payload: Mapping[str, Any], *, progress: Callable[[int], None] | None = None) -> dict[str, np.ndarray]:
    """``tf.towers`` for ``parallel.combine: param_mean``: train and record the trajectory.

    Returns:
        ``{"loss": [steps], "param/<name>": [steps+1, ...]}`` (module docstring: what each row holds).
    """
    spec = payload["spec"]
    par, opt_spec = spec["parallel"], spec["optimizer"]
    dtype, batches = step_batches(payload)
    init = {k: v for k, v in payload["init"].items() if not is_state(k)}
    trainer = LocalSGDTrainer(
        shard_loss_fn(spec["model"]), init, lambda: make_optimizer(opt_spec, list(init)), tower_devices(par["devices"]),
        dtype=dtype, period=par["period"], shard=par["shard"], weighting=par["weighting"], clip=make_clip(spec),
    )
    rec = Recorder({k: np.asarray(v, dtype.as_numpy_dtype) for k, v in init.items()}, grads=False)  # spills when large
    for k in range(spec["steps"]):
        loss, mean, _ = trainer.step(*batches(k))
        rec.loss(loss)
        rec.params(mean)
        if progress:
            progress(k + 1)
    return rec.finish()
