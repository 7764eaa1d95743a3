"""Hypothesis settings profiles, registered in one place.

``dev`` (fast, for editing), ``ci`` (what ``make test`` uses), ``thorough``
(long runs, not in CI). Select with ``HYPOTHESIS_PROFILE=<name>``.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

__all__ = ["PROFILES"]

_common = {
    "deadline": None,  # a case runs both frameworks: wall time varies with load
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
    "print_blob": True,
}
PROFILES = {"dev": 5, "ci": 12, "thorough": 200}

for _name, _n in PROFILES.items():
    settings.register_profile(_name, max_examples=_n, **_common)

settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))
