"""Tests of torchref.pool: a persistent gloo worker pool, its failure handling and clean-up."""

from __future__ import annotations

import os
import select
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from parity_tests.tests.processes import (
    HANG_DEADLINE,
    children,
    is_resource_tracker,
    living,
    wait_gone,
)
from torchref import _pool_testfns as fns
from torchref import pool as pool_mod
from torchref.pool import MAX_SIZE, DDPPool, RankFailed, get_pool, shutdown_pool

REPO = Path(__file__).resolve().parents[2]
LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}
POOL_TIMEOUT = 5.0

# a pool bug must fail here, not hang the run: past every wait of the module (their longest is a
# subprocess hang guard, processes.HANG_DEADLINE), with room for the test around it
pytestmark = pytest.mark.timeout(HANG_DEADLINE + 120)


@pytest.fixture(scope="module")
def pool4():
    """A pool of 4 ranks for this module (the session's shared 8-rank pool is left alone)."""
    with DDPPool(4, timeout=POOL_TIMEOUT) as p:
        yield p


def _assert_restarts(pool: DDPPool) -> None:
    assert not pool.alive
    result = pool.run(fns.allreduce_rank, None, 3)
    assert [r["sum"] for r in result] == [6.0] * 3
    assert pool.alive


def test_allreduce_over_subgroups_in_warm_pool(pool4):
    pids = pool4.pids
    for _ in range(2):
        for n in range(1, 5):
            results = pool4.run(fns.allreduce_rank, {"unused": [1, 2]}, n)
            assert [r["rank"] for r in results] == list(range(n))
            assert all(r["world_size"] == n for r in results)
            assert all(r["sum"] == n * (n + 1) / 2 for r in results)
            assert [r["pid"] for r in results] == pids[:n]  # same workers: the pool is reused
    worker = results[0]
    assert worker["threads"] == 1 and worker["deterministic"] and worker["sigint"]
    assert pool4.pids == pids


def test_rank_that_raises_is_named_and_pool_restarts(pool4):
    with pytest.raises(RankFailed) as info:
        pool4.run(fns.raise_on_rank1, None, 4)
    assert info.value.rank == 1 and info.value.how == "raised"
    assert "ValueError: boom from rank 1" in str(info.value)
    assert str(info.value).startswith("rank 1 raised")
    _assert_restarts(pool4)


def test_root_cause_is_named_not_the_peer_that_timed_out_waiting():
    """Rank 1 raises; rank 0 then times out in its all-reduce within the grace period.

    Both failures reach the parent; the one named is rank 1's own error, because rank 0's
    timeout is its consequence (lowest rank would name rank 0).
    """
    with DDPPool(2, timeout=0.3) as p:
        with pytest.raises(RankFailed) as info:
            p.run(fns.raise_on_rank1, None, 2)
    assert info.value.rank == 1 and "ValueError: boom from rank 1" in info.value.detail


@pytest.mark.parametrize(("how", "last_line", "order"), [
    ("died (signal 9)", "", 0),
    ("raised", "ValueError: boom", 1),
    ("raised", "RuntimeError: [gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 1ms for recv operation to complete", 2),
    ("raised", "RuntimeError: [gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234", 3),
    ("raised", "RuntimeError: [gloo/transport/tcp/pair.cc:598] Connection reset by peer", 3),
])
def test_failures_are_ordered_root_cause_first(how, last_line, order):
    """The gloo messages as torch 2.13 words them (seen in CI: a rank's timeout closes its peer's pair)."""
    detail = f"Traceback (most recent call last):\n  ...\n{last_line}\n" if last_line else ""
    assert pool_mod._consequence_rank(how, detail) == order


def test_killed_rank_is_named_and_pool_restarts(pool4):
    old = pool4.pids
    with pytest.raises(RankFailed) as info:
        pool4.run(fns.sigkill_rank2, None, 4)
    assert info.value.rank == 2 and info.value.how == f"died (signal {int(signal.SIGKILL)})"
    assert "rank 2 died" in str(info.value)
    assert living(old) == []
    _assert_restarts(pool4)


def test_hang_times_out_within_bound(pool4):
    start = time.monotonic()
    with pytest.raises(RankFailed) as info:
        pool4.run(fns.hang_rank1, None, 4)
    elapsed = time.monotonic() - start
    # The waiting ranks' collective times out after POOL_TIMEOUT and they report it.
    assert POOL_TIMEOUT - 0.5 < elapsed < POOL_TIMEOUT + 30
    assert info.value.how == "raised" and "Timed out" in str(info.value)
    _assert_restarts(pool4)


def test_shape_mismatch_between_ranks_fails(pool4):
    with pytest.raises(RankFailed):
        pool4.run(fns.shape_mismatch, None, 4)
    _assert_restarts(pool4)


def test_silent_rank_times_out_in_parent():
    p = DDPPool(1, timeout=POOL_TIMEOUT)
    try:
        p.start()
        pids = p.pids
        start = time.monotonic()
        with pytest.raises(RankFailed) as info:
            p.run(fns.sleep_then_allreduce, {"seconds": 60}, 1, timeout=0.5)
        assert time.monotonic() - start < 10
        assert info.value.rank == 0 and info.value.how.startswith("timed out after")
        assert not p.alive and living(pids) == []
    finally:
        p.close()


def test_a_job_that_beats_is_not_taken_for_a_hang():
    # the job's limit (0.5 s + the 2.1 s margin) bounds the time between two beats, not the whole
    # job: a large model's 20 steps may take minutes; a silent one still times out (test above)
    p = DDPPool(1, timeout=POOL_TIMEOUT)
    try:
        took = p.run(fns.work_and_beat, {"seconds": 4.0}, 1, timeout=0.5)[0]
        assert took >= 4.0 and p.alive
    finally:
        p.close()


def test_rows_a_job_writes_to_spill_files_count_as_its_progress():
    # no beat of its own, 8 rows 0.5 s apart (4 s) under a limit of 0.5 s + the 2.1 s margin: each row
    # written beats (rows.reporting_progress); without that the job is taken for hung after 2.6 s
    p = DDPPool(1, timeout=POOL_TIMEOUT)
    try:
        took = p.run(fns.spill_slowly, {"rows": 8, "seconds": 0.5}, 1, timeout=0.5)[0]
        assert took >= 4.0 and p.alive
    finally:
        p.close()


def test_close_and_restart_leave_nothing_behind():
    me = psutil.Process()
    before = {c.pid for c in children(me)}
    p = DDPPool(2, timeout=POOL_TIMEOUT)
    p.start()
    first, folder = p.pids, p.store_dir
    assert set(first) <= {c.pid for c in children(me)}
    p.restart()
    assert living(first) == [] and set(p.pids).isdisjoint(first)
    second = p.pids
    assert [r["sum"] for r in p.run(fns.allreduce_rank, None, 2)] == [3.0, 3.0]
    p.close()
    p.close()  # idempotent
    assert not p.alive and p.pids == [] and p.store_dir is None
    assert living(first + second) == []
    assert not os.path.exists(folder)
    extra = [c for c in children(me) if c.pid not in before]
    assert [c.pid for c in extra if not is_resource_tracker(c)] == []


def test_sockets_on_loopback_and_private_store(pool4):
    box: dict[str, object] = {}
    job = threading.Thread(target=lambda: box.update(
        result=pool4.run(fns.sleep_then_allreduce, {"seconds": 1.5}, 4)))
    pool4.start()
    job.start()
    try:
        time.sleep(0.5)
        assert stat.S_IMODE(os.stat(pool4.store_dir).st_mode) == 0o700
        conns = [c for pid in pool4.pids for c in psutil.Process(pid).net_connections("inet")]
        assert conns, "expected gloo sockets"
        for c in conns:
            assert c.laddr.ip in LOOPBACK, c
            assert not c.raddr or c.raddr.ip in LOOPBACK, c
    finally:
        job.join(60)
    assert [r["sum"] for r in box["result"]] == [10.0] * 4


@pytest.mark.parametrize(
    ("make", "text"),
    [
        (lambda: DDPPool(0), "0"),
        (lambda: DDPPool(MAX_SIZE + 1), str(MAX_SIZE + 1)),
        (lambda: DDPPool(2, timeout=0), "0"),
        (lambda: DDPPool(2, timeout=-1.5), "-1.5"),
        (lambda: DDPPool(2).run(fns.allreduce_rank, None, 3), "3"),
        (lambda: DDPPool(2).run(fns.allreduce_rank, None, 0), "0"),
        (lambda: DDPPool(2).run(fns.allreduce_rank, None, 1, timeout=0), "0"),
        (lambda: get_pool(0), "0"),
    ],
)
def test_invalid_arguments(make, text):
    with pytest.raises(ValueError, match=text):
        make()


def test_world_size_error_names_both_numbers():
    with pytest.raises(ValueError, match=r"world_size 5 .*\b4\b"):
        DDPPool(4).run(fns.allreduce_rank, None, 5)


def test_shared_pool_grows_and_shuts_down(monkeypatch):
    import torchref.pool as pool_module

    monkeypatch.setattr(pool_module, "_shared", None)  # leave the session's shared pool alone
    try:
        a = get_pool(2, timeout=7.0)
        assert get_pool(1) is a and get_pool(2) is a and a.size == 2 and a.timeout == 7.0
        b = get_pool(3)
        assert b is not a and b.size == 3 and not b.alive and b.timeout == 7.0  # grown, same timeout
        c = get_pool(2, timeout=5.0)  # another timeout: a new process group, the old one closed
        assert c is not b and c.size == 2 and c.timeout == 5.0 and get_pool(2) is c
        b = c
    finally:
        shutdown_pool()
    assert get_pool(2) is not b
    shutdown_pool()


CHILD = textwrap.dedent(
    """
    import signal
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from torchref import _pool_testfns as fns
    from torchref.pool import DDPPool
    pool = DDPPool(2, timeout=120.0)
    pool.start()
    print("READY", pool.store_dir, flush=True)
    pool.run(fns.sleep_then_allreduce, {"seconds": 600}, 2)
    """
)


def test_ctrl_c_tears_the_pool_down():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    child = subprocess.Popen([sys.executable, "-c", CHILD], cwd=REPO, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([child.stdout], [], [], HANG_DEADLINE)
        assert ready
        word, folder = child.stdout.readline().split()
        assert word == "READY" and os.path.isdir(folder)
        time.sleep(1.0)  # let it enter run()
        tree = [c.pid for c in children(child.pid)]
        assert len(tree) >= 2
        start = time.monotonic()
        child.send_signal(signal.SIGINT)
        child.wait(timeout=20)
        assert time.monotonic() - start < 20
        assert wait_gone(tree) == []  # the ranks exit once they see the parent go (issue 34: no fixed wait)
        assert not os.path.exists(folder)
        assert child.returncode != 0 and "KeyboardInterrupt" in child.stderr.read()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


ORPHAN = textwrap.dedent(
    """
    import time
    from torchref import pool as pool_mod
    from torchref.pool import DDPPool
    pool = DDPPool(2, timeout=60.0)
    pool.start()
    print(pool_mod._socket_folder(), pool.store_dir, *pool.pids, flush=True)
    time.sleep(600)
    """
)


def test_workers_exit_when_parent_dies():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    child = subprocess.Popen([sys.executable, "-c", ORPHAN], cwd=REPO, env=env,
                             stdout=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([child.stdout], [], [], HANG_DEADLINE)
        assert ready
        socket_folder, folder, *words = child.stdout.readline().split()
        pids = [int(word) for word in words]
        assert len(pids) == 2 and os.path.isdir(folder) and os.path.isdir(socket_folder)
        # the forkserver the ranks fork from (and the resource tracker) must go as well
        tree = [c.pid for c in children(child.pid)]
        assert set(pids) < set(tree)
        pids = tree
        child.kill()  # no atexit, no clean-up: the workers must notice on their own
        child.wait()
        assert wait_gone(pids) == []
        assert not os.path.exists(folder)  # rank 0 removed the orphaned store folder
        assert not os.path.exists(socket_folder)  # and the forkserver's socket folder
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_ranks_see_the_environment_of_the_parent_when_they_start(monkeypatch):
    """Forked from a server that started earlier, a rank still gets the parent's os.environ of now, as a spawned one would."""
    with DDPPool(1, timeout=POOL_TIMEOUT) as p:  # the forkserver runs from here on
        assert p.run(fns.getenv, "TFPAR_POOL_PROBE", 1) == [None]
    monkeypatch.setenv("TFPAR_POOL_PROBE", "set after the server started")
    with DDPPool(2, timeout=POOL_TIMEOUT) as p:
        assert p.run(fns.getenv, "TFPAR_POOL_PROBE", 2) == ["set after the server started"] * 2


LONG_TMPDIR = textwrap.dedent(
    """
    import os
    from torchref import _pool_testfns as fns
    from torchref.pool import DDPPool
    with DDPPool(2, timeout=60.0) as pool:
        print(*pool.run(fns.getenv, "TMPDIR", 2), flush=True)
    """
)


def test_the_pool_starts_under_a_long_tmpdir(tmp_path):
    """A TMPDIR too long for a Unix socket path (the forkserver's): the pool still starts, and the ranks keep TMPDIR."""
    tmp = tmp_path / ("t" * 100)
    tmp.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(tmp)}
    env.pop("TFPAR_SPILL_ROOT", None)
    res = subprocess.run([sys.executable, "-c", LONG_TMPDIR], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=HANG_DEADLINE)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == [str(tmp)] * 2


UNCLOSED = textwrap.dedent(
    """
    from torchref import _pool_testfns as fns
    from torchref.pool import DDPPool, stop_forkserver
    pool = DDPPool(2, timeout=60.0)  # started, still referenced, never closed: a test that swapped it out and failed
    pool.run(fns.allreduce_rank, None, 2)
    ranks = [p.pid for p in pool._procs]
    stop_forkserver()
    print(*ranks, flush=True)
    """
)


def test_stopping_the_forkserver_closes_a_pool_nobody_closed():
    """The forkserver leaves only when every rank it forked has (each holds its "alive" pipe), and
    ``stop_forkserver`` waits for it: with a pool left open it waited forever (a test session's
    end hung so in a rehearsal). It closes every pool still open first."""
    res = subprocess.run([sys.executable, "-c", UNCLOSED], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, timeout=HANG_DEADLINE)
    assert res.returncode == 0, res.stderr[-2000:]
    ranks = [int(pid) for pid in res.stdout.split()]
    assert len(ranks) == 2 and living(ranks) == []  # a zombie is gone too: it holds nothing
