"""Hypothesis settings profiles, registered in one place, under names of their own; loaded by no import.

``tfpar-dev`` (fast, for editing), ``tfpar-ci`` (what ``make test`` uses), ``tfpar-thorough``
(long runs, not in CI). Importing this module (the pytest plugin does) registers them and loads
none: a user's session keeps Hypothesis' defaults, or the profile they load themselves, until they
choose one of these with Hypothesis' own option, ``pytest --hypothesis-profile tfpar-ci``, or with
:func:`load` (this repository's conftest.py: ``HYPOTHESIS_PROFILE=ci`` or ``=tfpar-ci``).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

__all__ = ["PROFILES", "PREFIX", "register", "profile_name", "load"]

PREFIX = "tfpar-"

_common = {
    "deadline": None,  # a case runs both frameworks: wall time varies with load
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
    "print_blob": True,
}
#: profile name -> examples per property
PROFILES = {"tfpar-dev": 5, "tfpar-ci": 12, "tfpar-thorough": 200}


def register() -> None:
    """Register the profiles (again: idempotent). Loads none."""
    for name, n in PROFILES.items():
        settings.register_profile(name, max_examples=n, **_common)


def profile_name(name: str) -> str:
    """``ci`` -> ``tfpar-ci`` (the short names of ``HYPOTHESIS_PROFILE`` in this repository); any other
    name, ``tfpar-ci`` or a profile of the user's own, unchanged."""
    return PREFIX + name if PREFIX + name in PROFILES else name


def load(name: str | None = None) -> str:
    """Load ``name`` (default: ``$HYPOTHESIS_PROFILE``, else ``tfpar-dev``) and return the profile's full name.

    Called by this repository's conftest.py, never at import.
    """
    full = profile_name(name or os.environ.get("HYPOTHESIS_PROFILE") or "dev")
    settings.load_profile(full)
    return full


register()
