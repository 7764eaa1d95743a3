"""Splitting a global batch across towers, in TensorFlow ops.

``contiguous``: ``tf.split`` with ``np.array_split`` sizes (the first ``B mod N``
towers get one extra row), the classic tower programs' ``tf.split``. ``strided``: tower r takes
rows r, r+N, r+2N, ... (the order of torch's ``DistributedSampler`` without
shuffling or padding).
"""

from __future__ import annotations

import tensorflow as tf

from parity_tests.protocol.shards import shard_sizes  # the numbers both frameworks share

__all__ = ["shard_sizes", "split_batch"]


def split_batch(t: tf.Tensor, n: int, shard: str) -> list[tf.Tensor]:
    """Split ``t`` (``[B, ...]``) into ``n`` tower shards along axis 0."""
    batch = int(t.shape[0])
    sizes = shard_sizes(batch, n, shard)
    if shard == "contiguous":
        return tf.split(t, sizes, axis=0)
    return [t[r::n] for r in range(n)]
