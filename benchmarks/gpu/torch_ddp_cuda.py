"""The byo MLP's DDP port (examples/byo/mlp/torch_ddp.py) with the model and batches on a CUDA GPU.

For the device check (benchmarks/gpu/device_check.sh): every rank puts its replica on
``cuda:LOCAL_RANK mod GPUs`` (one GPU holds every rank with gloo; NCCL needs one GPU a rank).
On a machine without CUDA it runs on the CPU, as the original does.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import torchref

# the example's model and names, not a copy: the check compares this plugin with that one
_spec = importlib.util.spec_from_file_location(
    "byo_mlp_torch_ddp", Path(__file__).resolve().parents[2] / "examples" / "byo" / "mlp" / "torch_ddp.py")
_byo = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_byo)
MLP, NAMES = _byo.MLP, _byo.NAMES


@torchref.plugin.distributed(dtypes=("float32", "float64"))
def ddp(run):
    gpus = torch.cuda.device_count()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", run.rank)) % gpus) if gpus else torch.device("cpu")
    net = MLP(run.torch_dtype)
    net.load_state_dict({NAMES[k]: torch.as_tensor(run.to_torch(v)) for k, v in run.initial.items()})
    net.to(device)
    model = DDP(net, device_ids=[device.index] if gpus else None, process_group=run.group)
    opt = torch.optim.SGD(model.parameters(), lr=run.spec["optimizer"]["lr"])
    named = dict(net.named_parameters())

    def params():
        return {k: run.to_tf(named[name].detach()) for k, name in NAMES.items()}

    run.begin(params())
    for x, y in run.batches():
        loss = F.binary_cross_entropy_with_logits(model(torch.as_tensor(x, device=device)),
                                                  torch.as_tensor(y, device=device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss, group=run.group)
        run.record(mean_loss / run.world_size, params(),
                   grads={k: run.to_tf(named[name].grad) for k, name in NAMES.items()})
