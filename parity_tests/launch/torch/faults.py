"""Naming the rank that brought a torchrun job down, on every node.

A rank that fails leaves its peers waiting in a collective until they time
out or see its sockets close; each peer then only knows that *something*
went wrong. So every rank posts what it knows to the rendezvous store that
torchrun already runs (``MASTER_ADDR:MASTER_PORT``, a ``TCPStore``):

* ``where/<rank>``: node, local rank, host and pid, posted at start-up;
* ``beat/<rank>``: a counter a background thread bumps every
  :data:`BEAT_S` seconds (a hung rank still beats, a dead or frozen one does not);
* ``fail/<rank>``: how this rank failed (``raised`` its own error,
  ``timeout`` in a collective, ``peer`` closed on it) and the error's last line.

The root cause is the first ``raised`` rank; failing that, the ranks that
never reported (alive but hung, or dead); failing that, the first timeout.
One rank per node prints it (``printed/<node>`` is claimed with an atomic
``add``), so each ``torchrun`` call shows one line naming ``(node, rank)``.
A watchdog thread ends a rank that is still stuck a while after another
rank reported a failure, so no process outlives the job even where every
rank of a node hangs (torchrun only tears a node down when one of its own
workers exits).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from torchref.pool import _consequence_rank

__all__ = ["Where", "FaultBoard", "BEAT_S", "GRACE_S", "hostname"]

BEAT_S = 0.5  #: heartbeat period
GRACE_S = 2.0  #: after its own failure, how long a rank waits for the others' reports
_STORE_S = 10.0  # how long one store operation may block
_CLASS = {0: "died", 1: "raised", 2: "timeout", 3: "peer"}


@dataclass(frozen=True)
class Where:
    """Where a rank runs: its torchrun node (``GROUP_RANK``), global and local rank, host, pid."""

    node: int
    rank: int
    local_rank: int
    host: str
    pid: int

    def name(self) -> str:
        return f"node {self.node}, rank {self.rank} (local rank {self.local_rank}, host {self.host}, pid {self.pid})"


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


class FaultBoard:
    """This rank's view of the job's failures, kept in torchrun's rendezvous store.

    Args:
        master: ``(MASTER_ADDR, MASTER_PORT)`` of the store torchrun runs.
        prefix: a key prefix unique to this run and restart (``TORCHELASTIC_RUN_ID``).
        me: where this rank runs; world_size: the job's N; timeout: the collective timeout (messages).
        impl: the implementation's name (messages).
    """

    def __init__(self, master: tuple[str, int], prefix: str, me: Where, world_size: int, timeout: float,
                 impl: str) -> None:
        client = dist.TCPStore(master[0], master[1], is_master=False, timeout=timedelta(seconds=_STORE_S),
                               wait_for_workers=False)
        self.store = dist.PrefixStore(prefix, client)
        self.master, self.me, self.n, self.timeout, self.impl = master, me, world_size, timeout, impl
        self.store.set(f"where/{me.rank}", json.dumps(asdict(me)))
        self._done = threading.Event()
        self._failed_here = threading.Event()
        self.own = ""  # this rank's failure, as reported
        self._lock = threading.Lock()  # one store client, used from two threads
        self._thread = threading.Thread(target=self._watch, name="torchref-launch-watchdog", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ store access
    def _check(self, key: str) -> bool:
        with self._lock:
            return self.store.check([key])

    def _get(self, key: str) -> dict[str, Any]:
        with self._lock:
            return json.loads(self.store.get(key))

    def _add(self, key: str, amount: int) -> int:
        with self._lock:
            return int(self.store.add(key, amount))

    # ------------------------------------------------------------ the two threads
    def _watch(self) -> None:
        """Heartbeat; end this rank when the job has failed elsewhere and this rank is still running.

        A rank that is hung (or blocked in a collective whose peer is gone) would otherwise
        outlive the job wherever torchrun does not tear its node down, i.e. where no worker of
        the node exits by itself.
        """
        seen_failure: float | None = None
        misses = 0
        cause: str | None = None
        while not self._done.wait(BEAT_S):
            try:
                self._add(f"beat/{self.me.rank}", 1)
                failed = self._check("failed")
                if cause is None and self._check("cause"):
                    cause = self._get("cause")["line"]
                misses = 0
            except Exception:  # node 0's torchrun (which serves the store) has ended: the job cannot finish
                misses += 1
                if misses >= 2:
                    self._exit(cause or f"{self.impl} failed: lost torchrun's rendezvous store at"
                               f" {self.master[0]}:{self.master[1]} (node 0's torchrun ended); seen from"
                               f" {self.me.name()}", claim=False)
                continue
            if self._failed_here.is_set() or not failed:
                continue
            seen_failure = seen_failure or time.monotonic()
            waited = time.monotonic() - seen_failure
            if cause is not None and waited > BEAT_S:  # another rank named the cause: stop with it
                self._exit(cause, claim=True)
            if waited > GRACE_S + 3 * BEAT_S + 2.0:  # nobody decided (the deciding rank died): decide here
                self._exit(self.root_cause_line(), claim=True)

    def _exit(self, line: str, *, claim: bool) -> None:
        if self._done.is_set():
            return
        if not claim or self._claim():
            print(f"parity_tests.launch.torch: {line}", file=sys.stderr)
        _flush()
        os._exit(1)

    def stop(self) -> None:
        """The job finished (well or not): stop the heartbeat and the watchdog."""
        self._done.set()
        self._thread.join(2 * BEAT_S + _STORE_S)

    # ------------------------------------------------------------ failures
    def report(self, e: BaseException | str, step: int | None = None) -> str:
        """Post this rank's failure; return its kind: ``raised`` (its own error), ``timeout`` or ``peer``.

        ``e``: the exception, or the error's last line; ``step``: the step it happened at, if known.
        """
        self._failed_here.set()
        text = e if isinstance(e, str) else _last_line(e)
        kind = _CLASS[_consequence_rank("raised", text)]
        at = f" at step {step}" if step is not None else ""
        what = {"raised": f"raised{at}", "timeout": f"timed out in a collective{at}",
                "peer": f"lost a peer in a collective{at}"}[kind]
        self.own = f"{what}: {text}"
        with contextlib.suppress(Exception):
            with self._lock:
                self.store.set(f"fail/{self.me.rank}", json.dumps({"kind": kind, "line": self.own}))
                self.store.add("failed", 1)
        return kind

    def _reports(self) -> dict[int, dict[str, Any]]:
        return {r: self._get(f"fail/{r}") for r in range(self.n) if self._check(f"fail/{r}")}

    def _where(self, rank: int) -> str:
        try:
            return Where(**self._get(f"where/{rank}")).name() if self._check(f"where/{rank}") else f"rank {rank}"
        except Exception:
            return f"rank {rank}"

    def _beating(self, ranks: list[int]) -> set[int]:
        """The ranks among ``ranks`` whose heartbeat still advances."""
        before = {r: self._add(f"beat/{r}", 0) for r in ranks}
        time.sleep(3 * BEAT_S)
        return {r for r in ranks if self._add(f"beat/{r}", 0) != before[r]}

    def wait_for_reports(self) -> None:
        """Give the other ranks :data:`GRACE_S` to report (or until all have)."""
        deadline = time.monotonic() + GRACE_S
        with contextlib.suppress(Exception):
            while time.monotonic() < deadline and len(self._reports()) < self.n:
                time.sleep(0.1)

    def root_cause_line(self, *, patient: bool = False) -> str:
        """One line naming the rank that failed first (node and rank), as this rank sees it.

        ``patient``: this rank failed fast (a peer closed on it), so ranks that have not reported
        yet may still be waiting for their own collective to time out: give them the timeout.
        """
        try:
            reports = self._reports()
            if patient and not any(v["kind"] == "raised" for v in reports.values()):
                silent = [r for r in range(self.n) if r not in reports]
                if silent and len(self._beating(silent)) == len(silent):  # nobody is dead: wait for reports
                    deadline = time.monotonic() + self.timeout + GRACE_S
                    while time.monotonic() < deadline and len(reports) < self.n:
                        time.sleep(0.2)
                        reports = self._reports()
            raised = sorted(r for r, v in reports.items() if v["kind"] == "raised")
            if raised:
                r = raised[0]
                cause = f"{self._where(r)} {reports[r]['line']}"
            elif silent := [r for r in range(self.n) if r not in reports]:
                alive = self._beating(silent)
                dead = [r for r in silent if r not in alive]
                # a dead rank is the cause; the live silent ones are waiting for it (or hung)
                cause = "; ".join(
                    [f"{self._where(r)} stopped answering (its process died or froze)" for r in dead]
                    or [f"{self._where(r)} is alive but never reached the collective within the {self.timeout:g} s"
                        " timeout (hung)" for r in silent])
            else:
                r = min(reports, key=lambda q: (["raised", "timeout", "peer"].index(reports[q]["kind"]), q))
                cause = f"{self._where(r)} {reports[r]['line']}"
        except Exception as e:  # the store went away meanwhile: say what this rank knows
            cause = f"(the rendezvous store is gone: {type(e).__name__}) as seen from {self.me.name()}"
        return f"{self.impl} failed: {cause}"

    def _claim(self) -> bool:
        """Whether this rank is the first on its node to print the failure."""
        try:
            return self._add(f"printed/{self.me.node}", 1) == 1
        except Exception:
            return True

    def announce_failure(self, kind: str) -> None:
        """Print the root cause once per node; a rank that raised (``kind``) names itself without waiting.

        Otherwise one rank (the first to ask) decides the cause and posts it as ``cause``; the
        others print the same line, so every node names the same (node, rank).
        """
        line = f"{self.impl} failed: {self.me.name()} {self.own}" if kind == "raised" else None
        try:
            if line is None:
                self.wait_for_reports()
                if self._add("deciding", 1) == 1:
                    line = self.root_cause_line(patient=kind == "peer")
                else:  # another rank decides: wait for its line (it may wait a collective timeout)
                    deadline = time.monotonic() + self.timeout + 2 * GRACE_S + 3 * BEAT_S
                    while time.monotonic() < deadline and not self._check("cause"):
                        time.sleep(0.1)
                    line = self._get("cause")["line"] if self._check("cause") else self.root_cause_line()
            if not self._check("cause"):
                with self._lock:
                    self.store.set("cause", json.dumps({"line": line}))
        except Exception:  # the store is gone: say what this rank knows
            line = line or self.root_cause_line()
        if self._claim():
            print(f"parity_tests.launch.torch: {line}", file=sys.stderr)
        _flush()
        with contextlib.suppress(Exception):
            if len(self._reports()) < self.n:
                # some rank is stuck: stay (and keep node 0's store up) until its watchdog has read the cause
                time.sleep(3 * BEAT_S)
        self._done.set()  # no more store traffic: the store may be gone any moment now


def _last_line(e: BaseException) -> str:
    """``Type: the message's last line`` (gloo's messages run over several lines)."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[-1]}" if lines else type(e).__name__


def hostname() -> str:
    """This machine's short host name (messages)."""
    return socket.gethostname().split(".")[0]
