"""Classic DDP-side bugs, as plugins: a correct DDP loop and its mutants (no TensorFlow here).

:func:`reference` is a correct ``DistributedDataParallel`` training loop written
the way a user writes one, for the same cases as ``tf_towers.reference``: the
dense/batch-norm models, plain SGD (constant or step schedule), ``equal`` or
``by_size`` weighting (each rank's loss scaled by ``N n_r / B`` before DDP
averages), a global-norm clip after the all-reduce (TensorFlow's
``c / max(norm, c)``, written out: ``clip_grad_norm_`` adds 1e-6 to the norm),
and local batch norm (``BatchNorm1d``: DDP broadcasts rank 0's buffers at every
forward, so rank 0's moving statistics are kept). The logged loss is the
weighted mean of the ranks' losses (an all-reduce).

Every other plugin is the same loop with one change (``bug=...``), marked where
it happens in :func:`_ddp`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817

import torchref

DTYPES = ("float32", "float64")


def _lr(spec: dict, t: int) -> float:
    opt = spec["optimizer"]
    sched = opt.get("schedule", {"kind": "constant"})
    if sched["kind"] == "step":
        return sched["values"][sum(1 for b in sched["boundaries"] if b < t)]
    return opt["lr"]


def _build(run) -> tuple[torch.nn.Module, dict, dict]:
    """The case's model as a ``torch.nn.Sequential``, loaded from ``run.initial``; canonical -> torch names."""
    mods, params, buffers = [], {}, {}
    width = run.spec["model"]["input_shape"][0]
    for i, layer in enumerate(run.spec["model"]["layers"]):
        j = len(mods)
        if layer["type"] == "dense":
            mods.append(torch.nn.Linear(width, layer["units"], bias=layer.get("use_bias", True)))
            params[f"{i}.kernel"] = f"{j}.weight"
            if layer.get("use_bias", True):
                params[f"{i}.bias"] = f"{j}.bias"
            width = layer["units"]
            act = {"relu": torch.nn.ReLU, "tanh": torch.nn.Tanh, "sigmoid": torch.nn.Sigmoid}.get(layer.get("activation"))
            if act is not None:
                mods.append(act())
        elif layer["type"] == "batch_norm":
            mods.append(torch.nn.BatchNorm1d(width, eps=layer["epsilon"], momentum=1.0 - layer["momentum"]))
            params[f"{i}.gamma"], params[f"{i}.beta"] = f"{j}.weight", f"{j}.bias"
            buffers[f"{i}.moving_mean"], buffers[f"{i}.moving_variance"] = f"{j}.running_mean", f"{j}.running_var"
        else:
            raise ValueError(f"layer type {layer['type']!r} is not in this plugin")
    net = torch.nn.Sequential(*mods).to(run.torch_dtype)
    sd = {tn: torch.as_tensor(run.to_torch(run.initial[cn])) for cn, tn in {**params, **buffers}.items()}
    net.load_state_dict(sd, strict=False)
    return net, params, buffers


def _clip(params: list, c: float) -> None:
    """TensorFlow's global-norm rule: every gradient times ``c / max(norm, c)``."""
    norm = torch.sqrt(sum((p.grad * p.grad).sum() for p in params))
    scale = c / torch.clamp(norm, min=c)
    for p in params:
        p.grad.mul_(scale)


def _ddp(run, bug: str | None = None) -> None:
    spec = run.spec
    par = spec["parallel"]
    n, rank = run.world_size, run.rank
    net, pnames, bnames = _build(run)
    model = net if bug == "manual_allreduce" else DDP(net, process_group=run.group)
    opt = torch.optim.SGD(net.parameters(), lr=_lr(spec, 1))
    named, bufs = dict(net.named_parameters()), dict(net.named_buffers())

    def params() -> dict:
        return {k: run.to_tf(named[v].detach()) for k, v in pnames.items()}

    def state() -> dict:
        return {k: bufs[v].detach() for k, v in bnames.items()}

    run.begin(params(), state())
    share = len(run.shard()) / spec["data"]["global_batch"]  # n_r / B
    if bug != "manual_allreduce":  # each rank's own gradient before the all-reduce, for localisation
        run.hook_gradients(model, {k: named[v] for k, v in pnames.items()},
                           scale=n * share if par["weighting"] == "by_size" else 1.0)
    for t, (x, y) in enumerate(run.batches(), start=run.first_step):
        for group in opt.param_groups:
            group["lr"] = _lr(spec, t)
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(model(torch.as_tensor(x)), torch.as_tensor(y))
        objective = loss * (n * share) if par["weighting"] == "by_size" else loss
        if bug == "loss_times_world_size":  # "DDP averages, I want the sum": every gradient N times too large
            objective = objective * n
        objective.backward()
        if bug == "manual_allreduce":  # control: no DDP wrapper, the gradients summed over ranks and divided by N
            for p in net.parameters():
                dist.all_reduce(p.grad, group=run.group)
                p.grad.div_(n)
        if par.get("clip") is not None:
            _clip(list(net.parameters()), par["clip"]["global_norm"])
        grads = {k: run.to_tf(named[v].grad.detach()) for k, v in pnames.items()}  # the gradient applied
        if not (bug == "replica_skips_update" and rank == n - 1 and t == 2):  # the last rank skips step 2
            opt.step()
        logged = loss.detach() * (share if par["weighting"] == "by_size" else 1.0 / n)
        if bug != "loss_not_averaged":  # loss_not_averaged: rank 0 logs its own shard's loss
            dist.all_reduce(logged, group=run.group)
        else:
            logged = loss.detach()
        run.record(logged, params(), grads=grads, state=state(), device_loss=loss, device_inputs=x)


@torchref.plugin.distributed(dtypes=DTYPES)
def reference(run):
    """Correct DDP: the mean of the ranks' gradients (DDP's all-reduce), applied once per step on every rank."""
    _ddp(run)


@torchref.plugin.distributed(dtypes=DTYPES)
def loss_times_world_size(run):
    """The loss is multiplied by the world size before backward (to "undo" DDP's average)."""
    _ddp(run, "loss_times_world_size")


@torchref.plugin.distributed(dtypes=DTYPES)
def loss_not_averaged(run):
    """The logged loss is rank 0's own shard's loss, not the mean over ranks."""
    _ddp(run, "loss_not_averaged")


@torchref.plugin.distributed(dtypes=DTYPES)
def replica_skips_update(run):
    """The last rank skips the optimizer step of step 2 (a rank-dependent branch around ``opt.step()``)."""
    _ddp(run, "replica_skips_update")


@torchref.plugin.distributed(dtypes=DTYPES)
def manual_allreduce(run):
    """Control: no DDP wrapper; each gradient all-reduced (sum) and divided by the world size by hand."""
    _ddp(run, "manual_allreduce")
