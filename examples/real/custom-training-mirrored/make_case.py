"""Writes ``data.npz`` and ``init.npz`` of this example (numpy only; run from the repository root).

Data: 16 real handwritten digits (the project's ``digits`` generator: UCI 8x8 digits
enlarged to Fashion-MNIST's 28x28x1, in [0, 1], labels 0-9), as the notebook's
``train_images / 255`` would be. Weights: Keras' defaults for the notebook's layers,
drawn in numpy: Glorot-uniform kernels (``[kh, kw, in, out]``, ``[in, out]``) and zero
biases, at the case's widths.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from parity_tests.contract.generators import generate_data

HERE = Path(__file__).resolve().parent
WIDTHS = (4, 4, 8)  # conv1, conv2, dense1; the notebook's: 32, 64, 64
FULL = (32, 64, 64)


def shapes(widths: tuple[int, int, int]) -> dict[str, tuple[int, ...]]:
    """Kernel shapes: 28x28x1 -> conv3 26 -> pool 13 -> conv3 11 -> pool 5 -> flatten 25 c2 -> d1 -> 10."""
    c1, c2, d1 = widths
    return {"conv1": (3, 3, 1, c1), "conv2": (3, 3, c1, c2), "dense1": (5 * 5 * c2, d1), "dense2": (d1, 10)}


def write(folder: Path, widths: tuple[int, int, int] = WIDTHS, rows: int = 16) -> None:
    """``data.npz`` (``rows`` digits) and ``init.npz`` (the model at ``widths``) in ``folder``."""
    x, y = generate_data("digits", 7, rows, (28, 28, 1), (10,), "softmax_ce")
    np.savez_compressed(folder / "data.npz", x=x, y=y)
    rng = np.random.default_rng(17)
    init = {}
    for name, shape in shapes(widths).items():
        fan_in, fan_out = int(np.prod(shape[:-1])), shape[-1]
        if len(shape) == 4:  # Keras' conv fans: receptive field x channels
            fan_out = shape[0] * shape[1] * shape[3]
        limit = np.sqrt(6.0 / (fan_in + fan_out))
        init[f"{name}.kernel"] = rng.uniform(-limit, limit, shape)
        init[f"{name}.bias"] = np.zeros(shape[-1])
    np.savez(folder / "init.npz", **init)


if __name__ == "__main__":
    write(HERE)
