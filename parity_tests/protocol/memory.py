"""Giving a finished run's freed memory back to the system, in any process of the tool.

Used by the main process and the TensorFlow server after each run (``running.backends``) and by
each torch pool worker after each job (``torchref.pool``): both frameworks free their tensors into
the C allocator's arenas, which keep much of it, and the next run's peak then adds to it.
"""

from __future__ import annotations

import ctypes

__all__ = ["release_memory"]


def release_memory() -> None:
    """Give the memory a finished run freed back to the system (glibc's ``malloc_trim``).

    Measured: 0.2 GB of a 25 M-parameter TensorFlow run's remains returned in the main process
    (docs/memory.md); gigabytes of a float64 GPT-2 small torch rank, which waits in the pool beside
    the compare's TensorFlow runs. Nothing happens where there is no glibc.

    No ``gc.collect()`` here: a Ctrl-C that lands while the collector runs a finalizer is
    swallowed ("Exception ignored in ..."), and TensorFlow leaves many (measured: ``tfpar matrix``
    went on after Ctrl-C, ``tests/test_interrupt.py``).
    """
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
