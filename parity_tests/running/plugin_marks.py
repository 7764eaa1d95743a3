"""How a function is marked as a plugin, and what the tool reads of a marked function.

Low in ``running`` so that the TensorFlow plugin server (:mod:`.tf_worker`) can describe
a plugin it imported without importing :mod:`.plugins`, which starts that server.
"""

from __future__ import annotations

import sys
from typing import Any

# MARK: set by @tfpar.plugin.tensorflow and @torchref.plugin.distributed / .single
from parity_tests.protocol.plugin_mark import MARK

__all__ = ["MARK", "KINDS", "describe"]

KINDS = {"tensorflow": "@tfpar.plugin.tensorflow", "distributed": "@torchref.plugin.distributed",
         "single": "@torchref.plugin.single"}


def describe(fn: Any) -> dict[str, Any]:
    """What the parity tool needs to know of a module's attribute: is it there, callable, marked, and how."""
    mark = getattr(fn, MARK, None)
    module = sys.modules.get(getattr(fn, "__module__", "") or "")
    return {"found": fn is not None, "callable": callable(fn), "type": type(fn).__name__,
            "mark": None if getattr(mark, "kind", None) not in KINDS else
            {"kind": mark.kind, "dtypes": tuple(mark.dtypes), "keras": bool(getattr(mark, "keras", False)),
             "deterministic": bool(getattr(mark, "deterministic", True))},
            "file": getattr(module, "__file__", None)}
