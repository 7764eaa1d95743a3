"""Replayable failures: a case that broke a property, written as ``case.json`` + npz files.

    with replayable(case):
        assert_parity(...)

On an ``AssertionError`` inside the block the case is written to
``$TFPAR_FAILURES`` (default ``./failures``) in a folder named after a hash of
its content, and the error is re-raised with the path and the command that
replays it. Hypothesis shrinks first and reports the last (minimal) failure,
so the path printed with the final error is the minimal case.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from parity_tests.contract.case import Case, write_case
from parity_tests.protocol import settings

__all__ = ["failure_dir", "record_failure", "replayable"]


def failure_dir() -> Path:
    """Where failing cases are written (``$TFPAR_FAILURES`` or ``./failures``)."""
    return settings.failures_folder()


def record_failure(case: Case, folder: Path | None = None) -> Path:
    """Write ``case`` replayably; returns the path of its ``case.json``."""
    h = hashlib.sha256(json.dumps(case.spec, sort_keys=True).encode())
    for a in (case.x, case.y, *case.init.values(), *(a for a in (case.perm, case.w) if a is not None)):
        h.update(a.tobytes())
    out = (folder or failure_dir()) / f"{case.name}-{h.hexdigest()[:12]}"
    return write_case(case, out)


@contextmanager
def replayable(case: Case, folder: Path | None = None, impls: list[str] | None = None) -> Iterator[None]:
    """Re-raise an ``AssertionError`` with the path of the written case and the replay command.

    ``impls``: the implementations compared (plugins included), so that the printed
    command replays that comparison rather than the default one.
    """
    try:
        yield
    except AssertionError as e:
        path = record_failure(case, folder)
        names = f" --impls {','.join(impls)}" if impls else ""
        raise AssertionError(f"{e}\nreplay: tfpar compare {path}{names}") from e
