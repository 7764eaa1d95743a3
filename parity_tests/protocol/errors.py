"""The root of the tool's exceptions, and the one error type it answers bad input with.

:class:`TfparError` is the common base of every exception class of ``tfpar``, ``torchref`` and
``parity_tests``: ``except TfparError`` catches any of them. Each also keeps the standard base it
had (``ValueError`` for bad input, ``RuntimeError`` for a failed run), so ``except ValueError``
catches what it always did. (``parity_tests.cli.Terminated`` is not an error but SIGTERM, a
``BaseException`` like ``KeyboardInterrupt``, and stays outside the root.)

:class:`CaseError`: every message names the field (a dotted path such as ``optimizer.lr`` or
``model.layers[1].units``) and what was expected, so that the command line can
print it as a single line and exit with status 2.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TfparError", "CaseError"]


class TfparError(Exception):
    """The root of every exception class of ``tfpar``, ``torchref`` and ``parity_tests`` (``except TfparError``)."""


class CaseError(TfparError, ValueError):
    """Bad input: a case, a file it names, or a command-line argument.

    Args:
        field: dotted path of the offending field, e.g. ``"data.global_batch"``.
        expected: what would have been accepted, e.g. ``"an integer >= 1"``.
        got: the offending value (shown with ``repr``, shortened), if any.
    """

    _MISSING = object()

    def __init__(self, field: str, expected: str, got: Any = _MISSING) -> None:
        self.field = field
        self.expected = expected
        text = f"{field}: expected {expected}"
        if got is not CaseError._MISSING:
            shown = repr(got)
            if len(shown) > 80:
                shown = shown[:77] + "..."
            text += f", got {shown}"
        super().__init__(text)
