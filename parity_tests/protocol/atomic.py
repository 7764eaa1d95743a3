"""Atomic file writes: a temporary file in the same folder, fsync, then rename.

A crash or Ctrl-C in the middle leaves either the old file or the new one,
never half of one.
"""

from __future__ import annotations

import os
import secrets
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from parity_tests.protocol.rows import RowArray, iter_rows

__all__ = ["atomic_write_bytes", "atomic_write_text", "atomic_write_npz"]


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically; returns the path."""
    return _atomic(path, lambda f: f.write(data))


def _atomic(path: str | os.PathLike, write: Callable[[Any], Any]) -> Path:
    """``write(f)`` into a temporary file beside ``path``, fsync, rename; removed on any failure.

    The temporary name is chosen before the file exists and the file is created
    inside the ``try``: a SIGTERM/Ctrl-C (raised as an exception by ``tfpar``'s
    handlers at any bytecode) that lands just after the file was created still
    finds the name to remove. (``tempfile.mkstemp`` returns the name only once the
    file exists: a signal in between left a ``.tmp`` file behind, seen in CI.)
    """
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.parent / f".{p.name}.{secrets.token_hex(6)}.tmp"
    try:
        # O_EXCL: never another writer's file; 0o666 under the umask, as open() would make it
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return p


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write UTF-8 ``text`` to ``path`` atomically."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_npz(path: str | os.PathLike, arrays: dict[str, Any]) -> Path:
    """Write ``arrays`` as an uncompressed ``.npz`` atomically (no pickles), as ``np.savez`` does.

    Each member is streamed into the file: an array whose rows live in a file
    (:class:`parity_tests.protocol.rows.RowArray`) is copied row by row, never held whole.
    """
    def write(f: Any) -> None:
        with zipfile.ZipFile(f, "w", zipfile.ZIP_STORED, allowZip64=True) as z:
            for key, value in arrays.items():
                with z.open(f"{key}.npy", "w", force_zip64=True) as member:
                    if isinstance(value, RowArray):
                        header = {"descr": np.lib.format.dtype_to_descr(value.dtype), "fortran_order": False,
                                  "shape": tuple(value.shape)}
                        np.lib.format.write_array_header_2_0(member, header)
                        for _, chunk in iter_rows(value):
                            member.write(np.ascontiguousarray(chunk).tobytes())
                    else:
                        np.lib.format.write_array(member, np.asarray(value), allow_pickle=False)

    return _atomic(path, write)
