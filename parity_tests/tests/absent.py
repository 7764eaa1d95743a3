"""A child process in which some top-level modules are not installed (for the tests of one side alone).

:func:`absent_env` writes a ``sitecustomize.py`` that replaces the import system's path finder by one
that finds nothing for the named modules, as on a machine where they were never installed:
``import torch`` raises ``ModuleNotFoundError`` and ``importlib.util.find_spec("torch")`` is ``None``
(libraries probe for each other that way: torch asks whether TensorFlow exists, and must be told no,
not be given an error). The file is on ``PYTHONPATH``, so every process the child starts (the torch
pool's forkserver, torchrun's ranks, the TensorFlow server) lacks them too.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

__all__ = ["absent_env", "ROOT", "PYTHON"]

ROOT = Path(__file__).resolve().parents[2]

_SITE = '''\
import importlib.machinery, sys
_ABSENT = frozenset({names!r})


class _PathFinderWithout(importlib.machinery.PathFinder):
    """The path finder, finding nothing for the absent modules."""

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.partition(".")[0] in _ABSENT:
            return None
        return importlib.machinery.PathFinder.find_spec(name, path, target)


sys.meta_path[:] = [_PathFinderWithout if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
'''


def absent_env(folder: Path, *modules: str) -> dict[str, str]:
    """The environment of a child process in which ``modules`` (top-level names) cannot be imported."""
    site = Path(folder) / "absent-site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(_SITE.format(names=sorted(modules)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return env


PYTHON = sys.executable
