"""Writes ``data.npz`` and ``init.npz`` of this example (numpy only; run from the repository root).

Weights: ``cifar10.inference``'s initialisers at the case's widths, drawn in numpy: kernels
from a normal distribution truncated at two standard deviations (``truncated_normal_initializer``,
stddev 5e-2 for the convolutions, 0.04 for ``local3``/``local4``, 1/192 for
``softmax_linear``), biases 0 (conv1, softmax_linear) or 0.1 (conv2, local3, local4).
Data: 16 synthetic RGB images of 8x8 (the project's ``images`` generator, 10 classes) in
[0, 1], for CIFAR-10's 24x24 crops. State: ``ema.<name>``, the moving averages' shadows,
equal to the weights (``ExponentialMovingAverage.apply`` starts them at the variables' values).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from parity_tests.contract.generators import generate_data

HERE = Path(__file__).resolve().parent
SIZES = {"size": 8, "conv": 4, "local3": 8, "local4": 8}  # image side and widths
FULL = {"size": 24, "conv": 64, "local3": 384, "local4": 192}  # the program's
CLASSES = 10


def truncated_normal(rng: np.random.Generator, shape: tuple[int, ...], stddev: float) -> np.ndarray:
    """N(0, stddev^2) redrawn where |x| > 2 stddev, as ``tf.truncated_normal`` does."""
    out = rng.normal(0.0, stddev, shape)
    while (bad := np.abs(out) > 2 * stddev).any():
        out[bad] = rng.normal(0.0, stddev, int(bad.sum()))
    return out


def write(folder: Path, size: int, conv: int, local3: int, local4: int, rows: int = 16) -> None:
    """``init.npz`` and ``data.npz`` (``rows`` images of ``size`` x ``size``) in ``folder``."""
    rng = np.random.default_rng(10)
    flat = (-(-size // 4)) ** 2 * conv  # two stride-2 SAME pools: ceil(ceil(size / 2) / 2)
    layers = {  # name: (kernel shape, stddev, bias)
        "conv1": ((5, 5, 3, conv), 5e-2, 0.0),
        "conv2": ((5, 5, conv, conv), 5e-2, 0.1),
        "local3": ((flat, local3), 0.04, 0.1),
        "local4": ((local3, local4), 0.04, 0.1),
        "softmax_linear": ((local4, CLASSES), 1 / 192.0, 0.0),
    }
    init = {}
    for name, (shape, stddev, bias) in layers.items():
        init[f"{name}.weights"] = truncated_normal(rng, shape, stddev)
        init[f"{name}.biases"] = np.full(shape[-1], bias)
    # the moving averages' shadows (state), which start at the variables' initial values
    init.update({f"ema.{name}": value.copy() for name, value in init.items()})
    np.savez_compressed(folder / "init.npz", **init)
    x, y = generate_data("images", 4, rows, (size, size, 3), (CLASSES,), "softmax_ce")
    np.savez_compressed(folder / "data.npz", x=x, y=y)


if __name__ == "__main__":
    write(HERE, **SIZES)
