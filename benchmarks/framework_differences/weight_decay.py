"""Row "weight decay": Keras' decoupled ``weight_decay`` against torch's L2 ``weight_decay``.

    .venv/bin/python benchmarks/framework_differences/weight_decay.py

Code paths (installed versions):
  Keras 3.15  keras/src/optimizers/base_optimizer.py:952 ``_apply_weight_decay``:
              ``p <- p - p * wd * lr`` (line 959), called before the update step (lines 572,
              589) for every optimizer with ``weight_decay`` (Adam, SGD, RMSprop...; ``AdamW``
              is ``Adam`` with ``weight_decay=0.004``). ``regularizers.L2(l)`` adds
              ``l * sum(p^2)`` to the loss (keras/src/regularizers/regularizers.py:265): gradient
              ``2 l p``.
  torch 2.13  ``Adam(weight_decay=wd)``: ``g <- g + wd p`` (L2 in the gradient,
              torch/optim/adam.py:428, single-tensor path used on CPU; foreach: line 691 area);
              ``AdamW`` / ``decoupled_weight_decay=True``: ``p <- p (1 - lr wd)`` (line 419);
              ``SGD(weight_decay=wd)``: ``g <- g + wd p`` (torch/optim/sgd.py:353), inside the
              momentum buffer.

Conditions and size:
  * Keras ``Adam(weight_decay=wd)`` equals torch ``AdamW(weight_decay=wd)`` (same decoupled
    rule); it differs from torch ``Adam(weight_decay=wd)``. First step:
    ``|Delta| = |lr wd p0 + lr sign(g) - lr sign(g + wd p0)|`` (eps aside): ``lr wd |p0|``
    where the signs agree; later steps compound (no closed form). Vanishes at ``wd = 0``.
  * Keras ``L2(l)`` equals torch ``weight_decay = 2 l`` (both put the penalty in the gradient).
  * Plain SGD (no momentum): decoupled and L2 coincide, ``p - lr g - lr wd p`` (gap at rounding);
    with momentum they differ (torch's decay enters the buffer).
  Mapping: ``semantics`` of the optimizer's weight decay (decoupled vs L2), or torch's
  ``AdamW`` for Keras' ``Adam(weight_decay)``; ``2 l`` for an ``L2(l)`` regulariser.
"""

from __future__ import annotations

import numpy as np
from _common import max_abs, on_side, result

LR, WD, STEPS = 0.05, 0.1, 5


def problem() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(5)
    return (rng.standard_normal((4, 3)).astype(np.float32), rng.standard_normal((16, 4)).astype(np.float32),
            rng.standard_normal((16, 3)).astype(np.float32))


def keras_side(kind: str) -> np.ndarray:
    import keras
    import tensorflow as tf

    w0, x, y = problem()
    w = keras.Variable(w0)
    make = {
        "Adam(wd)": lambda: keras.optimizers.Adam(LR, epsilon=1e-8, weight_decay=WD),
        "Adam + L2(wd/2)": lambda: keras.optimizers.Adam(LR, epsilon=1e-8),
        "AdamW(wd)": lambda: keras.optimizers.AdamW(LR, epsilon=1e-8, weight_decay=WD),
        "SGD(wd)": lambda: keras.optimizers.SGD(LR, weight_decay=WD),
        "SGD(momentum, wd)": lambda: keras.optimizers.SGD(LR, momentum=0.9, weight_decay=WD),
        "SGD(momentum)": lambda: keras.optimizers.SGD(LR, momentum=0.9),
    }
    opt = make[kind]()
    reg = keras.regularizers.L2(WD / 2) if "L2" in kind else None
    for _ in range(STEPS):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - y))  # not numpy @: it would read w as a constant
            if reg is not None:
                loss = loss + reg(w)
        opt.apply_gradients([(tape.gradient(loss, w), w)])
    return np.asarray(w)


def torch_side(kind: str) -> np.ndarray:
    import torch

    w0, x, y = problem()
    w = torch.nn.Parameter(torch.from_numpy(w0))
    make = {
        "Adam(wd)": lambda: torch.optim.Adam([w], LR, weight_decay=WD),
        "AdamW(wd)": lambda: torch.optim.AdamW([w], LR, weight_decay=WD),
        "SGD(wd)": lambda: torch.optim.SGD([w], LR, weight_decay=WD),
        "SGD(momentum, wd)": lambda: torch.optim.SGD([w], LR, momentum=0.9, weight_decay=WD),
        "SGD(momentum)": lambda: torch.optim.SGD([w], LR, momentum=0.9),
    }
    opt = make[kind]()
    for _ in range(STEPS):
        opt.zero_grad()
        torch.mean((torch.from_numpy(x) @ w - torch.from_numpy(y)) ** 2).backward()
        opt.step()
    return w.detach().numpy()


def main() -> None:
    pairs = [
        ("Adam(wd)", "Adam(wd)", "the row: decoupled vs L2"),
        ("Adam(wd)", "AdamW(wd)", "mapping: torch AdamW"),
        ("AdamW(wd)", "AdamW(wd)", "AdamW both sides"),
        ("Adam + L2(wd/2)", "Adam(wd)", "mapping: L2(l) = weight_decay 2l"),
        ("SGD(wd)", "SGD(wd)", "plain SGD: the two rules coincide"),
        ("SGD(momentum, wd)", "SGD(momentum, wd)", "SGD with momentum: they do not"),
        ("SGD(momentum)", "SGD(momentum)", "control: the same momentum rule without decay"),
    ]
    keras_runs = {k: on_side(keras_side, k) for k in {p[0] for p in pairs}}
    torch_runs = {k: on_side(torch_side, k) for k in {p[1] for p in pairs}}
    print(f"lr {LR}, weight decay {WD}, {STEPS} steps, least squares in float32")
    gaps = {}
    for k, t, what in pairs:
        gaps[(k, t)] = max_abs(keras_runs[k], torch_runs[t])
        print(f"  Keras {k:18s} vs torch {t:18s} {gaps[(k, t)]:9.2g}   ({what})")
    result(
        "weight decay",
        True,
        f"{gaps[('Adam(wd)', 'Adam(wd)')]:.2g} Adam, {gaps[('SGD(momentum, wd)', 'SGD(momentum, wd)')]:.2g} SGD+momentum "
        f"after {STEPS} steps (lr {LR}, wd {WD}); mapped {gaps[('Adam(wd)', 'AdamW(wd)')]:.1g}",
        "wd = 0, or plain SGD (no momentum)",
        "Keras weight_decay = torch AdamW / decoupled; Keras L2(l) = torch weight_decay 2l",
    )


if __name__ == "__main__":
    main()
