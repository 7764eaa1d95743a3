"""What a user sees when their plugin raises: the exception's last line, and the traceback of their own frames.

A plugin runs inside the tool (``tfpar.plugin.run_plugin``, ``torchref.plugin.run_plugin_rank``)
and calls into TensorFlow, Keras or torch; a traceback of everything is mostly the tool's
and the libraries' frames. :func:`user_traceback` keeps the frames of the user's own
files and says in one line how many library frames it left out between them; the
tool's frames (``tfpar/``, ``torchref/``, ``parity_tests/`` but its ``tests/``, whose
plugins are users' code) are left out without a word. Chained exceptions
(``raise ... from``, an error while handling another) are shown as Python shows them.

Plain Python: importable from TensorFlow's side and torch's.
"""

from __future__ import annotations

import os
import re
import sysconfig
import traceback
from pathlib import Path

__all__ = ["last_line", "user_traceback", "is_tool_file", "is_library_file"]

_ROOT = Path(__file__).resolve().parents[2]
_TOOL = tuple(str(_ROOT / p) + os.sep for p in ("tfpar", "torchref", "parity_tests"))
_TOOL_TESTS = str(_ROOT / "parity_tests" / "tests") + os.sep  # test plugins are users' code
_LIBRARIES = tuple(sorted({str(Path(p).resolve()) + os.sep for p in
                           (sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib"))
                           if p}))


def last_line(e: BaseException) -> str:
    """``"KeyError: 'lr'"``: the exception's type and the last line of its message."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[-1].strip() if text else ''}".rstrip(": ")


def is_tool_file(filename: str) -> bool:
    """A file of ``tfpar``, ``torchref`` or ``parity_tests`` (not its tests)."""
    path = _resolved(filename)
    return path.startswith(_TOOL) and not path.startswith(_TOOL_TESTS)


def is_library_file(filename: str) -> bool:
    """A file of the standard library or an installed package (TensorFlow, Keras, torch, numpy ...),
    or one Python made up (``<frozen ...>``, ``<string>``)."""
    if filename.startswith("<"):
        return True
    return _resolved(filename).startswith(_LIBRARIES) or "site-packages" + os.sep in filename


def _resolved(filename: str) -> str:
    try:
        return str(Path(filename).resolve())
    except (OSError, RuntimeError):
        return filename


def user_traceback(e: BaseException) -> str:
    """The traceback of ``e`` with only the user's frames, as Python prints one (text, ends with a newline).

    Returns ``""`` when no frame of the user's own is on the stack (the error came from
    the tool before the plugin ran): the one line says it all then.
    """
    te = traceback.TracebackException.from_exception(e)
    chain: list[tuple[traceback.TracebackException, str | None]] = []
    seen, note = set(), None
    while te is not None and id(te) not in seen:
        seen.add(id(te))
        chain.append((te, note))
        if te.__cause__ is not None:
            te, note = te.__cause__, "The above exception was the direct cause of the following exception:"
        elif te.__context__ is not None and not te.__suppress_context__:
            te, note = te.__context__, "During handling of the above exception, another exception occurred:"
        else:
            te = None
    out: list[str] = []
    mine = 0
    for te, _ in chain:
        mine += sum(1 for f in te.stack if not is_tool_file(f.filename) and not is_library_file(f.filename))
    if not mine:
        return ""
    for i, (te, _) in enumerate(reversed(chain)):
        if i:
            out.append("\n" + chain[len(chain) - i][1] + "\n\n")
        out.append("Traceback (most recent call last; the tool's frames left out):\n")
        skipped = 0
        for f in te.stack:
            if is_tool_file(f.filename):
                continue
            if is_library_file(f.filename):
                skipped += 1
                continue
            if skipped:
                out.append(f"  [{skipped} frame{'s' if skipped > 1 else ''} in libraries]\n")
                skipped = 0
            out.append(f'  File "{f.filename}", line {f.lineno}, in {f.name}\n')
            if f.line:
                out.append(f"    {f.line.strip()}\n")
        if skipped:
            out.append(f"  [{skipped} frame{'s' if skipped > 1 else ''} in libraries]\n")
        out.append(_without_tool_frames("".join(te.format_exception_only())))
    return "".join(out)


_FRAME = re.compile(r'^\s*File "([^"]+)", line \d+, in \S+\s*$')


def _without_tool_frames(text: str) -> str:
    """The exception's text without the tool's frames that TensorFlow lists in it ("Detected at node
    ... defined at (most recent call last):"), each followed by a blank line."""
    out, drop_blank = [], False
    for line in text.splitlines(keepends=True):
        m = _FRAME.match(line)
        if m and (is_tool_file(m.group(1)) or m.group(1).startswith("<frozen")):
            drop_blank = True
            continue
        if drop_blank and not line.strip():
            drop_blank = False
            continue
        drop_blank = False
        out.append(line)
    return "".join(out)
