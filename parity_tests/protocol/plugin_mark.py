"""What a plugin's decorator declares, checked once for both sides.

``@tfpar.plugin.tensorflow`` and ``@torchref.plugin.distributed`` / ``.single`` set the attribute
:data:`MARK` on the function they mark; the parity tool reads it (``running.plugin_marks``). Both
decorators check their ``dtypes=`` with :func:`check_dtypes`, so the two sides accept and refuse the
same declarations with the same one-line message.
"""

from __future__ import annotations

from typing import Any

from parity_tests.protocol.errors import TfparError

__all__ = ["MARK", "DTYPES", "PluginDeclarationError", "check_dtypes"]

#: the attribute a plugin decorator sets on the function it marks
MARK = "__tfpar_plugin__"
#: the case dtypes a plugin may declare
DTYPES = ("float32", "float64")


class PluginDeclarationError(TfparError, ValueError):
    """A decorator was given something it cannot accept (e.g. an unknown dtype)."""


def check_dtypes(dtypes: Any, decorator: str) -> tuple[str, ...]:
    """``dtypes`` as a tuple of names of :data:`DTYPES`, or :class:`PluginDeclarationError` naming the bad one.

    Args:
        dtypes: what the decorator was given: one name or an iterable of names.
        decorator: the decorator as the user wrote it (``"tfpar.plugin.tensorflow"``), for the message.
    """
    if isinstance(dtypes, str):
        dtypes = (dtypes,)
    try:
        out = tuple(dtypes)
    except TypeError:
        raise PluginDeclarationError(f"{decorator}(dtypes=...) takes a tuple of dtype names, got {dtypes!r}") from None
    if not out:
        raise PluginDeclarationError(f"{decorator}(dtypes=...) needs at least one of {', '.join(DTYPES)}")
    for d in out:
        if d not in DTYPES:
            raise PluginDeclarationError(f"{decorator}(dtypes=...): unknown dtype {d!r}; expected among {', '.join(DTYPES)}")
    return out
