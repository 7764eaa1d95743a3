"""``python -m tfpar``: the ``tfpar`` command (:func:`parity_tests.cli.entry`), as the console script runs it.

The one module of ``tfpar`` above the judge's layers: it is the command line, not the library
(test_layering places it with ``parity_tests.cli``). Importing it imports no TensorFlow; torch
workers spawned by the command re-import it as ``__mp_main__``, so the call is guarded.
"""

from __future__ import annotations

from parity_tests.cli import entry

__all__: list[str] = []

if __name__ == "__main__":
    entry()
