"""A torch DDP port built from ``nn.Sequential`` that passes no ``activations=`` (test_layer_hooks.py).

The network is the case's ``dense 6 tanh -> dense 6 tanh -> dense 1`` written the torch way, each
activation its own module; ``sigmoid_layer_1`` has the seeded forward bug (``nn.Sigmoid`` after the
second ``Linear``), ``by_hand`` reports one activation itself.
"""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import torchref

BOTH = ("float32", "float64")


def _train(run, act1=torch.nn.Tanh, by_hand=False):
    net = torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.Tanh(), torch.nn.Linear(6, 6), act1(),
                              torch.nn.Linear(6, 1)).to(run.torch_dtype)
    dense = [net[0], net[2], net[4]]  # the case's layers 0, 1, 2
    with torch.no_grad():
        for i, lin in enumerate(dense):
            lin.weight.copy_(torch.as_tensor(run.to_torch(run.initial[f"{i}.kernel"])))
            lin.bias.copy_(torch.as_tensor(run.initial[f"{i}.bias"]))
    model = DDP(net, process_group=run.group)
    opt = torch.optim.SGD(model.parameters(), lr=run.spec["optimizer"]["lr"])

    def named(attr="data"):
        return {**{f"{i}.kernel": run.to_tf(getattr(lin.weight, attr)) for i, lin in enumerate(dense)},
                **{f"{i}.bias": getattr(lin.bias, attr) for i, lin in enumerate(dense)}}

    run.begin(named())
    for x, y in run.batches():
        opt.zero_grad()
        out = model(torch.as_tensor(x))
        loss = torch.nn.functional.binary_cross_entropy_with_logits(out, torch.as_tensor(y))
        loss.backward()
        grads = named("grad")  # after DDP's all-reduce: the combined gradient
        opt.step()
        logged = loss.detach().clone()
        dist.all_reduce(logged, group=run.group)
        extra = {"activations": {"logits": out}} if by_hand else {}
        run.record(logged / run.world_size, named(), grads=grads, **extra)


@torchref.plugin.distributed(dtypes=BOTH)
def good(run):
    _train(run)


@torchref.plugin.distributed(dtypes=BOTH)
def sigmoid_layer_1(run):
    _train(run, act1=torch.nn.Sigmoid)


@torchref.plugin.distributed(dtypes=BOTH)
def by_hand(run):
    _train(run, by_hand=True)
