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
    """One implementation the harness can run: its declaration and how to run it.

    What it is (name, kind, framework, dtypes, ...) is its :attr:`spec`, held once; the properties
    below read it, so ``impl.framework`` and ``impl.spec.framework`` are one value.

    Attributes:
        spec: what it declares (:class:`parity_tests.protocol.engine.EngineSpec`): a built-in's own
            declaration (``tfpar.engines``, ``torchref.engines``), else what a plugin or recorded run
            says of itself; the registry declares it for the judge (``protocol.engine.declare``).
        run: ``run(case, progress) -> trajectory``.
        plugin: for plugins, the resolved :class:`~parity_tests.running.plugins.PluginTarget`.
        refuse: ``refuse(case)`` raises ``CaseError`` for what it will not run of ``case``, decided from
            the case alone, without running anything (``harness.check_refusals`` asks every named
            implementation before the first runs); ``None``: nothing beyond its declared dtypes.
    """

    spec: EngineSpec
    run: Runner = field(repr=False, compare=False)
    plugin: Any = field(default=None, repr=False, compare=False)
    refuse: Callable[[Any], None] | None = field(default=None, repr=False, compare=False)

    @property
    def name(self) -> str:
        """As the user writes it (``tf.towers``, ``my_ddp.py:train``, ``recorded:run.npz``)."""
        return self.spec.name

    @property
    def kind(self) -> str:
        """``builtin``, ``plugin`` or ``recorded``."""
        return self.spec.kind

    @property
    def framework(self) -> str:
        """``tf`` or ``torch`` (what the theory of known differences keys on)."""
        return self.spec.framework

    @property
    def parallel(self) -> bool:
        """Whether it splits the global batch over devices (towers / ranks)."""
        return self.spec.parallel

    @property
    def dtypes(self) -> tuple[str, ...]:
        """The case dtypes it can run."""
        return self.spec.dtypes

    @property
    def description(self) -> str:
        """One line for listings."""
        return self.spec.description

    @property
    def keras(self) -> bool:
        """Whether its optimizers are Keras' (the float64 hyperparameter rounding applies)."""
        return self.spec.keras

    @property
    def rerunnable(self) -> bool:
        """``False`` for a recorded run (it cannot be run again from perturbed weights)."""
        return self.spec.rerunnable

    @property
    def captures(self) -> bool:
        """Whether a run of a case with ``capture = k`` may record step k's per-device values
        (``device/...``: inputs, activations, losses, gradients; docs/localisation.md stages)."""
        return self.spec.captures

    @property
    def source(self) -> Path | None:
        """A plugin's source file (hashed into manifests), else ``None``."""
        return getattr(self.plugin, "source", None)
