"""What the harness knows of an implementation: :class:`Implementation` (a name, what it runs, how).

Made by :mod:`.builtins`, :mod:`.plugins` and :mod:`.recorded`, kept by :mod:`.registry`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from parity_tests.protocol.engine import EngineSpec

__all__ = ["Implementation", "Runner"]

Runner = Callable[[Any, Callable[[int], None] | None], dict[str, np.ndarray]]  # (case, progress) -> trajectory


@dataclass(frozen=True)
class Implementation:
    """One implementation the harness can run.

    Attributes:
        name: as the user writes it.
        kind: ``builtin``, ``plugin`` or ``recorded``.
        framework: ``tf`` or ``torch`` (what the theory of known differences keys on).
        parallel: whether it splits the global batch over devices (towers / ranks).
        dtypes: the case dtypes it can run.
        run: ``run(case, progress) -> trajectory``.
        description: one line for listings.
        keras: whether its optimizers are Keras' (the float64 hyperparameter rounding applies).
        plugin: for plugins, the resolved :class:`~parity_tests.running.plugins.PluginTarget`.
        rerunnable: ``False`` for a recorded run (it cannot be run again from perturbed weights).
        declared: a built-in's :class:`EngineSpec` (``tfpar.engines``, ``torchref.engines``).
        captures: whether a run of a case with ``capture = k`` may record step k's per-device
            values (``device/...``: inputs, activations, losses, gradients; docs/localisation.md stages).
        refuse: ``refuse(case)`` raises ``CaseError`` for what it will not run of ``case``, decided from
            the case alone, without running anything (``harness.check_refusals`` asks every named
            implementation before the first runs); ``None``: nothing beyond its declared dtypes.
    """

    name: str
    kind: str
    framework: str
    parallel: bool
    dtypes: tuple[str, ...]
    run: Runner = field(repr=False, compare=False)
    description: str = ""
    keras: bool = False
    plugin: Any = field(default=None, repr=False, compare=False)
    rerunnable: bool = True
    captures: bool = False
    declared: EngineSpec | None = field(default=None, repr=False, compare=False)
    refuse: Callable[[Any], None] | None = field(default=None, repr=False, compare=False)

    @property
    def spec(self) -> EngineSpec:
        """What it declares (:class:`parity_tests.protocol.engine.EngineSpec`), for the judge: a built-in's
        own declaration, else what a plugin or recorded run says of itself."""
        if self.declared is not None:
            return self.declared
        return EngineSpec(self.name, self.kind, self.framework, bool(self.parallel), tuple(self.dtypes),
                          keras=bool(self.keras), captures=bool(self.captures), rerunnable=bool(self.rerunnable))

    @property
    def source(self) -> Path | None:
        """A plugin's source file (hashed into manifests), else ``None``."""
        return getattr(self.plugin, "source", None)
