"""DDP plugins as users write them, for the where-lines of test_localise_plugins.py (issue 35).

Each records no per-device values by hand: the layer hooks see its ``nn.Module`` (docs/plugins.md,
"Activations without writing anything").

* ``accumulate`` / ``accumulate_summed``: k micro-batches per step (``parallel.accumulate``), the
  first k - 1 under ``no_sync()``; ``_summed`` forgets to divide each micro-batch's loss by k (its
  gradient is k times the mean's).
* ``flatten_in_code`` / ``flatten_in_code_tanh``: the case's ``flatten -> dense relu -> dense``
  with the flatten written in ``forward`` (no module for the hooks to see); ``_tanh`` has the
  seeded forward bug (``tanh`` for the first dense layer's ``relu``); ``flatten_in_code_strided``
  reads rows r::N of each global batch (as under ``DistributedSampler``) where the case deals
  contiguous slices.
* ``count_in_float32``: ``accumulate``'s model whose mean divides by a float32 count.
* ``clip_loss_scaled``: the case's clip applied once, after the all-reduce, to the gradient of the loss
  times 128, then unscaled.
"""

import contextlib

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import torchref

BOTH = ("float32", "float64")


class _Flat(torch.nn.Module):
    def __init__(self, n_in: int, hidden: int, act):
        super().__init__()
        self.l0, self.l1, self.act = torch.nn.Linear(n_in, hidden), torch.nn.Linear(hidden, 1), act

    def forward(self, x):
        return self.l1(self.act(self.l0(x.flatten(1))))


def _train(run, net, dense, *, divide=True, strided=False, count32=False, loss_scale=None):
    """``dense``: the ``nn.Linear`` of each canonical layer index that holds parameters; ``strided``: this rank
    reads rows r, r+N, ... of each global batch (``DistributedSampler``'s dealing), whatever the case says;
    ``count32``: the mean as a GPT trainer writes it, the summed loss times ``1 / num_tokens`` with the int64
    count made a float32 tensor (``1 / 6`` rounded to float32, 2^-25 relative, in a float64 run);
    ``loss_scale``: ``S``: the loss times ``S`` is differentiated, the case's global-norm clip applied to that
    gradient (so at ``c / S`` of the true one), then the gradient divided by ``S`` (a loss-scaled program that
    clips before it unscales)."""
    net.to(run.torch_dtype)  # before the weights go in: a float32 module would round them
    with torch.no_grad():
        for i, lin in dense.items():
            lin.weight.copy_(torch.as_tensor(run.to_torch(run.initial[f"{i}.kernel"])))
            lin.bias.copy_(torch.as_tensor(run.initial[f"{i}.bias"]))
    model = DDP(net, process_group=run.group)
    if loss_scale is not None:  # this rank's gradients before the all-reduce, d l_r / d param (the loss's S undone)
        run.hook_gradients(model, {**{f"{i}.kernel": lin.weight for i, lin in dense.items()},
                                   **{f"{i}.bias": lin.bias for i, lin in dense.items()}}, scale=loss_scale)
    opt = torch.optim.SGD(model.parameters(), lr=run.spec["optimizer"]["lr"])
    k = run.spec["parallel"].get("accumulate", 1)

    def named(attr="data"):
        return {**{f"{i}.kernel": run.to_tf(getattr(lin.weight, attr)) for i, lin in dense.items()},
                **{f"{i}.bias": getattr(lin.bias, attr) for i, lin in dense.items()}}

    run.begin(named())
    batches = ((x[run.rank::run.world_size], y[run.rank::run.world_size]) for x, y in run.global_batches()) \
        if strided else run.batches()
    for x, y in batches:
        opt.zero_grad()
        logged = torch.zeros((), dtype=run.torch_dtype)
        for j, (xj, yj) in enumerate(zip(np.array_split(x, k), np.array_split(y, k), strict=True)):
            with model.no_sync() if j < k - 1 else contextlib.nullcontext():
                logits, target = model(torch.as_tensor(xj)), torch.as_tensor(yj)
                if count32:
                    inv = 1.0 / torch.tensor(target.numel()).float()  # float32: the count's reciprocal rounded
                    loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, target, reduction="sum") * inv
                else:
                    loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, target)
                (loss / k if divide else loss).mul(loss_scale or 1.0).backward()
            logged += loss.detach() / k
        if loss_scale is not None:
            clip = run.spec["parallel"]["clip"]["global_norm"]
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)  # on the scaled gradient: the bug
            for p in model.parameters():
                p.grad.div_(loss_scale)
        grads = named("grad")  # after DDP's all-reduce: the combined gradient
        opt.step()
        dist.all_reduce(logged, group=run.group)
        run.record(logged / run.world_size, named(), grads=grads)


def _mlp():
    net = torch.nn.Sequential(torch.nn.Linear(5, 10), torch.nn.ReLU(), torch.nn.Linear(10, 1))
    return net, {0: net[0], 1: net[2]}


@torchref.plugin.distributed(dtypes=BOTH)
def accumulate(run):
    _train(run, *_mlp())


@torchref.plugin.distributed(dtypes=BOTH)
def accumulate_summed(run):
    _train(run, *_mlp(), divide=False)


def _flat(run, act, strided=False):
    n_in = int(np.prod(run.spec["model"]["input_shape"]))
    net = _Flat(n_in, run.spec["model"]["layers"][1]["units"], act)
    _train(run, net, {1: net.l0, 2: net.l1}, strided=strided)


@torchref.plugin.distributed(dtypes=BOTH)
def flatten_in_code(run):
    _flat(run, torch.relu)


@torchref.plugin.distributed(dtypes=BOTH)
def flatten_in_code_tanh(run):
    _flat(run, torch.tanh)


@torchref.plugin.distributed(dtypes=BOTH)
def flatten_in_code_strided(run):
    _flat(run, torch.relu, strided=True)


@torchref.plugin.distributed(dtypes=BOTH)
def count_in_float32(run):
    _train(run, *_mlp(), count32=True)


@torchref.plugin.distributed(dtypes=BOTH)
def clip_loss_scaled(run):
    _train(run, *_mlp(), loss_scale=128.0)
