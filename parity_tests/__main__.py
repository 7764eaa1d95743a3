"""``python -m parity_tests``: the ``tfpar`` command (:func:`parity_tests.cli.entry`), as ``python -m tfpar``."""

from __future__ import annotations

from parity_tests.cli import entry

__all__: list[str] = []

if __name__ == "__main__":
    entry()
