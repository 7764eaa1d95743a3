"""Per-rank losses, reduced over the elements of one rank's shard."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["shard_loss"]


def shard_loss(loss: str, reduction: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``mse``, ``sigmoid_ce`` (logits, labels like ``out``) or ``softmax_ce``
    (logits ``[n, k]``, int64 labels ``[n]``), reduced by ``mean`` or ``sum``."""
    if loss == "mse":
        return F.mse_loss(out, y, reduction=reduction)
    if loss == "sigmoid_ce":
        return F.binary_cross_entropy_with_logits(out, y, reduction=reduction)
    if loss == "softmax_ce":
        return F.cross_entropy(out, y, reduction=reduction)
    raise ValueError(f"unknown loss {loss!r}")
