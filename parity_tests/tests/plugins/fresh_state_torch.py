"""A torch DDP plugin that checks, at its start, that no earlier run on this rank left state, then leaves every kind.

The DDP port of ``fresh_state_tf.leaves_state`` (dense 4-16 tanh, dense 3, softmax_ce, SGD with
momentum). The pool's ranks are long-lived: every run must find the rank as a fresh one has it.
No TensorFlow here: every rank imports this file.
"""

from __future__ import annotations

import random

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import torchref

RUNS: list[int] = []  # module state: a fresh import per run starts it empty
LEFTOVER = "tfpar-test-leftover"  # the description of a process group a run creates and does not destroy
NAMES = {"0.kernel": "0.weight", "0.bias": "0.bias", "1.kernel": "2.weight", "1.bias": "2.bias"}


def _groups_named(desc: str) -> list:
    world = dist.distributed_c10d._world
    return [pg for pg in world.pg_map if getattr(pg, "group_desc", None) == desc]


def stale_state(seed: int) -> list[str]:
    stale = []
    if RUNS:
        stale.append(f"module state ({len(RUNS)} earlier run(s) in this module)")
    if torch.get_default_dtype() != torch.float32:
        stale.append(f"default dtype {torch.get_default_dtype()}")
    if not torch.are_deterministic_algorithms_enabled():
        stale.append("deterministic algorithms off")
    if torch.get_num_threads() != 1:
        stale.append(f"{torch.get_num_threads()} intra-op threads")
    if not torch.is_grad_enabled():
        stale.append("grad mode off")
    b = torch.backends
    try:  # torch raises here once a per-backend fp32_precision was set beside the older setting
        if torch.get_float32_matmul_precision() != "highest":
            stale.append(f"float32 matmul precision {torch.get_float32_matmul_precision()}")
    except RuntimeError:
        stale.append("float32 matmul precision unreadable (the per-backend settings were changed)")
    if b.cuda.matmul.allow_tf32:
        stale.append("TF32 matmuls on")
    if not b.cudnn.allow_tf32:
        stale.append("cuDNN TF32 off")
    if b.mkldnn.matmul.fp32_precision != "none":
        stale.append(f"mkldnn matmuls in {b.mkldnn.matmul.fp32_precision}")
    if not b.mkldnn.enabled:
        stale.append("mkldnn off")
    if not b.cuda.matmul.allow_fp16_reduced_precision_reduction:
        stale.append("fp16 reduced-precision reductions off")
    if (torch.tensor([1e-39], dtype=torch.float32) * 1.0).item() == 0.0:  # a float32 subnormal
        stale.append("subnormals flushed to zero")
    if torch.is_warn_always_enabled():
        stale.append("warn_always on")
    if not torch.autograd.is_multithreading_enabled():
        stale.append("autograd multithreading off")
    if not torch.utils.deterministic.fill_uninitialized_memory:
        stale.append("fill_uninitialized_memory off")
    if not b.opt_einsum.enabled:
        stale.append("opt_einsum off")
    if torch.rand(1).item() != torch.rand(1, generator=torch.Generator().manual_seed(seed)).item():
        stale.append("torch's generator")
    if np.random.random() != np.random.RandomState(seed % 2**32).random_sample():
        stale.append("numpy's global generator")
    if random.random() != random.Random(seed).random():
        stale.append("Python's global generator")
    if _groups_named(LEFTOVER):
        stale.append("a process group an earlier run created")
    return stale


def leave_state(run) -> None:
    RUNS.append(1)
    torch.set_default_dtype(torch.float64)
    torch.use_deterministic_algorithms(False)
    torch.set_num_threads(2)
    torch.set_float32_matmul_precision("medium")
    b = torch.backends
    b.cuda.matmul.allow_tf32 = True
    b.cudnn.allow_tf32 = False
    b.mkldnn.matmul.fp32_precision = "bf16"  # float32 matmuls in bfloat16 where the CPU has AMX
    b.mkldnn.enabled = False
    b.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    torch.set_flush_denormal(True)
    torch.set_warn_always(True)
    torch.autograd.set_multithreading_enabled(False)
    torch.utils.deterministic.fill_uninitialized_memory = False
    b.opt_einsum.enabled = False
    torch.rand(3)
    np.random.random(3)
    random.random()
    dist.new_group([run.rank], use_local_synchronization=True, group_desc=LEFTOVER)  # this rank alone
    torch.set_grad_enabled(False)


@torchref.plugin.distributed(dtypes=("float32", "float64"))
def leaves_state(run):
    stale = stale_state(run.seed)
    if stale:
        raise AssertionError("state left by an earlier run: " + "; ".join(stale))
    net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)).to(run.torch_dtype)
    net.load_state_dict({NAMES[k]: torch.as_tensor(run.to_torch(v)) for k, v in run.initial.items()})
    model = DDP(net, process_group=run.group)
    opt = torch.optim.SGD(model.parameters(), lr=run.spec["optimizer"]["lr"], momentum=run.spec["optimizer"]["momentum"])
    named = dict(net.named_parameters())

    def params():
        return {k: run.to_tf(named[v]) for k, v in NAMES.items()}

    run.begin(params())
    for x, y in run.batches():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(torch.as_tensor(x)), torch.as_tensor(y))
        loss.backward()
        opt.step()
        logged = loss.detach().clone()
        dist.all_reduce(logged, group=run.group)
        run.record(logged / run.world_size, params())
    leave_state(run)


def premise(ctx, seed):
    """Pool job for ``tests/test_fresh_runs.py``: what a run sees after a run that left state, without and with the reset.

    Both blocks import this file afresh by path, as a plugin run does. Inside the first, the
    state is left and then looked at (the premise: the check sees each kind); the second,
    a new ``fresh_run``, must find none of it.
    """
    import sys

    from torchref.fresh import fresh_run
    from torchref.plugin import _import

    where = {"path": __file__, "module_name": "fresh_state_torch_premise", "attr": "stale_state"}
    with fresh_run(seed):
        _import(where)
        module = sys.modules[where["module_name"]]
        module.leave_state(ctx)
        without = module.stale_state(seed)
    with fresh_run(seed):
        after = _import(where)(seed)
    return without, after
