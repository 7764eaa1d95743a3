"""The suite's process helper (tests/processes.py): a zombie or a vanished process is gone, never an error."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil

from parity_tests.tests.processes import (
    alive,
    argv,
    children,
    cmdline,
    is_resource_tracker,
    living,
    wait_gone,
    wait_until,
)


def _zombie() -> subprocess.Popen:
    """A child that has exited and is not reaped yet (Popen reaps only when asked)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    assert wait_until(lambda: psutil.Process(child.pid).status() == psutil.STATUS_ZOMBIE, 60)
    return child


def test_a_zombie_is_gone_and_reading_it_raises_nothing():
    child = _zombie()
    try:
        with_psutil = psutil.Process(child.pid)
        try:  # the premise: psutil itself raises here (what failed test_interrupt under load)
            with_psutil.cmdline()
            raised = False
        except psutil.ZombieProcess:
            raised = True
        assert raised
        assert not alive(child.pid) and not alive(with_psutil)
        assert cmdline(child.pid) == "" and argv(with_psutil) == []
        assert child.pid not in [p.pid for p in children(os.getpid())]
        assert is_resource_tracker(child.pid)  # unreadable: never counted as a worker left behind
        assert wait_gone([child.pid], timeout=0.1) == []
    finally:
        child.wait()


def test_a_vanished_pid_is_gone():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: the pid names nothing now
    assert not alive(child.pid) and cmdline(child.pid) == "" and children(child.pid) == []


def test_a_running_child_is_alive_until_it_exits():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert alive(child.pid) and living([child.pid]) == [child.pid]
        assert child.pid in [p.pid for p in children(os.getpid())]
        assert "time.sleep(60)" in cmdline(child.pid)
        assert wait_gone([child.pid], timeout=0.2) == [child.pid]  # still there at its deadline
        started = time.monotonic()
        child.terminate()
        assert wait_gone([child.pid]) == []
        assert time.monotonic() - started < 30  # the poll ended at the exit, not at the deadline
    finally:
        child.kill()
        child.wait()


def test_wait_until_asks_once_more_at_the_deadline():
    calls: list[int] = []
    assert wait_until(lambda: calls.append(1) or True, timeout=0.0)  # a slow machine's missed interval
    assert len(calls) == 1
    assert not wait_until(lambda: False, timeout=0.0)
