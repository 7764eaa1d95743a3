"""The one registry of implementations: the only place that knows which exist.

An implementation name is one of:

* a built-in (``tf.towers``, ``tf.single``, ``tf.v1``, ``tf.mirrored``,
  ``torch.ddp``, ``torch.single``), registered by :mod:`.builtins` through
  :func:`register` like anything else;
* a plugin, ``path/to/file.py:function`` or ``package.module:function``
  (docs/plugins.md, :mod:`.plugins`);
* a short name an installed package declares in the entry-point group
  ``tfpar.implementations`` (its value is ``package.module:function``);
* a recorded run, ``recorded:path/run.npz`` (docs/testing-your-code.md, :mod:`.recorded`).

:func:`resolve` turns a name into an :class:`Implementation`, whose ``run``
the harness calls; the command line, ``compare_case``, the strategies and the
matrix all ask here.
"""

from __future__ import annotations

import threading
from importlib import metadata

from parity_tests.protocol.engine import declare
from parity_tests.protocol.errors import CaseError
from parity_tests.running.builtins import IMPLEMENTATIONS
from parity_tests.running.frameworks import require
from parity_tests.running.implementation import Implementation
from parity_tests.running.plugins import is_plugin_name, plugin_implementation, resolve_plugin
from parity_tests.running.recorded import recorded_implementation

__all__ = ["Implementation", "ENTRY_POINT_GROUP", "register", "resolve", "lookup", "builtin_names", "names",
           "describe_names"]

ENTRY_POINT_GROUP = "tfpar.implementations"


_lock = threading.RLock()
_registry: dict[str, Implementation] = {}
_builtin: list[str] = []


def register(impl: Implementation, *, builtin: bool = False) -> Implementation:
    """Add ``impl`` under its name (replacing a resolved plugin of the same name, never a built-in)."""
    with _lock:
        if impl.name in _builtin and not builtin:
            raise CaseError("--impls", f"a name other than the built-in {impl.name!r}", impl.name)
        _registry[impl.name] = impl
        declare(impl.spec)  # what the judge reads of it (parity_tests.protocol.engine)
        if builtin and impl.name not in _builtin:
            _builtin.append(impl.name)
    return impl


def _ensure_builtins() -> None:
    if not _builtin:
        for found in IMPLEMENTATIONS:  # tf.multiworker resolves (manifests name it) but is launched, not listed
            register(found, builtin=found.spec.in_process)


def builtin_names() -> tuple[str, ...]:
    """The built-in implementations, in registration order."""
    _ensure_builtins()
    return tuple(_builtin)


def _entry_points() -> dict[str, str]:
    return {ep.name: ep.value for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}


def names() -> tuple[str, ...]:
    """Every short name: the built-ins, then the installed packages' entry points."""
    return builtin_names() + tuple(n for n in sorted(_entry_points()) if n not in _builtin)


def describe_names() -> str:
    """A short text for help and error messages."""
    return ", ".join(names()) + ", FILE.py:FUNCTION, package.module:FUNCTION or recorded:RUN.npz"


def lookup(name: str) -> Implementation | None:
    """The implementation already resolved (or built in) under ``name``; resolves nothing new."""
    _ensure_builtins()
    return _registry.get(name)


def resolve(name: str, field: str = "--impls") -> Implementation:
    """The implementation called ``name``.

    Raises:
        CaseError: (naming ``field``) an unknown name, or a plugin or recorded run that
            cannot be loaded; the message says what was expected.
        FrameworkMissing: (a ``CaseError``) a built-in or plugin whose framework is not installed
            here; the message names the extra to install (:mod:`.frameworks`).
    """
    _ensure_builtins()
    if not isinstance(name, str) or not name.strip():
        raise CaseError(field, "an implementation name (" + describe_names() + ")", name)
    with _lock:
        found = _registry.get(name)
    if found is not None and found.kind != "recorded":  # a recorded file may change: re-read it
        if found.kind == "builtin":  # a plugin checked its framework when it was resolved
            require(found.framework, name, field)
        return found
    if name.startswith("recorded:"):
        return register(recorded_implementation(name, field))
    if is_plugin_name(name):
        return register(plugin_implementation(resolve_plugin(name, field)))
    eps = _entry_points()
    if name in eps:
        target = resolve_plugin(eps[name], f"{field} ({name}, entry point {ENTRY_POINT_GROUP})")
        return register(plugin_implementation(target, name=name))
    raise CaseError(field, "an implementation: " + describe_names(), name)
