"""How a global batch is cut across devices, and the asynchronous schedule: numbers both frameworks share.

``contiguous``: ``np.array_split`` sizes and order (the first ``B mod N`` devices get one
extra row; the classic ``tf.split``). ``strided``: device ``r`` takes rows ``r, r+N, r+2N,
...`` (torch's ``DistributedSampler`` order without shuffling or padding). The
asynchronous variant applies the devices' gradients in an order drawn per step from
``parallel.order_seed``; the device at position ``j`` read version ``max(0, j - s)``.
"""

from __future__ import annotations

import numpy as np

__all__ = ["shard_sizes", "shard_rows", "application_orders", "read_position"]


def shard_sizes(batch: int, n: int, shard: str) -> list[int]:
    """Rows per device, ``[N]``, for a global batch of ``batch`` rows over ``n`` devices."""
    if n < 1 or batch < n:
        raise ValueError(f"cannot split a batch of {batch} rows over {n} towers (each needs a row)")
    if shard == "contiguous":
        return [batch // n + (1 if r < batch % n else 0) for r in range(n)]
    if shard == "strided":
        return [len(range(r, batch, n)) for r in range(n)]
    raise ValueError(f"unknown shard {shard!r}")


def shard_rows(batch: int, n: int, rank: int, shard: str) -> np.ndarray:
    """Row indices of device ``rank``'s shard of a global batch of ``batch`` rows."""
    if shard == "contiguous":
        return np.array_split(np.arange(batch), n)[rank]
    if shard == "strided":
        return np.arange(rank, batch, n)
    raise ValueError(f"unknown shard {shard!r}")


def application_orders(n: int, steps: int, order_seed: int) -> np.ndarray:
    """``[steps, n]`` int: row k is step k's order of devices, ``default_rng(order_seed).permutation(n)`` drawn k-th."""
    rng = np.random.default_rng(order_seed)
    return np.stack([rng.permutation(n) for _ in range(steps)]).astype(np.int64)


def read_position(j: int, staleness: int) -> int:
    """The version index ``i`` (of the step's ``theta_{k,i}``) that the device at position ``j`` reads: ``max(0, j - s)``."""
    return max(0, j - staleness)
