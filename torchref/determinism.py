"""The settings every torch rank computes under, and their one-time cost paid where ranks fork from.

:func:`configure` sets what the manifest records for the torch side: one intra-op thread
(``torch.set_num_threads(1)``: a rank's reductions do not depend on how many threads the
machine has) and ``torch.use_deterministic_algorithms(True)``. The warm pool's ranks and
``parity_tests.launch.torch``'s ranks call it before their process group exists.

The first ``use_deterministic_algorithms`` call of a process imports what it needs lazily
(about 830 modules, sympy and mpmath among them: 1.2 s on this machine, measured
2026-11-23). Importing this module calls :func:`configure` once, so the pool's forkserver,
which imports it (``torchref.jobs.PRELOAD``), pays that once and every rank it forks
inherits the modules: an 8-rank pool starts in 3.0 s, against 7.5 s when every rank paid
it on the two cores (``docs/large-world.md``: 64 ranks in 5.1 s).

The import is not this call's alone: it is ``torch._dynamo``'s (which imports
``torch._inductor.config``), and ``DistributedDataParallel.__init__`` reads
``torch._dynamo.utils`` (torch 2.13), so every process that wraps a model in DDP pays it
once whatever the determinism settings. Setting the two flags without the import
(``torch._C._set_deterministic_algorithms`` and ``TORCHINDUCTOR_DETERMINISTIC=1``) saved
nothing for a ``torchrun`` rank (``test_launch.py`` 70.5 s before, 73.9 s after, measured
2026-11-23) and would have moved the import into every pool rank's first DDP job.
"""

from __future__ import annotations

import torch

__all__ = ["configure"]


def configure() -> None:
    """One intra-op thread and deterministic algorithms, in this process."""
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)


configure()  # at import: the forkserver's preload (module docstring)
