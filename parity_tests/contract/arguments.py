"""Command-line pieces shared by every entry point (``tfpar``, ``torchrun ... -m parity_tests.launch.torch``).

Bad arguments are bad input like any other: one line naming what was expected
(a :class:`~parity_tests.protocol.errors.CaseError`, exit status 2 by the caller),
never argparse's usage block.
"""

from __future__ import annotations

import argparse

from parity_tests.protocol.errors import CaseError

__all__ = ["OneLineParser", "positive_seconds"]


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors raise one ``CaseError`` line; subclasses set :attr:`help_hint`."""

    help_hint = "--help"  #: the command to suggest, e.g. ``tfpar --help``

    def error(self, message: str) -> None:  # one line, status 2, like every other bad input
        raise CaseError("command line", f"valid arguments ({message}); see '{self.help_hint}'")


def positive_seconds(text: str) -> float:
    """An argparse ``type``: a number of seconds ``> 0``."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number of seconds, got {text!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"a number of seconds > 0, got {text!r}")
    return v
