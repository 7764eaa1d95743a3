"""torchtitan PR #2323, reproduced: the global-token loss and DDP's own average divide the gradient by N twice.

    tfpar compare examples/wild/torchtitan-ddp-double-average/case.json --impls examples/wild/torchtitan-ddp-double-average/ddp.py:fixed,examples/wild/torchtitan-ddp-double-average/ddp.py:buggy

Origin (written anew, not copied): pytorch/torchtitan at 0cb743558a7aa96eabbc099d1712f85b197e1edb (PR #2206,
"handling valid token imbalance"): ``torchtitan/train.py`` L538 ``loss = loss_sum / global_valid_tokens``
(the token count summed over every data-parallel rank) and ``torchtitan/models/llama3/infra/parallelize.py``
L365-374 ``apply_ddp``: ``replicate(model, ...)``, whose all-reduce *averages*. FSDP's division was switched
off (``set_gradient_divide_factor(1.0)``, parallelize.py L276-284), DDP's was not: with N ranks the gradient
is ``(1/N) d(global mean)``. PR #2323 replaced DDP's average by a sum (a communication hook).

Here a "token" is a row of the batch, ``loss_sum`` the sum of the rows' losses; the fixed version sums
with a communication hook, as the PR does. Each rank records the logged loss (the global mean, which the
bug leaves right) and the gradient it applied.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817

import torchref

NAMES = {"0.kernel": "0.weight", "0.bias": "0.bias", "1.kernel": "2.weight", "1.bias": "2.bias"}


def _train(run, *, divide_by_n_again: bool) -> None:
    net = torch.nn.Sequential(torch.nn.Linear(5, 10), torch.nn.ReLU(), torch.nn.Linear(10, 1)).to(run.torch_dtype)
    net.load_state_dict({t: torch.as_tensor(run.to_torch(run.initial[c])) for c, t in NAMES.items()})
    model = DDP(net, process_group=run.group)
    named = dict(net.named_parameters())
    if not divide_by_n_again:  # the fix: DDP's all-reduce sums instead of averaging (PR #2323's hook)
        def sum_hook(group, bucket):  # noqa: ANN001, ANN202
            fut = dist.all_reduce(bucket.buffer(), group=group, async_op=True).get_future()
            return fut.then(lambda f: f.value()[0])
        model.register_comm_hook(run.group, sum_hook)
    o = run.spec["optimizer"]
    opt = torch.optim.AdamW(net.parameters(), lr=o["lr"], weight_decay=o["weight_decay"], eps=o["epsilon"])
    params = lambda: {c: run.to_tf(named[t].detach()) for c, t in NAMES.items()}  # noqa: E731
    run.begin(params())
    for t, (x, y) in enumerate(run.batches(), start=run.first_step):
        opt.zero_grad()
        xt, yt = torch.as_tensor(x), torch.as_tensor(y)
        local_tokens = torch.tensor(float(len(y)), dtype=run.torch_dtype)
        global_tokens = local_tokens.clone()
        dist.all_reduce(global_tokens, group=run.group)        # train.py: global_valid_tokens (summed over DP)
        per_device = None
        if t == run.capture_step:  # for localisation: this rank's d l_r / d params, l_r its own mean loss
            own = F.binary_cross_entropy_with_logits(net(xt), yt)
            per_device = dict(zip(NAMES, (run.to_tf(g) for g in torch.autograd.grad(own, [named[v] for v in NAMES.values()])), strict=True))
        loss_sum = F.binary_cross_entropy_with_logits(model(xt), yt, reduction="sum")
        loss = loss_sum / global_tokens                        # this rank's share of the global mean
        loss.backward()                                        # buggy: DDP averages on top (1/N once more)
        opt.step()
        logged = loss.detach().clone()
        dist.all_reduce(logged, group=run.group)               # the global mean: right in both versions
        run.record(logged, params(), grads={c: run.to_tf(named[v].grad) for c, v in NAMES.items()},
                   device_loss=loss_sum.detach() / local_tokens, device_inputs=x, device_grads=per_device)


@torchref.plugin.distributed(dtypes=("float32", "float64"))
def buggy(run):
    """Before PR #2323: loss normalised by the global token count, DDP still averaging."""
    _train(run, divide_by_n_again=True)


@torchref.plugin.distributed(dtypes=("float32", "float64"))
def fixed(run):
    """After PR #2323: the same loss, DDP's all-reduce a sum."""
    _train(run, divide_by_n_again=False)
