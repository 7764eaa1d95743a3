"""Writes ``data.npz`` and ``init.npz`` of this example (run from anywhere; numpy and torch only).

The program's own data set, ``MyTrainDataset``, is ``(torch.rand(20), torch.rand(1))`` pairs;
the case draws the same kind of rows from numpy (uniform in [0, 1)), 16 of them, and puts
them in the order ``DistributedSampler(shuffle=True, seed=0)`` reads them in epoch 0
(``torch.randperm(16)`` on a generator seeded with 0 + epoch), so that the case's
``split`` order with ``strided`` shards hands rank r exactly the rows the program's sampler
hands it (``perm[r::N]``, batched by ``B / N``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
ROWS = 16


def main() -> None:
    rng = np.random.default_rng(2024)
    x = rng.random((ROWS, 20))
    y = rng.random((ROWS, 1))
    perm = torch.randperm(ROWS, generator=torch.Generator().manual_seed(0 + 0)).numpy()
    np.savez(HERE / "data.npz", x=x[perm], y=y[perm])
    # torch.nn.Linear(20, 1)'s own initialisation, U(-1/sqrt(20), 1/sqrt(20)), drawn in numpy
    bound = 1 / np.sqrt(20)
    np.savez(HERE / "init.npz", **{"weight": rng.uniform(-bound, bound, (20, 1)),
                                   "bias": rng.uniform(-bound, bound, (1,))})


if __name__ == "__main__":
    main()
