"""The error an implementation raises for a valid case it does not implement."""

from __future__ import annotations

__all__ = ["Unsupported"]


class Unsupported(ValueError):
    """A case field this implementation does not implement (the caller reports it as bad input).

    Args:
        field: the case field, e.g. ``"parallel.clip"``.
        expected: what this implementation accepts, e.g. ``"no gradient clipping for tf.v1 (tf.towers has it)"``.
    """

    def __init__(self, field: str, expected: str) -> None:
        self.field, self.expected = field, expected
        super().__init__(f"{field}: {expected}")
