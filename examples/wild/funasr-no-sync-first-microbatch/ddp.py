"""modelscope/FunASR PR #3472, reproduced: ``no_sync`` keyed on the first micro-batch instead of the last.

    tfpar compare examples/wild/funasr-no-sync-first-microbatch/case.json --impls examples/wild/funasr-no-sync-first-microbatch/ddp.py:fixed,examples/wild/funasr-no-sync-first-microbatch/ddp.py:buggy

Origin (written anew, not copied): modelscope/FunASR at 036ed6936b439de31de156a32a3a0ef59b570032,
``funasr/train_utils/trainer_ds.py``: L651 ``my_context = model.no_sync if batch_idx % accum_grad != 0
else my_context`` (the all-reduce runs on micro-batches 0, k, 2k, ...), L751 ``loss = loss / self.accum_grad``,
L771 ``if (batch_idx + 1) % self.accum_grad == 0:`` (the optimizer steps after micro-batches k-1, 2k-1, ...).
DDP's all-reduce at micro-batch 0 averages what the ranks hold then; micro-batches 1..k-1 add each rank's
own gradients after it, unsynchronised, and the optimizer steps on them: every rank applies a different
gradient and the replicas part at the first step. The fix (d410a5652, PR #3472) keys ``no_sync`` on
``(batch_idx + 1) % accum_grad != 0``. The review's two-rank reproduction: accumulated gradients 4.0 and 7.0
on the two ranks, 5.5 and 5.5 after the fix. With one rank there is nothing to synchronise: both agree.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817

import torchref

NAMES = {"0.kernel": "0.weight", "0.bias": "0.bias", "1.kernel": "2.weight", "1.bias": "2.bias"}


def _train(run, *, sync_first: bool) -> None:
    net = torch.nn.Sequential(torch.nn.Linear(5, 10), torch.nn.ReLU(), torch.nn.Linear(10, 1)).to(run.torch_dtype)
    net.load_state_dict({t: torch.as_tensor(run.to_torch(run.initial[c])) for c, t in NAMES.items()})
    model = DDP(net, process_group=run.group)
    named = dict(net.named_parameters())
    run.hook_gradients(model, {c: named[v] for c, v in NAMES.items()}, scale=1.0)
    opt = torch.optim.SGD(net.parameters(), lr=run.spec["optimizer"]["lr"])
    accum_grad = run.spec["parallel"].get("accumulate", 1)
    params = lambda: {c: run.to_tf(named[v].detach()) for c, v in NAMES.items()}  # noqa: E731
    run.begin(params())
    batch_idx = 0
    for x, y in run.batches():
        losses = []
        for xm, ym in zip(np.array_split(x, accum_grad), np.array_split(y, accum_grad), strict=True):
            last = (batch_idx + 1) % accum_grad == 0
            skip_sync = batch_idx % accum_grad != 0 if sync_first else not last   # <- the bug and its fix
            with model.no_sync() if skip_sync else contextlib.nullcontext():
                loss = F.binary_cross_entropy_with_logits(model(torch.as_tensor(xm)), torch.as_tensor(ym))
                (loss / accum_grad).backward()
            losses.append(loss.detach())
            batch_idx += 1
        grads = {c: run.to_tf(named[v].grad) for c, v in NAMES.items()}       # what this rank applies
        opt.step()                                                             # (batch_idx + 1) % accum_grad == 0
        opt.zero_grad()
        local = torch.stack(losses).mean()
        logged = local.clone()
        dist.all_reduce(logged, group=run.group)
        run.record(logged / run.world_size, params(), grads=grads, device_loss=local, device_inputs=x)


@torchref.plugin.distributed(dtypes=("float32", "float64"))
def buggy(run):
    """Before PR #3472: the first micro-batch of each accumulation window is synchronised, the last is not."""
    _train(run, sync_first=True)


@torchref.plugin.distributed(dtypes=("float32", "float64"))
def fixed(run):
    """After PR #3472: every micro-batch but the last under ``no_sync``; the last one all-reduces the sum."""
    _train(run, sync_first=False)
