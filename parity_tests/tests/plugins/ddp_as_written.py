"""A DDP training program as the pytorch/examples scripts write it: the default process group everywhere.

``setup()`` initialises the process group and ``cleanup()`` destroys it; the model is wrapped
as ``DistributedDataParallel(model)``, the sampler is ``DistributedSampler(dataset)`` with no
ranks given, the loss is all-reduced over the default group, and a barrier ends the epoch.
Under the tool the job's group is the default one, ``init_process_group`` finds it there and
``destroy_process_group`` leaves the tool's groups alone (``torchref.fresh.job_world``). The
model is the 5-10-1 MLP of ``examples/byo/sampler``. No TensorFlow here.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import torchref

NAMES = {"0.kernel": "0.weight", "0.bias": "0.bias", "1.kernel": "2.weight", "1.bias": "2.bias"}


def setup() -> None:
    dist.init_process_group("gloo")


def cleanup() -> None:
    dist.destroy_process_group()


@torchref.plugin.distributed(dtypes=("float32", "float64"))
def train(run):
    setup()
    rank, world = dist.get_rank(), dist.get_world_size()
    if (rank, world) != (run.rank, run.world_size):
        raise AssertionError(f"the default group is rank {rank} of {world}, the job's {run.rank} of {run.world_size}")
    net = torch.nn.Sequential(torch.nn.Linear(5, 10), torch.nn.ReLU(), torch.nn.Linear(10, 1)).to(run.torch_dtype)
    net.load_state_dict({NAMES[k]: torch.as_tensor(run.to_torch(v)) for k, v in run.initial.items()})
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=run.spec["optimizer"]["lr"])
    named = {k: net.get_parameter(v) for k, v in NAMES.items()}
    x, y = run.dataset()
    dataset = TensorDataset(torch.as_tensor(x), torch.as_tensor(y))
    sampler = DistributedSampler(dataset, shuffle=False)
    loader = DataLoader(dataset, batch_size=run.spec["data"]["global_batch"] // world, sampler=sampler)
    run.begin({k: run.to_tf(p) for k, p in named.items()})
    step, epoch = 0, 0
    while step < run.steps:
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            opt.zero_grad()
            loss = F.binary_cross_entropy_with_logits(model(xb), yb)
            loss.backward()
            opt.step()
            logged = loss.detach().clone()
            dist.all_reduce(logged)
            run.record(logged / world, {k: run.to_tf(p) for k, p in named.items()})
            step += 1
            if step == run.steps:
                break
        dist.barrier()
        epoch += 1
    cleanup()


@torchref.plugin.single(dtypes=("float32", "float64"))
def sees_no_group(run):
    """A one-process reference finds no process group, as a one-process program would."""
    if dist.is_initialized():
        raise AssertionError("a single plugin sees a process group")
    raise RuntimeError("checked")  # the test reads this line: nothing to train here
