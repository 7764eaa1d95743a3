"""The torch side of the data pipeline: a ``Dataset`` over the case's arrays, ``DistributedSampler``, ``DataLoader``.

What a DDP training script does, one rank per process::

    sampler = DistributedSampler(ds, num_replicas=N, rank=r, shuffle=False, drop_last=False)
    loader = DataLoader(ds, batch_size=B // N, sampler=sampler)
    for epoch in ...:
        sampler.set_epoch(epoch)
        for x, y in loader: ...

``DistributedSampler`` pads the epoch's index list to ``T = N ceil(D/N)``
entries by repeating its first ones (``indices += indices[:T - D]``) and gives
rank r the entries ``r, r+N, ...``; ``DataLoader`` batches them by ``B/N``,
the last batch of an epoch being smaller. Padded rows are real rows to DDP:
they enter the rank's loss mean like any other.

A shuffled epoch is given explicitly (``perms[e mod E]``, drawn in numpy by the
case) and applied as ``Subset(ds, perm)`` under an unshuffled sampler, which
pads and strides the permuted list exactly as ``shuffle=True`` would pad and
stride its ``torch.randperm`` draw (that draw itself cannot be reproduced
outside torch's generator).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset

__all__ = ["CaseDataset", "rank_loader", "rank_batches", "single_batches"]


class CaseDataset(Dataset):
    """Row i is ``(x[i], y[i])``: ``x`` ``[D, *input_shape]``, ``y`` ``[D, ...]``."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        if len(x) != len(y):
            raise ValueError(f"x has {len(x)} rows and y {len(y)}")
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def rank_loader(dataset: Dataset, num_replicas: int, rank: int, per_rank_batch: int) -> tuple[DataLoader, DistributedSampler]:
    """Rank ``rank``'s ``DataLoader`` over an unshuffled, padded ``DistributedSampler`` (no worker processes)."""
    sampler = DistributedSampler(dataset, num_replicas=num_replicas, rank=rank, shuffle=False, drop_last=False)
    return DataLoader(dataset, batch_size=per_rank_batch, sampler=sampler, num_workers=0), sampler


def _epochs(dataset: CaseDataset, perms: np.ndarray | None) -> Iterator[Dataset]:
    """The dataset each epoch iterates: itself, or ``Subset(dataset, perms[e mod E])``."""
    e = 0
    while True:
        if perms is None:
            yield dataset
        else:
            p = np.asarray(perms, np.int64).reshape(-1, len(dataset))
            yield Subset(dataset, p[e % len(p)].tolist())
        e += 1


def rank_batches(x: torch.Tensor, y: torch.Tensor, *, num_replicas: int, rank: int, global_batch: int,
                 perms: np.ndarray | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Rank ``rank``'s batches, epoch after epoch (endless).

    Yields:
        ``(x_r, y_r, positions)``: ``[b_k, ...]`` rows of step k, and int64
        ``[b_k]`` positions in the step's global batch sequence
        (``k B + r + N j``: row m of global batch k is read by rank ``m mod N``),
        which index the case's per-position dropout masks.
    """
    if global_batch % num_replicas:
        raise ValueError(f"global batch {global_batch} is not a multiple of the {num_replicas} ranks")
    dataset = CaseDataset(x, y)
    k = 0
    loader, sampler = rank_loader(dataset, num_replicas, rank, global_batch // num_replicas)
    for epoch, ds in enumerate(_epochs(dataset, perms)):
        if perms is not None:  # a new list to sample from: a new sampler over it
            loader, sampler = rank_loader(ds, num_replicas, rank, global_batch // num_replicas)
        sampler.set_epoch(epoch)  # the DDP idiom; without shuffle the order does not depend on it
        for xb, yb in loader:
            yield xb, yb, k * global_batch + rank + num_replicas * torch.arange(len(xb))
            k += 1


def single_batches(x: torch.Tensor, y: torch.Tensor, *, global_batch: int,
                   perms: np.ndarray | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """One process's ``DataLoader(ds, batch_size=B, shuffle=False)`` batches, epoch after epoch (endless).

    Yields:
        ``(x_k, y_k, positions)``, positions ``k B + [0, b_k)``.
    """
    dataset = CaseDataset(x, y)
    k = 0
    for ds in _epochs(dataset, perms):
        for xb, yb in DataLoader(ds, batch_size=global_batch, shuffle=False, num_workers=0):
            yield xb, yb, k * global_batch + torch.arange(len(xb))
            k += 1
