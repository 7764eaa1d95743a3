"""A user's DDP port that records no gradient (as docs/plugins.md's example) but its per-device values, with the
classic bug of multiplying the loss by the world size before backward (test_capture.py)."""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import torchref

NAMES = {"0.kernel": "l0.weight", "0.bias": "l0.bias", "1.kernel": "l1.weight", "1.bias": "l1.bias"}


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l0, self.l1 = torch.nn.Linear(5, 10), torch.nn.Linear(10, 1)

    def forward(self, x):
        return self.l1(torch.relu(self.l0(x)))


@torchref.plugin.distributed(dtypes=("float32", "float64"))
def train(run):
    net = Net().to(run.torch_dtype)
    net.load_state_dict({NAMES[k]: torch.as_tensor(run.to_torch(v)) for k, v in run.initial.items()})
    model = DDP(net, process_group=run.group)
    named = dict(net.named_parameters())
    run.hook_gradients(model, {k: named[v] for k, v in NAMES.items()})
    opt = torch.optim.SGD(model.parameters(), lr=run.spec["optimizer"]["lr"])
    def params():
        return {k: run.to_tf(named[v]) for k, v in NAMES.items()}
    run.begin(params())
    for x, y in run.batches():
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(torch.as_tensor(x)), torch.as_tensor(y))
        (loss * run.world_size).backward()   # the bug: "DDP averages, I want the sum"
        opt.step()
        logged = loss.detach().clone()
        dist.all_reduce(logged, group=run.group)
        run.record(logged / run.world_size, params(), device_loss=loss, device_inputs=x)
