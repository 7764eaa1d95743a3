"""The judge: the case contract, running implementations, judging, reporting and the command line.

The package reads as the architecture, one subpackage a layer, each importing only
the ones below it (docs/architecture.md; ``tests/test_layering.py`` enforces it)::

    cli.py      the ``tfpar`` command
    reporting/  report.md / report.json / plots, the scenario matrix
    testing/    hypothesis strategies and profiles, replayable failures, assert_parity, the pytest plugin
    launch/     the cluster launchers (torchrun, TF_CONFIG workers)
    session/    one comparison: run, rerun, map, judge every pair; lockstep
    running/    the registry of implementations (built-ins, plugins, recorded runs), the harness, manifests
    judging/    the comparator, the tolerance model, the theory of known differences, pair verdicts
    contract/   the case format (docs/case-format.md), validation at the edge
    protocol/   what crosses to the engines (tfpar, torchref): rows, trajectories, settings, errors

Nothing here imports TensorFlow or torch at import time: spawned torch workers
re-import the parent's main module.

The flat module names of earlier releases (``parity_tests.case``,
``parity_tests.judge``, ``parity_tests.strategies``, ...) keep working: they
are the same module objects as their new homes.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import Any

__all__ = ["assert_parity", "compare_case", "load_case", "case_from_dict", "__version__"]

#: the version when the package runs from a source tree without installed metadata (``tfpar --version``
#: reads the installed distribution's first); kept equal to pyproject.toml's by ``tests/test_cli.py``
__version__ = "0.1.0"

# old flat name -> where the module lives now
_MOVED = {
    "case": "contract.case", "case_model": "contract.model", "case_optimizer": "contract.optimizer",
    "case_parallel": "contract.parallel", "fields": "contract.fields", "errors": "protocol.errors",
    "specs": "contract.specs", "generators": "contract.generators", "trajectory": "protocol.trajectory",
    "atomic": "protocol.atomic",
    "harness": "running.harness", "manifest": "running.manifest",
    "compare": "judging.compare", "theory": "judging.theory",
    "judge": "session.comparison",
    "report": "reporting.report", "matrix": "reporting.matrix", "docs_optimizers": "reporting.docs_optimizers",
    "strategies": "testing.strategies", "profiles": "testing.profiles", "failures": "testing.failures",
}


class _Alias(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: Any) -> Any:
        module = importlib.import_module(self.target)  # the very module object, not a copy
        self.spec = module.__spec__
        return module

    def exec_module(self, module: Any) -> None:
        module.__spec__ = self.spec  # the import system stamped the alias's spec on it: put the real one back


class _MovedFinder(importlib.abc.MetaPathFinder):
    """``import parity_tests.judge`` gives ``parity_tests.session.comparison`` (the same object)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        head, _, tail = fullname.partition(".")
        if head != __name__ or tail not in _MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, _Alias(f"{__name__}.{_MOVED[tail]}"))


if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _MovedFinder())

_LAZY = {
    "assert_parity": "parity_tests.testing.assertions",
    "compare_case": "parity_tests.session.comparison",
    "load_case": "parity_tests.contract.case",
    "case_from_dict": "parity_tests.contract.case",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _MOVED:  # ``parity_tests.judge`` as an attribute, after ``import parity_tests``
        return importlib.import_module(f"{__name__}.{_MOVED[name]}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
