"""A torch DDP port of a nested case (a residual block repeated) built from ``torchref.models.CaseModel``, with
one layer computing something else (``test_paths.py``): the forward stage must name that block's layer.

``planted_epsilon``: the layer norm of repeat copy 2's residual body (path ``1.2.0.body.1``) uses Keras'
default epsilon 1e-3 where the case says torch's 1e-5, the mistake a port makes in one block. ``good``:
the case as it is. ``every_layer_norm_epsilon``: any case, every layer norm with 100x its epsilon (one rank or
equal shards: the logged loss is the mean of the ranks'). Both pass their layer outputs by path (``CaseModel.trace``) as ``activations=``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817

import torchref
from torchref.losses import model_loss
from torchref.models import CaseModel

PLANTED = "1.2.0.body.1"


def _train(run, planted: str | None) -> None:
    model = CaseModel(run.spec["model"]["layers"], run.initial, run.torch_dtype)
    layer = model._layer

    def _layer(path, spec, h):  # noqa: ANN001, ANN202
        if planted == "every layer_norm" and spec["type"] == "layer_norm":
            return layer(path, {**spec, "epsilon": spec["epsilon"] * 100}, h)
        return layer(path, {**spec, "epsilon": 1e-3} if path == planted else spec, h)

    model._layer = _layer
    ddp = DDP(model, process_group=run.group)
    params = model.canonical()  # canonical names and layouts already: no run.to_tf
    opt = torch.optim.SGD(ddp.parameters(), lr=run.spec["optimizer"]["lr"])
    run.layer_hooks = False
    run.begin({k: p.detach().numpy().copy() for k, p in params.items()})
    for step, (x, y) in enumerate(run.batches(), start=run.first_step):
        model.trace = {} if step == run.capture_step else None
        opt.zero_grad()
        loss = model_loss(run.spec["model"], ddp(torch.as_tensor(x)), torch.as_tensor(y))
        loss.backward()
        opt.step()
        logged = loss.detach().clone()  # equal shards: the mean of the ranks' losses is the global loss
        dist.all_reduce(logged, group=run.group)
        run.record(logged / run.world_size, {k: p.detach().numpy().copy() for k, p in params.items()},
                   activations=model.trace, device_loss=loss, device_inputs=x)
        model.trace = None


@torchref.plugin.distributed(dtypes=("float64",))
def good(run) -> None:
    _train(run, None)


@torchref.plugin.distributed(dtypes=("float64",))
def planted_epsilon(run) -> None:
    _train(run, PLANTED)


@torchref.plugin.distributed(dtypes=("float64",))
def every_layer_norm_epsilon(run) -> None:
    """Every layer norm, at any depth, with 100x the case's epsilon (benchmarks/bench_shrink_nested.py)."""
    _train(run, "every layer_norm")


# -- the same network written as a user writes it: nn.Modules, no activations passed (the layer hooks see it) --


class Block(torch.nn.Module):
    """``x + body(x)``: the residual's add is code, which no hook sees."""

    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.LayerNorm(width, eps=eps))

    def forward(self, x):  # noqa: ANN001, ANN201
        return x + self.body(x)


class Net(torch.nn.Module):
    def __init__(self, eps: list[float]) -> None:
        super().__init__()
        self.inp, self.act = torch.nn.Linear(5, 6), torch.nn.Tanh()
        self.blocks = torch.nn.ModuleList([Block(6, e) for e in eps])
        self.head = torch.nn.Linear(6, 1)

    def forward(self, x):  # noqa: ANN001, ANN201
        h = self.act(self.inp(x))
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _module_names(copies: int) -> dict[str, str]:
    """Canonical name -> module parameter name (``1.2.0.body.1.gamma`` -> ``blocks.2.body.1.weight``)."""
    names = {"0.kernel": "inp.weight", "0.bias": "inp.bias", "2.kernel": "head.weight", "2.bias": "head.bias"}
    for r in range(copies):
        names.update({f"1.{r}.0.body.0.kernel": f"blocks.{r}.body.0.weight", f"1.{r}.0.body.0.bias": f"blocks.{r}.body.0.bias",
                      f"1.{r}.0.body.1.gamma": f"blocks.{r}.body.1.weight", f"1.{r}.0.body.1.beta": f"blocks.{r}.body.1.bias"})
    return names


def _train_modules(run, planted_copy: int | None) -> None:
    copies = run.spec["model"]["layers"][1]["count"]
    eps = run.spec["model"]["layers"][1]["body"][0]["body"][1]["epsilon"]
    net = Net([1e-3 if r == planted_copy else eps for r in range(copies)]).to(run.torch_dtype)
    names = _module_names(copies)
    net.load_state_dict({names[k]: torch.as_tensor(run.to_torch(v)) for k, v in run.initial.items()})
    model = DDP(net, process_group=run.group)
    named = dict(net.named_parameters())
    opt = torch.optim.SGD(model.parameters(), lr=run.spec["optimizer"]["lr"])

    def params():  # noqa: ANN202
        return {k: run.to_tf(named[v]) for k, v in names.items()}

    run.begin(params())
    for x, y in run.batches():
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(torch.as_tensor(x)), torch.as_tensor(y))
        loss.backward()
        opt.step()
        logged = loss.detach().clone()
        dist.all_reduce(logged, group=run.group)
        run.record(logged / run.world_size, params(), device_loss=loss, device_inputs=x)


@torchref.plugin.distributed(dtypes=("float64",))
def modules_good(run) -> None:
    _train_modules(run, None)


@torchref.plugin.distributed(dtypes=("float64",))
def modules_planted_epsilon(run) -> None:
    _train_modules(run, 2)
