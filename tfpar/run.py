"""Run one validated case on a TensorFlow implementation and record its trajectory.

Input is plain data (the case ``spec`` dict and numpy arrays, as
``parity_tests`` validated them); output is a trajectory: a dict of numpy
arrays in canonical names (``loss``, ``param/<name>``, ``grad/<name>``, and
``state/<name>`` for batch-norm moving statistics).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import tensorflow as tf

from parity_tests.protocol.grad_rounding import check_rounds_gradients
from parity_tests.protocol.payload import check_payload
from parity_tests.protocol.recorder import Recorder
from parity_tests.protocol.vocabulary import LOCAL_COMBINES  # each device applies its own updates

from .async_ import run_async
from .devices import tower_devices
from .engines import SPECS
from .grad_rounding import bf16_gradient
from .local_sgd import run_param_mean
from .lockstep import run_steps
from .losses import model_loss
from .mirrored import run_mirrored
from .models import build_variables, forward, forward_towers, is_state, needs_towers_fn
from .optimizers import make_clip, make_optimizer
from .pipeline import case_batches
from .refusals import refuse_declared
from .reuse import CACHE, Built, keyed_spec, structure_key
from .towers import TowerTrainer
from .v1 import run_v1

__all__ = ["IMPLS", "run_case"]

#: the TensorFlow engines this process runs (``tf.multiworker`` is launched one process per worker)
IMPLS = tuple(s.name for s in SPECS if s.in_process)



def _record(trainer: TowerTrainer, steps: int, batches: Callable[[int], tuple],
            progress: Callable[[int], None] | None,
            state: Mapping[str, tf.Variable] | None = None, capture: int | None = None) -> dict[str, np.ndarray]:
    state = state or {}
    # rows spill when large; the initial values are copied one variable at a time as the recorder takes them
    rec = Recorder(((name, v.numpy()) for name, v in zip(trainer.names, trainer.variables, strict=True)),
                   ((k, v.numpy()) for k, v in state.items()))
    for k in range(steps):
        loss, g = trainer.step(*batches(k), capture=capture == k + 1)
        if trainer.captured is not None:  # the per-device values of step ``capture`` (docs/localisation.md),
            # recorded at once: a large model's go to files now instead of being held through the later steps
            rec.add({f"device/{key}": v for key, v in trainer.captured.items()})
            rec.add({"device/step": np.asarray(capture)})
            trainer.captured = None
        rec.loss(loss)
        # one parameter at a time, each copy let go once recorded (a large model's rows go to files as they
        # come): never the model's values and gradients all at once beside the trainer's own
        for name, variable in zip(trainer.names, trainer.variables, strict=True):
            rec.param(name, variable.numpy())
            rec.grad(name, g.pop(name))
        rec.states((name, v.numpy()) for name, v in state.items())
        if progress:
            progress(k + 1)
    return rec.finish()


def run_case(payload: Mapping[str, Any], impl: str = "tf.towers", *,
             progress: Callable[[int], None] | None = None, feed: str | None = None) -> dict[str, np.ndarray]:
    """Train as the case says and return the trajectory.

    Args:
        payload: ``{"spec": dict, "x": [rows, ...], "y": [rows, ...], "init": {name: array}}``.
        impl: ``tf.towers`` (N towers, N = ``parallel.devices``), ``tf.single``
            (one device, the whole global batch), ``tf.v1`` (the classic tower programs'
            ``tf.compat.v1`` graph towers, :mod:`tfpar.v1`) or ``tf.mirrored``
            (``MirroredStrategy``, :mod:`tfpar.mirrored`).
        progress: called with the number of steps done.
        feed: how ``tf.towers`` and ``tf.single`` get their batches
            (:func:`tfpar.pipeline.case_batches`): ``arrays`` (sliced from the
            numpy arrays) or ``tfrecord`` (written to a TFRecord file and read
            through ``tf.data``); both give the same trajectory, bit for bit.
            Default: ``tfrecord`` for ``data.order: distributed_sampler``,
            ``arrays`` otherwise.
    Returns:
        ``{"loss": [steps], "param/<name>": [steps+1, ...], "grad/<name>": [steps, ...]}``,
        arrays in the case dtype.
    """
    if impl not in IMPLS:
        raise ValueError(f"unknown TensorFlow implementation {impl!r}")
    check_payload(payload, impl)  # every key declared (parity_tests.protocol.payload)
    rounded = check_rounds_gradients(payload, impl)  # the float64 run rounding the gradients (tfpar.grad_rounding)
    if rounded and impl not in ("tf.towers", "tf.single"):  # what tfpar.engines declares (rounds_gradients)
        raise ValueError(f"{impl} does not make the float64 run that rounds the gradients (grads_bf16)")
    # what the engine declares it runs (tfpar.engines), refused before anything trains (tfpar.refusals)
    if not refuse_declared(payload["spec"], impl):  # param_mean, async: each device applies its own updates
        combine = payload["spec"]["parallel"]["combine"]
        return run_param_mean(payload, progress=progress) if combine == "param_mean" else run_async(payload, progress=progress)
    mixed = payload["spec"]["dtype"] == "mixed_bfloat16"
    order = payload["spec"]["data"].get("order", "split")
    if impl == "tf.v1":
        return run_v1(payload, progress=progress)
    if impl == "tf.mirrored":
        return run_mirrored(payload, progress=progress)
    spec = payload["spec"]
    dtype = tf.float64 if spec["dtype"] == "float64" else tf.float32  # mixed_bfloat16: float32 master weights
    compute = tf.bfloat16 if mixed else None  # the layers' compute dtype (tfpar.models)
    par = spec["parallel"]
    n = par["devices"] if impl == "tf.towers" else 1
    devices = tower_devices(n)
    # a trainer built for this structure before (tfpar.reuse): its step is traced already
    key = structure_key(impl, devices, payload)
    built = CACHE.take(key)
    if built is None:
        built = _build(keyed_spec(spec), payload["init"], payload.get("w") is not None, devices, dtype, compute,
                       rounded)
    else:
        built.reset(payload["init"])
    feed = feed or ("tfrecord" if order == "distributed_sampler" else "arrays")
    with case_batches(payload, towers=n if impl == "tf.towers" else None, feed=feed) as batches:
        if payload.get("lockstep") is not None:  # parity_tests.session.lockstep: a step from each start state
            out = run_steps(built.trainer, built.state, batches, payload, _record)
        else:
            out = _record(built.trainer, spec["steps"], batches, progress, built.state, capture=payload.get("capture"))
    CACHE.give(key, built)  # only a finished run's trainer is kept
    return out


def _build(spec: Mapping[str, Any], init: Mapping[str, Any], weighted: bool, devices: list[str], dtype: tf.DType,
           compute: tf.DType | None, rounded: bool = False) -> Built:
    """A new trainer for ``tf.towers``/``tf.single``: variables from ``init``, a fresh optimizer.

    ``spec`` holds only the sections of :data:`tfpar.reuse.KEYED`: all a trainer that may be
    reused is built from (``weighted``: the payload has sample weights). ``rounded``: the float64 run
    that rounds the gradients where the mixed recipe does (:mod:`tfpar.grad_rounding`): each tower's loss
    reads every parameter and the model output through :func:`bf16_gradient` (a model of dense layers
    only, ``protocol.grad_rounding``: no lockstep ``towers_fn``).
    """
    par = spec["parallel"]
    model = spec["model"]
    variables = build_variables(init, dtype, device=devices[0])
    state = {k: v for k, v in variables.items() if is_state(k)}
    variables = {k: v for k, v in variables.items() if not is_state(k)}

    def loss_fn(params, x, y):
        if rounded:  # per tower (this is each tower's loss) and per micro-batch, as the mixed recipe rounds them
            params = {k: bf16_gradient(tf.convert_to_tensor(v)) for k, v in params.items()}
            return model_loss(model, bf16_gradient(forward(model["layers"], params, x, compute=compute)), y)
        return model_loss(model, forward(model["layers"], params, x, compute=compute), y)

    def towers_fn(params, xs, ys, extras):
        # lockstep: batch-norm statistics (sync) and moving averages cross towers within a step
        outs = forward_towers(model["layers"], params, xs, devices=devices, masks=extras, state=state,
                              batch_norm=par.get("batch_norm", "local"), reduce_device=devices[0], compute=compute)
        losses = []
        for out, y_r, ex, dev in zip(outs, ys, extras, devices, strict=True):
            with tf.device(dev):
                losses.append(model_loss(model, out, y_r, sample_weight=ex.get("w")))
        return losses

    trainer = TowerTrainer(
        loss_fn, variables, make_optimizer(spec["optimizer"], list(variables)), devices,
        combine=par["combine"] if par["combine"] not in LOCAL_COMBINES else "grad_mean",
        shard=par["shard"], weighting=par["weighting"],
        clip=make_clip(spec),
        # per-example extras (dropout masks, sample weights) are split with the batch by the lockstep path
        towers_fn=towers_fn if needs_towers_fn(model["layers"]) or weighted else None,
        accumulate=par.get("accumulate", 1),
        state=state,
    )
    return Built(trainer, state)
