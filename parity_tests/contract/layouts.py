"""Canonical parameters in torch's layouts, by name: :mod:`parity_tests.protocol.layouts`, re-exported.

Both plugin ``Run`` classes (``tfpar.plugin``, ``torchref.plugin``) use them, so they live in
``protocol``; the judge's side keeps importing them from here.
"""

from __future__ import annotations

from parity_tests.protocol.layouts import (
    LAYOUTS,
    LayoutError,
    NamedLayouts,
    layout_of,
    to_tf_named,
    to_torch_named,
)

__all__ = ["layout_of", "to_torch_named", "to_tf_named", "NamedLayouts", "LAYOUTS", "LayoutError"]
