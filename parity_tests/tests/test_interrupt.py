"""Ctrl-C during ``tfpar matrix``: a prompt stop, status 130, no process left, no half-written file."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from parity_tests.tests.processes import (
    EXIT_DEADLINE,
    children,
    cmdline,
    is_resource_tracker,
    wait_gone,
    wait_until,
)


@pytest.mark.parametrize(("sig", "status", "said"), [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")])
def test_ctrl_c_during_matrix_stops_promptly_and_leaves_nothing(tmp_path, sig, status, said):
    # every recorded row spilled to a file (docs/memory.md), in a temporary folder of the test's own
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TFPAR_SPILL_BYTES="0", TMPDIR=str(tmp))
    env.pop("TFPAR_SPILL_ROOT", None)
    proc = subprocess.Popen([sys.executable, "-m", "parity_tests.cli", "matrix", "--quick", "--out", str(tmp_path / "rep")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        # wait until the DDP pool's ranks exist and the first rows are done: TensorFlow's import, the
        # pool's start and the first cases take about 40 s on a quiet machine; the deadline allows
        # for a machine loaded several times over (the poll ends as soon as they are there)
        seen: list[psutil.Process] = []
        spilled = False

        def going() -> bool:
            nonlocal seen, spilled
            seen = children(proc.pid)  # every process of the tree, gone ones left out (issue 34)
            rows = list((tmp_path / "rep" / "rows").glob("*.json")) if (tmp_path / "rep" / "rows").exists() else []
            spilled = spilled or bool(list(tmp.glob("tfpar-spill-*/*.rows")))  # the runs spill their rows
            assert proc.poll() is None, proc.communicate()
            return len([p for p in seen if not is_resource_tracker(p)]) >= 2 and bool(rows) and spilled

        assert wait_until(going, 600, interval=0.5), "the matrix did not get going in 600 s"
        t0 = time.monotonic()
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=30)
        stopped = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == status, (proc.returncode, err[-2000:])
    assert said in err
    assert stopped < 30
    # the command has exited; its ranks and servers exit on their own once they see it (a closed
    # pipe, the parent-death signal): wait for that event, not a fixed second
    alive = wait_gone(seen, EXIT_DEADLINE)
    assert not alive, [(p.pid, cmdline(p)) for p in alive]
    assert not list((tmp_path / "rep").rglob("*.tmp"))  # atomic writes only
    assert not list(tmp.glob("tfpar-spill-*")), list(tmp.rglob("*"))  # the spill folder went with the run
    assert not list(tmp.glob("pymp-*")), list(tmp.rglob("*"))  # and the forkserver's socket folder
    for row in (tmp_path / "rep" / "rows").glob("*.json"):
        assert row.read_text().endswith("}")  # every row file is whole


STUCK_CHILD = """
import sys, threading
from parity_tests import cli

# what TensorFlow leaves after Ctrl-C lands while MirroredStrategy traces a step:
# a non-daemon replica thread waiting for a turn that never comes
threading.Thread(target=threading.Event().wait, name="replica").start()

def interrupted(args):
    raise KeyboardInterrupt

cli._cmd_run = interrupted
sys.argv = ["tfpar", "run", "unused.json", "--impl", "tf.towers", "--out", "unused.npz"]
cli.entry()
"""


def test_ctrl_c_exits_even_when_a_stuck_non_daemon_thread_remains(tmp_path):
    """Without the exit in ``cli.entry`` the interpreter would join the stuck thread forever."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.Popen([sys.executable, "-c", STUCK_CHILD], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err[-2000:]
    assert err.strip().splitlines()[-1] == "tfpar: interrupted"


@pytest.mark.parametrize(("sig", "status", "said"), [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")])
def test_a_signal_that_lands_in_a_finaliser_still_stops_the_command(monkeypatch, capsys, sig, status, said):
    """Python prints and drops an exception raised in ``__del__``: a signal whose handler ran inside
    a finaliser (TensorFlow's ``ConcreteFunction.__del__`` in a fresh-clone run of the matrix test
    above, 2026-11-23) was lost and the command went on. It is delivered again, and stops it."""
    from parity_tests import cli

    class Finalised:
        def __del__(self):
            os.kill(os.getpid(), sig)
            t = time.monotonic()
            while time.monotonic() - t < 0.2:  # the handler runs in here, at a bytecode boundary
                pass

    def command(args):
        Finalised()  # collected at once: its __del__ takes the signal
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            time.sleep(0.01)
        return 0

    monkeypatch.setattr(cli, "_cmd_run", command)
    # a lost signal lets the command run its ten seconds and return 0: the status alone tells the two
    # apart, so no bound on the elapsed time (which a loaded machine could stretch) is needed
    code = cli.main(["run", "case.json", "--impl", "tf.towers", "--out", "run.npz"])
    assert code == status
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"tfpar: {said}"
