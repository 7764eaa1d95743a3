"""NVIDIA-NeMo/Automodel #3846 / PR #3830, reproduced: ``loss * dp_size`` on a local mean, micro-batches summed.

    tfpar compare examples/wild/automodel-dp-size-local-mean/case.json --impls examples/wild/automodel-dp-size-local-mean/ddp.py:fixed,examples/wild/automodel-dp-size-local-mean/ddp.py:buggy

Origin (written anew, not copied): NVIDIA-NeMo/Automodel at 06925ed3efa20a793da3d1bc5acebd1a824da70c,
``nemo_automodel/recipes/llm/train_seq_cls.py``: L90 ``self.loss_fn = torch.nn.CrossEntropyLoss()`` (a
*local* per-micro-batch mean), L227-242 the loop over the step's micro-batches ending in ``(loss *
self._get_dp_group_size(include_cp=True)).backward()``, with no division by the number of micro-batches.
DDP averages over the ranks, so the gradient is ``(1/N) sum_r N sum_j d mean_{r,j} = N k d(global mean)``:
8x at 4 ranks x 2 micro-batches (32x at 8 x 4). ``* dp_size`` is right only beside a denominator
all-reduced over the ranks, as ``train_ft.py`` has it (L1193, L1211-1213); the fix gives the sequence
classifier the same: the loss summed over the micro-batch and divided by the labelled rows of the whole
step, all ranks and micro-batches, times ``dp_size``.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817

import torchref

NAMES = {"0.kernel": "0.weight", "0.bias": "0.bias", "1.kernel": "2.weight", "1.bias": "2.bias"}


def _train(run, *, local_mean: bool) -> None:
    net = torch.nn.Sequential(torch.nn.Linear(5, 10), torch.nn.ReLU(), torch.nn.Linear(10, 1)).to(run.torch_dtype)
    net.load_state_dict({t: torch.as_tensor(run.to_torch(run.initial[c])) for c, t in NAMES.items()})
    model = DDP(net, process_group=run.group)
    named = dict(net.named_parameters())
    run.hook_gradients(model, {c: named[v] for c, v in NAMES.items()})   # each rank's accumulated gradient
    o = run.spec["optimizer"]
    opt = torch.optim.AdamW(net.parameters(), lr=o["lr"], weight_decay=o["weight_decay"], eps=o["epsilon"])
    k, dp = run.spec["parallel"].get("accumulate", 1), run.world_size
    params = lambda: {c: run.to_tf(named[v].detach()) for c, v in NAMES.items()}  # noqa: E731
    run.begin(params())
    for x, y in run.batches():
        rows = torch.tensor(float(len(y)), dtype=run.torch_dtype)
        dist.all_reduce(rows, group=run.group)                   # the step's rows over every rank
        means = []
        for j, (xm, ym) in enumerate(zip(np.array_split(x, k), np.array_split(y, k), strict=True)):
            with model.no_sync() if j < k - 1 else contextlib.nullcontext():
                logits = model(torch.as_tensor(xm))
                if local_mean:   # train_seq_cls.py: CrossEntropyLoss() (a local mean) times dp_size, summed over j
                    loss = F.binary_cross_entropy_with_logits(logits, torch.as_tensor(ym))
                    (loss * dp).backward()
                else:            # the fix: a sum over the micro-batch, divided by the step's rows over all ranks
                    loss_sum = F.binary_cross_entropy_with_logits(logits, torch.as_tensor(ym), reduction="sum")
                    (loss_sum / rows * dp).backward()
                    loss = loss_sum / len(ym)
            means.append(loss.detach())
        grads = {c: run.to_tf(named[v].grad) for c, v in NAMES.items()}
        opt.step()
        opt.zero_grad()
        local = torch.stack(means).mean()
        logged = local.clone()
        dist.all_reduce(logged, group=run.group)                 # the logged loss: right in both versions
        run.record(logged / dp, params(), grads=grads, device_loss=local, device_inputs=x)


@torchref.plugin.distributed(dtypes=("float32", "float64"))
def buggy(run):
    """Before the fix: ``(local mean * dp_size).backward()`` per micro-batch: N x k times the gradient."""
    _train(run, local_mean=True)


@torchref.plugin.distributed(dtypes=("float32", "float64"))
def fixed(run):
    """After the fix: the micro-batch's sum over the step's rows on every rank, times ``dp_size``."""
    _train(run, local_mean=False)
