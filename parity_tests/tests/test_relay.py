"""A run's own output passed on in whole lines (``protocol/relay.py``)."""

from __future__ import annotations

import os

from parity_tests.protocol.relay import LineCutter, captured_output, without_chatter


def test_the_cutter_gives_whole_lines_and_ends_the_last():
    cut = LineCutter()
    assert cut.feed(b"ab") == b""
    assert cut.feed(b"c\nde") == b"abc\n"
    assert cut.feed(b"\n\nf") == b"de\n\n"
    assert cut.end() == b"f\n" and cut.end() == b""


def test_tensorflows_start_up_lines_are_dropped_and_nothing_else():
    lines = (b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n"
             b"my own line\nI0000 00:00:1 port.cc:153] oneDNN custom operations are on. You may see\n")
    assert without_chatter(lines) == b"my own line\n"
    assert without_chatter(b"x\n") == b"x\n"


def test_captured_output_sends_what_the_fds_got_then_puts_them_back():
    """File descriptors 1 and 2 (what a rank's print() and C++ code write to; pytest's own capture
    replaces sys.stdout here, so the test writes to the descriptors directly)."""
    sent: list[tuple[int, bytes]] = []
    before = os.fstat(1).st_ino, os.fstat(2).st_ino
    with captured_output(lambda fd, data: sent.append((fd, data))):
        os.write(1, b"from fd 1\n")
        os.write(2, b"from fd 2, unfinished")
    assert (os.fstat(1).st_ino, os.fstat(2).st_ino) == before
    out = b"".join(d for fd, d in sent if fd == 1)
    err = b"".join(d for fd, d in sent if fd == 2)
    assert out == b"from fd 1\n" and err == b"from fd 2, unfinished\n"
