"""Which framework an implementation needs, and one line naming the extra to install when it is absent.

TensorFlow and torch are extras of the ``tfpar`` package (docs/install.md): ``pip install tfpar``
brings neither, so that it never installs, replaces or downgrades a user's own build (a GPU
``tensorflow``, ``tensorflow[and-cuda]``, a CUDA torch). A machine may hold one side only (a GPU
box with torch alone records its runs there; ``recorded:`` runs are judged elsewhere). Asking
for an implementation whose framework is absent is bad input: :class:`FrameworkMissing`, a
:class:`CaseError` (exit 2, one line), never an ``ImportError`` traceback from deep inside a run.

Whether a framework is installed is asked of the import system (``importlib.util.find_spec``),
which imports nothing: the judge stays free of TensorFlow and torch.
"""

from __future__ import annotations

import importlib.util

from parity_tests.protocol.errors import CaseError

__all__ = ["FRAMEWORKS", "FrameworkMissing", "installed", "require", "missing_module"]

#: framework key -> (the modules it needs, what a person calls it, the extra that brings it)
FRAMEWORKS: dict[str, tuple[tuple[str, ...], str, str]] = {
    "tf": (("tensorflow", "keras"), "TensorFlow (with Keras 3)", "tf"),
    "torch": (("torch",), "torch", "torch"),
    # tf.summary's implementation (``tfpar compare --tensorboard``): TensorFlow without it raises
    # TBNotInstalledError at the first scalar, after the whole comparison ran
    "tensorboard": (("tensorboard",), "TensorBoard", "tensorboard"),
}


class FrameworkMissing(CaseError):
    """An implementation needs a framework this environment does not have (exit 2)."""


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a half-installed package, or one whose __spec__ is None
        return False


def installed(framework: str) -> bool:
    """Whether every module ``framework`` (``tf`` or ``torch``) needs can be imported here."""
    return all(_importable(m) for m in FRAMEWORKS[framework][0])


def _message(framework: str, who: str, module: str) -> str:
    _, title, extra = FRAMEWORKS[framework]
    return (f"{title} for {who}; no module named {module!r} here: pip install 'tfpar[{extra}]'"
            f" (or your own build; docs/install.md)")


def require(framework: str, who: str, field: str = "--impls") -> None:
    """Raise :class:`FrameworkMissing` (naming ``field`` and the extra) unless ``framework`` is installed.

    ``framework`` other than ``tf`` / ``torch`` (a recorded run's, which needs neither) passes.
    """
    if framework not in FRAMEWORKS:
        return
    for module in FRAMEWORKS[framework][0]:
        if not _importable(module):
            raise FrameworkMissing(field, _message(framework, who, module))


def missing_module(error: BaseException, who: str, field: str) -> FrameworkMissing | None:
    """The one-line error for an import of a user's module that failed because a framework is absent
    (``ModuleNotFoundError`` for ``torch``, ``tensorflow`` or ``keras`` themselves), else ``None``."""
    if not isinstance(error, ModuleNotFoundError) or not error.name:
        return None
    top = error.name.partition(".")[0]
    for framework, (modules, _, _) in FRAMEWORKS.items():
        if top in modules and not _importable(top):
            return FrameworkMissing(field, _message(framework, who, top))
    return None
