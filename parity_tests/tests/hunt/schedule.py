"""The contract's ``warmup_cosine`` curve, written out once for the hunt (its truth and its rewrites).

Kept apart from the product's ``parity_tests.protocol.hyper.cosine_lr`` on purpose: the hunt's
ground truth and its rewrites must not share code with the built-ins they are held against, or a
mistake there would agree with itself. No framework import: the torch ranks and the TensorFlow
server's children import it with their plugin files.
"""

from __future__ import annotations

import math

__all__ = ["curve", "drawn"]


def curve(schedule: dict, lr: float, t: int) -> float:
    """The rate of step ``t`` (from 1; ``t = 0`` gives 0), in float64 (``parity_tests/contract/optimizer.py``)::

        f(t) = lr t / k                                      t <= k
        f(t) = m + (lr - m) (1 + cos(pi (t - k) / d)) / 2     k < t <= k + d
        f(t) = m                                             t > k + d

    ``math.cos``, the C library's: one answer on every CPU (numpy's may take a vectorised path
    that differs by an ulp between machines).
    """
    k, d, m = schedule["warmup_steps"], schedule["decay_steps"], schedule["min_lr"]
    if t <= k:
        return lr * t / k
    if t > k + d:
        return m
    return m + (lr - m) * (1.0 + math.cos(math.pi * (t - k) / d)) / 2.0


def drawn(opt: dict) -> dict | None:
    """The case's ``warmup_cosine`` schedule, ``None`` for a constant rate (the only two the hunt draws)."""
    s = opt.get("schedule") or {"kind": "constant"}
    if s["kind"] == "constant":
        return None
    if s["kind"] != "warmup_cosine":
        raise ValueError(f"optimizer.schedule: the hunt's rewrites run constant or warmup_cosine, got {s['kind']!r}")
    return s
