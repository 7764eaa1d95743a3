"""torch DDP plugins for the lockstep tests: a correct port of a dense case and a seeded bug that fires late.

``clamp_inputs`` "sanitises" its inputs to [-CLAMP, CLAMP] before the forward pass: a
no-op on every batch without an outlier, so in a case whose only outlier sits in the 40th
global batch the bug fires at step 40 and nowhere else (``test_lockstep.py``). Plain
SGD with a constant learning rate: the optimizer has no state, so each one-step run from
``run.initial`` is a lockstep step. No TensorFlow here: every rank of the pool imports this file.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import torchref

BOTH = ("float32", "float64")
CLAMP = 5.0
BUG_STEP = 2  # the step at which the seeded rank and learning-rate bugs fire
_ACT = {"tanh": torch.tanh, "relu": torch.relu, "none": lambda h: h}


class Net(torch.nn.Module):
    """The case's two dense layers, ``[5] -> units (activation) -> 1``, weights in torch layout."""

    def __init__(self, spec: dict) -> None:
        super().__init__()
        first = spec["model"]["layers"][0]
        self.l0 = torch.nn.Linear(spec["model"]["input_shape"][0], first["units"])
        self.l1 = torch.nn.Linear(first["units"], 1)
        self.act = _ACT[first.get("activation", "none")]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l1(self.act(self.l0(x)))


NAMES = {"0.kernel": "l0.weight", "0.bias": "l0.bias", "1.kernel": "l1.weight", "1.bias": "l1.bias"}


def _train(run, *, clamp: bool, rank_bug: str | None = None, own_count: bool = False, lr_bug: bool = False) -> None:
    net = Net(run.spec).to(run.torch_dtype)
    net.load_state_dict({NAMES[k]: torch.as_tensor(run.to_torch(v)) for k, v in run.initial.items()})
    model = DDP(net, process_group=run.group)
    opt = torch.optim.SGD(model.parameters(), lr=run.spec["optimizer"]["lr"])
    named = dict(net.named_parameters())

    def params():
        return {k: run.to_tf(named[v]) for k, v in NAMES.items()}

    run.begin(params())
    # the case's step number, or the program's own count (from 1 in every run: a one-step lockstep run is "step 1")
    for step, (x, y) in enumerate(run.batches(), start=1 if own_count else run.first_step):
        x = torch.as_tensor(x)
        if clamp:
            x = x.clamp(-CLAMP, CLAMP)  # the seeded bug: only an outlier beyond CLAMP notices it
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(x), torch.as_tensor(y))
        loss.backward()
        fires = step == BUG_STEP
        if lr_bug and fires:  # every rank: the replicas stay in sync, the update is wrong
            for group in opt.param_groups:
                group["lr"] = 2 * run.spec["optimizer"]["lr"]
        if not (rank_bug == "drop" and run.rank == 1 and fires):
            opt.step()
        if rank_bug == "double" and run.rank == 1 and fires:
            opt.step()  # the same gradient applied twice on rank 1 alone
        logged = loss.detach().clone()
        dist.all_reduce(logged, group=run.group)
        run.record(logged / run.world_size, params())


@torchref.plugin.distributed(dtypes=BOTH)
def ddp(run):
    _train(run, clamp=False)


@torchref.plugin.distributed(dtypes=BOTH)
def clamp_inputs(run):
    _train(run, clamp=True)


@torchref.plugin.distributed  # float32 only (the default): lockstep cannot bound its float32 steps
def ddp_float32(run):
    _train(run, clamp=False)


# Seeded replica bugs (tests/test_lockstep_replicas.py): rank 1 drops or doubles its step-2 update.
# ``*_own``: the program counts its own steps, so a one-step lockstep run never reaches its step 2.
@torchref.plugin.distributed(dtypes=BOTH)
def rank1_drops(run):
    _train(run, clamp=False, rank_bug="drop")


@torchref.plugin.distributed(dtypes=BOTH)
def rank1_doubles(run):
    _train(run, clamp=False, rank_bug="double")


@torchref.plugin.distributed(dtypes=BOTH)
def rank1_drops_own(run):
    _train(run, clamp=False, rank_bug="drop", own_count=True)


@torchref.plugin.distributed(dtypes=BOTH)
def rank1_doubles_own(run):
    _train(run, clamp=False, rank_bug="double", own_count=True)


@torchref.plugin.distributed(dtypes=BOTH)
def ddp_own(run):
    """Correct, counting its own steps (what most programs do)."""
    _train(run, clamp=False, own_count=True)


@torchref.plugin.distributed(dtypes=BOTH)
def lr_doubled_own(run):
    """Every rank doubles its learning rate from its own step 2: in sync, wrong, and invisible to one-step runs."""
    _train(run, clamp=False, own_count=True, lr_bug=True)
