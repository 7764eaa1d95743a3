"""Module-level job functions for the pool's tests and benchmark (torch only).

Spawned workers import job functions by reference, so these must live in an importable module.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch
import torch.distributed as dist

from torchref.pool import RankContext


def allreduce_rank(ctx: RankContext, payload: Any) -> dict[str, Any]:
    """All-reduce rank+1 over the job's group: the sum is n(n+1)/2."""
    t = torch.tensor([float(ctx.rank + 1)], dtype=torch.float64)
    dist.all_reduce(t, group=ctx.group)
    return {"rank": ctx.rank, "world_size": ctx.world_size, "sum": float(t.item()),
            "pid": os.getpid(), "threads": torch.get_num_threads(),
            "deterministic": torch.are_deterministic_algorithms_enabled(),
            "sigint": signal.getsignal(signal.SIGINT) == signal.SIG_IGN}


def raise_on_rank1(ctx: RankContext, payload: Any) -> dict[str, Any]:
    if ctx.rank == 1:
        raise ValueError("boom from rank 1")
    return allreduce_rank(ctx, payload)


def sigkill_rank2(ctx: RankContext, payload: Any) -> dict[str, Any]:
    if ctx.rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return allreduce_rank(ctx, payload)


def hang_rank1(ctx: RankContext, payload: Any) -> dict[str, Any]:
    """Rank 1 skips the collective, so the others wait for it until the gloo timeout."""
    if ctx.rank == 1:
        return {"rank": 1}
    return allreduce_rank(ctx, payload)


def shape_mismatch(ctx: RankContext, payload: Any) -> list[float]:
    t = torch.ones(ctx.rank + 1, dtype=torch.float64)
    dist.all_reduce(t, group=ctx.group)
    return t.tolist()


def sleep_then_allreduce(ctx: RankContext, payload: Any) -> dict[str, Any]:
    time.sleep(payload["seconds"])
    return allreduce_rank(ctx, payload)


def work_and_beat(ctx: RankContext, payload: Any) -> float:
    """Work for ``payload["seconds"]`` (sleeping 0.25 s at a time), beating after each piece, like a training loop."""
    start = time.monotonic()
    while time.monotonic() - start < payload["seconds"]:
        time.sleep(0.25)
        ctx.beat()
    return time.monotonic() - start


def spill_slowly(ctx: RankContext, payload: Any) -> float:
    """Record ``payload["rows"]`` rows that spill to a file at once, one every ``payload["seconds"]``, never
    calling ``ctx.beat`` itself: a large model's copies between two training steps, where only the rows
    written report progress (``parity_tests.protocol.rows.reporting_progress``)."""
    import numpy as np

    from parity_tests.protocol.rows import RowList, set_spill_threshold

    start = time.monotonic()
    old = set_spill_threshold(0)  # every row goes to the file as it comes
    try:
        rows = RowList()
        for i in range(payload["rows"]):
            time.sleep(payload["seconds"])
            rows.append(np.full(4, float(i)))
        del rows
    finally:
        set_spill_threshold(old)
    return time.monotonic() - start


def getenv(ctx: RankContext, payload: Any) -> str | None:
    """This rank's value of the environment variable named ``payload``."""
    return os.environ.get(payload)


def determinism(ctx: RankContext, payload: Any) -> dict[str, Any]:
    """What ``torchref.determinism.configure`` set in this rank, eager mode and torch.compile's alike."""
    import torch._inductor.config as inductor_config

    return {"threads": torch.get_num_threads(), "deterministic": torch.are_deterministic_algorithms_enabled(),
            "inductor": inductor_config.deterministic}


def count_ddp_allreduces(ctx: RankContext, payload: Any) -> dict[str, Any]:
    """``parallel.accumulate`` under DDP: ``torchref.ddp._accumulate`` over ``payload["k"]`` micro-batches of
    this rank's rows, with a communication hook counting DDP's all-reduces (one per bucket per synced
    backward). Returns the count and the gradient DDP left in ``.grad``."""
    import numpy as np
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    from torchref.ddp import _accumulate
    from torchref.models import CaseModel

    spec = payload["spec"]
    model = CaseModel(spec["model"]["layers"], payload["init"], torch.float64)
    ddp = DDP(model, process_group=ctx.group)
    calls = [0]

    def hook(group, bucket):  # noqa: ANN001, ANN202  (DDP checks these annotations: none, or its own types)
        calls[0] += 1
        return default_hooks.allreduce_hook(group, bucket)

    ddp.register_comm_hook(ctx.group, hook)
    rows = np.array_split(np.arange(len(payload["x"])), ctx.world_size)[ctx.rank]
    x = torch.as_tensor(np.asarray(payload["x"])[rows])
    y = torch.as_tensor(np.asarray(payload["y"])[rows])
    _accumulate(ddp, spec["model"], x, y, {}, None, payload["k"], lambda l_j: l_j, sync=payload["sync"], trace=False)
    return {"calls": calls[0], "grads": {k: p.grad.numpy().copy() for k, p in model.canonical().items()}}
