"""Wall-clock timing shared by the benchmark scripts (``from timing import ...``: each script's
own folder is first on ``sys.path`` when run as ``python benchmarks/<script>.py``)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

__all__ = ["timings", "median_seconds"]


def timings(fn: Callable[[], object], repeats: int) -> list[float]:
    """Wall seconds of ``repeats`` calls of ``fn``, in order."""
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    """The median wall seconds of ``repeats`` calls of ``fn``."""
    return statistics.median(timings(fn, repeats))
