"""The torch reference: real ``DistributedDataParallel`` on gloo, and one process on the full batch.

Each rank of the job (a subgroup of the pool, ``ctx.group``) builds the case's
model, wraps it in DDP and trains on its own shard of every global batch. DDP
averages gradients (allreduce sum / world size) during ``backward``; the
case's combine rule and weighting are expressed through what each rank
differentiates:

``grad_mean``, weighting w_r
    rank r backpropagates ``N w_r l_r``; DDP's mean gives ``sum_r w_r g_r``
    (for ``equal`` weighting ``N w_r = 1`` and the loss is used as it is:
    plain DDP).
``loss_mean``
    the combined loss ``L = sum_r w_r l_r`` is formed with torch's
    differentiable allreduce (``torch.distributed.nn.functional.all_reduce``),
    and every rank differentiates ``L``. That allreduce's backward sums the
    ranks' seeds, so rank r's local gradient is ``N w_r g_r`` and DDP's mean
    is again ``sum_r w_r g_r``: the gradient of the averaged loss.

.. warning:: DDP always divides by the world size. With ``reduction: sum``
   every rank's loss is a sum over its shard, so DDP's update is the full-batch
   sum gradient divided by N: not what one process on the full batch computes.
"""

from __future__ import annotations

import contextlib
import itertools
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from parity_tests.protocol.grad_rounding import check_rounds_gradients
from parity_tests.protocol.recorder import Recorder
from parity_tests.protocol.rows import Keeper, set_spill_threshold, spill_arrays, spill_threshold
from parity_tests.protocol.shards import shard_rows

from . import tokens
from .data import rank_batches, single_batches
from .grad_rounding import bf16_gradient, round_parameter_gradients
from .jobs import merge_captures
from .losses import model_loss
from .models import CaseModel
from .optimizers import clip_grads, exported, load_state, make_optimizer, make_scheduler
from .pool import RankContext

__all__ = ["train_rank", "train_single", "merge_captures"]


def _arrays(payload: dict[str, Any]) -> tuple[torch.dtype, torch.Tensor, torch.Tensor]:
    spec = payload["spec"]
    dtype = torch.float64 if spec["dtype"] == "float64" else torch.float32
    x = tokens.inputs(payload["x"], dtype)  # token ids stay int64
    y = payload["y"]
    y = torch.as_tensor(np.asarray(y, np.int64)) if spec["model"]["loss"] == "softmax_ce" else torch.as_tensor(np.asarray(y), dtype=dtype)
    return dtype, x, y


def _compute(spec: dict[str, Any]) -> torch.dtype | None:
    """The autocast dtype of the forward pass: bfloat16 for ``mixed_bfloat16`` (float32 parameters), else none."""
    return torch.bfloat16 if spec["dtype"] == "mixed_bfloat16" else None


def _masks(payload: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Dropout keep-masks by layer index, bool ``[rows, *layer_input_shape]`` (canonical layout)."""
    return {i: torch.as_tensor(np.asarray(m, bool)) for i, m in (payload.get("masks") or {}).items()}


def _shard_loss(module: torch.nn.Module, model_spec: dict[str, Any], x: torch.Tensor, y: torch.Tensor,
                masks: dict[str, torch.Tensor], rows: torch.Tensor | slice,
                sample_weight: torch.Tensor | None = None) -> torch.Tensor:
    """The loss of data rows ``rows`` through ``module`` (a :class:`CaseModel` or its DDP wrapper).

    Mixed precision (``CaseModel.compute`` bfloat16): the forward pass, DDP wrapper
    included, runs under ``torch.autocast("cpu", dtype=torch.bfloat16)``, as a user
    writes it; the loss is outside it, in float32 (``torchref.losses.model_loss``).
    """
    model = getattr(module, "module", module)  # DDP keeps the CaseModel as .module
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=model.compute == torch.bfloat16):
        out, logits = module(x[rows], {i: m[rows] for i, m in masks.items()}, with_logits=True)
    if getattr(model, "grads_bf16", False):  # the float64 run rounding the gradients (torchref.grad_rounding): where
        # the mixed recipe's float() of its bfloat16 output and logits rounds their gradients, once per tensor
        rounded = bf16_gradient(out)
        logits = rounded if logits is out else None if logits is None else bf16_gradient(logits)
        out = rounded
    return model_loss(model_spec, out, y[rows], logits, sample_weight=sample_weight)


def _rounding(model: CaseModel, payload: dict[str, Any], engine: str) -> None:
    """The float64 run that rounds the gradients where the mixed recipe does (``protocol.grad_rounding``): each
    parameter's gradient of every backward (before DDP's all-reduce) and, in :func:`_shard_loss`, the output's."""
    model.grads_bf16 = check_rounds_gradients(payload, engine)
    if model.grads_bf16:
        round_parameter_gradients(model.parameters())


def _weights(payload: dict[str, Any], dtype: torch.dtype) -> torch.Tensor | None:
    """Per-example sample weights ``[rows]`` (``data.sample_weights``), indexed by position like the masks."""
    w = payload.get("w")
    return None if w is None else torch.as_tensor(np.asarray(w), dtype=dtype)


def _feed(payload: dict[str, Any], x: torch.Tensor, y: torch.Tensor, rows: np.ndarray, *,
          ranks: int | None, rank: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``(x_k, y_k, positions)`` for each step k: this rank's rows and their positions in the step sequence.

    ``split`` order: rows ``k B + rows`` (``rows``: the rank's shard of a global
    batch), which are also the positions. ``distributed_sampler``: the rank's
    ``DataLoader`` over a ``DistributedSampler`` (``ranks`` = N), or one
    process's ``DataLoader(batch_size=B)`` (``ranks=None``), see
    :mod:`torchref.data`. Positions index the per-position dropout masks.
    """
    data = payload["spec"]["data"]
    batch = data["global_batch"]
    if data.get("order", "split") == "distributed_sampler":
        if ranks is None:
            return single_batches(x, y, global_batch=batch, perms=payload.get("perm"))
        return rank_batches(x, y, num_replicas=ranks, rank=rank, global_batch=batch, perms=payload.get("perm"))
    return ((x[ix], y[ix], ix) for ix in (torch.as_tensor(k * batch + rows) for k in itertools.count()))


def _accumulate(module: torch.nn.Module, model_spec: dict[str, Any], x: torch.Tensor, y: torch.Tensor,
                masks: dict[str, torch.Tensor], weights: torch.Tensor | None, k: int, backprop, *, sync: bool,
                trace: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``parallel.accumulate``: this device's rows cut into ``k`` equal contiguous micro-batches, each run
    forward and backward: ``backprop(l_j) / k`` is differentiated, so the gradients accumulated in
    ``.grad`` are the mean over the micro-batches. Under DDP (``module`` a ``DistributedDataParallel``)
    the first ``k - 1`` run inside ``no_sync()`` (forward included, as DDP requires), so DDP all-reduces
    once, on the last backward; ``sync=False`` keeps the last inside ``no_sync()`` too (per-device
    clipping all-reduces by hand). ``trace``: the captured step's layer outputs, the micro-batches'
    concatenated in row order.

    Returns:
        ``l_r = (1/k) sum_j l_j`` and the mean of ``backprop(l_j)`` (both detached).
    """
    size = len(x) // k
    losses, backpropped, traces = [], [], []
    model = getattr(module, "module", module)
    for j in range(k):
        rows = slice(j * size, (j + 1) * size)
        synced = sync and j == k - 1
        with module.no_sync() if isinstance(module, DDP) and not synced else contextlib.nullcontext():
            if trace:
                model.trace = {}
            l_j = _shard_loss(module, model_spec, x, y, masks, rows, None if weights is None else weights[rows])
            b_j = backprop(l_j)
            (b_j / k).backward()
        if trace:
            traces.append(model.trace)
        losses.append(l_j.detach())
        backpropped.append(b_j.detach())
    if trace:
        model.trace = {key: np.concatenate([t[key] for t in traces]) for key in traces[0]}
    return sum(losses) / k, sum(backpropped) / k


def _snapshot(tensors: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {k: t.detach().numpy().copy() for k, t in tensors.items()}


def _capture_hook(named: dict[str, torch.nn.Parameter], store: dict[str, Any], armed: list[bool], scale: float,
                  keep: Keeper):
    """A DDP communication hook: copy each bucket's local gradients (before the all-reduce), then all-reduce.

    The copy, divided by ``scale``, is this rank's own gradient of its loss: what it backpropagated
    was ``scale`` times that loss, before DDP's division by N. Each copy goes through ``keep``
    (past the spill threshold, to a file at once: a large model's gradients are never held whole
    beside DDP's buckets). :func:`default_hooks.allreduce_hook` then does what DDP does without a
    hook (divide by the world size, all-reduce sum).
    """
    names = {id(p): k for k, p in named.items()}

    def hook(group, bucket):  # noqa: ANN001, ANN202  (DDP checks these annotations: none, or its own types)
        if armed[0]:
            for p, g in zip(bucket.parameters(), bucket.gradients(), strict=True):
                local = g.detach().numpy()
                store[names[id(p)]] = keep(local.copy() if scale == 1.0 else local / scale)
        return default_hooks.allreduce_hook(group, bucket)

    return hook


def train_rank(ctx: RankContext, payload: dict[str, Any]) -> dict[str, np.ndarray] | None:
    """Train one rank of a DDP job; rank 0 returns the trajectory, the others ``None``.

    Runs inside a pool worker (``torchref.pool``), with ``ctx.group`` the job's
    gloo subgroup of ``ctx.world_size`` ranks.
    """
    spec = payload["spec"]
    par, model_spec = spec["parallel"], spec["model"]
    n, r = ctx.world_size, ctx.rank
    set_spill_threshold(int(payload.get("spill_bytes", spill_threshold())))  # the parent's, in this worker
    if par["devices"] != n:
        raise ValueError(f"case asks for {par['devices']} devices but the job has {n} ranks")
    dtype, x, y = _arrays(payload)
    masks = _masks(payload)
    weights = _weights(payload, dtype)
    # sync batch norm all-reduces its statistics over the job's group; local keeps each
    # rank's own, and DDP broadcasts rank 0's buffers at every forward (broadcast_buffers)
    model = CaseModel(model_spec["layers"], payload["init"], dtype,
                      batch_norm=par.get("batch_norm", "local"), group=ctx.group, compute=_compute(spec))
    _rounding(model, payload, "torch.ddp")
    # DDP broadcasts rank 0's parameters at construction: all ranks start equal anyway. The gradients
    # are views of DDP's buckets (gradient_as_bucket_view): the same values in one copy of the model
    # instead of two (the buckets and .grad), what DDP's docs advise for memory
    ddp = DDP(model, process_group=ctx.group, gradient_as_bucket_view=True)
    opt = make_optimizer(spec["optimizer"], model.parameters(), model.canonical())
    sched = make_scheduler(spec["optimizer"], opt)
    load_state(opt, sched, model.canonical(), spec["optimizer"], payload.get("opt_state"))  # lockstep's start state
    clip, clip_sem = par.get("clip"), spec["optimizer"]["semantics"]
    capture = payload.get("capture")
    local_grads: dict[str, np.ndarray] = {}
    armed = [False]
    cap: dict[str, Any] = {}
    # Per-device clipping needs each rank's *global* gradient norm before the ranks are
    # averaged. A DDP comm hook (register_comm_hook) sees one bucket at a time, and DDP
    # launches a bucket's allreduce as soon as that bucket is ready, so a hook could only
    # clip by a per-bucket norm. Hence no_sync (DDP skips its allreduce; the forward must
    # run inside it too), clip the rank's own gradient, weight it, allreduce it by hand.
    per_device = clip is not None and clip["where"] == "per_device"
    k = par.get("accumulate", 1)

    def _what_rank_backprops(l_r: torch.Tensor) -> torch.Tensor:
        """What rank r differentiates for its loss ``l_r`` (module docstring): ``l_r`` itself (per-device
        clipping, plain DDP), ``N w_r l_r`` (weighted), or ``sum_r w_r l_r`` through the differentiable
        all-reduce (``loss_mean``)."""
        if per_device:
            return l_r
        if par["combine"] == "loss_mean":
            with warnings.catch_warnings():
                # deprecated in favour of a private module; it is still the public differentiable allreduce
                warnings.simplefilter("ignore", FutureWarning)
                return dist_fn.all_reduce(l_r * w[r], op=dist.ReduceOp.SUM, group=ctx.group)
        return l_r if par["weighting"] == "equal" else l_r * (n * w[r])

    named = model.canonical()
    batch = spec["data"]["global_batch"]
    rows = [shard_rows(batch, n, q, par["shard"]) for q in range(n)]
    sizes = [len(ix) for ix in rows]
    w = ([1.0 / n] * n if par["weighting"] == "equal" else [1.0] * n if par["weighting"] == "sum"
         else [s / batch for s in sizes])
    # distributed_sampler: every rank's batch has the same size (N | B, strided), so w_r = 1/N

    # the rank backpropagates s_r l_r (s_r = 1 for plain DDP and per-device clipping, N w_r when weighted
    # or through the differentiable all-reduce of loss_mean): d l_r / d param is its gradient / s_r
    keep = Keeper()  # the captured step's copies: to files past the spill threshold, one at a time
    if capture and not per_device:  # per_device runs under no_sync: the local gradient is read directly
        scale = 1.0 if par["combine"] == "grad_mean" and par["weighting"] == "equal" else n * w[r]
        ddp.register_comm_hook(ctx.group, _capture_hook(named, local_grads, armed, scale, keep))
    feed = _feed(payload, x, y, rows[r], ranks=n, rank=r)
    # rank 0 records (rows spill to a file when a large model's history grows: parity_tests.protocol.rows);
    # the initial values are copied one parameter at a time as the recorder takes them
    rec = Recorder(((k, p.detach().numpy().copy()) for k, p in named.items()), _snapshot(model.state())) if r == 0 else None
    # beats between a step's phases too: a large model's first step (its build, a capture's copies) can take
    # longer than the pool's timeout on a loaded machine (GPT-2 small in float64: torchref.pool)
    ctx.beat()
    for step in range(1, spec["steps"] + 1):
        x_r, y_r, pos = next(feed)
        capturing = capture == step
        armed[0] = capturing
        model.trace = {} if capturing else None
        if k > 1:  # parallel.accumulate: k micro-batches, DDP's all-reduce on the last backward only
            opt.zero_grad(set_to_none=True)
            l_r, reported = _accumulate(ddp, model_spec, x_r, y_r, {i: m[pos] for i, m in masks.items()},
                                        None if weights is None else weights[pos], k, _what_rank_backprops,
                                        sync=not per_device, trace=capturing)
        else:
            with ddp.no_sync() if per_device else contextlib.nullcontext():
                l_r = _shard_loss(ddp, model_spec, x_r, y_r, {i: m[pos] for i, m in masks.items()}, slice(None),
                                  None if weights is None else weights[pos])
                opt.zero_grad(set_to_none=True)
                if per_device:
                    l_r.backward()  # g_r, this rank's own gradient, not yet weighted
        if per_device:
            if capturing:
                local_grads.update({k: keep(p.grad.detach().numpy().copy()) for k, p in named.items()})
            clip_grads(model.parameters(), clip["global_norm"], clip_sem)
            if capturing:
                cap["clipped"] = {k: keep(p.grad.detach().numpy().copy()) for k, p in named.items()}
            for p in model.parameters():
                p.grad.mul_(w[r])
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=ctx.group)
            loss_value = (l_r.detach() * w[r]).clone()
            dist.all_reduce(loss_value, op=dist.ReduceOp.SUM, group=ctx.group)
        elif par["combine"] == "loss_mean":
            if k > 1:
                loss_value = reported  # the mean over the micro-batches of sum_r w_r l_{r,j}
            else:
                total = _what_rank_backprops(l_r)
                total.backward()
                loss_value = total.detach()
        else:
            if k == 1:
                _what_rank_backprops(l_r).backward()
            loss_value = (l_r.detach() * w[r]).clone()
            dist.all_reduce(loss_value, op=dist.ReduceOp.SUM, group=ctx.group)
        ctx.beat()  # forward and backward done
        if capturing:  # local_grads: this rank's gradient of l_r (the hook divided by s_r; per-device: s_r = 1)
            cap.update({"x": x_r.numpy().copy(), "loss": l_r.detach().numpy().copy(), "step": np.asarray(step),
                        "grad": dict(local_grads),
                        "combined": {k: keep(p.grad.detach().numpy().copy()) for k, p in named.items()},
                        "act": dict(model.trace)})
            armed[0], model.trace = False, None
        if clip is not None and not per_device:
            # after DDP's allreduce: every rank holds the same combined gradient and clips it alike
            clip_grads(model.parameters(), clip["global_norm"], clip_sem)
        if r == 0:
            for name, p in named.items():
                rec.grad(name, p.grad.detach().numpy().copy())
        ctx.beat()
        opt.step()
        if sched is not None:
            sched.step()
        if r == 0:
            rec.loss(loss_value.numpy().copy())
            for name, p in named.items():
                rec.param(name, p.detach().numpy().copy())
            rec.states(_snapshot(model.state()))
        ctx.beat()  # a step done: the parent's timeout counts from here (torchref.pool)
    device = _flat_capture(cap) if cap else None
    if r != 0:  # a large model's captured arrays travel as spill files (rank 0's go through rec.add)
        return None if device is None else {"device": spill_arrays(device)}
    rec.add({f"device/{k}": v for k, v in (device or {}).items()})
    rec.add(exported(opt, named, payload))  # lockstep: the optimizer state after the run
    return rec.finish()



def _flat_capture(cap: dict[str, Any]) -> dict[str, np.ndarray]:
    """One rank's captured step as flat ``key -> array`` (``grad/<name>``, ``act/<layer>``, ...)."""
    out = {"x": cap["x"], "loss": cap["loss"], "step": cap["step"]}
    for group in ("grad", "clipped", "combined", "act"):
        out.update({f"{group}/{k}": v for k, v in cap.get(group, {}).items()})
    return out


def train_single(ctx: RankContext | None, payload: dict[str, Any]) -> dict[str, np.ndarray]:
    """One process, the whole global batch, no DDP (``torch.single``)."""
    spec = payload["spec"]
    set_spill_threshold(int(payload.get("spill_bytes", spill_threshold())))
    model_spec = spec["model"]
    dtype, x, y = _arrays(payload)
    masks = _masks(payload)
    weights = _weights(payload, dtype)
    model = CaseModel(model_spec["layers"], payload["init"], dtype, batch_norm=spec["parallel"].get("batch_norm", "local"),
                      compute=_compute(spec))
    _rounding(model, payload, "torch.single")
    opt = make_optimizer(spec["optimizer"], model.parameters(), model.canonical())
    sched = make_scheduler(spec["optimizer"], opt)
    load_state(opt, sched, model.canonical(), spec["optimizer"], payload.get("opt_state"))  # lockstep's start state
    clip = spec["parallel"].get("clip")
    k = spec["parallel"].get("accumulate", 1)
    named = model.canonical()
    batch = spec["data"]["global_batch"]
    # rows spill to a file when a large model's history grows (parity_tests.protocol.rows)
    rec = Recorder(((k, p.detach().numpy().copy()) for k, p in named.items()), _snapshot(model.state()))
    feed = _feed(payload, x, y, np.arange(batch), ranks=None)
    keep = Keeper()  # the captured step's copies: to files past the spill threshold, one at a time
    capture, cap = payload.get("capture"), {}
    beat = ctx.beat if ctx is not None else lambda: None  # between phases too, as train_rank
    beat()
    for step in range(1, spec["steps"] + 1):
        x_k, y_k, pos = next(feed)
        model.trace = {} if capture == step else None
        opt.zero_grad(set_to_none=True)
        if k > 1:  # parallel.accumulate: k micro-batches of the whole batch, their gradients' mean
            loss, _ = _accumulate(model, model_spec, x_k, y_k, {i: m[pos] for i, m in masks.items()},
                                  None if weights is None else weights[pos], k, lambda l_j: l_j, sync=True,
                                  trace=capture == step)
        else:
            loss = _shard_loss(model, model_spec, x_k, y_k, {i: m[pos] for i, m in masks.items()}, slice(None),
                               None if weights is None else weights[pos])
            loss.backward()
        beat()  # forward and backward done
        if capture == step:  # one device: its gradient is the combined one, clipped (if at all) as a whole
            local = {k: keep(p.grad.detach().numpy().copy()) for k, p in named.items()}
            cap = {"x": x_k.numpy().copy(), "loss": loss.detach().numpy().copy(), "step": np.asarray(step),
                   "grad": local, "combined": local, "act": dict(model.trace)}
            model.trace = None
        if clip is not None:
            # one device: nothing to average, so per_device and after_combine are the same
            clip_grads(model.parameters(), clip["global_norm"], spec["optimizer"]["semantics"])
            if capture == step and clip["where"] == "per_device":  # what is combined is the clipped gradient
                cap["clipped"] = cap["combined"] = {k: keep(p.grad.detach().numpy().copy()) for k, p in named.items()}
        for name, p in named.items():
            rec.grad(name, p.grad.detach().numpy().copy())
        beat()
        opt.step()
        if sched is not None:
            sched.step()
        rec.loss(loss.detach().numpy().copy())
        for name, p in named.items():
            rec.param(name, p.detach().numpy().copy())
        rec.states(_snapshot(model.state()))
        beat()  # a step done: the parent's timeout counts from here (torchref.pool)
    rec.add({f"device/{k}": v for k, v in (_flat_capture(cap) if cap else {}).items()})
    rec.add(exported(opt, named, payload))  # lockstep: the optimizer state after the run
    return rec.finish()
