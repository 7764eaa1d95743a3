"""A persistent pool of worker processes forming one torch.distributed gloo group.

Starting a process group costs seconds per case on a small machine, so the pool is started
once and reused: every world size 1..size is served by a subgroup of ranks 0..n-1, which every
rank creates when a job first needs it. The pool only talks over loopback and a file store in a
private 0700 folder.

    with DDPPool(4, timeout=30.0) as pool:
        results = pool.run(module_level_fn, payload, world_size=2)  # [result0, result1]

A failed job (a rank raised, died or did not answer) raises :class:`RankFailed` and tears the
whole pool down, since the other ranks may be stuck in a collective; the next ``run`` starts
a fresh one.

The ranks are forked from multiprocessing's *forkserver*, a clean process (started by exec,
not forked from this one: no TensorFlow, no threads) that imports this module, and so torch,
once. A spawned rank imported torch itself, about 3 CPU-seconds a rank: on two cores the four
ranks of a cold ``tfpar compare`` competed with TensorFlow's import, and every pool restart of
the test suite paid it again. Each rank still gets the parent's ``os.environ`` as it is when
the rank starts (the server's is the one it had when it started), and multiprocessing's usual
preparation (``sys.path``, working directory, the main module re-imported as with spawn). The
server leaves with this process (it reads a pipe that closes then); :func:`stop_forkserver`
stops it sooner.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing as mp
import os
import pickle
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing import resource_tracker
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any

from parity_tests.protocol.errors import TfparError
from parity_tests.protocol.memory import release_memory
from parity_tests.protocol.rows import ensure_spill_root, reporting_progress

from .jobs import PRELOAD

if TYPE_CHECKING:
    import torch.distributed as dist

__all__ = [
    "MAX_SIZE", "DDPPool", "PoolError", "RankContext", "RankFailed", "get_pool", "shutdown_pool",
    "current_pool", "swap_pool", "stop_forkserver", "remove_socket_folder",
]

MAX_SIZE = 64  #: the largest pool size accepted
_POLL_S = 0.1  # how often the parent looks at the pipes and the processes while waiting
_GRACE_S = 1.0  # after one rank fails, how long to wait for the others' reports
_JOIN_S = 5.0  # how long close() lets workers exit on their own before killing them
_PARENT_CHECK_S = 1.0  # how often an idle worker checks that its parent still lives


@dataclass(frozen=True)
class RankContext:
    """What a job function gets besides its payload."""

    rank: int  #: this rank in the job, 0..world_size-1
    world_size: int  #: the job's world size
    group: dist.ProcessGroup  #: gloo subgroup of ranks 0..world_size-1
    timeout: float  #: seconds after which a collective of this pool fails
    #: tell the parent the job is making progress (a training step done): the job's timeout then
    #: bounds the time between two beats, not the whole job, so a large model's long run is not
    #: taken for a hang (rank 0's beats are enough: the ranks meet in every step's collectives)
    beat: Callable[[], None] = field(default=lambda: None, compare=False, repr=False)
    #: ``write(fd, data)``: pass whole lines the job's code printed (fd 1 or 2) to the parent, which
    #: writes them around its progress bar (``parity_tests.protocol.relay``); a plugin run uses it
    #: (``None`` outside the pool, e.g. under torchrun: the output goes where it goes)
    write: Callable[[int, bytes], None] | None = field(default=None, compare=False, repr=False)


class PoolError(TfparError, RuntimeError):
    """Base class of the pool's errors."""


class RankFailed(PoolError):
    """A rank of a job (or of the start-up) raised, died or did not answer in time."""

    def __init__(self, rank: int, how: str, detail: str = "", when: str = "", pool_intact: bool = False) -> None:
        self.rank, self.how, self.detail, self.when = rank, how, detail, when
        #: every rank of the job answered and each raised an error of its own: none is stuck in a
        #: collective, so the pool was kept (a user's plugin that raises does not cost a restart)
        self.pool_intact = pool_intact
        text = f"rank {rank} {how}{when}"
        super().__init__(f"{text}:\n{detail}" if detail else text)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.rank, self.how, self.detail, self.when, self.pool_intact))


def _check_timeout(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}")
    return float(value)


def _margin(timeout: float) -> float:
    # Collectives fail by themselves after `timeout`; the margin lets that error reach us
    # before we call the rank silent.
    return 2.0 + 0.25 * timeout


def _beater(conn: Connection, lock: threading.Lock) -> Callable[[], None]:
    """``beat()`` sending ``("beat", None)`` to the parent, at most once a second."""
    last = [0.0]

    def beat() -> None:
        now = time.monotonic()
        if now - last[0] >= 1.0:
            last[0] = now
            with lock:
                conn.send(("beat", None))

    return beat


def _writer(conn: Connection, lock: threading.Lock) -> Callable[[int, bytes], None]:
    """``write(fd, data)`` sending ``("out", (fd, data))`` to the parent (from the job's output thread)."""

    def write(fd: int, data: bytes) -> None:
        with lock:
            conn.send(("out", (fd, data)))

    return write


# what multiprocessing adds to its temporary folder for the forkserver's socket:
# "/pymp-XXXXXXXX/listener-XXXXXXXX", at most 34 characters; a Unix socket path holds 107
_SOCKET_PATH_MAX, _SOCKET_SUFFIX = 107, 34


#: the finalizer of the folder :func:`_socket_folder` made (None when multiprocessing's own is in use)
_socket_finalizer: Any = None


def _socket_folder() -> str:
    """multiprocessing's temporary folder, where the forkserver's Unix socket lives; made here if not yet made.

    Made here rather than by ``multiprocessing.util.get_temp_dir`` (whose cache this fills) for
    two reasons. Python 3.11 puts it under ``TMPDIR``, and a long ``TMPDIR`` (a pytest
    ``tmp_path``, a deep cluster scratch folder) ended in ``OSError: AF_UNIX path too long``
    when the pool started: then it goes under ``/tmp``. And multiprocessing removes it only at
    a normal exit: :func:`remove_socket_folder` removes it too (``tfpar`` calls it before the
    ``os._exit`` that can follow Ctrl-C), and so does an orphaned rank 0 when the parent was killed.
    """
    global _socket_finalizer
    from multiprocessing import process, util

    config = process.current_process()._config  # noqa: SLF001  (where get_temp_dir caches its folder)
    if config.get("tempdir") is None:
        base = tempfile.gettempdir()
        if len(base) + _SOCKET_SUFFIX > _SOCKET_PATH_MAX:
            base = "/tmp"
        folder = tempfile.mkdtemp(prefix="pymp-", dir=base)
        _socket_finalizer = util.Finalize(None, util._remove_temp_dir, args=(shutil.rmtree, folder),  # noqa: SLF001
                                          exitpriority=-100)
        config["tempdir"] = folder
    return config["tempdir"]


def _worker_main(rank: int, size: int, store_path: str, timeout: float, start_timeout: float,
                 conn: Connection, environ: dict[str, str], socket_folder: str) -> None:
    # Ctrl-C belongs to the parent, which tears the pool down; the parent blocked SIGINT
    # before starting the forkserver (whose forks inherit its mask), so no signal lands
    # before this line.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    # orphaned when this changes: the parent is gone, and so the forkserver, which exits with it
    parent_pid = os.getppid()
    os.environ.clear()
    os.environ.update(environ)  # the parent's, as a spawned rank would have had it
    # here, not at the top: the parent that starts the pool need not import torch
    import torch.distributed as dist

    from torchref.determinism import configure

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # gloo binds to 127.0.0.1 only
    configure()  # the forkserver paid its imports (torchref.determinism)
    try:
        # Ranks start seconds apart on a busy machine: rendezvous under start_timeout and
        # switch to the (short) collective timeout afterwards.
        start_td, td = timedelta(seconds=start_timeout), timedelta(seconds=timeout)
        store = dist.FileStore(store_path, size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=start_td)
        groups: dict[int, Any] = {size: dist.group.WORLD}
        dist.distributed_c10d._set_pg_timeout(td, dist.group.WORLD)
        conn.send(("ready", None))
    except BaseException:
        conn.send(("raised", traceback.format_exc()))
        return
    stopped = False
    sending = threading.Lock()  # the job's output thread sends too (RankContext.write)
    try:
        while not stopped:
            if not conn.poll(_PARENT_CHECK_S):
                if os.getppid() != parent_pid:
                    break  # orphaned: nobody will ever send "stop"
                continue
            data = conn.recv_bytes()
            try:
                message = pickle.loads(data)  # fails here if fn's module is not importable
                if message[0] == "stop":
                    stopped = True
                    continue
                if message[0] == "group":  # collective: every rank, in the order the parent sends them
                    n = message[1]
                    # new_group defaults to the backend's 30 min, not to the world's timeout.
                    groups[n] = dist.new_group(list(range(n)), timeout=start_td)
                    if rank < n:
                        dist.distributed_c10d._set_pg_timeout(td, groups[n])
                    conn.send(("ok", None))
                    continue
                _, fn, payload, n = message
                beat = {"beat": _beater(conn, sending)} if rank == 0 else {}  # rank 0 reports the job's progress
                # rank 0's rows written to spill files count as progress too (a large model's copies)
                with reporting_progress(beat.get("beat")):
                    result = fn(RankContext(rank, n, groups[n], timeout, write=_writer(conn, sending), **beat), payload)
                with sending:
                    conn.send(("ok", result))
                del result, payload
                release_memory()  # the job's freed tensors back to the system: the worker waits here beside the next runs
            except Exception as e:
                # a user's plugin that raised reports its own frames (torchref.plugin.PluginRaised.report)
                report = getattr(e, "report", None)
                with sending:
                    conn.send(("raised", report if isinstance(report, str) else traceback.format_exc()))
    except (EOFError, OSError):
        pass  # the parent is gone
    if stopped:
        dist.destroy_process_group()
    elif rank == 0:  # orphaned: the parent cannot remove its store folder any more, nor the forkserver's
        shutil.rmtree(os.path.dirname(store_path), ignore_errors=True)
        shutil.rmtree(socket_folder, ignore_errors=True)
    # Interpreter finalisation tears down the gloo contexts for seconds (4-7 s at 8 ranks);
    # nothing is left to save, so exit at once and let the OS close the sockets.
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)


# How a rank's failure reads as a consequence of another's. A rank that fails first (dies, or
# raises an error of its own) leaves its peers waiting in a collective until it times out; a
# rank whose collective times out closes its connections, and its peers then see "connection
# closed by peer". So the root cause is the failure lowest in this order; ties go to the
# lowest rank.
_PEER_CLOSED = re.compile(r"connection (closed|reset) by peer|broken pipe", re.IGNORECASE)
_TIMED_OUT = re.compile(r"timed out|timeout", re.IGNORECASE)


def _consequence_rank(how: str, detail: str) -> int:
    """0: died; 1: raised its own error; 2: a collective timed out; 3: a peer closed on it."""
    if how.startswith("died"):
        return 0
    last = detail.strip().splitlines()[-1] if detail.strip() else ""
    if _PEER_CLOSED.search(last):
        return 3
    if _TIMED_OUT.search(last):
        return 2
    return 1


def _describe_death(proc: mp.process.BaseProcess) -> str:
    proc.join(_POLL_S)  # the pipe may close a moment before the exit code is known
    code = proc.exitcode
    if code is None:
        return "died (closed its pipe)"
    return f"died (signal {-code})" if code < 0 else f"died (exit code {code})"


class DDPPool:
    """A pool of ``size`` spawned ranks forming one gloo process group, reused for many jobs."""

    def __init__(self, size: int = 8, *, timeout: float = 60.0, start_timeout: float = 300.0):
        if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= MAX_SIZE:
            raise ValueError(f"pool size must be an integer in 1..{MAX_SIZE}, got {size!r}")
        self.size = size
        self.timeout = _check_timeout("timeout", timeout)
        self.start_timeout = _check_timeout("start_timeout", start_timeout)
        self._procs: list[mp.process.BaseProcess] = []
        self._conns: list[Connection] = []
        self._dir: str | None = None
        self._lock = threading.RLock()  # one job (or start, or close) at a time
        self._groups: set[int] = set()  # world sizes whose subgroup the running workers made
        self._pending = False  # spawned by spawn(), start-up handshake not yet awaited

    @property
    def alive(self) -> bool:
        """True when the pool is started and every worker is running."""
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    @property
    def pids(self) -> list[int]:
        """Worker process ids in rank order (empty when not started)."""
        return [p.pid for p in self._procs if p.pid is not None]

    @property
    def store_dir(self) -> str | None:
        """The private folder holding the rendezvous file store (None when not started)."""
        return self._dir

    def start(self) -> None:
        """Spawn the workers and wait until all of them joined every group; no-op if alive."""
        # the spill folder (TFPAR_SPILL_ROOT) is named in this process before any worker is spawned, so
        # that the workers inherit it: their recorded rows then live where this process removes them
        ensure_spill_root()
        with self._lock:
            if self.alive and not self._pending:
                return
            try:
                if not (self.alive and self._pending):  # not spawned yet, or a worker died meanwhile
                    self._teardown()
                    self._spawn()
                self._gather(self.size, self.start_timeout, " during start-up")
                self._pending = False
            except BaseException:
                self._teardown()
                raise

    def spawn(self) -> None:
        """Start the workers' processes without waiting for them; the next :meth:`run` (or :meth:`start`) waits.

        The workers import torch and join their process groups meanwhile, so a caller that
        has slow work of its own to do first (importing TensorFlow) overlaps the two.
        No-op when the pool already has workers.
        """
        with self._lock:
            if self._procs:
                return
            try:
                self._spawn()
                self._pending = True
            except BaseException:
                self._teardown()
                raise

    def _spawn(self) -> None:
        _spawned.add(self)  # closed by stop_forkserver if nobody else closes it
        self._groups = {self.size}  # the world group; subgroups are made as jobs need them
        socket_folder = _socket_folder()
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload([__name__, *PRELOAD])  # the server imports torch once; ranks fork from it
        self._dir = tempfile.mkdtemp(prefix="torchref-pool-")  # mode 0700
        store_path = os.path.join(self._dir, "store")
        # A blocked signal stays blocked across fork+exec, closing the window before the
        # worker installs SIG_IGN for SIGINT. Launching multiprocessing's resource tracker
        # unblocks SIGINT in this thread, so launch it first.
        resource_tracker.ensure_running()
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            for rank in range(self.size):
                parent_conn, child_conn = ctx.Pipe()
                proc = ctx.Process(
                    target=_worker_main, name=f"torchref-pool-rank{rank}", daemon=True,
                    args=(rank, self.size, store_path, self.timeout, self.start_timeout,
                          child_conn, dict(os.environ), socket_folder))
                proc.start()
                child_conn.close()
                self._procs.append(proc)
                self._conns.append(parent_conn)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)

    def run(self, fn: Callable[[RankContext, Any], Any], payload: Any, world_size: int, *,
            timeout: float | None = None) -> list[Any]:
        """Run ``fn(ctx, payload)`` on ranks 0..world_size-1; return their results in rank order.

        ``timeout`` bounds how long the parent waits for this job (default: the pool's); the
        collectives themselves fail after the pool's timeout. Raises :class:`RankFailed`
        (and tears the pool down) when a rank raises, dies or does not answer.
        """
        if (isinstance(world_size, bool) or not isinstance(world_size, int)
                or not 1 <= world_size <= self.size):
            raise ValueError(f"world_size {world_size!r} is outside 1..{self.size} "
                             f"(the pool's size is {self.size})")
        limit = self.timeout if timeout is None else _check_timeout("timeout", timeout)
        # Pickled once, up front: an unpicklable fn or payload fails here, pool intact.
        message = pickle.dumps(("job", fn, payload, world_size), pickle.HIGHEST_PROTOCOL)
        with self._lock:
            self.start()
            try:
                if world_size not in self._groups:
                    self._make_group(world_size)
                for conn in self._conns[:world_size]:
                    with contextlib.suppress(OSError):  # a dead worker: _gather reports it
                        conn.send_bytes(message)
                return self._gather(world_size, limit + _margin(limit), "")
            except RankFailed as e:
                if not e.pool_intact:
                    self._teardown()
                raise
            except BaseException:
                self._teardown()
                raise

    def _make_group(self, n: int) -> None:
        """Every rank creates the subgroup of ranks 0..n-1, the first time a job needs it.

        Made at start-up, every subgroup of a 64-rank pool cost each rank about 3 gloo threads a
        group it belongs to, and the idle pool used about 1.5 of the 2-core machine's cores
        (measured 2026-11-22, docs/large-world.md); a pool makes only the sizes its jobs use.
        """
        message = pickle.dumps(("group", n))
        for conn in self._conns:
            with contextlib.suppress(OSError):  # a dead worker: _gather reports it
                conn.send_bytes(message)
        self._gather(self.size, self.start_timeout, f" making the subgroup of ranks 0..{n - 1}")
        self._groups.add(n)

    def _gather(self, n: int, limit: float, when: str) -> list[Any]:
        pending = dict(enumerate(self._conns[:n]))
        results: dict[int, Any] = {}
        failures: dict[int, tuple[str, str]] = {}  # rank -> (how, detail)
        deadline = time.monotonic() + limit
        while pending and (left := deadline - time.monotonic()) > 0:
            wait([*pending.values(), *(self._procs[r].sentinel for r in pending)],
                 timeout=min(_POLL_S, left))
            for rank, conn in list(pending.items()):
                try:
                    kind, value = conn.recv() if conn.poll() else (None, None)
                except (EOFError, OSError):
                    kind, value = "died", None
                if kind is None and not self._procs[rank].is_alive():
                    kind = "died"
                if kind is None:
                    continue
                if kind == "out":  # what the job's code printed, whole lines: around the progress bar
                    from parity_tests.protocol.relay import write_output

                    write_output(*value)
                    continue
                if kind == "beat":  # the job moves on: the limit counts from its last beat
                    if not failures:
                        deadline = max(deadline, time.monotonic() + limit)
                    continue
                del pending[rank]
                if kind in ("ok", "ready"):
                    results[rank] = value
                    continue
                how = "raised" if kind == "raised" else _describe_death(self._procs[rank])
                failures[rank] = (how, value or "")
                # The others may wait in a collective for the failed rank: stop soon.
                deadline = min(deadline, time.monotonic() + _GRACE_S)
        if failures:
            rank = min(failures, key=lambda r: (_consequence_rank(*failures[r]), r))
            how, detail = failures[rank]
        elif pending:
            rank, how, detail = min(pending), f"timed out after {limit:.1f} s", ""
        else:
            return [results[r] for r in range(n)]
        # Every rank answered and each failure is an error of its own (not a death, a timeout or
        # a peer's hang-up): no rank waits in a collective, so the group is fit for the next job.
        intact = not pending and not when and all(_consequence_rank(*f) == 1 for f in failures.values())
        if not intact:
            self._teardown()
        raise RankFailed(rank, how, detail, when, pool_intact=intact)

    def close(self) -> None:
        """Stop the workers (killing any that do not exit promptly); idempotent."""
        with self._lock:
            stop = pickle.dumps(("stop",))
            for conn in self._conns:
                with contextlib.suppress(OSError):
                    conn.send_bytes(stop)
            deadline = time.monotonic() + _JOIN_S
            for proc in self._procs:
                proc.join(max(0.0, deadline - time.monotonic()))
            self._teardown()

    def _teardown(self) -> None:
        self._pending = False
        procs, conns, self._procs, self._conns = self._procs, self._conns, [], []
        for proc in procs:
            if proc.is_alive():
                proc.kill()  # SIGKILL: a rank stuck in a collective ignores anything gentler
        for proc in procs:
            proc.join(_JOIN_S)
        for item in [*conns, *procs]:
            with contextlib.suppress(OSError, ValueError):
                item.close()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def restart(self) -> None:
        """Close the pool and start a fresh one."""
        with self._lock:
            self.close()
            self.start()

    def __enter__(self) -> DDPPool:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"DDPPool(size={self.size}, timeout={self.timeout}, alive={self.alive})"


_shared: DDPPool | None = None
_DEFAULT_TIMEOUT = 60.0  # seconds: the shared pool's collective timeout unless one is asked for
_shared_lock = threading.Lock()
_atexit_registered = False


#: every pool that has spawned ranks and is not yet garbage (stop_forkserver closes them first)
_spawned: weakref.WeakSet[DDPPool] = weakref.WeakSet()


def get_pool(size: int = 8, *, timeout: float | None = None) -> DDPPool:
    """The process-wide shared pool; created on first use, started by its first ``run``.

    Asking for a larger size than the current pool's closes it and creates a bigger one
    (with the same timeout unless another is given). ``timeout``: the collectives'
    timeout in seconds; ``None`` keeps the current pool's (60 s for a new one), and a
    different value closes the current pool and creates one with it, because a process
    group's timeout is fixed when its ranks start. The pool is closed at interpreter exit.
    """
    global _shared, _atexit_registered
    DDPPool(size, timeout=_DEFAULT_TIMEOUT if timeout is None else timeout)  # validates; starts nothing
    with _shared_lock:
        keep = _shared.timeout if _shared is not None else _DEFAULT_TIMEOUT
        want = keep if timeout is None else float(timeout)
        if _shared is not None and (_shared.size < size or _shared.timeout != want):
            _shared.close()
            _shared = None
        if _shared is None:
            # start-up is CPU-bound (each rank imports torch: about 3 CPU-s a rank at 32 and
            # 64 ranks); measured on the shared 2-core machine: 160 s at 16 ranks, 224 s
            # at 32, so 300 s would not hold 64 ranks
            _shared = DDPPool(size, timeout=want, start_timeout=max(300.0, 10.0 * size))
            if not _atexit_registered:
                atexit.register(stop_forkserver)  # atexit runs last-in first: after the pool's close
                atexit.register(shutdown_pool)
                _atexit_registered = True
        return _shared


def current_pool() -> DDPPool | None:
    """The shared pool as it is now (None before the first :func:`get_pool`); creates nothing."""
    return _shared


def swap_pool(pool: DDPPool | None) -> DDPPool | None:
    """Make ``pool`` the shared one and return the previous, neither closed nor started.

    For a few jobs at a world size larger than the warm pool's without losing it:
    ``old = swap_pool(DDPPool(16))``, run, then ``swap_pool(old).close()``.
    """
    global _shared
    with _shared_lock:
        old, _shared = _shared, pool
    return old


def shutdown_pool() -> None:
    """Close the shared pool, if any."""
    global _shared
    with _shared_lock:
        pool, _shared = _shared, None
    if pool is not None:
        pool.close()


def stop_forkserver() -> None:
    """Stop the forkserver the ranks fork from, if it runs, and remove its socket's folder.

    Both would go at a normal exit anyway (the server leaves with this process); a caller
    that counts its children (a test session's end) or may leave by ``os._exit``
    (``tfpar`` after Ctrl-C) stops them first. The next pool start starts another.
    """
    from multiprocessing import forkserver

    # The server leaves only when every process it forked has: each holds the server's "alive"
    # pipe (multiprocessing hands it to every child), and _stop waits for the server. A pool
    # nobody closed (dropped without close, or swapped out of the shared place and not put
    # back) would make this wait forever, at a test session's end or at interpreter exit.
    for pool in list(_spawned):
        pool.close()
    forkserver._forkserver._stop()  # noqa: SLF001  (the one way to stop it; idempotent)
    remove_socket_folder()


def remove_socket_folder() -> None:
    """Remove the folder of the forkserver's socket, if :func:`_socket_folder` made it (a running
    server does not need it any more: it has its socket open; only a new pool start would)."""
    global _socket_finalizer
    if _socket_finalizer is not None:
        _socket_finalizer()  # removes the folder and clears get_temp_dir's cache; runs once
        _socket_finalizer = None
