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

import warnings
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from torch.nn.parallel import DistributedDataParallel as DDP

from .losses import shard_loss
from .models import CaseModel
from .optimizers import make_optimizer
from .pool import RankContext

__all__ = ["shard_rows", "train_rank", "train_single"]


def shard_rows(batch: int, n: int, rank: int, shard: str) -> np.ndarray:
    """Row indices of ``rank``'s shard of a global batch of ``batch`` rows.

    ``contiguous``: ``np.array_split`` order; ``strided``: rows rank, rank+N, ...
    (``DistributedSampler`` order without shuffle or padding).
    """
    if shard == "contiguous":
        return np.array_split(np.arange(batch), n)[rank]
    if shard == "strided":
        return np.arange(rank, batch, n)
    raise ValueError(f"unknown shard {shard!r}")


def _arrays(payload: dict[str, Any]) -> tuple[torch.dtype, torch.Tensor, torch.Tensor]:
    spec = payload["spec"]
    dtype = torch.float64 if spec["dtype"] == "float64" else torch.float32
    x = torch.as_tensor(np.asarray(payload["x"]), dtype=dtype)
    y = payload["y"]
    y = torch.as_tensor(np.asarray(y, np.int64)) if spec["model"]["loss"] == "softmax_ce" else torch.as_tensor(np.asarray(y), dtype=dtype)
    return dtype, x, y


def _trajectory(losses, params, grads) -> dict[str, np.ndarray]:
    traj = {"loss": np.asarray(losses)}
    traj.update({f"param/{k}": np.stack(v) for k, v in params.items()})
    traj.update({f"grad/{k}": np.stack(v) for k, v in grads.items()})
    return traj


def train_rank(ctx: RankContext, payload: dict[str, Any]) -> dict[str, np.ndarray] | None:
    """Train one rank of a DDP job; rank 0 returns the trajectory, the others ``None``.

    Runs inside a pool worker (``torchref.pool``), with ``ctx.group`` the job's
    gloo subgroup of ``ctx.world_size`` ranks.
    """
    spec = payload["spec"]
    par, model_spec = spec["parallel"], spec["model"]
    n, r = ctx.world_size, ctx.rank
    if par["devices"] != n:
        raise ValueError(f"case asks for {par['devices']} devices but the job has {n} ranks")
    dtype, x, y = _arrays(payload)
    model = CaseModel(model_spec["layers"], payload["init"], dtype)
    # DDP broadcasts rank 0's parameters at construction: all ranks start equal anyway
    ddp = DDP(model, process_group=ctx.group)
    opt = make_optimizer(spec["optimizer"], model.parameters())
    named = model.canonical()
    batch = spec["data"]["global_batch"]
    rows = [shard_rows(batch, n, q, par["shard"]) for q in range(n)]
    sizes = [len(ix) for ix in rows]
    w = [1.0 / n] * n if par["weighting"] == "equal" else [s / batch for s in sizes]
    params = {k: [p.detach().numpy().copy()] for k, p in named.items()}
    grads: dict[str, list[np.ndarray]] = {k: [] for k in named}
    losses = []
    for k in range(spec["steps"]):
        ix = torch.as_tensor(k * batch + rows[r])
        l_r = shard_loss(model_spec["loss"], model_spec["reduction"], ddp(x[ix]), y[ix])
        opt.zero_grad(set_to_none=True)
        if par["combine"] == "loss_mean":
            with warnings.catch_warnings():
                # deprecated in favour of a private module; it is still the public differentiable allreduce
                warnings.simplefilter("ignore", FutureWarning)
                total = dist_fn.all_reduce(l_r * w[r], op=dist.ReduceOp.SUM, group=ctx.group)
            total.backward()
            loss_value = total.detach()
        else:
            (l_r if par["weighting"] == "equal" else l_r * (n * w[r])).backward()
            loss_value = (l_r.detach() * w[r]).clone()
            dist.all_reduce(loss_value, op=dist.ReduceOp.SUM, group=ctx.group)
        if r == 0:
            for name, p in named.items():
                grads[name].append(p.grad.detach().numpy().copy())
        opt.step()
        if r == 0:
            losses.append(loss_value.numpy().copy())
            for name, p in named.items():
                params[name].append(p.detach().numpy().copy())
    return _trajectory(losses, params, grads) if r == 0 else None


def train_single(ctx: RankContext | None, payload: dict[str, Any]) -> dict[str, np.ndarray]:
    """One process, the whole global batch, no DDP (``torch.single``)."""
    spec = payload["spec"]
    model_spec = spec["model"]
    dtype, x, y = _arrays(payload)
    model = CaseModel(model_spec["layers"], payload["init"], dtype)
    opt = make_optimizer(spec["optimizer"], model.parameters())
    named = model.canonical()
    batch = spec["data"]["global_batch"]
    params = {k: [p.detach().numpy().copy()] for k, p in named.items()}
    grads: dict[str, list[np.ndarray]] = {k: [] for k in named}
    losses = []
    for k in range(spec["steps"]):
        sl = slice(k * batch, (k + 1) * batch)
        loss = shard_loss(model_spec["loss"], model_spec["reduction"], model(x[sl]), y[sl])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        for name, p in named.items():
            grads[name].append(p.grad.detach().numpy().copy())
        opt.step()
        losses.append(loss.detach().numpy().copy())
        for name, p in named.items():
            params[name].append(p.detach().numpy().copy())
    return _trajectory(losses, params, grads)
