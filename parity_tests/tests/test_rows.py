"""Spilled trajectory rows (``parity_tests.protocol.rows``): a large run's history lives in files, and
every verdict, gap and localisation is the same as with the arrays in memory.

The spill threshold is set to 0 here (every array moves to a file at its first row), so the
smallest cases exercise the path a 25 M-parameter model takes.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import pickle

import numpy as np
import pytest

from parity_tests.judging.compare import compare_trajectories, first_nonfinite, relative_gap
from parity_tests.protocol import rows
from parity_tests.protocol.trajectory import load_trajectory, save_trajectory
from parity_tests.running.harness import run_impl
from parity_tests.session.comparison import compare_case
from parity_tests.tests.helpers import MLP, make
from parity_tests.tests.processes import HANG_DEADLINE


@pytest.fixture
def spill_everything():
    old = rows.set_spill_threshold(0)
    try:
        yield
    finally:
        rows.set_spill_threshold(old)


def _spilled(values: list[np.ndarray]) -> rows.RowArray:
    rl = rows.RowList()
    for v in values:
        rl.append(v)
    out = rl.finish()
    assert isinstance(out, rows.RowArray)
    return out


def test_rows_stay_in_memory_below_the_threshold_and_move_to_a_file_past_it():
    rl = rows.RowList([np.zeros(3, np.float32)] * 2)
    assert isinstance(rl.finish(), np.ndarray)
    old = rows.set_spill_threshold(20)  # two rows of 12 bytes are 24 > 20
    try:
        out = rows.RowList([np.arange(3, dtype=np.float32), np.arange(3, dtype=np.float32) + 1]).finish()
    finally:
        rows.set_spill_threshold(old)
    assert isinstance(out, rows.RowArray) and os.path.exists(out.path)
    assert out.shape == (2, 3) and out.dtype == np.float32
    assert np.asarray(out).tolist() == [[0, 1, 2], [1, 2, 3]]


def test_many_arrays_each_under_the_threshold_spill_once_together_they_pass_it():
    """A transformer's trajectory is a hundred kernels of a few MB each: each under the threshold,
    together over it. The threshold bounds what a process holds in all unfinished lists, so the
    lists that receive rows past it move to files; below it, in memory as before."""
    old = rows.set_spill_threshold(100)  # rows of 12 bytes: 8 of them fit, the 9th passes it
    try:
        lists = [rows.RowList() for _ in range(6)]
        for step in range(2):
            for rl in lists:
                rl.append(np.full(3, step, np.float32))
        out = [rl.finish() for rl in lists]
        again = [rows.RowList([np.zeros(3, np.float32)] * 2).finish() for _ in range(4)]  # finished: released
    finally:
        rows.set_spill_threshold(old)
    # step 0 holds 6 x 12 = 72 bytes; at step 1 the third list's row makes 108 > 100: it spills its 24 (84
    # held), the fourth makes 96, the fifth 108 again and spills: never more than the threshold + one row
    kinds = [type(a) for a in out]
    nd, ra = np.ndarray, rows.RowArray
    assert kinds == [nd, nd, ra, nd, ra, nd], kinds
    assert all(np.asarray(a).tolist() == [[0, 0, 0], [1, 1, 1]] for a in out)
    assert all(isinstance(a, np.ndarray) for a in again)
    assert rows._held[0] == 0


def test_a_row_array_reads_rows_and_knows_their_norms_and_finiteness(spill_everything):
    values = [np.array([[1.0, -4.0], [2.0, 0.5]]), np.array([[np.nan, 1.0], [0.0, 0.0]]),
              np.array([[0.0, np.inf], [3.0, 0.0]])]
    a = _spilled(values)
    assert a.shape == (3, 2, 2) and len(a) == 3 and a.ndim == 3 and a.nbytes == 3 * 4 * 8
    assert np.array_equal(a[0], values[0]) and np.array_equal(a[-1], values[2])
    assert np.array_equal(np.asarray(a), np.stack(values), equal_nan=True)
    assert np.array_equal(a[1:], np.stack(values)[1:], equal_nan=True)
    assert a.norms[0] == 4.0 and np.isnan(a.norms[1]) and a.norms[2] == np.inf
    assert a.finite.tolist() == [True, False, False]
    # the same answers as the in-memory arrays give
    assert np.array_equal(rows.row_norms(a), rows.row_norms(np.stack(values)), equal_nan=True)
    assert rows.nonfinite_rows(a).tolist() == rows.nonfinite_rows(np.stack(values)).tolist()
    with pytest.raises(IndexError):
        a[3]
    with pytest.raises(ValueError, match="row 1 has shape"):
        rows.RowList([np.zeros(2), np.zeros(3)])


def test_spilled_rows_have_the_bytes_of_tobytes_and_the_norms_of_abs_max(spill_everything):
    # the writer skips tobytes()'s copy and the norm abs(row)'s temporary: the file and the norms must be
    # what those give, on the rows where a shortcut could differ (a NaN beside -inf, -inf alone, negative
    # zeros, a transposed view, bool and int rows)
    cases = [
        [np.array([-np.inf, np.nan, 2.0]), np.array([-np.inf, 1.0, 0.5]), np.array([-0.0, -0.0, -0.0])],
        [np.arange(6.0).reshape(2, 3).T - 4.0, np.full((3, 2), -7.5)],
        [np.array([True, False]), np.array([False, False])],
        [np.array([-3, 2], np.int32), np.array([5, -9], np.int32)],
    ]
    for values in cases:
        a = _spilled(values)
        with open(a.path, "rb") as f:
            assert f.read() == b"".join(np.ascontiguousarray(v).tobytes() for v in values)
        with np.errstate(invalid="ignore"):
            expected = [float(np.abs(v).max()) for v in values]
        assert np.array_equal(a.norms, expected, equal_nan=True)
        assert all(np.copysign(1.0, n) == 1.0 for n in a.norms if not np.isnan(n))  # never -0.0
        assert a.finite.tolist() == [bool(np.isfinite(v).all()) for v in values]


def test_every_row_written_to_a_file_reports_progress_inside_the_block_only(spill_everything):
    ticks: list[int] = []
    with rows.reporting_progress(lambda: ticks.append(1)):
        kept = rows.RowList()
        for i in range(3):
            kept.append(np.full(5, float(i)))  # past the threshold (0): written as they come
        assert len(ticks) == 3
        rows.to_file(np.zeros((4, 2)))
        assert len(ticks) == 7
        store = rows.RowStore(threshold=0)
        store.put(np.ones(3))
        assert len(ticks) == 8
        rows.remove_files(store.close())
    rows.to_file(np.zeros((4, 2)))  # outside: nothing reported
    assert len(ticks) == 8


def test_chunks_cover_every_row_once(spill_everything):
    values = [np.full((4,), float(i)) for i in range(7)]
    a = _spilled(values)
    for arr in (a, np.stack(values)):
        chunks = list(rows.iter_rows(arr, max_elements=8))  # two rows of 4 a chunk
        assert [s for s, _ in chunks] == [0, 2, 4, 6]
        assert np.array_equal(np.concatenate([c for _, c in chunks]), np.stack(values))
    assert len(list(rows.iter_rows(np.stack(values)))) == 1  # an array that fits: one chunk, no copy


def test_the_file_goes_with_the_array_and_travels_to_another_process_once(spill_everything):
    a = _spilled([np.ones(3)])
    path = a.path
    received = pickle.loads(pickle.dumps(a))  # what the pool's pipe does with a worker's result
    del a
    gc.collect()
    assert os.path.exists(path), "the sender gave the file away: only the receiver deletes it"
    assert np.array_equal(np.asarray(received), np.ones((1, 3)))
    del received
    gc.collect()
    assert not os.path.exists(path)


def test_a_run_that_fails_half_way_leaves_no_file(spill_everything):
    rl = rows.RowList([np.ones(3)])
    path = rl._path
    assert path and os.path.exists(path)
    del rl
    gc.collect()
    assert not os.path.exists(path)


def test_gaps_and_comparisons_read_row_by_row_and_agree_with_memory(spill_everything):
    rng = np.random.default_rng(0)
    x = [rng.normal(size=(5, 3)) for _ in range(4)]
    y = [v + rng.normal(size=v.shape) * 1e-3 for v in x]
    y[2][1, 1] = np.nan
    sx, sy = _spilled(x), _spilled(y)
    mx, my = np.stack(x), np.stack(y)
    assert np.array_equal(relative_gap(sx, sy), relative_gap(mx, my), equal_nan=True)
    scale = np.array([1.0, 2.0, 3.0, 4.0])
    assert np.array_equal(relative_gap(sx, my, scale=scale), relative_gap(mx, my, scale=scale), equal_nan=True)
    on_disk = compare_trajectories({"param/w": sx}, {"param/w": sy}, rtol=1e-4, atol=0.0)
    in_memory = compare_trajectories({"param/w": mx}, {"param/w": my}, rtol=1e-4, atol=0.0)
    assert on_disk.message() == in_memory.message() and not on_disk.ok
    assert first_nonfinite({"param/w": sy}) == first_nonfinite({"param/w": my}) is not None


def test_a_spilled_trajectory_file_equals_the_in_memory_one(tmp_path, spill_everything):
    values = [np.arange(6.0).reshape(2, 3) * i for i in range(3)]
    traj = {"loss": np.array([1.0, 2.0]), "param/w": _spilled(values)}
    save_trajectory(tmp_path / "t.npz", traj)
    back = load_trajectory(tmp_path / "t.npz")
    assert np.array_equal(back["param/w"], np.stack(values)) and back["param/w"].dtype == np.float64
    assert [p.name for p in tmp_path.iterdir()] == ["t.npz"]  # nothing half-written beside it


@pytest.mark.parametrize(("impls", "changes", "status"), [
    (["tf.towers", "torch.ddp"], {}, "parity"),
    # towers average N per-tower sums, one process sums the whole batch: off by N (theory predicts it)
    (["torch.single", "tf.towers"], {"model__reduction": "sum"}, "expected_difference"),
])
def test_verdicts_are_the_same_with_every_array_spilled(pool, impls, changes, status):
    case = make(MLP, steps=3, dtype="float32", **changes)  # float32: four runs, the float64 rule and the floors
    in_memory = compare_case(case, impls)
    old = rows.set_spill_threshold(0)
    try:
        spilled = compare_case(case, impls)
        spilled_run = run_impl(case, impls[0] if impls[0].startswith("torch") else impls[1])
    finally:
        rows.set_spill_threshold(old)
    # the torch worker spilled too (the threshold travels with the job) and gave its files to this process
    assert isinstance(spilled_run["param/0.kernel"], rows.RowArray)
    assert any(isinstance(v, rows.RowArray) for t in spilled.trajectories.values() for v in t.values())
    for m, s in zip(in_memory.pairs, spilled.pairs, strict=True):
        assert m.verdict.status == s.verdict.status == status
        assert (m.verdict.gap, m.verdict.bound, m.verdict.detail) == (s.verdict.gap, s.verdict.bound, s.verdict.detail)
        assert np.array_equal(m.verdict.per_step_gap, s.verdict.per_step_gap, equal_nan=True)
        assert m.localisation == s.localisation
    if status != "parity":
        assert spilled.pairs[0].localisation["stage"] is not None


def test_the_tensorflow_side_spills_as_it_trains(spill_everything):
    traj = run_impl(dataclasses.replace(make(MLP, steps=2)), "tf.towers")
    assert isinstance(traj["param/0.kernel"], rows.RowArray) and traj["param/0.kernel"].shape[0] == 3
    assert isinstance(traj["grad/0.kernel"], rows.RowArray) and traj["grad/0.kernel"].shape[0] == 2


def test_a_large_comparison_keeps_its_verdicts_but_not_its_trajectories_unless_full(tmp_path, monkeypatch):
    from parity_tests.reporting import report

    result = compare_case(make(MLP, steps=2), ["tf.towers", "tf.single"])
    monkeypatch.setattr(report, "KEEP_BYTES", 100)  # this run's arrays are a few kB: "large" here
    report.write_case_report(result, tmp_path / "kept-not")
    assert not (tmp_path / "kept-not" / "trajectories").exists()
    assert "trajectories not kept" in (tmp_path / "kept-not" / "report.md").read_text()
    report.write_case_report(result, tmp_path / "full", full=True)
    files = sorted(p.name for p in (tmp_path / "full" / "trajectories").glob("*.npz"))
    assert files == ["tf.single_float64.npz", "tf.towers_float64.npz"]
    assert "full trajectory kept" in (tmp_path / "full" / "report.md").read_text()


def test_plugins_spill_too_and_leave_no_file(pool, spill_everything):
    from pathlib import Path

    plugins = Path(__file__).resolve().parent / "plugins"
    tf_good, ddp, skips = (f"{plugins / 'tf_plugins.py'}:good", f"{plugins / 'torch_plugins.py'}:ddp",
                           f"{plugins / 'torch_plugins.py'}:rank1_skips_step_2")
    case = make(MLP, parallel__devices=3, steps=3)  # float64
    before = set(rows.spill_root().iterdir())
    spilled = compare_case(case, [tf_good, ddp, "torch.ddp"])
    assert [p.verdict.status for p in spilled.pairs] == ["parity", "parity"], spilled.summary()
    assert max(p.verdict.gap for p in spilled.pairs) < 1e-14  # as test_plugins finds with nothing spilled
    assert all(isinstance(spilled.trajectories[f"{i}@float64"]["param/0.kernel"], rows.RowArray) for i in (tf_good, ddp))
    # the replicas-in-sync check reads the spilled rows of every rank
    assert run_impl(case, skips).findings[0].startswith("replicas diverged at step 2: rank 1, parameter 0.bias")
    # the runs' own files (RowStore) were removed once assembled: only the trajectories' RowArrays remain
    live = {v.path for t in spilled.trajectories.values() for v in t.values() if isinstance(v, rows.RowArray)}
    left = set(rows.spill_root().iterdir()) - before
    assert {p for p in left if p.suffix == ".plugin"} == set()
    assert {str(p) for p in left} <= live | {str(p) for p in left if p.suffix == ".rows"}


def test_compare_full_keeps_the_trajectories_a_large_comparison_would_not(tmp_path, monkeypatch):
    import json

    from parity_tests.cli import main
    from parity_tests.reporting import report

    monkeypatch.setattr(report, "KEEP_BYTES", 100)
    case = tmp_path / "case.json"
    case.write_text(json.dumps({**MLP, "steps": 2}))
    for flags, kept in (([], False), (["--full"], True)):
        out = tmp_path / f"rep{len(flags)}"
        assert main(["compare", str(case), "--impls", "tf.towers,tf.single", "--report", str(out), *flags]) == 0
        assert (out / "trajectories").is_dir() == kept


def test_a_spilled_array_has_the_digest_of_the_same_array_in_memory(spill_everything):
    from parity_tests.running.manifest import array_digest

    values = [np.arange(6, dtype=np.float32).reshape(2, 3) + i for i in range(4)]
    assert array_digest(_spilled(values)) == array_digest(np.stack(values))
    assert array_digest(_spilled(values[:3])) != array_digest(np.stack(values))


def test_large_payload_arrays_reach_the_workers_as_a_file_with_the_same_result(pool, monkeypatch):
    from parity_tests.running import backends

    case = make(MLP, steps=2)
    piped = run_impl(case, "torch.ddp")
    made: list[list[str]] = []
    real = backends.by_file

    def spy(payload):
        out, files = real(payload)
        made.append(files)
        assert isinstance(out["init"]["0.kernel"], rows.RowRef) and isinstance(out["x"], rows.RowRef)
        return out, files

    monkeypatch.setattr(backends, "BY_FILE_BYTES", 0)  # every array by file
    monkeypatch.setattr("parity_tests.running.builtins.by_file", spy)
    by_file = run_impl(case, "torch.ddp")
    assert made and made[0] and not any(os.path.exists(p) for p in made[0])  # removed after the job
    for k in piped:
        assert np.array_equal(np.asarray(piped[k]), np.asarray(by_file[k])), k


def test_spill_arrays_moves_the_largest_arrays_until_the_rest_fit_and_keeps_their_bytes():
    a = {"big": np.arange(12.0).reshape(3, 4), "small": np.arange(2.0), "step": np.asarray(1)}  # 96 + 16 (+ 8) bytes
    old = rows.set_spill_threshold(112)  # exactly what the arrays with rows hold: nothing moves
    try:
        at = rows.spill_arrays(a)
        rows.set_spill_threshold(111)  # one byte less: the largest moves, the rest (16) fits
        over = rows.spill_arrays(a)
        rows.set_spill_threshold(0)
        everything = rows.spill_arrays(a)
    finally:
        rows.set_spill_threshold(old)
    assert all(at[k] is a[k] for k in a)
    assert isinstance(over["big"], rows.RowArray) and over["small"] is a["small"] and over["step"] is a["step"]
    assert over["big"].shape == (3, 4) and over["big"].dtype == np.float64
    assert np.asarray(over["big"]).tobytes() == a["big"].tobytes()
    assert over["big"].norms.tolist() == [3.0, 7.0, 11.0] and over["big"].finite.all()
    assert isinstance(everything["small"], rows.RowArray) and everything["step"] is a["step"]  # a scalar has no rows


def test_a_spill_that_fails_half_way_leaves_no_file(spill_everything, monkeypatch):
    before = set(os.listdir(rows.spill_root()))
    real = rows._stats
    calls = []

    def fail_second(row):
        calls.append(1)
        if len(calls) == 2:
            raise OSError("disk full")
        return real(row)

    monkeypatch.setattr(rows, "_stats", fail_second)
    with pytest.raises(OSError, match="disk full"):
        rows.to_file(np.ones((3, 2)))
    assert set(os.listdir(rows.spill_root())) == before


@pytest.mark.parametrize("impl", ["torch.ddp", "tf.towers"])
def test_a_captured_step_spilled_is_the_captured_step_in_memory(pool, impl):
    """Every rank spills its captured arrays and the parent joins them row by row into files
    (``torchref.jobs.merge_captures``); TensorFlow's capture goes to files as it is recorded."""
    case = dataclasses.replace(make(MLP, steps=2, parallel__devices=2), capture=2)
    here = run_impl(case, impl)
    old = rows.set_spill_threshold(0)
    try:
        spilled = run_impl(case, impl)
    finally:
        rows.set_spill_threshold(old)
    for key in ("device/x", "device/grad/0.kernel", "device/combined/0.kernel"):  # concatenated, stacked, rank 0's
        assert isinstance(spilled[key], rows.RowArray), key
    assert sorted(here) == sorted(spilled)
    for key in here:
        assert np.asarray(here[key]).tobytes() == np.asarray(spilled[key]).tobytes(), key
        assert np.asarray(here[key]).shape == np.asarray(spilled[key]).shape, key


def test_payload_arrays_each_under_the_limit_go_by_file_once_together_they_pass_it(monkeypatch):
    """A transformer's weights are a hundred arrays of a few MB: each under ``BY_FILE_BYTES``, together over it."""
    from parity_tests.running import backends

    payload = {"spec": {}, "init": {"a": np.arange(4.0), "b": np.ones(2)}, "x": np.zeros(1)}  # 32 + 16 + 8 bytes
    monkeypatch.setattr(backends, "BY_FILE_BYTES", 56)  # exactly what they hold: nothing moves
    out, files = backends.by_file(payload)
    assert files == [] and out["init"]["a"] is payload["init"]["a"] and out["x"] is payload["x"]
    monkeypatch.setattr(backends, "BY_FILE_BYTES", 55)  # one byte less: the largest moves, the rest (24) fits
    out, files = backends.by_file(payload)
    try:
        assert isinstance(out["init"]["a"], rows.RowRef) and np.asarray(out["init"]["a"]).tolist() == [0, 1, 2, 3]
        assert out["init"]["b"] is payload["init"]["b"] and out["x"] is payload["x"] and len(files) == 1
    finally:
        rows.remove_files(files)


def test_merged_captures_each_under_the_threshold_go_to_files_once_together_they_pass_it():
    """The ranks' captured arrays joined in the parent: a GPT's are a hundred arrays of a few MB, each under the
    threshold, together 0.9 GB at 29.5 M parameters (all of them stayed in memory)."""
    from torchref.jobs import merge_captures

    def rank(r):
        return {"x": np.full((2, 3), r, float), "loss": np.asarray(1.0 + r), "grad/a": np.full(4, r, float),
                "grad/b": np.full(4, r + 2, float)}

    results = [{"loss": np.zeros(1), **{f"device/{k}": v for k, v in rank(0).items()}, "device/step": np.asarray(1)},
               {"device": rank(1)}]
    old = rows.set_spill_threshold(150)  # x joined is 96 bytes, the losses 16, each gradient 64: the gradients pass it
    try:
        merged = merge_captures([dict(r) for r in results])
    finally:
        rows.set_spill_threshold(old)
    assert isinstance(merged["device/x"], np.ndarray) and isinstance(merged["device/loss"], np.ndarray)
    assert isinstance(merged["device/grad/a"], rows.RowArray) and isinstance(merged["device/grad/b"], rows.RowArray)
    in_memory = merge_captures([dict(r) for r in results])  # the default threshold: nothing moves
    assert all(isinstance(v, np.ndarray) for v in in_memory.values())
    for k, v in in_memory.items():
        assert np.asarray(merged[k]).tobytes() == v.tobytes() and np.asarray(merged[k]).shape == v.shape, k


def test_a_bad_spill_threshold_in_the_environment_is_one_line_and_status_2(tmp_path):
    import json
    import subprocess
    import sys

    case = tmp_path / "case.json"
    case.write_text(json.dumps(MLP))
    env = {**os.environ, "TFPAR_SPILL_BYTES": "64MB"}
    env.pop("TFPAR_SPILL_ROOT", None)
    out = subprocess.run([sys.executable, "-m", "parity_tests.cli", "compare", str(case)], env=env,
                         capture_output=True, text=True, timeout=HANG_DEADLINE)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip() == ("tfpar: error: TFPAR_SPILL_BYTES: expected a whole number of bytes >= 0"
                                  " (the environment variable), got '64MB'")


def test_a_worker_never_brings_back_a_spill_folder_its_owner_removed(tmp_path):
    """The folder the tool names exists from the moment it is named (a worker may spill first), and
    once the process that named it removed it (Ctrl-C tearing a run down), a worker that spills
    late gets an error instead of re-creating a folder nobody would remove (seen under load in
    test_interrupt); a folder the user named is created by any process."""
    import subprocess
    import sys

    code = (
        "import os, sys\n"
        "from parity_tests.protocol import rows\n"
        "root = rows.ensure_spill_root()\n"
        "assert os.path.isdir(root)\n"
        "rows.set_spill_threshold(0)\n"
        "child = os.fork()\n"
        "if child == 0:\n"
        "    rows._owned[0] = None  # as in a worker started from this process\n"
        "    import time; time.sleep(0.5)\n"
        "    try:\n"
        "        rows.RowList([__import__('numpy').zeros(3)])\n"
        "        os._exit(3)\n"
        "    except FileNotFoundError:\n"
        "        os._exit(0 if not os.path.exists(root) else 4)\n"
        "rows.remove_spill_root()\n"
        "_, status = os.waitpid(child, 0)\n"
        "print(os.waitstatus_to_exitcode(status), os.path.exists(root))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TFPAR_SPILL_ROOT"}
    env["TMPDIR"] = str(tmp_path)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=HANG_DEADLINE)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["0", "False"]
    mine = tmp_path / "my-spill"
    env["TFPAR_SPILL_ROOT"] = str(mine)
    code = "from parity_tests.protocol import rows\nprint(rows.spill_root())\n"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=HANG_DEADLINE)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == str(mine) and mine.is_dir()
