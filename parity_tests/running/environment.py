"""The environment a run happened in: tool and library versions (package metadata only)."""

from __future__ import annotations

import platform
import sys
from importlib import metadata

__all__ = ["versions"]


def versions() -> dict[str, str]:
    """Tool and library versions (read from package metadata: imports nothing heavy)."""
    out = {"python": sys.version.split()[0], "platform": platform.platform()}
    for dist in ("tfpar", "tensorflow-cpu", "tensorflow", "keras", "torch", "numpy", "hypothesis"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out
