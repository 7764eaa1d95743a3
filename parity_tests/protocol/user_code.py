"""Users' code imported by name: the one importer of ``FILE.py:FUNCTION`` and ``package.module:FUNCTION``.

Every place that imports a user's module goes through here: the parity tool resolving a plugin
name (``parity_tests.running.plugins``), the TensorFlow plugin server's fresh child
(``parity_tests.running.tf_worker``) and every torch rank (``torchref.plugin``). A name is
located once (:func:`locate`: one line of bad input naming the field) into a *location*, plain
data a worker process can be sent (nothing is pickled)::

    {"path": "/abs/my_towers.py", "module_name": "tfpar_plugin_my_towers_1a2b3c4d", "attr": "train"}
    {"module": "my_pkg.towers", "attr": "train"}

and imported wherever it runs with :func:`import_module`. Standard library only; importing this
module imports nothing of the user's.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import re
import sys
import types
from collections.abc import Mapping
from pathlib import Path

from parity_tests.protocol.errors import CaseError

__all__ = ["Location", "split_name", "locate", "module_name", "where", "import_module"]

#: ``{"path", "module_name", "attr"}`` (a file) or ``{"module", "attr"}`` (an importable module)
Location = Mapping[str, str]


def split_name(name: str, field: str) -> tuple[str, str]:
    """``("path/my.py", "train")`` of ``"path/my.py:train"``; :class:`CaseError` naming ``field`` if it is not one."""
    where_, _, attr = name.rpartition(":")
    if not where_ or not attr.isidentifier():
        raise CaseError(field, "a plugin named FILE.py:FUNCTION or package.module:FUNCTION", name)
    return where_, attr


def module_name(path: Path) -> str:
    """The name a user's file is imported under: its stem and a hash of its path (two ``train.py`` differ)."""
    stem = re.sub(r"\W", "_", path.stem)
    return f"tfpar_plugin_{stem}_{hashlib.sha256(str(path).encode()).hexdigest()[:8]}"


def locate(name: str, field: str) -> tuple[dict[str, str], Path | None]:
    """Where ``name`` (``FILE.py:FUNCTION`` or ``package.module:FUNCTION``) lives, without importing it.

    Returns:
        (its location, the source file: the ``.py`` a module's spec names, else ``None``).

    Raises:
        CaseError: (one line, naming ``field``) not of that form, no such file, no such module.
    """
    where_, attr = split_name(name, field)
    if where_.endswith(".py") or "/" in where_ or "\\" in where_:
        path = Path(where_).expanduser().resolve()
        if not path.is_file():
            raise CaseError(field, f"an existing Python file; {where_} does not exist", name)
        return {"path": str(path), "module_name": module_name(path), "attr": attr}, path
    try:
        found = importlib.util.find_spec(where_)
    except (ImportError, ValueError):
        found = None
    if found is None:
        raise CaseError(field, f"an importable module; no module named {where_!r} (a file needs its .py)", name)
    origin = found.origin
    return {"module": where_, "attr": attr}, Path(origin) if origin and origin.endswith(".py") else None


def where(location: Location) -> str:
    """The file's name (``my_towers.py``) or the module's (``my_pkg.towers``), for messages."""
    return os.path.basename(location["path"]) if location.get("path") else location["module"]


def import_module(location: Location) -> types.ModuleType:
    """The module at ``location``, imported in this process (once: a file's module is kept in ``sys.modules``
    under :func:`module_name`, as ``import`` keeps a package's).

    A file's folder goes first on ``sys.path`` (unless it is on it already), so that its sibling modules
    import as under ``python FILE``. Whatever the module raises is raised; a file's half-made module is
    taken out of ``sys.modules`` first, so a later import starts afresh. The caller words the error.
    """
    if not location.get("path"):
        return importlib.import_module(location["module"])
    name = location["module_name"]
    if name in sys.modules:
        return sys.modules[name]
    path = Path(location["path"])
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module
