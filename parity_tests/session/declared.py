"""What the registry declares of an implementation, for the session's planning (``None``: a name only a custom runner knows).
"""

from __future__ import annotations

from parity_tests.protocol.errors import CaseError
from parity_tests.running import registry

__all__ = ['declared', 'runs_float64', 'rerunnable']


def declared(impl: str) -> registry.Implementation | None:
    """The registry's entry for ``impl`` (``None`` for a name only a custom runner knows)."""
    try:
        return registry.resolve(impl)
    except CaseError:
        return None


def runs_float64(impl: str) -> bool:
    found = declared(impl)
    return found is None or "float64" in found.dtypes


def rerunnable(impl: str) -> bool:
    found = declared(impl)
    return found is None or found.rerunnable

