"""Row "warm-up + cosine": Keras' ``CosineDecay(warmup_target=...)`` against torch's own schedulers.

    .venv/bin/python benchmarks/framework_differences/warmup_cosine.py

Code paths (installed versions):
  Keras 3.15  keras/src/optimizers/schedules/learning_rate_schedule.py, ``CosineDecay.__call__``:
              ``initial_learning_rate`` 0.0 makes every tensor float32 (whatever floatx); with
              ``s = min(step, decay_steps + warmup_steps)``: ``s < warmup_steps``:
              ``(warmup_target - initial) * (s / warmup_steps) + initial``; else
              ``warmup_target * ((1 - alpha) * 0.5 * (1 + cos(pi * (s - warmup_steps) / decay_steps)) + alpha)``.
              The optimizer calls it with ``iterations``, the updates already applied (0 at the first).
  torch 2.13  torch/optim/lr_scheduler.py: ``LinearLR.get_lr`` (recursive: ``lr * (1 + (end - start) /
              (total * start + (e - 1) (end - start)))``), ``CosineAnnealingLR.get_lr`` (recursive:
              ``(1 + cos(pi e / T)) / (1 + cos(pi (e - 1) / T)) (lr - eta_min) + eta_min``; periodic after
              ``T_max``), ``SequentialLR.step`` (restarts the next scheduler with ``step(0)``, its closed form).

The case's schedule (``protocol.hyper.cosine_lr``) is the continuous curve ``f`` at step ``t``:
``lr t / k`` up to ``k``, a half cosine to ``min_lr`` at ``k + d``, flat after. What each class gives:
  * Keras' ``CosineDecay(0.0, d, alpha=min_lr / lr, warmup_target=lr, warmup_steps=k)``: ``f(t - 1)`` in
    float32 (one step late; step 1 at rate 0);
  * torch ``SequentialLR([LinearLR(1/k, 1, k - 1), CosineAnnealingLR(d, min_lr), ConstantLR(min_lr / lr)],
    milestones=[k - 1, k - 1 + d])``: ``f(t)`` up to the recursion's rounding;
  * torch ``CosineAnnealingLR`` alone past ``T_max``: climbs back to ``lr`` (why ``ConstantLR`` is there).
Consequence on training: plain SGD on a least-squares problem with Keras' schedule against torch's,
and against torch's run with the Keras rates (the mapping: one step of lateness explains it all).
"""

from __future__ import annotations

import math

import numpy as np
from _common import on_side, result

LR, MIN_LR, K, D, STEPS = 0.1, 0.01, 4, 10, 20


def curve(t: int) -> float:
    if t <= K:
        return LR * t / K
    if t >= K + D:
        return MIN_LR
    return MIN_LR + (LR - MIN_LR) * (1 + math.cos(math.pi * (t - K) / D)) / 2


def keras_side() -> list[float]:
    import keras
    import tensorflow as tf

    s = keras.optimizers.schedules.CosineDecay(0.0, D, alpha=MIN_LR / LR, warmup_target=LR, warmup_steps=K)
    return [float(s(tf.constant(t - 1, tf.int64))) for t in range(1, STEPS + 1)]


def torch_side() -> dict[str, list[float]]:
    import torch

    def rates(make) -> list[float]:
        p = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
        opt = torch.optim.SGD([p], lr=LR)
        sched = make(opt)
        out = []
        for _ in range(STEPS):
            out.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        return out

    S = torch.optim.lr_scheduler
    seq = lambda o: S.SequentialLR(o, [S.LinearLR(o, 1.0 / K, 1.0, K - 1), S.CosineAnnealingLR(o, D, MIN_LR),  # noqa: E731
                                       S.ConstantLR(o, MIN_LR / LR, 2**62)], milestones=[K - 1, K - 1 + D])
    bare = lambda o: S.SequentialLR(o, [S.LinearLR(o, 1.0 / K, 1.0, K - 1), S.CosineAnnealingLR(o, D, MIN_LR)],  # noqa: E731
                                    milestones=[K - 1])
    return {"sequential": rates(seq), "without ConstantLR": rates(bare)}


def torch_long(steps: int, k: int, d: int) -> float:
    """The recursion's greatest relative drift from the closed form over ``steps`` (lr 6e-4, min 6e-5)."""
    import torch

    S = torch.optim.lr_scheduler
    lr, m = 6e-4, 6e-5
    p = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
    o = torch.optim.SGD([p], lr=lr)
    s = S.SequentialLR(o, [S.LinearLR(o, 1.0 / k, 1.0, k - 1), S.CosineAnnealingLR(o, d, m), S.ConstantLR(o, m / lr, 2**62)],
                       milestones=[k - 1, k - 1 + d])
    worst = 0.0
    for t in range(1, steps + 1):
        x = min(t, k + d)
        want = lr * x / k if x <= k else m + (lr - m) * (1 + math.cos(math.pi * (x - k) / d)) / 2
        worst = max(worst, abs(o.param_groups[0]["lr"] - want) / want)
        o.step()
        s.step()
    return worst


def sgd(rates: list[float]) -> np.ndarray:
    rng = np.random.default_rng(3)
    x, y = rng.standard_normal((32, 4)), rng.standard_normal((32, 1))
    w = np.zeros((4, 1))
    for lr in rates:
        w = w - lr * (2 * x.T @ (x @ w - y) / len(x))
    return w


def main() -> None:
    keras_rates = on_side(keras_side)
    torch_rates = on_side(torch_side)
    f = [curve(t) for t in range(1, STEPS + 1)]
    late = max(abs(k - c) / LR for k, c in zip(keras_rates[1:], f[:-1], strict=True))
    own = max(abs(k - c) / LR for k, c in zip(keras_rates, f, strict=True))
    seq = max(abs(a - c) / c for a, c in zip(torch_rates["sequential"], f, strict=True))
    climb = max(torch_rates["without ConstantLR"][K + D:])
    drift = {n: on_side(torch_long, n + 10 + 100, 10, n) for n in (200, 2000)}
    print(f"lr {LR}, min_lr {MIN_LR}, warmup {K}, decay {D}, {STEPS} steps")
    print("  step  curve f(t)   Keras CosineDecay   torch SequentialLR   torch without ConstantLR")
    for t in range(1, STEPS + 1):
        print(f"  {t:4d}  {f[t - 1]:.8f}   {keras_rates[t - 1]:.8f}          {torch_rates['sequential'][t - 1]:.8f}"
              f"           {torch_rates['without ConstantLR'][t - 1]:.8f}")
    print(f"  Keras against f(t):     {own:.3g} of lr (step 1 at {keras_rates[0]})")
    print(f"  Keras against f(t - 1): {late:.3g} of lr (float32 rounding)")
    print(f"  torch SequentialLR against f(t): {seq:.3g} relative; recursion, warm-up 10 + decay 200: {drift[200]:.3g},"
          f" decay 2000: {drift[2000]:.3g}")
    print(f"  CosineAnnealingLR alone after T_max climbs back to {climb:.4g} (lr {LR})")
    w_keras, w_torch = sgd(keras_rates), sgd(torch_rates["sequential"])
    w_mapped = sgd([0.0] + f[:-1])
    gap = float(np.max(np.abs(w_keras - w_torch)) / np.max(np.abs(w_torch)))
    mapped = float(np.max(np.abs(w_keras - w_mapped)) / np.max(np.abs(w_mapped)))
    print(f"  SGD, {STEPS} steps: Keras' rates vs torch's {gap:.3g} relative; vs the curve one step late {mapped:.2g}")
    result("warm-up + cosine (not in the table)", "new",
           f"Keras CosineDecay = f(t - 1) to {late:.1g} of lr (float32), f(t) off by {own:.2g} of lr; SGD {STEPS} steps"
           f" {gap:.2g}; torch SequentialLR = f(t) to {seq:.1g} ({drift[2000]:.1g} over 2,100 steps)",
           "never under native (one step late); semantics torch/tf: both compute f(t)",
           "map the Keras side onto torch's rule (semantics torch); Keras' float32 cos is not reproducible")


if __name__ == "__main__":
    main()
