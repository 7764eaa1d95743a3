"""Looking at processes the tests do not own, and waiting for them, on a loaded machine.

A test that walks a process tree sees processes come and go while it looks: a forked
TensorFlow run that has reported and exited but is not yet reaped (a zombie), a short-lived
child of TensorFlow's start-up, a rank that exits between ``children()`` and ``cmdline()``.
psutil raises ``NoSuchProcess``, ``ZombieProcess`` (a subclass) or ``AccessDenied`` for such a
process; here every one of them means *gone*, in one place (a fresh-clone ``make test`` under
load failed on ``cmdline()`` of a zombie, 2026-11-28: issue 34).

Waiting: a test never sleeps for a fixed time and then asserts that something happened. It
polls for the event itself (:func:`wait_until`) with a deadline far above the quiet-machine time,
because a poll returns as soon as the event happens: a generous deadline costs nothing when the
code is right and only bounds how long a broken run takes to fail.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import psutil

__all__ = ["EXIT_DEADLINE", "GONE", "HANG_DEADLINE", "alive", "argv", "children", "cmdline", "is_resource_tracker", "living", "wait_gone", "wait_until"]

#: What psutil raises for a process that exited, turned zombie or cannot be read while it is looked at.
GONE = (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied)

#: How long a test waits for processes to exit after what ends them (a signal, a closed pipe, a
#: stop message). On a quiet machine they go within a second; under load (four test workers on two
#: cores, issue 34) the scheduler may not run them for several seconds. Past this, something is wrong.
EXIT_DEADLINE = 60.0

#: How long a subprocess of the suite (a fresh interpreter importing TensorFlow or torch, a small run)
#: may take before the test calls it hung. Quiet, such a process takes 5-60 s; a machine loaded several
#: times over stretches that by as much (issue 34). A guard against a hang, not a claim about speed:
#: a correct process ends long before it, and only a hung one waits it out.
HANG_DEADLINE = 600.0


def _process(p: psutil.Process | int) -> psutil.Process | None:
    if isinstance(p, psutil.Process):
        return p
    try:
        return psutil.Process(p)
    except GONE:
        return None


def alive(p: psutil.Process | int) -> bool:
    """Whether ``p`` still runs (a zombie holds nothing and counts as gone)."""
    proc = _process(p)
    if proc is None:
        return False
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except GONE:
        return False


def living(procs: Iterable[psutil.Process | int]) -> list[psutil.Process | int]:
    """The members of ``procs`` that still run, in order."""
    return [p for p in procs if alive(p)]


def argv(p: psutil.Process | int) -> list[str]:
    """``p``'s command line as a list; ``[]`` for a process that is gone."""
    proc = _process(p)
    if proc is None:
        return []
    try:
        return proc.cmdline()
    except GONE:
        return []


def cmdline(p: psutil.Process | int) -> str:
    """``p``'s command line joined by spaces; ``""`` for a process that is gone."""
    return " ".join(argv(p))


def children(p: psutil.Process | int, recursive: bool = True) -> list[psutil.Process]:
    """The living descendants of ``p`` (its children with ``recursive=False``); ``[]`` when ``p`` is gone."""
    proc = _process(p)
    if proc is None:
        return []
    try:
        found = proc.children(recursive=recursive)
    except GONE:
        return []
    return [c for c in found if alive(c)]


def is_resource_tracker(p: psutil.Process | int) -> bool:
    """Whether ``p`` is multiprocessing's resource tracker (it outlives its users by design), or is gone."""
    line = cmdline(p)
    return not line or "resource_tracker" in line


def wait_until(predicate: Callable[[], object], timeout: float, interval: float = 0.1) -> bool:
    """Poll ``predicate`` until it is true or ``timeout`` seconds pass; whether it became true.

    The predicate is asked once more at the deadline, so a slow last interval cannot miss it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


def wait_gone(procs: Iterable[psutil.Process | int], timeout: float = EXIT_DEADLINE) -> list[psutil.Process | int]:
    """Wait up to ``timeout`` s for every process of ``procs`` to exit; those still running then."""
    procs = list(procs)
    wait_until(lambda: not living(procs), timeout)
    return living(procs)
