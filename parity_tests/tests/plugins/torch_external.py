"""The DDP port of ``tf_external.py``: ``lin.w`` is the TensorFlow-layout kernel ``[in, out]`` of a torch Linear."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import torchref


@torchref.plugin.distributed(dtypes=("float32", "float64"))
def ddp(run):
    n_in, n_out = run.initial["lin.w"].shape
    lin = torch.nn.Linear(n_in, n_out).to(run.torch_dtype)
    lin.load_state_dict({"weight": torch.as_tensor(run.to_torch(run.initial["lin.w"], layout="dense")),
                         "bias": torch.as_tensor(run.initial["lin.b"])})
    model = DDP(lin, process_group=run.group)
    opt = torch.optim.SGD(model.parameters(), lr=run.spec["optimizer"]["lr"])

    def params():
        return {"lin.w": run.to_tf(lin.weight, layout="dense"), "lin.b": lin.bias}

    run.begin(params())
    for x, y in run.batches():
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(torch.as_tensor(x)), torch.as_tensor(y))
        loss.backward()
        grads = {"lin.w": run.to_tf(lin.weight.grad, layout="dense").clone(), "lin.b": lin.bias.grad.clone()}
        opt.step()
        logged = loss.detach().clone()
        dist.all_reduce(logged, group=run.group)
        run.record(logged / run.world_size, params(), grads=grads)


@torchref.plugin.distributed(dtypes=("float32", "float64"))
def ddp_sampler(run):
    """The same model fed as a DDP program feeds it: its own ``DataLoader`` over ``DistributedSampler``."""
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    n_in, n_out = run.initial["lin.w"].shape
    lin = torch.nn.Linear(n_in, n_out).to(run.torch_dtype)
    lin.load_state_dict({"weight": torch.as_tensor(run.to_torch(run.initial["lin.w"], layout="dense")),
                         "bias": torch.as_tensor(run.initial["lin.b"])})
    model = DDP(lin, process_group=run.group)
    opt = torch.optim.SGD(model.parameters(), lr=run.spec["optimizer"]["lr"])
    x, y = run.dataset()
    data = TensorDataset(torch.as_tensor(x), torch.as_tensor(y))
    sampler = DistributedSampler(data, num_replicas=run.world_size, rank=run.rank, shuffle=False)
    loader = DataLoader(data, batch_size=run.spec["data"]["global_batch"] // run.world_size, sampler=sampler)
    run.begin({"lin.w": run.to_tf(lin.weight, layout="dense"), "lin.b": lin.bias})
    step, epoch = 0, 0
    while step < run.steps:
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            loss.backward()
            opt.step()
            logged = loss.detach().clone()
            dist.all_reduce(logged, group=run.group)
            run.record(logged / run.world_size, {"lin.w": run.to_tf(lin.weight, layout="dense"), "lin.b": lin.bias})
            step += 1
            if step == run.steps:
                break
        epoch += 1


@torchref.plugin.distributed(dtypes=("float32", "float64"))
def ddp_guessing(run):
    """``ddp`` as a plugin for a case model writes it: ``run.to_torch(a)`` by rank, which an external model's 2-D
    array cannot be told by (a kernel or a table?): bad input, one line naming ``layout=``."""
    n_in, n_out = run.initial["lin.w"].shape
    lin = torch.nn.Linear(n_in, n_out).to(run.torch_dtype)
    lin.load_state_dict({"weight": torch.as_tensor(run.to_torch(run.initial["lin.w"])),
                         "bias": torch.as_tensor(run.initial["lin.b"])})
