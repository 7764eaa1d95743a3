"""Every ``TFPAR_*`` environment variable the tool reads, read here and nowhere else.

Each is documented in ``docs/settings.md`` (a test checks that every name in
:data:`SETTINGS` is there and that no other module reads a ``TFPAR_*`` variable).
A value that cannot be read is bad input: :class:`~parity_tests.protocol.errors.CaseError`
naming the variable and what was expected, which the command line prints as one
line (exit 2). Readers are functions, not constants: nothing is read at import,
and a test or a parent process may set a variable before the first read.

========================  ==========================  =================================================
variable                  default                     meaning
========================  ==========================  =================================================
``TFPAR_SPILL_BYTES``     ``67108864`` (64 MiB)       bytes of rows a process may hold in memory (one
                                                      array's, and all arrays' together) before they
                                                      move to files (``docs/memory.md``)
``TFPAR_SPILL_ROOT``      named by the top process    the folder spilled rows live in; set by the first
                                                      process that spills and inherited by its workers
``TFPAR_DEVICES``         64 CPU devices, 8 with GPUs logical TensorFlow devices to make
``TFPAR_GPU_MEMORY_MB``   1024 when GPUs are split    memory limit of each virtual GPU
``TFPAR_LOCAL_DEVICES``   the GPUs a worker sees      replicas per ``tf.multiworker`` worker
``TFPAR_TRACE_CACHE``     ``1``                       ``0`` turns off reuse of traced TensorFlow trainers
``TFPAR_FAILURES``        ``./failures``              where the pytest plugin writes failing cases
========================  ==========================  =================================================
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from parity_tests.protocol.errors import CaseError

__all__ = ["Setting", "SETTINGS", "spill_bytes", "spill_root", "set_spill_root", "devices", "gpu_memory_mb",
           "local_devices", "trace_cache", "trace_cache_off", "failures_folder", "check"]


@dataclass(frozen=True)
class Setting:
    """One environment variable: its name, default (as text) and what it controls."""

    name: str
    default: str
    meaning: str


SPILL_BYTES = Setting("TFPAR_SPILL_BYTES", str(64 * 2**20), "bytes of rows a process keeps in memory (one array's, and all arrays' together) before they spill to files")
SPILL_ROOT = Setting("TFPAR_SPILL_ROOT", "", "the folder of spilled rows, named by the top-level process")
DEVICES = Setting("TFPAR_DEVICES", "64 (CPU), 8 (GPUs)", "logical TensorFlow devices to configure")
GPU_MEMORY_MB = Setting("TFPAR_GPU_MEMORY_MB", "1024", "memory limit in MB of each virtual GPU")
LOCAL_DEVICES = Setting("TFPAR_LOCAL_DEVICES", "", "replicas per tf.multiworker worker")
TRACE_CACHE = Setting("TFPAR_TRACE_CACHE", "1", "0 turns off the reuse of traced TensorFlow trainers")
FAILURES = Setting("TFPAR_FAILURES", "failures", "where the pytest plugin writes failing cases")

#: every variable, in the order ``docs/settings.md`` lists them
SETTINGS: tuple[Setting, ...] = (SPILL_BYTES, SPILL_ROOT, DEVICES, GPU_MEMORY_MB, LOCAL_DEVICES, TRACE_CACHE, FAILURES)


def _whole(setting: Setting, low: int, what: str) -> int | None:
    """The variable as a whole number ``>= low``; ``None`` when unset or empty."""
    text = os.environ.get(setting.name, "").strip()
    if not text:
        return None
    if not text.isdigit() or int(text) < low:
        raise CaseError(setting.name, f"{what} (the environment variable)", text)
    return int(text)


def spill_bytes() -> int:
    """``TFPAR_SPILL_BYTES``: bytes of rows a process may hold in memory (one array's, and all arrays'
    together) before they move to files."""
    value = _whole(SPILL_BYTES, 0, "a whole number of bytes >= 0")
    return int(SPILL_BYTES.default) if value is None else value


def spill_root() -> str | None:
    """``TFPAR_SPILL_ROOT``: the spill folder this process inherited or named, ``None`` before one is named."""
    return os.environ.get(SPILL_ROOT.name) or None


def set_spill_root(path: str) -> None:
    """Name the spill folder for this process and every worker it starts afterwards (they inherit it)."""
    os.environ[SPILL_ROOT.name] = path


def devices(default: int) -> int:
    """``TFPAR_DEVICES``: logical TensorFlow devices to configure (``default`` when unset)."""
    value = _whole(DEVICES, 1, "a whole number of devices >= 1")
    return default if value is None else value


def gpu_memory_mb() -> int | None:
    """``TFPAR_GPU_MEMORY_MB``: the memory limit of each virtual GPU, ``None`` when unset."""
    return _whole(GPU_MEMORY_MB, 1, "a whole number of megabytes >= 1")


def local_devices() -> int | None:
    """``TFPAR_LOCAL_DEVICES``: replicas per ``tf.multiworker`` worker, ``None`` when unset."""
    return _whole(LOCAL_DEVICES, 1, "an integer >= 1 (replicas per worker)")


def trace_cache() -> bool:
    """``TFPAR_TRACE_CACHE``: whether traced TensorFlow trainers are reused (anything but ``0``)."""
    return os.environ.get(TRACE_CACHE.name, TRACE_CACHE.default) != "0"


@contextlib.contextmanager
def trace_cache_off() -> Iterator[None]:
    """Turn trainer reuse off for the block (``TFPAR_TRACE_CACHE=0``, so worker processes see it too);
    the variable's earlier value, or its absence, is restored after."""
    before = os.environ.get(TRACE_CACHE.name)
    os.environ[TRACE_CACHE.name] = "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(TRACE_CACHE.name, None)
        else:
            os.environ[TRACE_CACHE.name] = before


def failures_folder() -> Path:
    """``TFPAR_FAILURES``: where the pytest plugin writes the failing cases (``./failures`` by default)."""
    return Path(os.environ.get(FAILURES.name) or FAILURES.default)


def check() -> None:
    """Read every variable once: the first one that cannot be read raises its :class:`CaseError`.

    Entry points call it before any work, so that a bad value is one line and exit status 2
    there, not a failure inside a worker halfway through a run.
    """
    spill_bytes()
    devices(1)
    gpu_memory_mb()
    local_devices()
