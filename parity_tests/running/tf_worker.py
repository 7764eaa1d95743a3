"""Every TensorFlow plugin run in a fresh process, forked from a warm server that imported TensorFlow once.

A TensorFlow plugin is the user's program. It sets process-wide state as a
program may: ``tf.distribute.MirroredStrategy`` registers collective groups and
instance keys in the eager context (a second strategy in the same process reuses
instance 100 with another dtype: ``Collective instance 100 expected ... data_type 1
but got ... data_type 2 ... Restart your program to reset``), ``keras.config.set_floatx``
and ``keras.mixed_precision.set_global_policy`` change every later layer,
``tf.compat.v1.disable_eager_execution()`` cannot be undone, Keras' name counters,
``tf.random.set_seed``, ``tf.config.run_functions_eagerly``, the default graph, the
module's own top-level objects (a module-level strategy or model). The tool runs a
plugin several times per comparison (each dtype, the perturbed rerun, the
localisation rerun, the spread reruns of a nondeterministic plugin), so each run
gets a process of its own, as running the program again would.

How, and what it costs (``benchmarks/bench_plugin_isolation.py``, docs/plugins.md
"Every run starts clean"): a *server* process (``python -m
parity_tests.running.tf_worker``) imports TensorFlow, Keras and ``tfpar`` once,
without starting TensorFlow's runtime (no op has run: no device, no thread pool,
no eager context). Each run is an ``os.fork()`` of it: the child puts Keras' settings
and global state back as ``import keras`` left them (``tfpar.fresh``: no global dtype
policy made, so a program's ``set_floatx`` alone works as in a fresh ``python``),
configures the case's devices and op determinism, imports the plugin's module afresh, runs it,
and sends its records back (large arrays as spill files, ``parity_tests.protocol.rows``).
Forking is safe there: the server has one thread of its own (plus OpenBLAS's
idle pool, which registers fork handlers) and no TensorFlow runtime. The child
exits with ``os._exit`` once its records are sent, so nothing of it outlives
the run.

Lifetimes: the server leaves when this process closes its end of the socket
(exit, a kill) or asks it to; a child is killed by the kernel when the server
dies (``PR_SET_PDEATHSIG``), and by the server when this process stops waiting
(Ctrl-C). The server runs in a session of its own and ignores SIGINT: Ctrl-C
belongs to this process, which tears the server and its child down.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import traceback
from collections.abc import Mapping
from multiprocessing.connection import Connection, wait
from typing import Any

from parity_tests.protocol.errors import TfparError
from parity_tests.protocol.memory import release_memory
from parity_tests.protocol.relay import without_chatter, write_output
from parity_tests.protocol.rows import ensure_spill_root, remove_files
from parity_tests.running.backends import RunError, by_file, quiet_stderr

__all__ = ["TFWorker", "get_worker", "shutdown_worker", "WorkerDied", "run_in_child", "job_context", "run_case_job"]

_JOIN_S = 5.0  # how long close() lets the server leave on its own before killing it


class WorkerDied(TfparError, RuntimeError):
    """The run's process died without reporting (a signal, ``os._exit``, a crash inside TensorFlow)."""


class TFWorker:
    """A warm TensorFlow server; :meth:`run` forks one fresh process per job from it.

    ``run(job)`` returns what :func:`run_in_child` returned in the child (plain data),
    or raises :class:`WorkerDied`. One job at a time (a lock); a job interrupted by
    an exception in the caller (Ctrl-C) kills the child and the server, and the next
    job starts another server.
    """

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._ready = False
        self._lock = threading.RLock()
        self.child: int | None = None  #: the pid of the run in progress, if any

    @property
    def pid(self) -> int | None:
        """The server's pid (``None`` when not started)."""
        return None if self._proc is None else self._proc.pid

    def start(self) -> None:
        """Start the server without waiting for it (it imports TensorFlow meanwhile); no-op when started."""
        ensure_spill_root()  # named before the server starts: its runs inherit it and spill where this process removes
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                return
            self._teardown()
            mine, theirs = socket.socketpair()
            with mine, theirs:
                # its environment is this process's now; each job also carries os.environ as it is then
                # a session of its own: the terminal's Ctrl-C reaches this process only, which tears
                # the server down (no preexec_fn: this process has threads)
                self._proc = subprocess.Popen(
                    [sys.executable, "-m", "parity_tests.running.tf_worker", str(theirs.fileno())],
                    pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, start_new_session=True)
                self._conn = Connection(os.dup(mine.fileno()))
            self._ready = False

    def run(self, job: Mapping[str, Any]) -> Any:
        """Run ``job`` in a fresh child of the server; its result (see :func:`run_in_child`)."""
        message = pickle.dumps(("run", dict(job)), pickle.HIGHEST_PROTOCOL)  # an unpicklable job fails here
        with self._lock:
            self.start()
            try:
                if not self._ready:
                    self._expect("ready")
                    self._ready = True
                self._conn.send_bytes(message)
                self.child = self._expect("started")
                status, data = self._expect("done", relay=True)
            except BaseException:
                self._teardown()  # Ctrl-C, or the server died: nothing of it stays
                raise
            finally:
                self.child = None
            if data is None:
                how = (f"signal {-status}" if status < 0 else f"exit code {status}") if status is not None else "unknown"
                raise WorkerDied(f"its process died ({how}) without reporting")
            return pickle.loads(data)

    def _expect(self, tag: str, *, relay: bool = False) -> Any:
        while True:
            try:
                got = self._conn.recv()
            except (EOFError, OSError):
                code = None
                with contextlib.suppress(subprocess.TimeoutExpired):
                    code = self._proc.wait(_JOIN_S) if self._proc is not None else None
                raise WorkerDied(f"the TensorFlow server died (exit status {code}) before it sent {tag!r}") from None
            if relay and got[0] == "out":  # the run's own output, whole lines (_relay_output)
                write_output(got[1], got[2])
                continue
            break
        if got[0] == "failed":  # the server could not start (TensorFlow failed to import)
            raise WorkerDied(f"the TensorFlow server could not start: {got[1]}")
        if got[0] != tag:
            raise WorkerDied(f"the TensorFlow server sent {got[0]!r}, expected {tag!r}")
        return got[1] if len(got) == 2 else got[1:]

    def close(self) -> None:
        """Stop the server (and a child still running); idempotent."""
        with self._lock:
            if self._conn is not None and self._proc is not None and self._proc.poll() is None:
                with contextlib.suppress(OSError):
                    self._conn.send(("stop",))
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self._proc.wait(_JOIN_S)
            self._teardown()

    def _teardown(self) -> None:
        if self.child is not None:
            with contextlib.suppress(OSError):
                os.kill(self.child, signal.SIGKILL)  # the server's child: dies with it anyway (PDEATHSIG)
            self.child = None
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(_JOIN_S)
        if self._conn is not None:
            with contextlib.suppress(OSError):
                self._conn.close()
        self._proc, self._conn, self._ready = None, None, False


_shared: TFWorker | None = None
_shared_lock = threading.Lock()


def get_worker(*, start: bool = True) -> TFWorker:
    """The process-wide server (started now unless ``start=False``); closed at interpreter exit."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = TFWorker()
            atexit.register(shutdown_worker)
    if start:
        _shared.start()
    return _shared


def shutdown_worker() -> None:
    """Stop the shared server, if any."""
    global _shared
    with _shared_lock:
        worker, _shared = _shared, None
    if worker is not None:
        worker.close()


def job_context(devices: int = 1) -> dict[str, Any]:
    """What every job carries of this process as it is now: working folder, environment, ``sys.path``,
    spill threshold, and the tower devices to configure (the largest count reserved here, at least ``devices``)."""
    from parity_tests.protocol.rows import spill_threshold
    from parity_tests.running import backends

    return {"cwd": os.getcwd(), "environ": {"TF_CPP_MIN_LOG_LEVEL": "2", **os.environ}, "sys_path": list(sys.path),
            "spill_bytes": spill_threshold(), "devices": max(backends.reserved_tf_devices(), int(devices))}


def run_case_job(case: Any, impl: str, devices: int, **job: Any) -> Any:
    """Run ``job`` (``location`` + ``deterministic`` for a plugin, ``builtin`` for a built-in engine) on
    ``case``'s payload in a fresh child of the server, with ``devices`` tower devices; the child's answer.

    The payload's large arrays travel as a spill file (:func:`~parity_tests.running.backends.by_file`),
    removed once the child is done.

    Raises:
        RunError: the child died without reporting (named ``impl``).
    """
    payload, files = by_file(case.payload())
    try:
        return get_worker().run({**job_context(devices), **job, "payload": payload})
    except WorkerDied as e:
        raise RunError(f"{impl} failed: {e}") from None
    finally:
        remove_files(files)


# ---------------------------------------------------------------------------------------------- the server

#: Keras' settings and global state right after the server imported it (``tfpar.fresh.snapshot``): what a
#: program that imports Keras starts with; each run's child puts them back before it imports the plugin
_FRESH: dict[str, Any] | None = None



def _serve(fd: int) -> None:
    global _FRESH
    conn = Connection(fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        with quiet_stderr():
            import tensorflow  # noqa: F401  (what every child would import: paid once, here)

            with contextlib.suppress(ImportError):
                import keras  # noqa: F401
            from tfpar.fresh import snapshot

            _FRESH = snapshot()  # Keras as `import keras` leaves it: each run starts from it (tfpar.fresh)
            import tfpar.plugin  # noqa: F401
            import tfpar.run  # noqa: F401  (every engine module, as `import tfpar` did before it was lazy)
            from parity_tests.protocol import plugin_mark  # noqa: F401
    except BaseException as e:  # noqa: BLE001  (reported to the parent, which says it in one line)
        conn.send(("failed", traceback.format_exception_only(type(e), e)[-1].strip()))
        return
    conn.send(("ready", None))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return  # the parent is gone
        if message[0] != "run":
            return
        if not _fork_one(conn, message[1]):
            return


def _fork_one(conn: Connection, job: dict[str, Any]) -> bool:
    """Fork a child for ``job``, forward its result; ``False`` when the parent left meanwhile."""
    r, w = os.pipe()
    outs = [os.pipe(), os.pipe()]  # the child's stdout and stderr, relayed line by line (_relay_output)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        os.close(r)
        code = 0
        try:
            conn.close()  # the parent's socket is the server's: the child reports through its own pipe
            for fd, (pr, pw) in zip((1, 2), outs, strict=True):
                os.close(pr)
                os.dup2(pw, fd)
                os.close(pw)
            sys.stdout.reconfigure(line_buffering=True)  # a pipe now: print() shows as it happens
            _die_with_parent()
            result = run_in_child(job)
            with Connection(w, readable=False) as out:
                out.send_bytes(pickle.dumps(result, pickle.HIGHEST_PROTOCOL))
        except BaseException:  # noqa: BLE001
            traceback.print_exc()
            code = 70
        finally:
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os._exit(code)  # no interpreter shutdown: TensorFlow's teardown takes seconds and adds nothing
    os.close(w)
    for _, pw in outs:
        os.close(pw)
    streams = {pr: (fd, b"") for fd, (pr, _) in zip((1, 2), outs, strict=True)}
    child = Connection(r, writable=False)
    conn.send(("started", pid))
    data: bytes | None = None
    parent_left = False
    try:
        while True:
            ready = wait([child, conn, *streams])
            for pr in [x for x in ready if x in streams]:
                _relay_output(conn, streams, pr)
            if child in ready:
                with contextlib.suppress(EOFError, OSError):
                    data = child.recv_bytes()
                break
            if conn in ready:  # only the parent's leaving (EOF) or "stop" can come now
                parent_left = True
                os.kill(pid, signal.SIGKILL)
                break
    finally:
        child.close()
        status = None
        # what the child writes last, up to its pipes' end: drained before it is waited for, so a
        # child whose last flush fills a pipe is never left blocked (a process the child started
        # that keeps the pipes open is not waited for: a second of silence after the child's exit)
        while streams and not parent_left:
            ready = wait(list(streams), timeout=1.0)
            for pr in ready:
                _relay_output(conn, streams, pr)
            if not ready and status is None:
                done, st = os.waitpid(pid, os.WNOHANG)
                status = st if done else None
            if not ready and status is not None:
                break
        if status is None:
            _, status = os.waitpid(pid, 0)
        for pr in streams:
            os.close(pr)
    if parent_left:
        return False
    code = os.waitstatus_to_exitcode(status)
    conn.send(("done", code, data))
    # the result's bytes (and their pickled copy) given back: the next child is forked from this process and
    # starts with its resident memory (a large model's result is 0.1 GB, a captured step's was 1.2 GB)
    del data
    release_memory()
    return True


def _relay_output(conn: Connection, streams: dict[int, tuple[int, bytes]], pr: int) -> None:
    """Read what the child wrote on one of its streams and send the parent its whole lines (the rest at EOF).

    Whole lines only: the parent writes each between its progress bar's redraws
    (``parity_tests.protocol.relay.write_output``), so a line is never cut by the bar.
    """
    fd, pending = streams[pr]
    try:
        chunk = os.read(pr, 65536)
    except OSError:
        chunk = b""
    if not chunk:
        if pending and without_chatter(pending + b"\n"):  # an unfinished last line is ended here: what the
            conn.send(("out", fd, without_chatter(pending + b"\n")))  # tool prints next starts a line
        del streams[pr]
        os.close(pr)
        return
    pending += chunk
    head, sep, rest = pending.rpartition(b"\n")
    if sep and without_chatter(head + sep):
        conn.send(("out", fd, without_chatter(head + sep)))
    streams[pr] = (fd, rest)


def _die_with_parent() -> None:
    """``PR_SET_PDEATHSIG(SIGKILL)``: the kernel kills this child when the server goes (Linux only)."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    if os.getppid() == 1:  # the server went before the line above
        os._exit(0)


def run_in_child(job: Mapping[str, Any]) -> dict[str, Any]:
    """In the fresh child: set the process up as the job says, import the plugin, run it.

    ``job``: ``{"cwd", "environ", "sys_path", "spill_bytes", "devices", "location", "payload",
    "deterministic"}``: the caller's working folder, environment and ``sys.path`` as they are
    now (the server was started earlier), its spill threshold, how many tower devices to
    configure (the caller's TensorFlow count), where the plugin lives, the case payload, and
    whether op determinism is on (``@tfpar.plugin.tensorflow(deterministic=...)``).

    Python's and numpy's global generators are seeded with the case seed (a rerun draws
    the same numbers); TensorFlow's global seed is left unset, as in a fresh program. Keras'
    process-wide settings and global state are put back as ``import keras`` left them in the
    server (``tfpar.fresh``: floatx, the global dtype policy, name counters, the global seed).

    With ``"builtin": impl`` instead of ``"location"``, the built-in engine ``impl`` runs the payload
    (:func:`_run_builtin`). With ``"inspect": True`` (and no payload) the module is only imported and the name looked
    up: ``{"described": parity_tests.protocol.plugin_mark.describe(fn)}`` (resolving a plugin name).

    Returns:
        ``{"records": ...}`` (``tfpar.plugin.Run.records``), ``{"raised": {"step", "when", "line",
        "frames"}}`` (the plugin raised: ``tfpar.plugin.PluginRaised``) or ``{"input": line}``
        (the module failed to import, or the case asks for more devices than were configured).
    """
    import random

    import numpy as np

    from parity_tests.protocol.rows import set_spill_threshold
    from tfpar.fresh import restore

    restore(_FRESH)  # Keras' floatx, global dtype policy, name counters, seed: as `import keras` left them
    os.chdir(job["cwd"])
    os.environ.clear()
    os.environ.update(job["environ"])
    sys.path[:] = list(job["sys_path"])
    set_spill_threshold(int(job["spill_bytes"]))
    import tfpar
    from tfpar.plugin import PluginRaised, run_plugin

    with quiet_stderr():
        if "builtin" in job:
            # one inter-op thread: a large model's towers then do not all run their forward and backward at once,
            # so their activations are not all held together (29.5 M GPT, float64: 0.57 GB less at the peak, the
            # same time on 2 cores; each op's kernel still uses every core). The same values: op determinism holds
            # each op's result, whatever runs beside it (tests/test_builtins_isolation.py: bit for bit)
            import tensorflow as tf

            tf.config.threading.set_inter_op_parallelism_threads(1)
        tfpar.configure_devices(int(job["devices"]) or None)  # op determinism on, as for every run
    if not job.get("deterministic", True):
        from tensorflow.python.framework import config as tf_config

        tf_config.disable_op_determinism()  # the plugin said it cannot run deterministically
    seed = int(job["payload"]["spec"].get("seed", 0)) if "payload" in job else 0
    random.seed(seed)
    np.random.seed(seed % 2**32)
    if "builtin" in job:  # a built-in engine's run (parity_tests.running.builtins: a model too large to keep here)
        return _run_builtin(job["builtin"], job["payload"])
    try:
        fn = _import(job["location"])
    except Exception as e:  # noqa: BLE001  (bad input: one line, as the parent's own import says it)
        from parity_tests.protocol.frames import last_line
        from parity_tests.protocol.user_code import where

        return {"input": f"{where(job['location'])} to import cleanly; it raised {last_line(e)}"}
    if job.get("inspect"):  # resolving a name: what the module holds under it
        from parity_tests.protocol.plugin_mark import describe

        return {"described": describe(fn)}
    from parity_tests.contract.layouts import LayoutError

    try:
        return {"records": run_plugin(fn, job["payload"])}
    except PluginRaised as e:
        return {"raised": {"step": e.step, "when": e.when, "line": e.line, "frames": e.frames}}
    except LayoutError as e:  # run.to_torch / run.to_tf asked what cannot be told: bad input, one line
        return {"input": e.line()}


def _run_builtin(impl: str, payload: Mapping[str, Any]) -> dict[str, Any]:
    """``tfpar.run_case(payload, impl)`` in this child: ``{"trajectory": ...}`` (spilled rows travel as file
    names), ``{"unsupported": (field, expected)}`` (``tfpar.Unsupported``) or ``{"failed": line}``."""
    import numpy as np

    import tfpar

    # the initial weights stay as they came (a large model's as RowRef s of the payload's file): every engine
    # reads each one where it makes that variable (np.asarray), so the run never holds them all beside its
    # variables (a float64 copy of the model, 0.24 GB at 29.5 M parameters)
    payload = {**payload, **{k: np.asarray(payload[k]) for k in ("x", "y") if k in payload}}
    try:
        return {"trajectory": tfpar.run_case(payload, impl)}
    except tfpar.Unsupported as e:
        return {"unsupported": (e.field, e.expected)}
    except Exception as e:  # noqa: BLE001  (a TensorFlow failure on a valid case: one line, as in-process)
        return {"failed": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}


def _import(location: Mapping[str, str]) -> Any:
    """The plugin function at ``location``, its module imported afresh in this process (``protocol.user_code``)."""
    from parity_tests.protocol.user_code import import_module

    return getattr(import_module(location), location["attr"], None)


if __name__ == "__main__":  # the server: python -m parity_tests.running.tf_worker FD
    _serve(int(sys.argv[1]))
