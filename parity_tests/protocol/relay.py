"""A run's own output (what the user's code prints) passed to the tool's process in whole lines.

A plugin runs in another process (a fresh TensorFlow child, a torch pool rank) whose stdout
and stderr would otherwise go straight to the terminal, into the middle of the tool's
progress bar. Instead the run's file descriptors 1 and 2 go into pipes, their bytes are cut
into whole lines (:class:`LineCutter`) and sent to the tool's process, which writes each
between the bar's redraws (:func:`write_output`). An unfinished last line is ended at the
run's end, so what the tool prints next starts a line of its own.

Plain Python: used by ``parity_tests.running.tf_worker`` and ``torchref.plugin``.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable, Iterator
from multiprocessing.connection import wait
from typing import Any

__all__ = ["LineCutter", "write_output", "captured_output", "without_chatter", "BENIGN"]

#: TensorFlow's start-up lines (absl logs them before its level is read): dropped from a run's output
BENIGN = (b"All log messages before absl::InitializeLog()", b"oneDNN custom operations are on",
          b"This TensorFlow binary is optimized", b"rebuild TensorFlow with the appropriate compiler flags")


def without_chatter(lines: bytes) -> bytes:
    """``lines`` (whole lines) without TensorFlow's known start-up lines (:data:`BENIGN`)."""
    if not any(b in lines for b in BENIGN):
        return lines
    return b"".join(line for line in lines.splitlines(keepends=True) if not any(b in line for b in BENIGN))


class LineCutter:
    """Bytes in, whole lines out: ``feed(chunk)`` returns the complete lines so far, ``end()`` the rest, ended."""

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, chunk: bytes) -> bytes:
        head, sep, self._pending = (self._pending + chunk).rpartition(b"\n")
        return head + sep

    def end(self) -> bytes:
        rest, self._pending = self._pending, b""
        return rest + b"\n" if rest else b""


def _has_fileno(stream: Any) -> bool:
    try:
        stream.fileno()
    except (AttributeError, OSError, ValueError):
        return False
    return True


def write_output(fd: int, data: bytes) -> None:
    """Write a run's output to this process's stdout (1) or stderr (2), around any progress bar.

    ``tqdm.external_write_mode`` clears the bars drawn on that stream first and draws them
    again after: the run's lines never share a line with a bar.
    """
    stream = sys.stdout if fd == 1 else sys.stderr
    try:
        from tqdm import tqdm

        guard: Any = tqdm.external_write_mode(file=stream)
    except ImportError:
        guard = contextlib.nullcontext()
    with guard:
        stream.flush()
        if _has_fileno(stream):
            os.write(stream.fileno(), data)
        else:  # a captured stream (pytest's capsys): text
            stream.write(data.decode(errors="replace"))
        stream.flush()


@contextlib.contextmanager
def captured_output(send: Callable[[int, bytes], None]) -> Iterator[None]:
    """For the body, this process's fds 1 and 2 go into pipes; a thread sends their whole lines as ``send(fd, lines)``.

    On leaving, Python's streams are flushed, the fds put back, and everything written is sent
    (an unfinished last line ended) before this returns.
    """
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    pipes = {fd: os.pipe() for fd in (1, 2)}
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    for fd, (_, w) in pipes.items():
        os.dup2(w, fd)
        os.close(w)
    readers = {r: (fd, LineCutter()) for fd, (r, _) in pipes.items()}

    def pump() -> None:
        open_ = dict(readers)
        while open_:
            for r in wait(list(open_)):
                fd, cut = open_[r]
                chunk = os.read(r, 65536)
                lines = without_chatter(cut.feed(chunk) if chunk else cut.end())
                if lines:
                    with contextlib.suppress(Exception):  # the parent gone: nobody to tell
                        send(fd, lines)
                if not chunk:
                    del open_[r]
                    os.close(r)

    thread = threading.Thread(target=pump, name="tfpar-output", daemon=True)
    thread.start()
    try:
        yield
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        for fd, old in saved.items():
            os.dup2(old, fd)  # the pipes' last writer closes: the thread reads their end
            os.close(old)
        thread.join()
