"""pytorch/torchtitan #2972, reproduced: the summed token loss backpropagated, the division only for the metric.

    tfpar compare examples/wild/torchtitan-pp-sum-loss/case.json --impls examples/wild/torchtitan-pp-sum-loss/ddp.py:fixed,examples/wild/torchtitan-pp-sum-loss/ddp.py:buggy

Origin (written anew, not copied): pytorch/torchtitan at ab598d9cb, ``torchtitan/trainer.py``: without
pipeline parallelism L707 ``loss = loss_sum / global_valid_tokens`` is what is backpropagated; with it,
L666-682 the schedule (``pp_schedule.step(..., losses=losses)``) backpropagates each micro-batch's *summed*
loss, and L692 ``loss = torch.sum(torch.stack(losses)) / global_valid_tokens`` divides afterwards, for the
metric only. "PP gradients are global_valid_tokens times larger than non-PP gradients" (the issue, open at
this snapshot). Here one rank stands for the last pipeline stage: its gradient is B times the true one.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817

import torchref

NAMES = {"0.kernel": "0.weight", "0.bias": "0.bias", "1.kernel": "2.weight", "1.bias": "2.bias"}


def _train(run, *, pipeline_path: bool) -> None:
    net = torch.nn.Sequential(torch.nn.Linear(5, 10), torch.nn.ReLU(), torch.nn.Linear(10, 1)).to(run.torch_dtype)
    net.load_state_dict({t: torch.as_tensor(run.to_torch(run.initial[c])) for c, t in NAMES.items()})
    model = DDP(net, process_group=run.group)
    named = dict(net.named_parameters())
    run.hook_gradients(model, {c: named[v] for c, v in NAMES.items()})
    opt = torch.optim.SGD(net.parameters(), lr=run.spec["optimizer"]["lr"])
    params = lambda: {c: run.to_tf(named[v].detach()) for c, v in NAMES.items()}  # noqa: E731
    run.begin(params())
    for x, y in run.batches():
        global_valid_tokens = torch.tensor(float(len(y)), dtype=run.torch_dtype)
        dist.all_reduce(global_valid_tokens, group=run.group)
        loss_sum = F.binary_cross_entropy_with_logits(model(torch.as_tensor(x)), torch.as_tensor(y), reduction="sum")
        if pipeline_path:                       # the schedule's backward on the sum; the division for the metric
            loss_sum.backward()
            loss = loss_sum.detach() / global_valid_tokens
        else:                                   # non-PP: divide, then backward (x N: DDP averages the ranks)
            loss = loss_sum / global_valid_tokens
            (loss * run.world_size).backward()
        grads = {c: run.to_tf(named[v].grad) for c, v in NAMES.items()}
        opt.step()
        opt.zero_grad()
        logged = loss.detach().clone()
        dist.all_reduce(logged, group=run.group)
        run.record(logged, params(), grads=grads, device_loss=loss_sum.detach() / len(y), device_inputs=x)


@torchref.plugin.distributed(dtypes=("float32", "float64"))
def buggy(run):
    """The PP path at ab598d9cb: the summed loss backpropagated."""
    _train(run, pipeline_path=True)


@torchref.plugin.distributed(dtypes=("float32", "float64"))
def fixed(run):
    """The non-PP path: the loss divided by the step's tokens before backward."""
    _train(run, pipeline_path=False)
