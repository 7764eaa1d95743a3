"""Atomic writes leave either the old file or the new one, never a temporary file, whatever the
moment an exception (a signal, raised by tfpar's handlers) arrives."""

import os

import numpy as np
import pytest

from parity_tests.protocol import atomic
from parity_tests.protocol.atomic import atomic_write_npz, atomic_write_text


def test_a_written_file_replaces_the_old_one_and_leaves_nothing_else(tmp_path):
    target = tmp_path / "sub" / "a.json"
    atomic_write_text(target, "old")
    atomic_write_text(target, "new")
    assert target.read_text() == "new"
    assert sorted(p.name for p in target.parent.iterdir()) == ["a.json"]


def test_an_npz_reads_back(tmp_path):
    atomic_write_npz(tmp_path / "t.npz", {"x": np.arange(3.0)})
    with np.load(tmp_path / "t.npz") as z:
        assert z["x"].tolist() == [0.0, 1.0, 2.0]


@pytest.mark.parametrize("when", ["created", "written", "replaced"])
def test_an_interrupt_at_any_moment_leaves_no_temporary_file(tmp_path, monkeypatch, when):
    """A KeyboardInterrupt right after the temporary file is created (the window a signal hit in
    CI: ``mkstemp`` had made the file but not yet returned its name), after it is written, or
    instead of the rename: the old file stays, nothing else."""
    target = tmp_path / "a.json"
    target.write_text("old")
    real_open, real_replace = os.open, os.replace

    def open_then_interrupt(*args, **kwargs):
        fd = real_open(*args, **kwargs)
        if when == "created":
            raise KeyboardInterrupt
        return fd

    def write(f):
        f.write(b"new")
        if when == "written":
            raise KeyboardInterrupt

    def replace(*args):
        if when == "replaced":
            raise KeyboardInterrupt
        return real_replace(*args)

    monkeypatch.setattr(atomic.os, "open", open_then_interrupt)
    monkeypatch.setattr(atomic.os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        atomic._atomic(target, write)
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]
