"""How runs are carried out, below the registry: TensorFlow started the tool's way in this
process, torch jobs on the shared DDP pool, payloads handed over by file, device checks.

TensorFlow implementations and TensorFlow plugins run in this process (TensorFlow is
imported on first use, never at import time, so spawned torch workers that re-import the
parent's main module do not pay for it); torch implementations and torch plugins run in
the shared DDP worker pool. Only plain data crosses: the case payload in, numpy
trajectories out. :mod:`.harness` runs an implementation by name on top of this.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

import numpy as np

from parity_tests.contract.case import Case
from parity_tests.protocol.errors import CaseError, TfparError
from parity_tests.protocol.relay import BENIGN

__all__ = ["RunError", "set_pool_timeout", "tf_module", "reserve_tf_devices", "reserved_tf_devices", "check_torch_ranks", "tf_device_count", "check_tf_devices", "run_torch_job", "by_file", "RANK_MIB", "BY_FILE_BYTES", "pool_timeout"]

_log = logging.getLogger("tfpar.running")  # the library's messages; the tfpar command shows them on stderr
_POOL_TIMEOUT: float | None = None
_TF_DEVICES = 0  # the largest tower count asked for before TensorFlow started (reserve_tf_devices)
#: memory of one torch pool rank: 212-215 MiB unique (psutil USS) when idle at 8, 16, 32 and 64 ranks
#: (2026-11-22, torch imported, process group joined), plus a quarter for a small model's job
RANK_MIB = 270


class RunError(TfparError, RuntimeError):
    """An implementation failed while running a valid case (e.g. a DDP rank died)."""


def set_pool_timeout(seconds: float | None) -> None:
    """Per-job timeout for torch runs (None: the pool's default)."""
    global _POOL_TIMEOUT
    _POOL_TIMEOUT = seconds


_STARTED: list[Any] = []  # tfpar, once tf_module started TensorFlow in this process


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """Drop TensorFlow's known start-up lines (``protocol.relay.BENIGN``) from file descriptor 2.

    TensorFlow 2.21 logs through absl before ``TF_CPP_MIN_LOG_LEVEL`` is read, so the C++
    stderr is captured for the block and replayed without the known informational lines
    (anything else is shown as it was).
    """
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            for line in tmp.read().decode(errors="replace").splitlines():
                if line.strip() and not any(b.decode() in line for b in BENIGN):
                    # TensorFlow's own line, as a warning of this library's: with no logging
                    # configured, Python's last-resort handler still shows it on stderr
                    _log.warning("%s", line)


def tf_module() -> Any:
    """Import ``tfpar`` and start TensorFlow once in this process, without its start-up chatter.

    ``"tfpar" in sys.modules`` says nothing here: the package is lazy, and the registry imports
    ``tfpar.engines`` (no TensorFlow) long before a TensorFlow run.
    """
    if _STARTED:
        return _STARTED[0]
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    with quiet_stderr():
        import tfpar

        tfpar.configure_devices(_TF_DEVICES or None)  # the first op logs too
        # every case builds its own trainer, so each traces its step once by design:
        # TensorFlow's retracing advice is noise here
        import tensorflow as tf

        tf.get_logger().setLevel("ERROR")
    _STARTED.append(tfpar)
    return tfpar


def reserve_tf_devices(n: int) -> None:
    """Ask for at least ``n`` tower devices when TensorFlow starts in this process.

    TensorFlow fixes its device list when its runtime starts, so the largest N a
    run needs must be known first: ``tfpar matrix`` reserves its rows' largest N
    before TensorFlow starts, and :func:`check_tf_devices` reserves each case's N
    (the first case of a process starts TensorFlow). Without GPUs
    ``tfpar`` makes 64 logical CPU devices anyway (they cost nothing measurable);
    with GPUs this decides how many virtual GPUs are made. No effect once
    TensorFlow has started.
    """
    global _TF_DEVICES
    _TF_DEVICES = max(_TF_DEVICES, int(n))


def reserved_tf_devices() -> int:
    """The largest tower count asked for so far (:func:`reserve_tf_devices`; 0 when none)."""
    return _TF_DEVICES


def check_torch_ranks(n: int, field: str = "parallel.devices") -> None:
    """Refuse, before spawning anything, a world size whose ranks this machine cannot hold.

    A pool of ``n`` ranks needs about ``n * RANK_MIB`` MiB (each rank imports torch and
    joins the process group); a running pool of at least ``n`` ranks needs nothing more, and
    a smaller one is closed before the larger starts, so its ranks' memory counts as free.

    Raises:
        CaseError: naming ``field``, the most ranks that fit, and the memory figures.
    """
    import psutil

    from torchref.pool import current_pool

    pool = current_pool()
    if pool is not None and pool.size >= n and pool.alive:
        return
    # what the next job starts: the shared pool's size when it is large enough (a matrix creates
    # its largest pool up front), else n ranks after the smaller pool closed
    size = pool.size if pool is not None and pool.size >= n else n
    free = psutil.virtual_memory().available
    for pid in pool.pids if pool is not None and pool.size < n else []:  # closed first
        try:
            free += psutil.Process(pid).memory_full_info().uss
        except (psutil.Error, OSError):
            pass
    fit = int(free // (RANK_MIB * 2**20))
    if size > fit:
        raise CaseError(field, f"at most {fit} torch ranks on this machine ({free / 2**30:.1f} GiB of memory available,"
                               f" about {RANK_MIB} MiB per rank)", size)


def tf_device_count() -> int:
    """How many tower devices this process has (configures TensorFlow's devices)."""
    return len(tf_module().available_devices())


def check_tf_devices(case: Case, impl: str, *, towers: bool = True) -> Any:
    """``tfpar`` with the case's devices checked: N towers (``towers``) and every placement fit this process."""
    n = case.devices
    placed = [device + 1 for _, _, device in case.spec["model"].get("placement", [])]
    reserve_tf_devices(max([n if towers else 1, *placed]))  # effective only when this case starts TensorFlow
    tfpar = tf_module()
    have = len(tfpar.available_devices())
    if towers and n > have:  # one device per tower
        raise CaseError("parallel.devices", f"at most {have} (the tower devices this process has: TensorFlow fixed them"
                                            " when it started; set TFPAR_DEVICES before start-up for more)", n)
    for j, (_, _, device) in enumerate(case.spec["model"].get("placement", [])):
        if device >= have:
            raise CaseError(f"model.placement[{j}][2]", f"a device index below {have} (the devices this process has)", device)
    return tfpar


def run_torch_job(impl: str, fn: Any, job: Any, world_size: int, *,
                  on_failure: Any = None) -> list[Any]:
    """Run ``fn(ctx, job)`` on ranks 0..world_size-1 of the shared pool; failures become one line.

    ``on_failure(detail, rank) -> Exception | None`` may turn a rank's traceback text into a more
    specific error (what a plugin raised, or bad input it met) before the generic one.

    Raises:
        RunError: a rank raised, died or hung (named, with the remote error's last line).
    """
    from torchref.pool import PoolError, RankFailed, get_pool

    check_torch_ranks(world_size)
    shared = {} if _POOL_TIMEOUT is None else {"timeout": _POOL_TIMEOUT}
    pool = get_pool(world_size, **shared)  # reused when large enough, restarted larger when not
    try:
        return pool.run(fn, job, world_size, timeout=_POOL_TIMEOUT)
    except RankFailed as e:  # one line: the rank, how it failed, and the remote error's last line
        specific = on_failure(e.detail, e.rank) if on_failure else None
        if specific is not None:
            raise specific from e
        last = next((line.strip() for line in reversed(e.detail.splitlines()) if line.strip()), "")
        raise RunError(f"{impl} failed: rank {e.rank} {e.how}{e.when}" + (f": {last}" if last else "")) from e
    except PoolError as e:
        raise RunError(f"{impl} failed: {e}") from e


#: payload arrays past this many bytes together travel to the workers as a file, not through the pipes
BY_FILE_BYTES = 16 * 2**20


def by_file(payload: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``payload`` with its largest arrays (initial weights, data) written to a spill file until the rest hold at
    most :data:`BY_FILE_BYTES`, and that file.

    A job's payload is pickled and sent to every rank: a 25 M-parameter model's float64 initial
    weights are 200 MB, pickled beside the main process's own run (measured: +0.6 GB peak). As
    :class:`~parity_tests.protocol.rows.RowRef` they pickle as a file name; each rank reads them
    (``np.asarray``). The caller removes the file once the job is over
    (:func:`~parity_tests.protocol.rows.remove_files`).
    """
    from parity_tests.protocol.rows import RowStore

    store = RowStore(threshold=0)  # every array put goes to the file
    arrays = {("init", k): v for k, v in payload["init"].items()} | {(k, None): payload[k] for k in ("x", "y") if k in payload}
    sizes = {key: np.asarray(v).nbytes for key, v in arrays.items()}
    # the largest first until the rest hold at most BY_FILE_BYTES together: a transformer's weights are a hundred
    # arrays of 1-8 MB, each under it (29.5 M GPT: 0.24 GB in float64 went through the pipes with every job)
    held = sum(sizes.values())
    moved = {}
    for key in sorted(sizes, key=lambda key: -sizes[key]):
        if held <= BY_FILE_BYTES:
            break
        moved[key] = store.put(np.asarray(arrays[key]))
        held -= sizes[key]
    out = {**payload, "init": {k: moved.get(("init", k), v) for k, v in payload["init"].items()}}
    out.update({k: moved[(k, None)] for k in ("x", "y") if (k, None) in moved})
    return out, store.close()


def pool_timeout() -> float | None:
    """The per-job timeout set for torch runs (``None``: the pool's default)."""
    return _POOL_TIMEOUT
