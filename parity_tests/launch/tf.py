"""One TensorFlow worker of a ``tf.multiworker`` run; start it on every worker with its ``TF_CONFIG``.

    TF_CONFIG='{"cluster": {"worker": ["127.0.0.1:20001", "127.0.0.1:20002"]}, "task": {"type": "worker", "index": 0}}' \\
        python -m parity_tests.launch.tf CASE --impl tf.multiworker --out run.npz [--timeout SECONDS]

Every worker trains (``tfpar.multiworker``); the chief (``chief`` 0, or ``worker`` 0
without a chief) writes the trajectory and its manifest exactly as ``tfpar run``
does, so ``tfpar compare CASE --impls tf.towers,recorded:run.npz`` judges it.

Exit status: 0 done; 2 bad input (one line naming the field: the case, ``--out``,
``TF_CONFIG``, or ``parallel.devices`` not equal to workers x local devices); 1 the
run failed: a peer died (named with its task index and address: TensorFlow reports
it, connection refused or missing heartbeats), the replicas diverged, or TensorFlow
failed; 137 ended by the guard: no progress for ``--timeout`` seconds (the line
names the tasks that do not accept connections), or SIGINT/SIGTERM.

Faults: a worker that never starts, or hangs without dying, would block the others
forever (a collective has no deadline), and while it waits TensorFlow holds the
interpreter lock, so no watchdog thread or Python signal handler of this process
runs, and TensorFlow's own SIGTERM handler keeps ``timeout``/``kill`` from ending
it. So every worker starts a guard (``_GUARD``: a few lines of plain Python in a
child process, fed a line per step over a pipe) that SIGKILLs it with one line on
timeout or on SIGINT/SIGTERM, and exits when the pipe closes. A worker always
leaves with ``os._exit``: a normal interpreter exit would wait in TensorFlow's
shutdown barrier for peers that may be gone.

This module is the command line only (it imports ``parity_tests`` for the case
contract and the manifest, inside :func:`main`); the training is
:mod:`tfpar.multiworker`, TensorFlow only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from parity_tests.protocol.errors import TfparError

__all__ = ["DEFAULT_TIMEOUT", "IMPL", "main", "entry"]

IMPL = "tf.multiworker"
DEFAULT_TIMEOUT = 300.0  # seconds without a finished step (joining included) before a peer counts as hung
_PREFIX = "parity_tests.launch.tf"


def _say(line: str) -> None:
    print(f"{_PREFIX}: {line}", file=sys.stderr, flush=True)


def _leave(code: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


# The guard runs in its own small process (plain Python, no TensorFlow): while a worker waits to join
# the cluster or inside a collective, TensorFlow holds the interpreter lock, so a watchdog thread (or a
# Python signal handler) in the worker never runs (measured: a thread meant to fire after 6 s had not
# fired after 60 s). It reads one line per event from the worker on its stdin:
#   "P <phase>" progress, "C <json>" the cluster, "W" writing files, "w" written, "D" done.
# It ends the worker (SIGKILL) with one line when no progress came for the timeout, or when it gets
# SIGINT/SIGTERM (Ctrl-C reaches the whole process group; TensorFlow's own SIGTERM handler would
# swallow it in the worker), never while the chief writes; it exits when the worker's pipe closes,
# so it never outlives the worker.
_GUARD = r"""
import json, os, select, signal, socket, sys, time
parent, timeout, prefix = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
state = {"phase": "starting", "who": "worker", "tasks": None, "rank": None, "writing": False, "stop": None}
def say(line):
    sys.stderr.write(prefix + ": " + state["who"] + ": " + line + "\n"); sys.stderr.flush()
def end(line, code):
    say(line)
    try: os.kill(parent, signal.SIGKILL)
    except OSError: pass
    os._exit(code)
def silent():
    out = []
    for r, (job, idx, addr) in enumerate(state["tasks"] or []):
        if r == state["rank"]: continue
        host, _, port = addr.rpartition(":")
        try: socket.create_connection((host.strip("[]"), int(port)), timeout=2).close()
        except OSError: out.append("%s %d (%s)" % (job, idx, addr))
    return out
def on_signal(num, frame):
    state["stop"] = num
signal.signal(signal.SIGINT, on_signal); signal.signal(signal.SIGTERM, on_signal)
last, buf = time.monotonic(), b""
while True:
    if state["stop"] and not state["writing"]:
        end("interrupted (%s) while %s" % (signal.Signals(state["stop"]).name, state["phase"]), 128 + state["stop"])
    try: ready = select.select([0], [], [], 0.25)[0]
    except InterruptedError: ready = []
    if ready:
        data = os.read(0, 65536)
        if not data: os._exit(0)  # the worker is gone: so is its guard
        buf += data
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1); kind, text = line[:1].decode(), line[2:].decode()
            last = time.monotonic()
            if kind == "P": state["phase"] = text
            elif kind == "C": state.update(json.loads(text))
            elif kind == "W": state["writing"] = True
            elif kind == "w": state["writing"] = False
            elif kind == "T": timeout = float(text)
            elif kind == "D": os._exit(0)
    elif not state["writing"] and time.monotonic() - last > timeout:
        if state["tasks"] is None:
            end("no progress for %g s while %s" % (timeout, state["phase"]), 1)
        names = silent()
        why = (", ".join(names) + " not accepting connections (not started, or dead)") if names else (
            "every other worker accepts connections, so one is hung or slower than the timeout (raise --timeout for long steps)")
        end("no progress for %g s while %s; %s" % (timeout, state["phase"], why), 1)
"""


class _Watch:
    """The worker's side of the guard process (see ``_GUARD``): reports progress to it."""

    def __init__(self, timeout: float) -> None:
        self.who = "worker"
        self.phase = "starting"
        self._guard = subprocess.Popen([sys.executable, "-S", "-c", _GUARD, str(os.getpid()), str(timeout), _PREFIX],
                                       stdin=subprocess.PIPE, close_fds=True)

    def _send(self, kind: str, text: str = "") -> None:
        try:
            assert self._guard.stdin is not None
            self._guard.stdin.write(f"{kind} {text}".replace("\n", " ").encode() + b"\n")
            self._guard.stdin.flush()
        except (BrokenPipeError, OSError):  # the guard is gone (killed): nothing to report to
            pass

    def timeout(self, seconds: float) -> None:
        self._send("T", str(seconds))

    def cluster(self, cluster: Any) -> None:
        self.who = f"{cluster.name()}, {cluster.rank + 1} of {cluster.num_workers}"
        self._send("C", json.dumps({"who": self.who, "rank": cluster.rank, "tasks": [list(t) for t in cluster.tasks]}))

    def progress(self, phase: str) -> None:
        self.phase = phase
        self._send("P", phase)

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        """Neither the watchdog nor a signal ends the worker inside this block."""
        self._send("W")
        try:
            yield
        finally:
            self._send("w")

    def done(self) -> None:
        self._send("D")
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._guard.wait(timeout=5)


def _parser() -> argparse.ArgumentParser:
    from parity_tests.protocol.errors import CaseError

    class Parser(argparse.ArgumentParser):
        def error(self, message: str) -> None:  # one line, status 2
            raise CaseError("command line", f"valid arguments ({message}); see 'python -m parity_tests.launch.tf --help'")

    p = Parser(prog="python -m parity_tests.launch.tf", description="One TensorFlow worker of a tf.multiworker run "
                                                           "(MultiWorkerMirroredStrategy; the cluster comes from TF_CONFIG).")
    p.add_argument("case", help="path to case.json (the same case on every worker)")
    p.add_argument("--impl", required=True, help=f"{IMPL} (the only implementation launched per worker)")
    p.add_argument("--out", required=True, help="trajectory file the chief writes (.npz, with its .manifest.json)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                   help="seconds without a finished step (joining the cluster included) before giving up, "
                        "naming the workers that do not answer (default: %(default)g)")
    return p


def _run(argv: Sequence[str] | None, watch: _Watch) -> int:
    from parity_tests.contract.case import load_case
    from parity_tests.protocol import settings
    from parity_tests.protocol.errors import CaseError
    from parity_tests.protocol.trajectory import save_trajectory
    from parity_tests.running.manifest import manifest_path, write_manifest
    from parity_tests.running.provenance import build_manifest
    from tfpar import multiworker as mw
    from tfpar.errors import Unsupported

    args = _parser().parse_args(argv)
    settings.check()
    if not args.timeout > 0:
        raise CaseError("--timeout", "a number of seconds > 0", args.timeout)
    watch.timeout(args.timeout)
    if args.impl != IMPL:
        raise CaseError("--impl", f"{IMPL} (parity_tests.launch.tf starts TensorFlow workers; torch ranks start with"
                                  " torchrun ... -m parity_tests.launch.torch, everything else with tfpar run)", args.impl)
    out = Path(args.out)
    if out.suffix != ".npz":
        raise CaseError("--out", "a file name ending in .npz", args.out)
    try:
        cluster = mw.parse_tf_config(os.environ.get("TF_CONFIG"))
        watch.cluster(cluster)
        if cluster.is_chief and not out.parent.exists():
            raise CaseError("--out", f"a file in an existing folder; {out.parent} does not exist")
        watch.progress("reading the case")
        case = load_case(args.case)
        mw.check_supported(case.spec)
        if case.spec["dtype"] not in ("float32", "float64"):
            raise CaseError("dtype", f"float32 or float64 for {IMPL}", case.spec["dtype"])
        if "external" in case.spec["model"]:
            raise CaseError("model", f"a layer list for {IMPL} (an external model runs only on plugins)")
        local = mw.configure_local_devices()
        world = cluster.num_workers * local
        if case.devices != world:
            raise CaseError("parallel.devices", f"{world}: the replicas of this cluster ({cluster.num_workers}"
                                                f" worker(s) in TF_CONFIG x {local} local device(s))", case.devices)
    except Unsupported as e:
        raise CaseError(e.field, e.expected) from None
    watch.progress("joining the cluster")
    t_join = t_steps = time.monotonic()
    steps = case.spec["steps"]
    try:
        strategy = mw.make_multiworker_strategy()
        first = cluster.rank * local
        _say(f"{watch.who}: joined; replicas {first}..{first + local - 1} of {world}, {steps} steps of {case.name}")
        watch.progress("step 1")
        t_steps = time.monotonic()
        traj = mw.run_multiworker(case.payload(), strategy,
                                  progress=lambda k: watch.progress(f"step {k + 1}" if k < steps else "finishing"))
    except Exception as e:
        text = str(e)
        dead = mw.failed_task(text, cluster)
        if dead is not None:
            how = ("it stopped sending heartbeats" if "unhealthy" in text
                   else "connection refused" if "refused" in text else "unreachable")
            raise _Failed(f"{watch.who}: {cluster.name(dead)} died or stopped responding while {watch.phase}"
                          f" (TensorFlow: {how})") from e
        line = next((ln.strip() for ln in text.splitlines() if ln.strip()), type(e).__name__)
        raise _Failed(f"{watch.who}: {IMPL} failed while {watch.phase}: {type(e).__name__}: {line}") from e
    took = f"joined in {t_steps - t_join:.1f} s, {steps} steps in {time.monotonic() - t_steps:.2f} s"
    if not cluster.is_chief:
        print(f"{IMPL}: {cluster.name()} finished {steps} steps of {case.name} ({took}); the chief writes {out.name}", flush=True)
        return 0
    with watch.writing():
        watch.progress("writing the trajectory")
        save_trajectory(out, traj)
        manifest = build_manifest(case, IMPL, traj, out.name)
        manifest["cluster"] = {"tasks": [f"{j}:{i} {a}" for j, i, a in cluster.tasks], "local_devices": local,
                               "replicas": world}
        mpath = write_manifest(manifest_path(out), manifest)
    print(f"{IMPL}: {steps} steps of {case.name} on {cluster.num_workers} worker(s) x {local} device(s) -> {out}"
          f" (final loss {float(traj['loss'][-1]):.6g}; {took}); manifest {mpath}", flush=True)
    return 0


class _Failed(TfparError, RuntimeError):
    """The run failed (exit 1); the message is the one line to print."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run this worker; returns the exit status (see the module docstring)."""
    # TensorFlow first, as a worker of tfpar's own package always did: the guard's phases start after
    # its import (seconds), so a timeout or Ctrl-C while "starting" is about this worker, not the import
    import tfpar.multiworker  # noqa: F401
    from parity_tests.protocol.errors import CaseError

    # Ctrl-C and SIGTERM are the guard's to handle (it ends this process at once, or after a write)
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    watch = _Watch(DEFAULT_TIMEOUT)
    try:
        return _run(argv, watch)
    except CaseError as e:
        _say(f"{watch.who}: error: {e}")
        return 2
    except _Failed as e:
        _say(str(e))
        return 1
    finally:
        watch.done()
        signal.signal(signal.SIGINT, previous)  # for callers in a process that goes on (tests)


def entry() -> None:
    """``python -m parity_tests.launch.tf``: :func:`main`, then leave at once (see the module docstring)."""
    _leave(main())


if __name__ == "__main__":  # pragma: no cover
    entry()
