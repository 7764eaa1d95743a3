"""Synthetic trajectories for the tolerance model's unit tests: rounding-like noise of a chosen size.

``truth`` is a float64 "exact" run; ``jitter`` adds elementwise relative noise of random sign
(what rounding does) and casts; ``f32_runs`` and ``perturbation_runs`` build the runs the
float32 and perturbation rules judge. Used by test_rules, test_bounds, test_gaps, test_guards,
test_loss_channel, test_verdict and test_perturbation.
"""

from __future__ import annotations

import numpy as np

__all__ = ["STEPS", "SHAPES", "Traj", "truth", "jitter", "copy", "f32_runs", "perturbation_runs"]

STEPS = 6
SHAPES = {"0.kernel": (3, 5), "0.bias": (5,), "1.kernel": (5, 2), "1.bias": (2,)}
Traj = dict[str, np.ndarray]


def truth(seed: int = 0, steps: int = STEPS) -> Traj:
    """A float64 'exact' trajectory: O(1) parameters moved by small updates, zero-initialised biases."""
    rng = np.random.default_rng(seed)
    traj: Traj = {"loss": rng.random(steps) + 0.5}
    for name, shape in SHAPES.items():
        start = np.zeros(shape) if name.endswith("bias") else rng.normal(size=shape)
        updates = 0.01 * rng.normal(size=(steps, *shape))
        traj[f"param/{name}"] = np.concatenate([start[None], start + np.cumsum(updates, axis=0)])
        traj[f"grad/{name}"] = updates / 0.01
    traj["state/2.moving_mean"] = 0.5 + 0.1 * rng.normal(size=(steps + 1, 2))
    return traj



def jitter(traj: Traj, rel: float, seed: int, dtype: type = np.float64) -> Traj:
    """Elementwise relative noise of size ~rel (rounding-like, random sign), then cast."""
    rng = np.random.default_rng(seed)
    return {
        k: (v * (1 + rel * rng.uniform(-1, 1, size=v.shape))).astype(dtype) for k, v in traj.items()
    }



def copy(traj: Traj) -> Traj:
    return {k: v.copy() for k, v in traj.items()}



def f32_runs(seed: int = 0, noise: float = 2e-6) -> tuple[Traj, Traj, Traj, Traj]:
    """(a32, b32, a64, b64): float64 runs equal up to rounding, float32 runs each with its own noise."""
    a64 = truth(seed)
    b64 = jitter(a64, 1e-15, seed=seed + 100)
    a32 = jitter(a64, noise, seed=seed + 200, dtype=np.float32)
    b32 = jitter(b64, noise, seed=seed + 300, dtype=np.float32)
    return a32, b32, a64, b64



def perturbation_runs(seed: int = 0, noise: float = 2e-6) -> tuple[Traj, Traj, Traj, Traj]:
    """(a32, b32, a32p, b32p): each side's rounding noise, and its perturbed rerun's independent noise."""
    a64 = truth(seed)
    return tuple(jitter(a64, noise, seed=seed + s, dtype=np.float32) for s in (200, 300, 400, 500))  # type: ignore[return-value]

