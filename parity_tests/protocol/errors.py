"""The one error type the tool answers bad input with.

Every message names the field (a dotted path such as ``optimizer.lr`` or
``model.layers[1].units``) and what was expected, so that the command line can
print it as a single line and exit with status 2.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CaseError"]


class CaseError(ValueError):
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
