"""The DDP port of ``optim_tf.towers``: the ``torch.optim`` class the case names, handed to the tool with ``run.use_optimizer``.

Written as a GPT trainer is: decay / no-decay parameter groups (``optimizer.no_decay``, by parameter
kind), gradient accumulation under ``no_sync`` (``parallel.accumulate``), ``clip_grad_norm_`` on the
all-reduced gradient (``parallel.clip``), warm-up + cosine with torch's own schedulers. No TensorFlow
here: every rank imports this file.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import torchref

NAMES = {"0.kernel": "0.weight", "0.bias": "0.bias", "1.kernel": "2.weight", "1.bias": "2.bias"}


def torch_optimizer(opt: dict, params) -> torch.optim.Optimizer:
    name, lr = opt["name"], opt["lr"]
    wd = opt.get("weight_decay", 0.0)
    if name in ("adam", "amsgrad"):
        return torch.optim.Adam(params, lr, betas=(opt["beta1"], opt["beta2"]), eps=opt["epsilon"],
                                amsgrad=name == "amsgrad", weight_decay=wd)
    if name == "adamw":
        return torch.optim.AdamW(params, lr, betas=(opt["beta1"], opt["beta2"]), eps=opt["epsilon"], weight_decay=wd)
    if name == "rmsprop":
        return torch.optim.RMSprop(params, lr, alpha=opt["rho"], eps=opt["epsilon"], momentum=opt["momentum"],
                                   centered=opt["centered"])
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr, initial_accumulator_value=opt["initial_accumulator"], eps=opt["epsilon"])
    if name == "adadelta":
        return torch.optim.Adadelta(params, lr, rho=opt["rho"], eps=opt["epsilon"])
    return torch.optim.SGD(params, lr, momentum=opt.get("momentum", 0.0), nesterov=name == "nesterov")


def torch_scheduler(opt: dict, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler | None:
    """Warm-up + cosine as a torch user writes it with torch's own schedulers (stepped after each update)."""
    schedule = opt.get("schedule", {"kind": "constant"})
    if schedule["kind"] != "warmup_cosine":
        return None
    k, d, m, lr = schedule["warmup_steps"], schedule["decay_steps"], schedule["min_lr"], opt["lr"]
    sched = torch.optim.lr_scheduler
    parts = [sched.LinearLR(optimizer, start_factor=1.0 / k, total_iters=k - 1),
             sched.CosineAnnealingLR(optimizer, T_max=d, eta_min=m),
             sched.ConstantLR(optimizer, factor=m / lr, total_iters=2**62)]
    return sched.SequentialLR(optimizer, parts, milestones=[k - 1, k - 1 + d])


@torchref.plugin.distributed(dtypes=("float32", "float64"))
def ddp(run):
    net = torch.nn.Sequential(torch.nn.Linear(5, 10), torch.nn.ReLU(), torch.nn.Linear(10, 1)).to(run.torch_dtype)
    net.load_state_dict({NAMES[k]: torch.as_tensor(run.to_torch(v)) for k, v in run.initial.items()})
    model = DDP(net, process_group=run.group)
    named = {k: dict(net.named_parameters())[v] for k, v in NAMES.items()}
    kinds = run.spec["optimizer"].get("no_decay", [])  # ["bias"]: the biases take no weight decay
    skip = [p for k, p in named.items() if k.rsplit(".", 1)[-1] in kinds]
    groups = ([{"params": [p for p in net.parameters() if all(p is not q for q in skip)]},
               {"params": skip, "weight_decay": 0.0}] if skip else model.parameters())
    opt = torch_optimizer(run.spec["optimizer"], groups)
    k = run.spec["parallel"].get("accumulate", 1)
    clip = run.spec["parallel"].get("clip")
    scheduler = torch_scheduler(run.spec["optimizer"], opt)
    run.use_optimizer(opt, named, scheduler=scheduler)  # under --lockstep: the reference's slots, step, schedule

    def params():
        return {k: run.to_tf(p) for k, p in named.items()}

    run.begin(params())
    for x, y in run.batches():
        opt.zero_grad()
        loss = torch.zeros((), dtype=run.torch_dtype)
        for j, (xm, ym) in enumerate(zip(np.array_split(x, k), np.array_split(y, k), strict=True)):
            # all-reduce only after the last micro-batch
            with model.no_sync() if j < k - 1 else contextlib.nullcontext():
                part = torch.nn.functional.binary_cross_entropy_with_logits(model(torch.as_tensor(xm)),
                                                                            torch.as_tensor(ym)) / k
                part.backward()
            loss = loss + part.detach()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip["global_norm"])
        grads = {k: run.to_tf(p.grad) for k, p in named.items()}
        opt.step()
        if scheduler is not None:
            scheduler.step()
        logged = loss.detach().clone()
        dist.all_reduce(logged, group=run.group)
        run.record(logged / run.world_size, params(), grads=grads)


@torchref.plugin.distributed(dtypes=("float32", "float64"))
def ddp_without_handover(run):
    """``ddp`` without ``run.use_optimizer``: fine for a free run, refused under --lockstep with a stateful optimizer."""
    run.use_optimizer = lambda *a, **k: None
    ddp(run)


@torchref.plugin.distributed(dtypes=("float32", "float64"))
def ddp_twin(run):
    """``ddp`` under another name: a second plugin to compare it with."""
    ddp(run)
