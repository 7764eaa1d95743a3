"""torch plugins for the MLP case of ``parity_tests/tests/helpers.py``: a correct DDP port and its mistakes.

No TensorFlow here: every rank of the pool imports this file.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import torchref

BOTH = ("float32", "float64")
NAMES = {"0.kernel": "l0.weight", "0.bias": "l0.bias", "1.kernel": "l1.weight", "1.bias": "l1.bias"}


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l0 = torch.nn.Linear(5, 10)
        self.l1 = torch.nn.Linear(10, 1)

    def forward(self, x):
        return self.l1(torch.relu(self.l0(x)))


def _train(run, *, change=None):
    net = Net().to(run.torch_dtype)
    net.load_state_dict({NAMES[k]: torch.as_tensor(run.to_torch(v)) for k, v in run.initial.items()})
    model = DDP(net, process_group=run.group) if run.group is not None else net
    opt = torch.optim.SGD(model.parameters(), lr=run.spec["optimizer"]["lr"])
    named = dict(net.named_parameters())

    def params():
        return {k: run.to_tf(named[v]) for k, v in NAMES.items()}

    run.begin(params())
    for k, (x, y) in enumerate(run.batches(), start=run.first_step):
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(torch.as_tensor(x)), torch.as_tensor(y))
        loss.backward()
        if change:
            change(k, net)
        opt.step()
        logged = loss.detach().clone()
        if run.group is not None:
            dist.all_reduce(logged, group=run.group)
            logged /= run.world_size
        run.record(logged, params())


@torchref.plugin.distributed(dtypes=BOTH)
def ddp(run):
    _train(run)


@torchref.plugin.single(dtypes=BOTH)
def single(run):
    _train(run)


@torchref.plugin.distributed(dtypes=BOTH)
def raises_at_step_2(run):
    def change(k, net):
        if k == 2:  # on every rank: a deterministic bug in the user's code
            raise KeyError("lr_schedule")

    _train(run, change=change)


@torchref.plugin.distributed(dtypes=BOTH)
def rank1_skips_step_2(run):
    def change(k, net):
        if k == 2 and run.rank == 1:  # this replica's update is lost: it falls out of sync
            for p in net.parameters():
                p.grad.zero_()

    _train(run, change=change)


def _schedule(run):
    return run.spec["optimizer"]["lr_schedule"]  # a key the case does not have: raises KeyError


@torchref.plugin.distributed(dtypes=BOTH)
def raises_before_begin(run):
    _schedule(run)  # before run.begin: the line says "before step 1"
    _train(run)


@torchref.plugin.distributed(dtypes=BOTH)
def prints(run):
    """``ddp``, printing from every rank as a user's program does: a line on stdout, an unfinished one on stderr."""
    import sys

    print(f"rank {run.rank} says hello")
    print(f"rank {run.rank} unfinished", end="", file=sys.stderr)
    _train(run)
