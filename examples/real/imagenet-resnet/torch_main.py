"""tfpar compare examples/real/imagenet-resnet/case.json --impls examples/real/imagenet-resnet/tf_towers.py:towers,examples/real/imagenet-resnet/torch_main.py:main_worker

A port of pytorch/examples ``imagenet/main.py`` (https://github.com/pytorch/examples,
commit 42068585f7da9a2f8656f793d21c30ee6806c6b9, the last commit to touch that file;
snapshot HEAD 77f55b912142e11fcfdf5b530231fb9c52f181e8) as a tfpar torch plugin, run
distributed, with the model it builds by default, ``resnet18`` (``resnet_torch.py``, at a
tiny size). Line numbers are those of that commit. The original is not copied here; each
part below is written anew and names the lines it follows.

The program: ``main_worker`` (lines 137-306) initialises the process group, builds
``models.__dict__[args.arch]()``, and then (lines 167-197) wraps it in
``DistributedDataParallel`` only on an accelerator: on a CPU (``use_accel`` false) it
prints "using CPU, this will be slow" and trains the bare model; it builds
``nn.CrossEntropyLoss()``, ``SGD(model.parameters(), lr=0.1, momentum=0.9,
weight_decay=1e-4)`` and ``StepLR(step_size=30, gamma=0.1)`` (stepped once an epoch).
``train`` (lines 309-355) puts the model in train mode and, per batch of its
``DistributedSampler``: forward, ``criterion``, ``losses.update(loss.item(), n)`` (the
rank's own loss), ``zero_grad``, ``backward``, ``step``.

What differs from the original, and why (marked ``tfpar:`` in the code):

* the process group is the tool's (gloo, the default group while the plugin runs); the
  model is the case's ResNet, built in the case dtype and loaded with the case's weights
  (``init.npz``: torchvision's initialisation, drawn once);
* the batches are the case's (``run.batches()``: this rank's contiguous shard of each
  global batch) instead of ``ImageFolder`` + ``DistributedSampler`` + transforms; images
  arrive channels-last and are moved to ``[n, 3, h, w]``;
* the hyperparameters are read from the case (the program's defaults: lr 0.1, momentum
  0.9, weight decay 1e-4); ``StepLR`` is kept, but the case's steps are all in epoch 0;
* accuracy, timing meters, validation and checkpoints are left out; the loss recorded is
  the one ``losses.update`` receives on the rank (rank 0's is the trajectory's).

Three entry points:

``main_worker``
    the program as written, on a CPU: no ``DistributedDataParallel``. Each rank trains
    its own replica on its own shard.
``main_worker_ddp``
    the accelerator path's ``DistributedDataParallel(model)`` (line 187), on the CPU.
``main_worker_ddp_mean_loss``
    that, and the loss recorded as the mean over ranks (all-reduced), the number a
    tower program logs, instead of the rank's own.

No TensorFlow import here: every rank imports this file.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.lr_scheduler import StepLR

import torchref

sys.path.insert(0, str(Path(__file__).resolve().parent))
from names import case_name  # noqa: E402
from resnet_torch import ResNet  # noqa: E402


# --------------------------------------------------------------------------------------------
# The program (main.py lines 137-355), written anew; changed parts marked "tfpar:".
# --------------------------------------------------------------------------------------------
def build(run, *, use_ddp: bool):
    """Lines 158-207: the model (DDP-wrapped on an accelerator only), criterion, optimizer, scheduler."""
    model = _case_resnet18(run)                                      # tfpar: changed (resnet18(): the case's size)
    if use_ddp:                                                      # tfpar: the accelerator path's
        model = torch.nn.parallel.DistributedDataParallel(model)
    # else: line 167, "using CPU, this will be slow": the bare model
    criterion = nn.CrossEntropyLoss()
    opt = run.spec["optimizer"]                                      # tfpar: changed (args.lr, ...)
    optimizer = torch.optim.SGD(model.parameters(), opt["lr"], momentum=opt["momentum"],
                                weight_decay=opt["weight_decay"])
    scheduler = StepLR(optimizer, step_size=30, gamma=0.1)
    return model, criterion, optimizer, scheduler


def train_batch(model, criterion, optimizer, images, target):
    """Lines 334-349: one batch of ``train``; returns what ``losses.update`` receives."""
    output = model(images)
    loss = criterion(output, target)
    logged = loss.item()                                             # losses.update(loss.item(), n)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return logged


# --------------------------------------------------------------------------------------------
# Glue: the case's weights in, the case's batches through, every step recorded.
# --------------------------------------------------------------------------------------------
def _case_resnet18(run) -> ResNet:
    widths = tuple(run.initial[k].shape[-1] for k in ("layer1.0.conv1.kernel", "layer2.0.conv1.kernel",
                                                      "layer3.0.conv1.kernel", "layer4.0.conv1.kernel"))
    blocks = tuple(len({k.split(".")[1] for k in run.initial if k.startswith(f"layer{s}.")}) for s in range(1, 5))
    model = ResNet(widths, blocks, run.initial["fc.bias"].shape[0], run.torch_dtype)
    with torch.no_grad():
        for key, value in model.state_dict().items():
            name = case_name(key, _is_bn(model, key))
            if name is not None:
                value.copy_(torch.as_tensor(run.to_torch(run.initial[name], layout=_layout(model, key))))
    return model


def _layout(model: nn.Module, key: str) -> str:
    """How torch holds the array ``key`` against the case's TensorFlow layout (an external model's arrays are told
    theirs: docs/plugins.md, "Layouts"): a conv or linear weight, else the same array."""
    module = model.get_submodule(key.rsplit(".", 1)[0])
    if key.endswith(".weight") and isinstance(module, nn.Conv2d):
        return "conv"
    return "dense" if key.endswith(".weight") and isinstance(module, nn.Linear) else "none"


def _is_bn(model: nn.Module, key: str) -> bool:
    return isinstance(model.get_submodule(key.rsplit(".", 1)[0]), nn.BatchNorm2d)


def _snapshot(run, net: nn.Module) -> tuple[dict, dict]:
    params, state = {}, {}
    for key, value in net.state_dict().items():
        name = case_name(key, _is_bn(net, key))
        if name is None:
            continue
        (state if key.endswith(("running_mean", "running_var")) else params)[name] = run.to_tf(value.detach(), layout=_layout(net, key))
    return params, state


def _grads(run, net: nn.Module) -> dict:
    """The gradient each parameter holds after ``backward`` (DDP's average; weight decay is the optimizer's)."""
    return {case_name(key, _is_bn(net, key)): run.to_tf(p.grad, layout=_layout(net, key)) for key, p in net.named_parameters()}


def _main_worker(run, *, use_ddp: bool, mean_loss: bool) -> None:
    model, criterion, optimizer, scheduler = build(run, use_ddp=use_ddp)
    net = model.module if use_ddp else model
    model.train()
    params, state = _snapshot(run, net)
    run.begin(params, state)
    for images, target in run.batches():
        images = torch.as_tensor(images).permute(0, 3, 1, 2)         # [n, h, w, 3] -> [n, 3, h, w]
        logged = train_batch(model, criterion, optimizer, images, torch.as_tensor(target))
        if mean_loss:                                                # tfpar: the fixed variant's log
            total = torch.tensor(logged, dtype=run.torch_dtype)
            dist.all_reduce(total)
            logged = (total / run.world_size).item()
        params, state = _snapshot(run, net)
        run.record(torch.tensor(logged, dtype=run.torch_dtype), params, grads=_grads(run, net), state=state)
    # scheduler.step() runs at the end of an epoch (line 291): after the case's steps


@torchref.plugin.distributed(dtypes=("float32", "float64"))
def main_worker(run):
    """As written, on a CPU: no DistributedDataParallel; each rank logs its own loss."""
    _main_worker(run, use_ddp=False, mean_loss=False)


@torchref.plugin.distributed(dtypes=("float32", "float64"))
def main_worker_ddp(run):
    """The accelerator path's DistributedDataParallel on the CPU; each rank logs its own loss."""
    _main_worker(run, use_ddp=True, mean_loss=False)


@torchref.plugin.distributed(dtypes=("float32", "float64"))
def main_worker_ddp_mean_loss(run):
    """DistributedDataParallel, and the loss logged as the mean over ranks."""
    _main_worker(run, use_ddp=True, mean_loss=True)
