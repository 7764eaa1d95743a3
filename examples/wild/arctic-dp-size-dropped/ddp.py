"""Snowflake-AI-Research/Arctic-Platform PR #119 / issue #121, reproduced: ``dp_size`` dropped from the loss.

    tfpar compare examples/wild/arctic-dp-size-dropped/case.json --impls examples/wild/arctic-dp-size-dropped/ddp.py:fixed,examples/wild/arctic-dp-size-dropped/ddp.py:buggy

Origin (written anew, not copied): the token-mean loss of
``arctic_platform/integrations/verl/grpo_loss.py`` L169 (Snowflake-AI-Research/Arctic-Platform at
5864380): ``masked_sum(loss_mat, loss_mask) / batch_num_tokens * dp_size``, with ``batch_num_tokens`` the
token count of the whole step over every rank. The ``* dp_size`` cancels DeepSpeed's average over the R
ranks. ``arctic_platform/integrations/_cortex_shared.py``, ``to_cortex_fwd_bwd_payload`` (L25), forwarded
``batch_num_tokens`` and ``global_batch_size`` but not ``dp_size`` (L74-76 at 60ba6bf, branch
``sfc-gh-kganesan/skyrl-cortex-shim``, 2026-08-21; its docstring L7: "``dp_size`` is deliberately NOT sent";
dropped by 17f1d3e, where 0c1479b and 47bf349 still sent it; PR #119, later than that history, put it back), so the zone computed with
``dp_size = 1``: the gradient exactly ``1/R`` of the true one, "a 4x colder learning
rate" at 4 ranks that Adam hides, until global-norm clipping acts (``||g|| > c`` for the true gradient
but not for ``g / R``). Here a token is a row; the clip is torch's ``clip_grad_norm_`` after the all-reduce,
at the case's ``parallel.clip.global_norm``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817

import torchref

NAMES = {"0.kernel": "0.weight", "0.bias": "0.bias", "1.kernel": "2.weight", "1.bias": "2.bias"}


def _train(run, *, forward_dp_size: bool) -> None:
    net = torch.nn.Sequential(torch.nn.Linear(5, 10), torch.nn.ReLU(), torch.nn.Linear(10, 1)).to(run.torch_dtype)
    net.load_state_dict({t: torch.as_tensor(run.to_torch(run.initial[c])) for c, t in NAMES.items()})
    model = DDP(net, process_group=run.group)
    named = dict(net.named_parameters())
    run.hook_gradients(model, {c: named[v] for c, v in NAMES.items()})
    o = run.spec["optimizer"]
    opt = torch.optim.Adam(net.parameters(), lr=o["lr"], eps=o["epsilon"])
    clip = (run.spec["parallel"].get("clip") or {}).get("global_norm")
    dp_size = run.world_size if forward_dp_size else 1          # <- the payload dropped it: 1 on the zone
    params = lambda: {c: run.to_tf(named[v].detach()) for c, v in NAMES.items()}  # noqa: E731
    run.begin(params())
    for x, y in run.batches():
        opt.zero_grad()
        batch_num_tokens = torch.tensor(float(len(y)), dtype=run.torch_dtype)
        dist.all_reduce(batch_num_tokens, group=run.group)     # step-global token count
        masked_sum = F.binary_cross_entropy_with_logits(model(torch.as_tensor(x)), torch.as_tensor(y), reduction="sum")
        (masked_sum / batch_num_tokens * dp_size).backward()   # DeepSpeed/DDP then average over the ranks
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        grads = {c: run.to_tf(named[v].grad) for c, v in NAMES.items()}
        opt.step()
        local = masked_sum.detach() / len(y)
        logged = local.clone()
        dist.all_reduce(logged, group=run.group)
        run.record(logged / run.world_size, params(), grads=grads, device_loss=local, device_inputs=x)


@torchref.plugin.distributed(dtypes=("float32", "float64"))
def buggy(run):
    """Before PR #119: ``dp_size`` not forwarded, the zone's loss scaled by 1: the gradient 1/R of the true one."""
    _train(run, forward_dp_size=False)


@torchref.plugin.distributed(dtypes=("float32", "float64"))
def fixed(run):
    """After PR #119: ``dp_size`` forwarded, the token-mean times R cancels DeepSpeed's average."""
    _train(run, forward_dp_size=True)
